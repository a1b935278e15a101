"""Accuracy benchmark: does a method keep the answers right, on first and follow-up questions?

    python -m engine.bench --mode accuracy --per-type 100 --budgets 0.05,0.1,0.2,0.5,1.0

Held-out chats from engine/tiny/arena_scenes.py (what tiny-arena-vl answers; hub models take the same
questions): one image, several images, a video. Each chat is two turns, as a user asks them: the
media and the first question in one message (the method compresses that prompt, seeing the
question), then a follow-up about a *different* object on the same compressed cache. That second
turn is where methods that keep what the first question needs (SnapKV-like) and methods that do not
look at it differ. An answer counts when its first word (lower case, punctuation stripped) is the
expected one.

Every method runs at every value of its knob: ``--budgets`` for methods with a budget, ``--taus`` for
a method whose knob is ZipVL's threshold ``tau``; methods without a knob run once. Each point
records the knob and the REALISED KV fraction: the bytes the method's cache holds after the first
prompt, over the full cache's bytes after the same prompt, averaged over the items. The figure puts
that fraction on the x axis.

Three probes check that the benchmark is in the regime the methods were made for (full cache, the
media prefilled first, then visual KV removed by hand before the first question): keep only the
object tokens (should cost nothing), drop exactly the tokens the answer needs (should fall to
chance), drop a random 75% of the visual tokens (should cost a lot). Prints a table; writes JSON
and a Plotly figure (HTML, and PNG when kaleido and a Chrome are installed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

import backends

from ..errors import UserError
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import ARENA, load_model
from ..tiny.arena_scenes import QUESTION_TYPES, Item, held_out

ASSETS = Path(__file__).resolve().parents[2] / "assets"
PROBES = ("keep only the object tokens", "drop exactly the needed tokens", "drop a random 75% of visual tokens")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench --mode accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=ARENA)
    p.add_argument("--methods", default="all", help="comma-separated method names, or 'all'")
    p.add_argument("--budgets", default="0.05,0.1,0.2,0.5,1.0", help="values of a method's budget")
    p.add_argument("--taus", default="0.9,0.95,0.975,0.99", help="values of a method's tau (ZipVL), when it has no budget")
    p.add_argument("--per-type", type=int, default=50, help="held-out chats per question type")
    p.add_argument("--probe-items", type=int, default=None, help="chats per type for the full cache and the probes "
                                                                 "(default: --per-type)")
    p.add_argument("--types", default=",".join(QUESTION_TYPES), help=f"question types: {', '.join(QUESTION_TYPES)}")
    p.add_argument("--out", default=str(ASSETS / "accuracy"), help="writes OUT.json, OUT.html (and OUT.png)")
    p.add_argument("--no-figure", action="store_true")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="run nothing: print the tables and draw the figure of an earlier run's OUT.json")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def is_right(text: str, expected: str) -> bool:
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return bool(words) and words[0] == expected.lower()


def chat(loaded, backend, it: Item) -> tuple[list[bool], int]:
    """The item's questions asked one after another in one chat (media with the first); per turn
    whether the answer is right, and the cache's bytes after the first prompt."""
    conv = Conversation(loaded, backend)
    right, first_bytes = [], 0
    for k, q in enumerate(it.turns):
        update = conv.ask(Message(q.text, **(it.media() if k == 0 else {})), max_new_tokens=4)
        first_bytes = first_bytes or update.metrics.kv_bytes_prefill
        right.append(is_right(update.text, q.answer))
    return right, first_bytes


def visual_positions(layout) -> list[int]:
    """Token index of each visual token of the prompt, in the order arena_scenes numbers them."""
    return [p for v in layout.visuals for p in range(*v.span)]


def drop_visual(conv: Conversation, dropped: list[int]) -> None:
    """Remove the given visual tokens (arena_scenes numbering) of the last prompt from every layer."""
    at = visual_positions(conv.layouts[-1])
    gone = torch.tensor([at[k] for k in dropped], dtype=torch.long)
    for layer in conv.cache.layers:
        layer.keep(torch.nonzero(~torch.isin(layer.positions[0], gone.to(layer.positions.device)))[:, 0])


def probed(loaded, it: Item, dropped: list[int]) -> bool:
    """Full cache; the media prefilled, the given visual tokens removed, then the first question."""
    conv = Conversation(loaded, backends.make_backend("full"))
    conv.feed(Message("", **it.media()))
    drop_visual(conv, dropped)
    return is_right(conv.ask(Message(it.question.text), max_new_tokens=4).text, it.question.answer)


def probe(loaded, items: list[Item], rng: np.random.Generator) -> dict[str, float]:
    edits = {
        PROBES[0]: lambda it: [k for k in range(it.visual_tokens()) if k not in set(it.informative)],
        PROBES[1]: lambda it: list(it.question.tokens),
        PROBES[2]: lambda it: [int(k) for k in rng.choice(it.visual_tokens(), round(0.75 * it.visual_tokens()), replace=False)],
    }
    return {name: float(np.mean([probed(loaded, it, edit(it)) for it in items])) for name, edit in edits.items()}


def knob_of(method: str) -> str | None:
    """The knob a method's points sweep: its budget, else a ``tau`` parameter, else none."""
    cls = backends.backend_class(method)
    if cls.uses_budget:
        return "budget"
    return "tau" if any(p.name == "tau" for p in cls.param_specs()) else None


def sweep(loaded, method: str, values: dict[str, list[float]], items: list[Item], full_bytes: list[int]) -> list[dict]:
    """One point per knob value: accuracy of first and follow-up questions, realised KV fraction."""
    knob = knob_of(method)
    points = []
    for value in values.get(knob, [None]):
        kwargs = {} if knob is None else {knob: value}
        runs = [chat(loaded, backends.make_backend(method, **kwargs), it) for it in items]
        points.append({"knob": knob, "value": value,
                       "realised": float(np.mean([b / f for (_, b), f in zip(runs, full_bytes)])),
                       "first": float(np.mean([r[0] for r, _ in runs])),
                       "follow": float(np.mean([r[1] for r, _ in runs]))})
    return points


def _values(text: str, name: str) -> list[float]:
    try:
        values = sorted(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"--{name} must be comma-separated numbers; got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise UserError(f"--{name} must lie in (0, 1]; got {text}")
    return values


def run(args) -> dict:
    values = {"budget": _values(args.budgets, "budgets"), "tau": _values(args.taus, "taus")}
    methods = backends.available() if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        backends.backend_class(m)
    kinds = [k.strip() for k in args.types.split(",") if k.strip()]
    for k in kinds:
        if k not in QUESTION_TYPES:
            raise UserError(f"unknown question type '{k}'; choose from: {', '.join(QUESTION_TYPES)}")
    loaded = load_model(args.model)
    probe_items = args.probe_items or args.per_type
    points: dict[str, dict[str, list[dict]]] = {}
    probes: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(args.seed)
    for kind in kinds:
        items = held_out(kind, max(args.per_type, probe_items), turns=2)
        full = [chat(loaded, backends.make_backend("full"), it) for it in items[:probe_items]]
        full_bytes = [b for _, b in full]
        points[kind] = {"full": [{"knob": None, "value": None, "realised": 1.0,
                                  "first": float(np.mean([r[0] for r, _ in full])),
                                  "follow": float(np.mean([r[1] for r, _ in full]))}]}
        print(f"{kind:7s} full             first {points[kind]['full'][0]['first']:.2f}  "
              f"follow-up {points[kind]['full'][0]['follow']:.2f}  ({probe_items} chats)", flush=True)
        for method in [m for m in methods if m != "full"]:
            points[kind][method] = sweep(loaded, method, values, items[:args.per_type], full_bytes[:args.per_type])
            print(f"{kind:7s} {method:16s} " + "  ".join(
                f"{p['knob'] or '-'}={p['value']}: kv {p['realised']:.2f} first {p['first']:.2f} follow {p['follow']:.2f}"
                for p in points[kind][method]), flush=True)
        if not args.no_probe:
            probes[kind] = probe(loaded, items[:probe_items], rng)
    return {"model": args.model, "per_type": args.per_type, "probe_items": probe_items,
            "protocol": "two-turn chats: media + first question in one prompt, then a follow-up about another object",
            "x": "realised KV fraction (bytes after the first prompt / full cache's bytes)",
            "points": points, "probe": probes}


def table(report: dict) -> str:
    lines = [f"model {report['model']}: {report['per_type']} held-out two-turn chats per type "
             f"({report['probe_items']} for the full cache and the probes); accuracy of the first question "
             "and of the follow-up; kv = realised KV fraction"]
    for kind, per_method in report["points"].items():
        full = per_method["full"][0]
        lines.append(f"\n[{kind}]  full cache: first {full['first']:.2f}, follow-up {full['follow']:.2f}")
        for method, points in per_method.items():
            if method == "full":
                continue
            for p in points:
                knob = f"{p['knob']} {p['value']}" if p["knob"] else "-"
                lines.append(f"    {method:16s} {knob:13s} kv {p['realised']:5.2f}   first {p['first']:5.2f}"
                             f"   follow-up {p['follow']:5.2f}")
        for name, acc in report["probe"].get(kind, {}).items():
            lines.append(f"    probe: {name}: {acc:.2f} ({100 * (acc - full['first']):+.0f} points)")
    return "\n".join(lines)


def _mean(points: list[dict], key: str) -> float:
    return float(np.mean([p[key] for p in points]))


def markdown(report: dict) -> str:
    """The README's tables: per method and knob value, the realised KV fraction and the accuracy of
    the first question and of the follow-up, each the mean over the question types."""
    kinds = list(report["points"])
    methods = list(dict.fromkeys(m for per in report["points"].values() for m in per))
    lines = ["| method | knob | KV held (measured) | first question | follow-up | follow-up per type (" +
             ", ".join(kinds) + ") |", "|---|---|---|---|---|---|"]
    for method in methods:
        for i, _ in enumerate(report["points"][kinds[0]][method]):
            same = [report["points"][k][method][i] for k in kinds]
            knob = f"{same[0]['knob']} {same[0]['value']}" if same[0]["knob"] else "-"
            lines.append(f"| {method} | {knob} | {_mean(same, 'realised'):.2f} | {_mean(same, 'first'):.2f} | "
                         f"**{_mean(same, 'follow'):.2f}** | " + " ".join(f"{p['follow']:.2f}" for p in same) + " |")
    if report.get("probe"):
        lines += ["", "| probe (full cache, first question) | " + " | ".join(kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        for name in PROBES:
            lines.append(f"| {name} | " + " | ".join(f"{report['probe'][k][name]:.2f}" for k in kinds) + " |")
    return "\n".join(lines)


def figure(report: dict, out: Path) -> list[str]:
    """Two rows (first question, follow-up), one column per type; x = realised KV fraction."""
    import plotly.colors
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    kinds = list(report["points"])
    titles = [f"{k}: {turn}" for turn in ("first question", "follow-up") for k in kinds]
    fig = make_subplots(rows=2, cols=len(kinds), subplot_titles=titles, shared_yaxes=True, vertical_spacing=0.14)
    palette = plotly.colors.qualitative.D3 + plotly.colors.qualitative.Set2
    methods = list(dict.fromkeys(m for per in report["points"].values() for m in per))
    for row, turn in enumerate(("first", "follow"), 1):
        for col, kind in enumerate(kinds, 1):
            for i, method in enumerate(methods):
                points = sorted(report["points"][kind].get(method, []), key=lambda p: p["realised"])
                if not points:
                    continue
                fig.add_trace(go.Scatter(x=[p["realised"] for p in points], y=[p[turn] for p in points], name=method,
                                         legendgroup=method, showlegend=row == 1 and col == 1, mode="lines+markers",
                                         marker={"symbol": "star" if method == "full" else "circle", "size": 9},
                                         line={"color": palette[i % len(palette)]},
                                         text=[f"{p['knob']}={p['value']}" if p["knob"] else method for p in points]),
                              row=row, col=col)
            fig.update_xaxes(type="log", title_text="realised KV fraction" if row == 2 else None, row=row, col=col)
        fig.update_yaxes(title_text=f"accuracy ({'first' if row == 1 else 'follow-up'})", range=[0, 1.02], row=row, col=1)
    fig.update_layout(title=f"{report['model']}: held-out accuracy vs realised KV fraction (two-turn chats)",
                      template="plotly_white", width=300 * len(kinds) + 200, height=720)
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
    out = Path(args.out)
    try:
        report = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args)
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
