"""The accuracy run's report: its tables (plain text and docs/benchmarks.md's markdown), its figure,
and the Wilson intervals they give (:mod:`.accuracy` runs the chats and writes the JSON they read)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .common import REFERENCE

PROBES = ("keep only the object tokens", "drop exactly the needed tokens", "drop a random 75% of visual tokens")
PROTOCOLS = ("with", "before", "follow")
PROTOCOL_TITLES = {"with": "first question, compressed with it", "before": "first question, compressed before it",
                   "follow": "follow-up"}


def wilson(hits: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``hits`` / ``n``."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def line(kind: str, method: str, p: dict) -> str:
    knob = f"{p['knob']}={p['value']}" if p["knob"] else "-"
    loyal_cells = "/".join(f"{p[f'{n}_loyalty']:.2f}" if f"{n}_loyalty" in p else "-" for n in PROTOCOLS)
    return (f"{kind:8s} {method:15s} {knob:12s} kv {p['realised']:.2f}  " +
            "  ".join(f"{name} {p[name]:.2f}" for name in PROTOCOLS) +
            f"  loyalty {loyal_cells}  ran on {max(p[f'{n}_ran_on'] for n in PROTOCOLS):.2f}  (n={p['n']})" +
            (f"  over {p['seeds']} seeds: " + "  ".join(f"{n} {min(p[f'{n}_seeds']):.2f}-{max(p[f'{n}_seeds']):.2f}"
                                                       for n in PROTOCOLS) if p.get("seeds") else ""))


def _pooled(points: list[dict], key: str) -> tuple[float, float, float]:
    """Mean over the types (equal counts) and the Wilson interval of the pooled counts."""
    hits = sum(p[key] * p["n"] for p in points)
    n = sum(p["n"] for p in points)
    lo, hi = wilson(hits, n)
    return hits / n, lo, hi


def _cell(points: list[dict], key: str) -> str:
    mean, lo, hi = _pooled(points, key)
    return f"{mean:.2f} ({lo:.2f}-{hi:.2f})"


def _loyalty_cell(points: list[dict]) -> str:
    """The three protocols' loyalty over all types (with / before / follow), "-" for a row measured
    before loyalty was (an earlier run's)."""
    if not all(f"{n}_loyalty" in p for p in points for n in PROTOCOLS):
        return "-"
    return " / ".join(f"{_pooled(points, f'{n}_loyalty')[0]:.2f}" for n in PROTOCOLS)


def table(report: dict) -> str:
    source = (f"{report['per_type']} items of {report['dataset']}, {report['metric']} score" if report.get("dataset") else
              f"scenes v{report.get('generation', 2)}: {report['per_type']} held-out two-turn chats per type; whole answers right")
    lines = [f"model {report['model']} ({source}): with = first question compressed with it, before = compressed "
             "before it, follow = follow-up; kv = realised KV fraction; loyalty with/before/follow = share of items "
             "answered as the full cache answered"]
    for kind, per_method in report["points"].items():
        lines.append(f"\n[{kind}]")
        for method, points in per_method.items():
            for p in points:
                lines.append("    " + line(kind, method, p).split(None, 1)[1])
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
             "loyalty (with / before / follow) | ran on | follow-up per type (" + ", ".join(kinds) + ") |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method in methods:
        for i, _ in enumerate(report["points"][kinds[0]][method]):
            same = [report["points"][k][method][i] for k in kinds]
            knob = f"{same[0]['knob']} {same[0]['value']}" if same[0]["knob"] else "-"
            ran_on = max(_pooled(same, f"{n}_ran_on")[0] for n in PROTOCOLS)
            lines.append(f"| {method} | {knob} | {np.mean([p['realised'] for p in same]):.2f} | {_cell(same, 'with')} | "
                         f"{_cell(same, 'before')} | **{_cell(same, 'follow')}** | {_loyalty_cell(same)} | {ran_on:.2f} | "
                         + " ".join(f"{p['follow']:.2f}" for p in same) + " |")
    if report.get("probe"):
        lines += ["", "| probe (full cache, first question) | " + " | ".join(kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        for name in PROBES:
            lines.append(f"| {name} | " + " | ".join(f"{report['probe'][k][name]:.2f}" for k in kinds) + " |")
    return "\n".join(lines)


# The floors a method must clear (docs/benchmarks.md's "How to read it"): black, dashed, so
# no method's colour is taken for them
FLOORS = {"random": ("#000000", "x"), "downsample": ("#000000", "cross")}


def _marker(method: str, i: int) -> dict:
    """The full cache a large star (methods that match it sit on top of it); the floors their own
    symbols; past the palette's first ten colours, whose next ones look alike, another symbol tells
    methods apart."""
    if method == REFERENCE:
        return {"symbol": "star", "size": 15}
    if method in FLOORS:
        return {"symbol": FLOORS[method][1], "size": 10}
    return {"symbol": ("circle", "diamond", "square")[i // 10 % 3], "size": 9}


def _line(method: str, i: int, palette: list[str]) -> dict:
    if method in FLOORS:
        return {"color": FLOORS[method][0], "dash": "dash"}
    return {"color": palette[i % len(palette)]}


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
                                     marker=_marker(method, i), line=_line(method, i, palette)),
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
