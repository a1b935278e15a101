"""Accuracy benchmark: does a method keep the answers right, when, and on which turn?

    python -m kv_arena.bench --mode accuracy --per-type 200 --budgets 0.1,0.2,0.5

Held-out chats of the served tiny-arena-vl's scenes (the question types of its generation,
kv_arena/tiny/generations.py; hub models take the same questions). Each item is a two-turn chat, and
every method at every value of its knob answers it three ways:
  with      the media and the first question in one message: the method compresses that prompt
            seeing the question (what a chat does today);
  before    the media prefilled and compressed first, then the first question on the compressed
            cache (what a cached picture is: the method cannot know the question);
  follow    the second question, about *another* object, on the cache compressed "with".
An answer counts when it is the expected answer whole (lower case, punctuation dropped, exact word
for word); one that starts right and runs on past its end counts wrong, and the share of those is
reported per method. Every rate carries its 95% Wilson interval.

Each point records the knob and the REALISED KV fraction: the bytes the method's cache holds after
the first prompt over the full cache's bytes after the same prompt, averaged over the items; the
figure puts it on the x axis. ``--budgets`` for methods with a budget, ``--taus`` for a method whose
knob is ZipVL's threshold ``tau``, ``--keeps`` for VisionZip's share of image tokens kept; methods
without a knob run once. A method the model's vision tower cannot serve (VisionZip on Qwen-VL, the
default tiny-arena-vl's family) is not run; the run says so and why (``refused`` in the JSON).

Three probes check the regime (full cache, media prefilled, visual KV removed by hand before the
first question): keep only the object tokens (should cost nothing), drop exactly the tokens the
answer needs (should fall to chance), drop a random 75% of the visual tokens (should cost a lot).
Prints a table; writes JSON and a Plotly figure (HTML, and PNG when kaleido and a Chrome are installed).

``--dataset ID_OR_PATH --metric anls|vqa|relaxed|choice`` asks a public data set's items instead
(:mod:`.datasets_items`: DocVQA, TextVQA, ChartQA, MMBench, Video-MME; a ``save_to_disk`` folder or a
hub id, streamed, ``--limit`` rows), scored by its metric (:mod:`.metrics`), by the same protocols:
an item has one question, so the follow-up asks it after an opener turn the method compressed with.
No probes (they need the scenes' object tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kv_arena import backends

from ..errors import UserError
from ..paths import ASSETS, IN_CHECKOUT
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import ARENA, load_model
from ..runtime.vision_tokens import refusal
from ..tiny import generations
from .common import REFERENCE
from .datasets_items import load_items
from .metrics import METRICS

PROBES = ("keep only the object tokens", "drop exactly the needed tokens", "drop a random 75% of visual tokens")
PROTOCOLS = ("with", "before", "follow")
PROTOCOL_TITLES = {"with": "first question, compressed with it", "before": "first question, compressed before it",
                   "follow": "follow-up"}


def parse_args(argv=None) -> argparse.Namespace:
    kinds = generations.of().scenes.QUESTION_TYPES
    p = argparse.ArgumentParser(prog="python -m kv_arena.bench --mode accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=ARENA)
    p.add_argument("--methods", default="all", help="comma-separated method names, or 'all'")
    p.add_argument("--budgets", default="0.1,0.2,0.5", help="values of a method's budget")
    p.add_argument("--taus", default="0.975", help="values of a method's tau (ZipVL), when it has no budget")
    p.add_argument("--bits", default="2,4", help="values of a method's bits (KIVI), when it has no budget")
    p.add_argument("--keeps", default="0.333,0.111", help="values of a method's keep (VisionZip: the share of an "
                   "image's tokens kept; paper 192 and 64 of 576)")
    p.add_argument("--per-type", type=int, default=200, help="held-out chats per question type")
    p.add_argument("--probe-items", type=int, default=None, help="chats per type for the probes (default: --per-type)")
    p.add_argument("--types", default=",".join(kinds), help=f"question types: {', '.join(kinds)}")
    # the committed figure is rewritten in a checkout; an installed package's folder is never written
    p.add_argument("--out", default=None,
                   help="writes OUT.json, OUT.html (and OUT.png); default: the --add run's own file, else "
                        "assets/accuracy in a checkout")
    p.add_argument("--no-figure", action="store_true")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="run nothing: print the tables and draw the figure of an earlier run's OUT.json")
    p.add_argument("--add", default=None, metavar="JSON",
                   help="run only --methods on that earlier run's items (its model, types and count) and write "
                        "it back with their rows added (or replaced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report's JSON (progress and tables go to stderr)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA)")
    p.add_argument("--dataset", default=None, metavar="ID_OR_PATH",
                   help="a data set's items instead of the scenes: a save_to_disk folder or a hub id (streamed)")
    p.add_argument("--split", default=None, help="the data set's split (a hub id: default test)")
    p.add_argument("--subset", default=None, help="the hub data set's configuration, e.g. DocVQA")
    p.add_argument("--limit", type=int, default=None, help="read the first N items only")
    p.add_argument("--metric", default=None, choices=METRICS, help="how a data set's answers are scored")
    p.add_argument("--frames", type=int, default=8, help="frames sampled per video of a data set")
    args = p.parse_args(argv)
    if args.out is None:  # --add writes back where it read, never over the committed run
        args.out = args.add.removesuffix(".json") if args.add else str(ASSETS / "accuracy") if IN_CHECKOUT else "accuracy"
    return args


def answer_words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


@dataclass(frozen=True)
class Verdict:
    right: float  # the whole answer, word for word (1 or 0); a data set's metric: its score in [0, 1]
    ran_on: bool  # started with the answer and went on past it (and is not right)


def judge(text: str, expected: str) -> Verdict:
    got, want = answer_words(text), answer_words(expected)
    return Verdict(got == want, len(got) > len(want) and got[: len(want)] == want)


def is_right(text: str, expected: str) -> bool:
    return judge(text, expected).right


def wilson(hits: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``hits`` / ``n``."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def answer_budget(expected: str) -> int:
    """New tokens for an answer: room to run on past its end, which counts wrong."""
    return 2 * len(answer_words(expected)) + 4


def verdict(q, text: str) -> Verdict:
    """A scene's question: the whole answer; a data set's (it has ``score``): its metric's score."""
    if not hasattr(q, "score"):
        return judge(text, q.answer)
    right = q.score(text)
    return Verdict(right, not right and judge(text, q.answer).ran_on)


def chat(loaded, backend, it, turns=None) -> tuple[list[Verdict], int]:
    """The item's questions (or ``turns``) asked one after another in one chat (media with the
    first); a verdict per turn, and the cache's bytes after the first prompt."""
    conv = Conversation(loaded, backend)
    verdicts, first_bytes = [], 0
    for k, q in enumerate(it.turns if turns is None else turns):
        update = conv.ask(Message(q.text, **(it.media() if k == 0 else {})), max_new_tokens=answer_budget(q.answer))
        first_bytes = first_bytes or update.metrics.kv_bytes_prefill
        verdicts.append(verdict(q, update.text))
    return verdicts, first_bytes


def asked_before(loaded, backend, it) -> Verdict:
    """The media prefilled and compressed first, then the first question on that cache."""
    conv = Conversation(loaded, backend)
    conv.feed(Message("", **it.media()))
    q = it.question
    return verdict(q, conv.ask(Message(q.text), max_new_tokens=answer_budget(q.answer)).text)


def visual_positions(layout) -> list[int]:
    """Token index of each visual token of the prompt, in the order the scenes number them."""
    return [p for v in layout.visuals for p in range(*v.span)]


def drop_visual(conv: Conversation, dropped: list[int]) -> None:
    """Remove the given visual tokens (the scenes' numbering) of the last prompt from every layer."""
    at = visual_positions(conv.layouts[-1])
    gone = torch.tensor([at[k] for k in dropped], dtype=torch.long)
    for layer in conv.cache.layers:
        layer.keep(torch.nonzero(~torch.isin(layer.positions[0], gone.to(layer.positions.device)))[:, 0])


def check_grid(loaded, it) -> None:
    """The probes remove tokens by the scene's numbering, which is the model's only where its
    processor keeps the scene's grid (tiny-arena-vl's does; a processor that rescales does not)."""
    conv = Conversation(loaded, backends.make_reference())
    conv.feed(Message("", **it.media()))
    read = len(visual_positions(conv.layouts[-1]))
    if read != it.visual_tokens():
        raise UserError(f"{loaded.spec.name} reads a {it.kind} scene as {read} visual tokens where the scene has "
                        f"{it.visual_tokens()} (its processor rescales it), so the probes cannot remove the scene's "
                        "tokens: run with --no-probe")


def probed(loaded, it, dropped: list[int]) -> bool:
    """Full cache; the media prefilled, the given visual tokens removed, then the first question."""
    conv = Conversation(loaded, backends.make_reference())
    conv.feed(Message("", **it.media()))
    drop_visual(conv, dropped)
    q = it.question
    return is_right(conv.ask(Message(q.text), max_new_tokens=answer_budget(q.answer)).text, q.answer)


def probe(loaded, items: list, rng: np.random.Generator) -> dict[str, float]:
    edits = {
        PROBES[0]: lambda it: [k for k in range(it.visual_tokens()) if k not in set(it.informative)],
        PROBES[1]: lambda it: list(it.question.tokens),
        PROBES[2]: lambda it: [int(k) for k in rng.choice(it.visual_tokens(), round(0.75 * it.visual_tokens()), replace=False)],
    }
    return {name: float(np.mean([probed(loaded, it, edit(it)) for it in items])) for name, edit in edits.items()}


def knob_of(method: str) -> str | None:
    """The knob a method's points sweep: its budget, else a ``tau``, ``bits`` or ``keep`` parameter, else none."""
    cls = backends.backend_class(method)
    if cls.uses_budget:
        return "budget"
    return next((p.name for p in cls.param_specs() if p.name in ("tau", "bits", "keep")), None)


def point(loaded, method: str, kwargs: dict, items: list, full_bytes: list[int]) -> dict:
    """One method at one knob value over ``items``: each protocol's rate and run-on share, and the
    realised KV fraction."""
    make = lambda: backends.make_backend(method, **kwargs)  # noqa: E731 - a fresh cache per chat
    chats = [chat(loaded, make(), it) for it in items]
    before = [asked_before(loaded, make(), it) for it in items]
    follow = [v[1] if len(v) > 1 else chat(loaded, make(), it, it.follow_turns)[0][-1] for (v, _), it in zip(chats, items)]
    verdicts = {"with": [v[0] for v, _ in chats], "before": before, "follow": follow}
    out = {"n": len(items), "realised": float(np.mean([b / f for (_, b), f in zip(chats, full_bytes)]))}
    for name, vs in verdicts.items():
        out[name] = float(np.mean([v.right for v in vs]))
        out[f"{name}_ran_on"] = float(np.mean([v.ran_on for v in vs]))
    return out


def sweep(loaded, method: str, values: dict[str, list[float]], items: list, full_bytes: list[int]) -> list[dict]:
    """One point per knob value (see :func:`point`)."""
    knob = knob_of(method)
    return [{"knob": knob, "value": value} | point(loaded, method, {} if knob is None else {knob: value}, items, full_bytes)
            for value in values.get(knob, [None])]


def _values(text: str, name: str, high: float = 1.0, kind=float) -> list:
    try:
        values = sorted(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"--{name} must be comma-separated numbers; got {text!r}") from None
    if not values or any(not 0 < v <= high for v in values):
        raise UserError(f"--{name} must lie in (0, {high:g}]; got {text}")
    return values


def _line(kind: str, method: str, p: dict) -> str:
    knob = f"{p['knob']}={p['value']}" if p["knob"] else "-"
    return (f"{kind:8s} {method:15s} {knob:12s} kv {p['realised']:.2f}  " +
            "  ".join(f"{name} {p[name]:.2f}" for name in PROTOCOLS) +
            f"  ran on {max(p[f'{n}_ran_on'] for n in PROTOCOLS):.2f}  (n={p['n']})")


def run(args) -> dict:
    values = {"budget": _values(args.budgets, "budgets"), "tau": _values(args.taus, "taus"),
              "bits": _values(args.bits, "bits", 16, int), "keep": _values(args.keeps, "keeps")}
    if args.add:  # the earlier run's items: the same model, types and count
        earlier = json.loads(Path(args.add).read_text())
        args.model, args.per_type, args.no_probe = earlier["model"], earlier["per_type"], True
        args.types = ",".join(earlier["points"])
    methods = backends.available() if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        backends.backend_class(m)
    data = dataset_items(args)  # its one "type": read before the model loads, so a bad source fails fast
    kinds = list(data) or [k.strip() for k in args.types.split(",") if k.strip()]
    generation = generations.of()  # the served one: its scenes, whichever model answers them
    scenes = generation.scenes
    for k in kinds:
        if k not in scenes.QUESTION_TYPES and k not in data:
            raise UserError(f"unknown question type '{k}'; choose from: {', '.join(scenes.QUESTION_TYPES)}")
    if args.per_type < 1:
        raise UserError(f"--per-type must be at least 1; got {args.per_type}")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    refused = {m: refusal(loaded.model, backends.make_backend(m)) for m in methods}
    refused = {m: reason for m, reason in refused.items() if reason}  # VisionZip on a tower without a CLS token
    for m, reason in refused.items():
        print(f"{m}: not run: {reason}", flush=True)
    methods = [m for m in methods if m not in refused]
    probe_items = args.probe_items or args.per_type
    points: dict[str, dict[str, list[dict]]] = {}
    probes: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(args.seed)
    if not args.no_probe:  # before the sweeps, which take the time
        for kind in kinds:
            check_grid(loaded, scenes.held_out(kind, 1, turns=1)[0])
    reference = [] if args.add else [REFERENCE]  # --add keeps the earlier run's row: not asked again
    for kind in kinds:
        items = data.get(kind) or scenes.held_out(kind, max(args.per_type, probe_items), turns=2)[: args.per_type]
        # the full cache's bytes after the first prompt: that turn alone, no follow-up to answer
        full_bytes = [chat(loaded, backends.make_reference(), it, it.turns[:1])[1] for it in items]
        points[kind] = {}
        for method in reference + [m for m in methods if m != REFERENCE]:
            points[kind][method] = ([{"knob": None, "value": None} | point(loaded, REFERENCE, {}, items, full_bytes)]
                                    if method == REFERENCE else sweep(loaded, method, values, items, full_bytes))
            for p in points[kind][method]:
                print(_line(kind, method, p), flush=True)
        if not args.no_probe:
            probes[kind] = probe(loaded, scenes.held_out(kind, probe_items, turns=1), rng)
    report = {"model": args.model, "generation": generation.number, "per_type": args.per_type, "probe_items": probe_items,
              "protocols": PROTOCOL_TITLES, "scoring": "whole answer, normalised exact match",
              "x": "realised KV fraction (bytes after the first prompt / full cache's bytes)",
              "points": points, "probe": probes, "refused": refused}
    if data:
        report |= {"per_type": len(items), "dataset": args.dataset, "split": args.split, "metric": args.metric,
                   "scoring": f"{args.metric} (kv_arena.bench.metrics), the mean score"}
    return added(earlier, report) if args.add else report


def dataset_items(args) -> dict[str, list]:
    """``--dataset``'s items under its name (nothing without it); it needs ``--metric``."""
    if not args.dataset:
        if args.metric or args.limit or args.split:
            raise UserError("--metric, --limit and --split go with --dataset")
        return {}
    if not args.metric:
        raise UserError(f"--dataset needs --metric: one of {', '.join(METRICS)}")
    if args.add:
        raise UserError("--add reruns the scenes' items; with --dataset, run the data set again")
    args.no_probe = True  # the probes edit the scenes' object tokens, which a data set does not mark
    name = Path(args.dataset).name if Path(args.dataset).is_dir() else args.dataset
    return {name: load_items(args.dataset, args.metric, args.split, args.limit, args.subset, args.frames)}


def added(earlier: dict, report: dict) -> dict:
    """``earlier`` with ``report``'s methods' rows added (the full cache's stays the earlier run's)."""
    for kind, per_method in report["points"].items():
        earlier["points"][kind] |= {m: p for m, p in per_method.items() if m != REFERENCE}
    earlier["refused"] = earlier.get("refused", {}) | report["refused"]
    return earlier


def _pooled(points: list[dict], key: str) -> tuple[float, float, float]:
    """Mean over the types (equal counts) and the Wilson interval of the pooled counts."""
    hits = sum(p[key] * p["n"] for p in points)
    n = sum(p["n"] for p in points)
    lo, hi = wilson(hits, n)
    return hits / n, lo, hi


def _cell(points: list[dict], key: str) -> str:
    mean, lo, hi = _pooled(points, key)
    return f"{mean:.2f} ({lo:.2f}-{hi:.2f})"


def table(report: dict) -> str:
    source = (f"{report['per_type']} items of {report['dataset']}, {report['metric']} score" if report.get("dataset") else
              f"scenes v{report.get('generation', 2)}: {report['per_type']} held-out two-turn chats per type; whole answers right")
    lines = [f"model {report['model']} ({source}): with = first question compressed with it, before = compressed "
             "before it, follow = follow-up; kv = realised KV fraction"]
    for kind, per_method in report["points"].items():
        lines.append(f"\n[{kind}]")
        for method, points in per_method.items():
            for p in points:
                lines.append("    " + _line(kind, method, p).split(None, 1)[1])
        for name, acc in report["probe"].get(kind, {}).items():
            lines.append(f"    probe: {name}: {acc:.2f}")
    for method, reason in report.get("refused", {}).items():
        lines.append(f"\n{method}: not run: {reason}")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """docs/benchmarks.md's tables: per method and knob value, the realised KV fraction and the three
    protocols' rates over all types, each with its 95% interval, and the largest run-on share."""
    kinds = list(report["points"])
    methods = list(dict.fromkeys(m for per in report["points"].values() for m in per))
    lines = ["| method | knob | KV held (measured) | with the question | before the question | follow-up | "
             "ran on | follow-up per type (" + ", ".join(kinds) + ") |", "|---|---|---|---|---|---|---|---|"]
    for method in methods:
        for i, _ in enumerate(report["points"][kinds[0]][method]):
            same = [report["points"][k][method][i] for k in kinds]
            knob = f"{same[0]['knob']} {same[0]['value']}" if same[0]["knob"] else "-"
            ran_on = max(_pooled(same, f"{n}_ran_on")[0] for n in PROTOCOLS)
            lines.append(f"| {method} | {knob} | {np.mean([p['realised'] for p in same]):.2f} | {_cell(same, 'with')} | "
                         f"{_cell(same, 'before')} | **{_cell(same, 'follow')}** | {ran_on:.2f} | "
                         + " ".join(f"{p['follow']:.2f}" for p in same) + " |")
    if report.get("probe"):
        lines += ["", "| probe (full cache, first question) | " + " | ".join(kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        for name in PROBES:
            lines.append(f"| {name} | " + " | ".join(f"{report['probe'][k][name]:.2f}" for k in kinds) + " |")
    return "\n".join(lines)


def _marker(method: str, i: int) -> dict:
    """The full cache a large star (methods that match it sit on top of it); past the palette's
    first ten colours, whose next ones look alike, another symbol tells methods apart."""
    if method == REFERENCE:
        return {"symbol": "star", "size": 15}
    return {"symbol": ("circle", "diamond", "square")[i // 10 % 3], "size": 9}


def figure(report: dict, out: Path) -> list[str]:
    """One panel per protocol; x = realised KV fraction, y = whole-answer rate over all types,
    with 95% intervals."""
    import plotly.colors
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    kinds = list(report["points"])
    fig = make_subplots(rows=1, cols=len(PROTOCOLS), subplot_titles=[PROTOCOL_TITLES[p] for p in PROTOCOLS],
                        shared_yaxes=True, horizontal_spacing=0.05)
    palette = plotly.colors.qualitative.D3 + plotly.colors.qualitative.Dark2
    methods = list(dict.fromkeys(m for per in report["points"].values() for m in per))
    for col, protocol in enumerate(PROTOCOLS, 1):
        for i, method in enumerate(methods):
            rows = []
            for j, _ in enumerate(report["points"][kinds[0]][method]):
                same = [report["points"][k][method][j] for k in kinds]
                mean, lo, hi = _pooled(same, protocol)
                knob = f"{same[0]['knob']}={same[0]['value']}" if same[0]["knob"] else method
                rows.append((float(np.mean([p["realised"] for p in same])), mean, lo, hi, knob))
            rows.sort()
            fig.add_trace(go.Scatter(x=[r[0] for r in rows], y=[r[1] for r in rows], name=method, legendgroup=method,
                                     showlegend=col == 1, mode="lines+markers", text=[r[4] for r in rows],
                                     error_y={"type": "data", "symmetric": False, "array": [r[3] - r[1] for r in rows],
                                              "arrayminus": [r[1] - r[2] for r in rows]},
                                     marker=_marker(method, i), line={"color": palette[i % len(palette)]}),
                          row=1, col=col)
        fig.update_xaxes(type="log", title_text="realised KV fraction", row=1, col=col)
    fig.update_yaxes(title_text="whole answers right (all types)", range=[0, 1.02], row=1, col=1)
    fig.update_layout(title=f"{report['model']}: held-out accuracy vs realised KV fraction, 95% intervals",
                      template="plotly_white", width=1400, height=620,
                      legend={"font": {"size": 12}, "tracegroupgap": 2})  # every method's name fits beside the panels
    written = [str(out) + ".html"]
    fig.write_html(written[0], include_plotlyjs="cdn")
    try:
        fig.write_image(str(out) + ".png", scale=2)
        written.append(str(out) + ".png")
    except Exception as exc:  # noqa: BLE001 - kaleido or its Chrome missing: the HTML and JSON carry the numbers
        print(f"no PNG ({exc.__class__.__name__}): pip install kaleido, with Chrome or Chromium installed")
    return written


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.json:
        return report_main(args)
    with contextlib.redirect_stdout(sys.stderr):  # progress and tables to stderr: stdout is the JSON alone
        code = report_main(args)
    if code == 0:
        print(Path(str(args.out) + ".json").read_text() if not args.from_json else Path(args.from_json).read_text())
    return code


def report_main(args) -> int:
    out = Path(args.out)
    try:
        report = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args)
        if "generation" not in report:
            raise UserError(f"{args.from_json} was written by an earlier version of this benchmark (first-word "
                            "scoring, no 'before' column): run it again")
    except (UserError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(report))
    print("\n" + markdown(report))
    written = []
    if not args.from_json:
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(str(out) + ".json").write_text(json.dumps(report, indent=1))
        written.append(str(out) + ".json")
    if not args.no_figure:
        written += figure(report, out)
    print("wrote " + ", ".join(written or ["nothing"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
