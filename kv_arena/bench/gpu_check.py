"""The GPU check: what a lent accelerator runs, in at most ``--limit-minutes`` (10) on one H100.

    python -m kv_arena.bench --mode gpu-check            # CUDA, bf16; writes docs/gpu.md and docs/gpu.json
    python -m kv_arena.bench --mode gpu-check --smoke --json   # the tiny models on the CPU, seconds (CI)

Three checks, in this order (the costliest last, so a slow machine still reports the others):

1. Speed and memory, every registered method against the full cache (``--mode decode``'s machinery:
   the decoder of ``random:Qwen/Qwen2-VL-2B-Instruct`` at full size from the bundled config, fed a
   synthetic prompt of 8,192, then 32,768 visual tokens; interleaved repeats, medians with the
   min-max of the per-repeat ratios; CUDA events): KV bytes held, time to first token (the decoder's
   prefill, the method's compression included; the vision tower is the same for every method and
   left out), a decode step against the full cache's (``decode_vs_full``), and
   ``torch.cuda.max_memory_allocated`` over one method's prefill and step (``peak_memory_bytes``, None
   on a CPU) against ``memory_bound_bytes``, the weights plus the KV the method holds.
2. ``same_tokens_at_lossless``: each method at budget 1.0 with its ``lossless_params`` gives the full
   cache's tokens, on the whole model (vision tower included), two synthetic pictures, greedy.
3. The offline model (tiny-arena-vl) answers its held-out scenes on the device as on the CPU, in
   float32 and in the run's dtype.

A stage that would start past the deadline is skipped and named in ``skipped``. The page it writes
keeps the capacity tables (``## Capacity`` on, :func:`kept_sections`). ``--smoke`` runs the
same code on the tiny models (tiny-qwen2-vl, 64 visual tokens) on the CPU, so the command cannot rot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from kv_arena import backends

from ..errors import UserError
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import ARENA, load_model, pick_device
from ..runtime.vision_tokens import refusal
from ..tiny import generations
from . import decode
from .accuracy import answer_budget, is_right
from .common import visual_sizes
from .methods import synthetic_images

DOCS = Path(__file__).resolve().parents[2] / "docs"
FULL = {"model": "random:Qwen/Qwen2-VL-2B-Instruct", "visual": "8192,32768", "picture": 448, "items": 8}
SMOKE = {"model": "tiny-qwen2-vl", "visual": "64", "picture": 224, "items": 1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny models on the CPU, in seconds (what CI runs)")
    p.add_argument("--visual-tokens", default=None, help="comma-separated sizes (default 8192,32768; smoke 64)")
    p.add_argument("--budget", type=float, default=0.2, help="the budget of every method that takes one")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5; smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per repeat (default 16; smoke 2)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens compared by the lossless check")
    p.add_argument("--limit-minutes", type=float, default=10.0, help="no stage starts after this (default 10)")
    p.add_argument("--device", default=None, help="default: cuda (the smoke: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the page to write (default docs/gpu.md; the smoke writes none)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    return p.parse_args(argv)


def speed_rows(args, setup: dict, device: torch.device, dtype: str, visual: int) -> list[dict]:
    """``--mode decode`` at one size: every method that runs in the decoder, and stock sdpa."""
    return decode.run(decode.parse_args([
        "--model", setup["model"], "--visual-tokens", str(visual), "--budget", str(args.budget),
        "--repeats", str(args.repeats), "--steps", str(args.steps), "--device", str(device), "--dtype", dtype,
        "--seed", str(args.seed)]))


def same_tokens_at_lossless(loaded, methods: list[str], picture: int, new_tokens: int) -> dict:
    """Method -> whether its lossless setting gives the full cache's tokens and bytes (None: the
    model cannot serve it, e.g. VisionZip without a CLS token)."""
    message = Message("Describe the pictures.", images=synthetic_images(2, picture))
    ask = lambda backend: Conversation(loaded, backend).ask(message, max_new_tokens=new_tokens, ignore_eos=True)  # noqa: E731
    reference = ask(backends.make_reference())
    found = {}
    for name in methods:
        backend = backends.make_backend(name, budget=1.0, **backends.backend_class(name).lossless_params)
        if refusal(loaded.model, backend):
            found[name] = None
            continue
        got = ask(backend)
        found[name] = got.token_ids == reference.token_ids and got.metrics.kv_bytes == reference.metrics.kv_bytes
    return found


def offline_answers(device: torch.device, dtype: str, items: list) -> list[str]:
    loaded = load_model(ARENA, device=str(device), dtype=dtype)
    return [Conversation(loaded, backends.make_reference()).ask(
        Message(it.question.text, **it.media()), max_new_tokens=answer_budget(it.question.answer)).text.strip()
        for it in items]


def offline_check(device: torch.device, dtypes: list[str], per_type: int) -> dict:
    """The offline model's answers on ``device`` in each dtype against the CPU's in float32."""
    generation = generations.of()
    items = [it for kind in generation.scenes.QUESTION_TYPES for it in generation.scenes.held_out(kind, per_type)]
    cpu = offline_answers(torch.device("cpu"), "float32", items)
    out = {"model": ARENA, "generation": generation.number, "items": len(items), "right_cpu": _right(cpu, items)}
    for dtype in dtypes:
        got = offline_answers(device, dtype, items)
        out |= {f"same_answers_{dtype}": sum(a == b for a, b in zip(got, cpu)) / len(items),
                f"right_{dtype}": _right(got, items)}
    return out


def _right(answers: list[str], items: list) -> float:
    return sum(is_right(a, it.question.answer) for a, it in zip(answers, items)) / len(items)


def run(args: argparse.Namespace) -> dict:
    setup = SMOKE if args.smoke else FULL
    args.repeats = args.repeats or (2 if args.smoke else 5)
    args.steps = args.steps or (2 if args.smoke else 16)
    device = pick_device(args.device or ("cpu" if args.smoke else "cuda"))
    if not args.smoke and device.type != "cuda":
        raise UserError("the GPU check runs on CUDA (--device cuda); --smoke runs its tiny models on the CPU")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("no CUDA device here: run the GPU check where one is lent, or --smoke on the CPU")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    sizes = visual_sizes(args.visual_tokens or setup["visual"])
    start, deadline = time.monotonic(), time.monotonic() + 60 * args.limit_minutes
    methods = backends.available()
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": dtype, "model": setup["model"], "budget": args.budget,
              "repeats": args.repeats, "steps": args.steps, "smoke": args.smoke,
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "skipped": [], "rows": []}
    speed, took = {}, {}
    lossless, offline = {}, None
    stages = [("speed", sizes[0]), ("lossless", None), ("offline", None)] + [("speed", v) for v in sizes[1:]]
    for stage, visual in stages:
        left = deadline - time.monotonic()
        # a larger prompt costs at least in proportion to the last size's stage (attention: more)
        guess = max((took[v] * visual / v for v in took), default=0.0) if stage == "speed" else 0.0
        if left <= 0 or guess > left:
            report["skipped"].append(f"{stage}{f' at {visual:,} visual tokens' if visual else ''}: "
                                     f"{left:.0f} s left of --limit-minutes {args.limit_minutes:g}, about {guess:.0f} s needed")
            continue
        began = time.monotonic()
        if stage == "speed":
            speed[visual] = {r["method"]: r for r in speed_rows(args, setup, device, dtype, visual)}
            took[visual] = time.monotonic() - began
        elif stage == "lossless":
            loaded = load_model(setup["model"], device=str(device), dtype=dtype, seed=args.seed)
            lossless = same_tokens_at_lossless(loaded, methods, setup["picture"], args.new_tokens)
            del loaded
        else:
            offline = offline_check(device, list(dict.fromkeys(["float32", dtype])), setup["items"])
    report["rows"] = [row(name, visual, speed.get(visual, {}), lossless) for visual in sizes for name in methods]
    report["offline"] = offline
    report["minutes"] = round((time.monotonic() - start) / 60, 2)
    return report


def row(method: str, visual: int, measured: dict, lossless: dict) -> dict:
    """One method at one size: the speed stage's figures (None where it did not run the method:
    skipped, or a method that acts before the decoder: :func:`.decode.acts_before_decoder`) and the lossless verdict."""
    r = measured.get(method)
    pick = lambda key: None if r is None else r[key]  # noqa: E731
    return {"method": method, "visual_tokens": visual, "kv_bytes": pick("kv_bytes"), "kv_ratio": pick("kv_ratio"),
            "ttft_s": pick("prefill_s"), "ttft_vs_full": pick("prefill_ratio"),
            "ttft_vs_full_range": pick("prefill_ratio_range"), "step_s": pick("step_s"),
            "decode_vs_full": pick("decode_ratio"), "decode_vs_full_range": pick("decode_ratio_range"),
            "peak_memory_bytes": pick("peak_memory_bytes"), "memory_bound_bytes": pick("memory_bound_bytes"),
            "same_tokens_at_lossless": lossless.get(method),
            "not_timed": None if r is not None else (decode.acts_before_decoder(method) if measured else "skipped")}


def _range(r: dict, name: str) -> str:
    if r[name] is None:
        return "-"
    low, high = r[f"{name}_range"]
    return f"{r[name]:.2f} ({low:.2f}-{high:.2f})"


def markdown(report: dict) -> str:
    """The table docs/gpu.md holds: one line per method and size."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"  # noqa: E731
    lines = [f"Device: **{report['device']}**, torch {report['torch']}, {report['dtype']}, {report['date']}; "
             f"model {report['model']} (its decoder, random weights); budget {report['budget']}; "
             f"{report['repeats']} repeats of {report['steps']} decode steps; {report['minutes']} min.", "",
             "| visual | method | KV MiB | KV / full | TTFT s | TTFT / full | step ms | decode / full | "
             "peak MiB | weights + KV MiB | same tokens at lossless |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    verdict = {True: "yes", False: "**no**", None: "-"}
    for r in report["rows"]:
        timed = r["kv_bytes"] is not None
        kv = f"{r['kv_ratio']:.3f}" if timed else r["not_timed"]
        ttft = f"{r['ttft_s']:.3f}" if timed else "-"
        step = f"{r['step_s'] * 1000:.2f}" if timed else "-"
        lines.append(f"| {r['visual_tokens']:,} | {r['method']} | {mib(r['kv_bytes'])} | {kv} | {ttft} | "
                     f"{_range(r, 'ttft_vs_full')} | {step} | {_range(r, 'decode_vs_full')} | "
                     f"{mib(r['peak_memory_bytes'])} | {mib(r['memory_bound_bytes'])} | "
                     f"{verdict[r['same_tokens_at_lossless']]} |")
    offline = report.get("offline")
    if offline:
        same = ", ".join(f"{k.removeprefix('same_answers_')} {v:.2f}" for k, v in offline.items() if k.startswith("same_"))
        lines += ["", f"Offline model {offline['model']}, {offline['items']} held-out scenes: same answers as the "
                      f"CPU's: {same}; right on the CPU {offline['right_cpu']:.2f}."]
    lines += [f"\nSkipped: {s}" for s in report["skipped"]]
    return "\n".join(lines)


def kept_sections(path: Path) -> str:
    """The page's part from its ``## Capacity`` heading on (``--mode capacity``'s tables, written by
    those runs, not by this check): kept when the check writes the page anew."""
    text = path.read_text() if path.exists() else ""
    at = text.find("\n## Capacity")
    return "" if at < 0 else text[at:]


def page(report: dict, json_name: str) -> str:
    return ("# The GPU check\n\nWritten by `python -m kv_arena.bench --mode gpu-check` (what it measures: "
            "[kv_arena/bench/gpu_check.py](../kv_arena/bench/gpu_check.py)); every row as JSON in "
            f"[{json_name}]({json_name}).\n\n" + markdown(report) + "\n")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.limit_minutes <= 0:
            raise UserError("--limit-minutes must be positive")
        report = run(args)
    except (UserError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None if args.smoke else DOCS / "gpu.md"
    if out is not None:
        out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        out.write_text(page(report, out.with_suffix(".json").name) + kept_sections(out))
    print(json.dumps(report, indent=2) if args.json else markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
