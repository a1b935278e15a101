"""Benchmark: every chosen method against the full cache, same input, one process.

    python -m kv_arena.bench --model tiny-qwen2-vl --methods full,streamingllm --budget 0.5 \\
        --image a.png --image b.png --prompt "Compare the images." --max-new-tokens 32 --json

The full cache is the reference for every ratio. After a warm-up, ``--repeats`` rounds run every
method once, in an order rotated per round; a timed ratio is taken per round against the full
cache's run of the same round and printed as its median with the min-max over rounds (marked where
that range crosses 1); times are medians, answers and bytes those of the last round. Without
``--image``/``--video`` two synthetic 448 px images are used. ``--list --json`` prints every method
(parameters, defaults, ranges) and every model. Exit code 2 and one line on stderr for bad input.

The comparison axis is ``realised_fraction``: the bytes the method's cache really holds after the
prompt (``kv_bytes_prefill``) over the full cache's (``kv_bytes_full_prefill``). For a method that
takes a budget it should not exceed the budget; a method with its own knob (``uses_budget`` false:
ZipVL's ``tau``, MPIC's mode, in ``params``) runs at ``budget`` 1.0 and lands where its knob puts it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch
from PIL import Image

from kv_arena import backends
from kv_arena.backends.descriptions import describe, shown_title
from kv_arena.backends.stack import selects

from ..errors import UserError
from ..media import load_image, load_video
from ..runtime.generate import Conversation, agreement, loyal
from ..runtime.inputs import Message
from ..runtime.models import DEFAULT_MODEL, list_models, load_model
from .common import REFERENCE, SPREAD_NOTE, Spread, add_repeats_arg, aligned, check_repeats, rotated, run_main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--methods", default="full,streamingllm", help="comma-separated method names")
    p.add_argument("--budget", type=float, default=0.5, help="fraction of the KV cache kept (0.01 - 1.0)")
    p.add_argument("--image", action="append", default=[], help="image path (repeatable)")
    p.add_argument("--video", action="append", default=[], help="video path (repeatable)")
    p.add_argument("--frames", type=int, default=8, help="frames sampled per video")
    p.add_argument("--prompt", default="Describe the images in detail.")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--set", action="append", default=[], metavar="[METHOD.]NAME=VALUE",
                   help="method parameter (repeatable); without METHOD. it goes to every method that takes it")
    p.add_argument("--question-after", action="store_true",
                   help="prefill and compress the media first, then feed the question on top of the compressed cache")
    p.add_argument("--num-layers", type=int, default=None, help="override the decoder depth (random/tiny models)")
    p.add_argument("--vision-layers", type=int, default=None, help="cut the vision encoder (random/tiny models)")
    add_repeats_arg(p)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--quantization", default=None, help="4bit or 8bit weights (hub models on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list methods and models")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--markdown", action="store_true", help="with --list: the README's methods table")
    return p.parse_args(argv)


def method_params(methods: list[str], settings: list[str]) -> dict[str, dict]:
    """Route ``--set`` values to the methods that take them; unknown names are an error."""
    params: dict[str, dict] = {m: {} for m in methods}
    for item in settings:
        if "=" not in item:
            raise UserError(f"--set expects NAME=VALUE, got '{item}'")
        key, value = item.split("=", 1)
        target, _, name = key.rpartition(".")
        takers = [m for m in ([target] if target else methods)
                  if m in params and name in {p.name for p in backends.backend_class(m).param_specs()}]
        if not takers:
            raise UserError(f"no chosen method takes a parameter '{key}'")
        for m in takers:
            params[m][name] = value
    return params


def synthetic_images(count: int = 2, size: int = 448) -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8")) for _ in range(count)]


def run_method(loaded, name: str, budget: float, params: dict, media: dict, prompt: str,
               max_new_tokens: int, question_after: bool, ignore_eos: bool = False):
    backend = backends.make_backend(name, budget=budget, **params)
    conv = Conversation(loaded, backend)
    update = conv.ask(Message(prompt, **media), max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                      question_after=question_after)
    return update, backend, conv


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def _ratio(runs: list, reference: list, key: str) -> dict:
    """``key``'s per-round ratio to the full cache's: its fields, or None where the reference is 0."""
    measured = [getattr(u.metrics, key) for u, _ in runs]
    ref = [getattr(u.metrics, key) for u, _ in reference]
    name = {"prefill_s": "prefill_ratio", "decode_tok_s": "decode_ratio"}[key]
    if not all(ref):
        return {name: None, f"{name}_range": None}
    return Spread.paired(measured, ref).fields(name)


def run(args: argparse.Namespace) -> list[dict]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        backends.backend_class(m)  # unknown names fail before the model loads
    if not 0 < args.budget <= 1:
        raise UserError(f"--budget must lie in (0, 1]; got {args.budget}")
    check_repeats(args.repeats)
    methods = [REFERENCE] + [m for m in methods if m != REFERENCE]
    params = method_params(methods, args.set)
    for m in methods:  # parameter values are checked before any work
        backends.make_backend(m, budget=args.budget, **params[m])
    images = [load_image(p) for p in args.image]
    videos = [load_video(p, args.frames) for p in args.video]
    if not images and not videos:
        images = synthetic_images()
    media = {"images": images, "videos": videos, "num_frames": args.frames}
    loaded = load_model(args.model, device=args.device, dtype=args.dtype, num_layers=args.num_layers,
                        quantization=args.quantization, seed=args.seed, vision_layers=args.vision_layers)
    run_method(loaded, REFERENCE, 1.0, {}, media, args.prompt, 2, args.question_after)  # warm-up

    runs: dict[str, list] = {name: [] for name in methods}  # per round: (update, backend)
    for r in range(args.repeats):
        for name in rotated(methods, r):
            update, backend, _ = run_method(loaded, name, args.budget, params[name], media, args.prompt,
                                            args.max_new_tokens, args.question_after, args.ignore_eos)
            runs[name].append((update, backend))
    full_update, _ = runs[REFERENCE][-1]
    full = full_update.metrics
    rows = []
    for name in methods:
        update, backend = runs[name][-1]
        m = update.metrics
        realised = m.kv_bytes_prefill / full.kv_bytes_prefill if full.kv_bytes_prefill else None
        median = {key: statistics.median(getattr(u.metrics, key) for u, _ in runs[name])
                  for key in ("ttft_s", "prefill_s", "overhead_s", "decode_tok_s")}
        scoring = Spread.paired([u.metrics.overhead_s for u, _ in runs[name]],
                                [u.metrics.prefill_s for u, _ in runs[REFERENCE]])
        rows.append(_jsonable({
            "method": name, "budget": backend.budget, "model": args.model,
            "uses_budget": backend.uses_budget, "realised_fraction": realised, "params": backend.config, "prompt_tokens": m.prompt_tokens, "visual_tokens": m.visual_tokens,
            "new_tokens": m.new_tokens, "text": update.text, "repeats": args.repeats, **median,
            **scoring.fields("overhead_ratio"),  # method's hooks / full prefill
            **_ratio(runs[name], runs[REFERENCE], "prefill_s"), **_ratio(runs[name], runs[REFERENCE], "decode_tok_s"),
            "kv_bytes_prefill": m.kv_bytes_prefill, "kv_bytes": m.kv_bytes,
            "kv_bytes_full_prefill": full.kv_bytes_prefill, "kv_bytes_full": full.kv_bytes,
            "kv_ratio": m.kv_bytes / full.kv_bytes if full.kv_bytes else None,
            "kv_ratio_prefill": realised,
            "token_agreement": agreement(update.token_ids, full_update.token_ids, loaded.adapter.eos_ids),
            "loyal": loyal(update.text, full_update.text),  # the full cache's answer, whole
            "tokens_held": m.tokens_held, "peak_memory_bytes": m.peak_memory_bytes,
            "question_after": args.question_after, "report": backend.report.to_dict(),
        }))
    return rows


def _spread_cell(row: dict, name: str, digits: int) -> str:
    if row[name] is None:
        return "-"
    return Spread(row[name], *row[f"{name}_range"], row["repeats"]).cell(digits)


def table(rows: list[dict]) -> str:
    cols = [("method", "{}"), ("realised_fraction", "{:.3f}"), ("kv_ratio", "{:.3f}"), ("kv_bytes", "{:,}"), ("ttft_s", "{:.3f}"),
            ("prefill_ratio", 2), ("overhead_s", "{:.4f}"), ("overhead_ratio", 3), ("decode_tok_s", "{:.1f}"),
            ("decode_ratio", 2), ("new_tokens", "{}"), ("token_agreement", "{:.2f}"), ("loyal", "{}")]
    cells = [[c for c, _ in cols]] + [[_spread_cell(r, c, fmt) if isinstance(fmt, int)
                                       else fmt.format(r[c]) if r[c] is not None else "-" for c, fmt in cols]
                                      for r in rows]
    lines = aligned(cells)
    budget = next((r["budget"] for r in rows if r["uses_budget"]), 1.0)  # methods with their own knob run at 1.0
    head = f"model {rows[0]['model']}, budget {budget}, " \
           f"{rows[0]['prompt_tokens']} prompt tokens ({rows[0]['visual_tokens']} visual); ratios are against the full " \
           f"cache, {rows[0]['repeats']} rounds (times: medians)"
    notes = [f"{r['method']}: {r['report']['note']}" for r in rows if r["report"].get("note")]  # EVS on pictures
    return "\n".join([head, SPREAD_NOTE] + lines + notes)


def _paper_cell(url: str | None) -> str:
    """A paper's link, named by its arXiv id where it has one."""
    if not url:
        return ""
    return f"[{url.rstrip('/').rsplit('/', 1)[-1]}]({url})" if "arxiv.org/abs/" in url else f"[paper]({url})"


def _knob_cell(info: dict) -> str:
    """What sets how much a method holds: the budget, else its first own parameter (its main one)
    with its default, else nothing."""
    if info["uses_budget"]:
        return "budget"
    own = info["params"][1:]
    return f"`{own[0]['name']}` ({own[0]['default']})" if own else "none"


def methods_markdown() -> str:
    """The README's methods table, from the registry (a test keeps the two the same): each method
    with its paper, what it does to the cache, its knob and whether it streams under a KV cap."""
    rows = ["| method | paper | does | knob | streams under a cap | in one line |", "|---|---|---|---|---|---|"]
    for name in backends.available():
        info = describe(backends.backend_class(name))
        rows.append(f"| {shown_title(info)} (`{name}`) | {_paper_cell(info['paper'])} | {info['does']} | "
                    f"{_knob_cell(info)} | {'yes' if info['streams_under_cap'] else ''} | {info['summary']} |")
    return "\n".join(rows)


def listing(args) -> int | None:
    """``--list``: the methods and models (with ``--json``, everything the UI knows of them)."""
    if not args.list:
        return None
    found = {"methods": [describe(backends.backend_class(n)) for n in backends.available()],
             "models": list_models()}
    if args.json:
        print(json.dumps(found, indent=2))
    elif args.markdown:
        print(methods_markdown())
    else:
        print("methods:", ", ".join(backends.available()))
        selectors = ", ".join(backends.names_where(selects))
        print("stacks: ", f"SELECTOR+STORE, e.g. snapkv+fp8; selectors: {selectors}; stores: "
              + ", ".join(backends.names_where(lambda cls: cls.quantised_store)))
        print("models: ", ", ".join(m["name"] for m in found["models"]))
    return 0


def main(argv=None) -> int:
    return run_main(parse_args, run, table, argv, before=listing)


if __name__ == "__main__":
    sys.exit(main())
