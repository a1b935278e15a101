"""Accuracy benchmark: does a method keep the answer right? Held-out questions, every method x budget.

    python -m engine.bench --mode accuracy --per-type 50 --budgets 0.05,0.1,0.2,0.5,1.0

Each item is a question from engine/scenes.py with its media: one board (count, colour; what the
bundled tiny-arena-vl answers), several boards or a short video (which_image, direction: for hub
models, ``--model Qwen/Qwen2-VL-2B-Instruct --types which_image,direction``). The media are
prefilled and compressed first, then the question is fed on top of the compressed cache (as
``--question-after`` in the main benchmark): otherwise a method could keep exactly the tokens the
question points at, and compression could not change a one-word answer. An answer counts when its
first word (lower case, punctuation stripped) is the expected one. Methods without a budget run
once. A probe then drops visual KV by hand (one unrelated cell, a random 75%, exactly the cells the
answer needs) to show the benchmark is sensitive to the right tokens. Prints a table; writes the
numbers (JSON) and a Plotly figure (HTML, and PNG when kaleido and a Chrome are installed) of
accuracy vs budget.
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

from .errors import UserError
from .generate import Conversation
from .inputs import Message
from .models import load_model
from .scenes import EXTRA_TYPES, GRID, QUESTION_TYPES, Item, held_out

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench --mode accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-arena-vl")
    p.add_argument("--methods", default="all", help="comma-separated method names, or 'all'")
    p.add_argument("--budgets", default="0.05,0.1,0.2,0.5,1.0")
    p.add_argument("--per-type", type=int, default=50, help="held-out questions per question type")
    p.add_argument("--types", default=",".join(QUESTION_TYPES),
                   help=f"question types: {', '.join(QUESTION_TYPES + EXTRA_TYPES)} (the last ones need a hub model)")
    p.add_argument("--out", default=str(ASSETS / "accuracy"), help="writes OUT.json, OUT.html (and OUT.png)")
    p.add_argument("--no-figure", action="store_true")
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def answer(loaded, backend, item: Item, drop=None) -> str:
    """Compress the media, then ask; ``drop(cache, layout)`` edits the cache by hand before asking."""
    conv = Conversation(loaded, backend)
    conv.feed(Message("", **item.media()))
    if drop is not None:
        drop(conv.cache, conv.layouts[-1])
    return conv.ask(Message(item.question.text), max_new_tokens=8).text


def is_right(text: str, expected: str) -> bool:
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return bool(words) and words[0] == expected.lower()


def accuracy(loaded, backend_factory, items: list[Item], drop_for=None) -> float:
    right = 0
    for it in items:
        drop = drop_for(it.question) if drop_for else None
        right += is_right(answer(loaded, backend_factory(), it, drop), it.question.answer)
    return right / len(items)


def _dropper(cells_to_drop):
    """Remove the visual tokens of the given (row, column) cells of the board from every layer."""
    def drop(cache, layout):
        start = layout.visuals[0].span[0]
        gone = torch.tensor([start + r * GRID + c for r, c in cells_to_drop], dtype=torch.long)
        for layer in cache.layers:
            layer.keep(torch.nonzero(~torch.isin(layer.positions[0], gone.to(layer.positions.device)))[:, 0])
    return drop


def probe(loaded, items, rng) -> dict[str, float]:
    """Accuracy after dropping one unrelated cell, a random 75% of cells, or exactly the needed ones."""
    every = [(r, c) for r in range(GRID) for c in range(GRID)]
    full = lambda: backends.make_backend("full")  # noqa: E731

    def unrelated(q):
        others = q.unrelated_cells()
        return _dropper([others[rng.integers(len(others))]] if others else [])

    def random75(q):
        return _dropper([every[i] for i in rng.choice(len(every), size=round(0.75 * len(every)), replace=False)])

    return {"drop one unrelated cell": accuracy(loaded, full, items, unrelated),
            "drop a random 75% of cells": accuracy(loaded, full, items, random75),
            "drop exactly the needed cells": accuracy(loaded, full, items, lambda q: _dropper(q.cells))}


def figure(results: dict, budgets: list[float], out: Path, model: str) -> list[str]:
    """One panel per question type, one line per method; methods without a budget are flat dots."""
    import plotly.colors
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    kinds = list(results)
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[f"{k} questions" for k in kinds], shared_yaxes=True)
    palette = plotly.colors.qualitative.D3
    methods = list(dict.fromkeys(m for per_method in results.values() for m in per_method))
    for col, kind in enumerate(kinds, 1):
        for i, method in enumerate(methods):
            points = results[kind].get(method)
            if not points:
                continue
            flat = len(points) == 1
            ys = [points["1.0"]] * len(budgets) if flat else [points[str(b)] for b in budgets]
            fig.add_trace(go.Scatter(x=budgets, y=ys, name=method, legendgroup=method, showlegend=col == 1,
                                     mode="lines" if flat else "lines+markers",
                                     line={"color": palette[i % len(palette)], "dash": "dot" if flat else "solid"}),
                          row=1, col=col)
        fig.update_xaxes(type="log", tickvals=budgets, title_text="budget (fraction of KV kept)", row=1, col=col)
    fig.update_yaxes(title_text="accuracy", range=[0, 1.02], row=1, col=1)
    fig.update_layout(title=f"{model}: held-out accuracy vs KV budget (media compressed before the question)",
                      template="plotly_white", width=1100, height=480)
    written = [str(out) + ".html"]
    fig.write_html(written[0], include_plotlyjs="cdn")
    try:
        fig.write_image(str(out) + ".png", scale=2)
        written.append(str(out) + ".png")
    except Exception as exc:  # noqa: BLE001 - kaleido or its Chrome missing: the HTML and JSON carry the numbers
        print(f"no PNG ({exc.__class__.__name__}): pip install kaleido, with Chrome or Chromium installed")
    return written


def run(args) -> dict:
    budgets = sorted(float(b) for b in args.budgets.split(","))
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise UserError(f"--budgets must lie in (0, 1]; got {args.budgets}")
    methods = backends.available() if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        backends.backend_class(m)
    kinds = [k.strip() for k in args.types.split(",") if k.strip()]
    for k in kinds:
        if k not in QUESTION_TYPES + EXTRA_TYPES:
            raise UserError(f"unknown question type '{k}'; choose from: {', '.join(QUESTION_TYPES + EXTRA_TYPES)}")
    loaded = load_model(args.model)
    items_of = {kind: held_out(kind, args.per_type) for kind in kinds}
    results: dict[str, dict[str, dict[str, float]]] = {}
    for kind, items in items_of.items():
        results[kind] = {}
        for method in ["full"] + [m for m in methods if m != "full"]:
            cls = backends.backend_class(method)
            points = budgets if cls.uses_budget else [1.0]
            results[kind][method] = {
                str(b): accuracy(loaded, lambda b=b: backends.make_backend(method, budget=b), items) for b in points}
            print(f"{kind:7s} {method:16s} " + "  ".join(f"{b}: {a:.2f}" for b, a in results[kind][method].items()),
                  flush=True)
    probes = {}
    if not args.no_probe:
        rng = np.random.default_rng(args.seed)
        probes = {kind: probe(loaded, items_of[kind], rng) for kind in kinds if kind in QUESTION_TYPES}
    return {"model": args.model, "per_type": args.per_type, "budgets": budgets, "question_after": True,
            "accuracy": results, "probe": probes}


def table(report: dict) -> str:
    budgets = report["budgets"]
    lines = [f"model {report['model']}, {report['per_type']} held-out questions per type, media compressed "
             "before the question; accuracy (full cache in the first row)"]
    for kind, per_method in report["accuracy"].items():
        lines.append(f"\n[{kind}]  " + "method".ljust(16) + "".join(f"{b:>7}" for b in budgets))
        for method, points in per_method.items():
            cells = [f"{points[str(b)]:7.2f}" if str(b) in points else f"{points['1.0']:7.2f}" if len(points) == 1 else "      -"
                     for b in budgets]
            lines.append(" " * (len(kind) + 4) + method.ljust(16) + "".join(cells))
        if kind in report["probe"]:
            full = per_method["full"]["1.0"]
            for name, acc in report["probe"][kind].items():
                lines.append(" " * (len(kind) + 4) + f"probe: {name}: {acc:.2f} ({100 * (acc - full):+.0f} points)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = run(args)
    except (UserError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps(report, indent=1))
    written = [str(out) + ".json"]
    if not args.no_figure:
        written += figure(report["accuracy"], report["budgets"], out, report["model"])
    print("wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
