"""The live panels, as Plotly figures built from the service's plain figures (no torch).

Each figure keeps a fixed ``uirevision`` so a user's zoom survives the redraws while tokens stream.
The full cache is always drawn in grey, dashed where it is a line, and named "(cached)" when its
figures come from an earlier run on the same input.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

FULL_COLOR = "#8c8c8c"
COLORS = ["#e4572e", "#2e86ab", "#f3a712", "#29bf12", "#a846a0"]
LAYOUT = dict(template="plotly_white", height=340, margin=dict(l=50, r=20, t=50, b=90),
              legend=dict(orientation="h", y=-0.3, yanchor="top"), font=dict(size=12))


def byte_unit(largest: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return scale, name
    return 1, "bytes"


def fmt_bytes(n: float) -> str:
    scale, unit = byte_unit(n)
    return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n:.0f} bytes"


def step_spread(*runs: dict) -> float | None:
    """The relative spread (std / mean) of the decode steps' times, the larger of the runs': a
    difference smaller than this is within the noise of this machine. None: too few steps to tell."""
    spreads = []
    for run in runs:
        steps = run["metrics"].get("step_s") or []
        if len(steps) >= 2:
            mean = sum(steps) / len(steps)
            spreads.append((sum((s - mean) ** 2 for s in steps) / (len(steps) - 1)) ** 0.5 / mean if mean else 0.0)
    return max(spreads, default=None)


def vs_full(value: float, reference: float, spread: float | None = 0.0) -> str:
    """Every "vs full" figure in one unit, a ratio to the full cache ("0.50x"); "~ same" when the
    difference is smaller than ``spread`` (relative), i.e. within the noise of repeated steps;
    "(noise ?)" when there were too few steps to measure that spread."""
    if not reference:
        return "n/a"
    ratio = value / reference
    if spread is None:
        return f"{ratio:.2f}x (noise ?)"
    return "~ same" if abs(ratio - 1) < spread else f"{ratio:.2f}x"


def kept_fraction(run: dict, reference: dict | None) -> float | None:
    """The fraction of the full cache's bytes the run holds after the prompt (measured, not the budget)."""
    full = reference["metrics"]["kv_bytes_prefill"] if reference else 0
    return run["metrics"]["kv_bytes_prefill"] / full if full else None


def series_name(run: dict) -> str:
    return run["method"] + (" (cached)" if run.get("cached") else "")


def _empty(title: str, uirevision: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, uirevision=uirevision, **LAYOUT)
    return fig


def memory_figure(runs: list[dict], reference: dict | None = None) -> go.Figure:
    """KV bytes held after the prompt (x = 0) and after each generated token, per method.

    ``runs``: dicts with ``method`` and ``metrics["kv_trace"]``; ``reference``: the full cache's,
    drawn dashed, and every method's last point is labelled with its saving against it.
    """
    fig = _empty("KV cache memory while answering", "memory")
    everything = [r for r in ([reference] if reference else []) + runs if r and r["metrics"]["kv_trace"]]
    if not everything:
        return fig
    scale, unit = byte_unit(max(max(r["metrics"]["kv_trace"]) for r in everything))
    full = reference["metrics"]["kv_trace"] if reference else None
    if full:
        fig.add_scatter(y=[b / scale for b in full], name=series_name(reference), mode="lines",
                        line=dict(color=FULL_COLOR, dash="dash"))
    for i, run in enumerate(runs):
        trace = run["metrics"]["kv_trace"]
        if not trace:
            continue
        fig.add_scatter(y=[b / scale for b in trace], name=series_name(run), mode="lines",
                        line=dict(color=COLORS[i % len(COLORS)]))
        if full:  # the saving at the same point of the answer
            last = len(trace) - 1
            held, ref = trace[last], full[min(last, len(full) - 1)]
            fig.add_annotation(x=last, y=held / scale, text=f"{1 - held / ref:.0%} saved" if ref else "",
                               showarrow=True, arrowhead=2, ax=-40, ay=-30, font=dict(color=COLORS[i % len(COLORS)]))
    fig.update_xaxes(title="generated tokens (0 = after the prompt)")
    fig.update_yaxes(title=f"KV cache ({unit})", rangemode="tozero")
    return fig


def speed_figure(runs: list[dict], reference: dict | None = None) -> go.Figure:
    """Time to first token and decode tokens/s, one horizontal bar per method (names never collide,
    however many), the full cache first, labelled with the ratio to it ("~ same" within the spread
    of the decode steps)."""
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.2,
                        subplot_titles=("<b>Time to first token</b> (s), lower is better",
                                        "<b>Decode speed</b> (tokens/s), higher is better"))
    fig.update_annotations(font_size=13)
    fig.update_layout(uirevision="speed", showlegend=False, **(LAYOUT | {"margin": dict(l=20, r=20, t=40, b=30)}))
    bars = ([reference] if reference else []) + [r for r in runs if r]
    for row, key in ((1, "ttft_s"), (2, "decode_tok_s")):
        ref = reference["metrics"][key] if reference else None
        labels = [f"{r['metrics'][key]:.3g}" + ("" if r is reference or ref is None else
                                               f"  {vs_full(r['metrics'][key], ref, step_spread(r, reference))}")
                  for r in bars]
        colors = [FULL_COLOR if r is reference else COLORS[(i - bool(reference)) % len(COLORS)] for i, r in enumerate(bars)]
        values = [r["metrics"][key] for r in bars]
        fig.add_bar(y=[series_name(r) for r in bars], x=values, orientation="h", text=labels, textposition="outside",
                    cliponaxis=False, marker_color=colors, textfont=dict(size=12), row=row, col=1)
        fig.update_xaxes(range=[0, 1.6 * max(values, default=0) or 1], row=row, col=1)  # room for the labels
        fig.update_yaxes(autorange="reversed", automargin=True, tickfont=dict(size=12), row=row, col=1)
    fig.update_layout(uniformtext=dict(minsize=12, mode="show"))  # never shrink a label to fit a short bar
    return fig


def layer_figure(runs: list[dict], reference: dict | None = None) -> go.Figure:
    """Per layer: the share of the full cache's bytes each method holds (tokens held / tokens seen
    when there is no reference), with the method's planned per-layer budget where it reports one."""
    fig = _empty("Kept per layer", "layers")
    full = reference["layers"]["bytes"] if reference else None
    for i, run in enumerate(runs):
        layers = run.get("layers")
        if not layers:
            continue
        color = COLORS[i % len(COLORS)]
        if full:
            shares = [b / f if f else 0.0 for b, f in zip(layers["bytes"], full)]
        else:
            shares = [t / layers["seen"] if layers["seen"] else 0.0 for t in layers["tokens"]]
        x = list(range(1, len(shares) + 1))
        fig.add_bar(x=x, y=shares, name=series_name(run), marker_color=color)
        if layers.get("planned"):
            fig.add_scatter(x=x, y=layers["planned"], name=f"{run['method']}: planned budget", mode="markers",
                            marker=dict(color=color, symbol="line-ew-open", size=18, line=dict(width=3)))
    fig.update_xaxes(title="layer", dtick=1 if len(fig.data) and len(fig.data[0].x or ()) <= 40 else None)
    fig.update_yaxes(title="share of the full cache" if full else "tokens held / tokens seen",
                     tickformat=".0%", rangemode="tozero")
    fig.update_layout(barmode="group")
    return fig


def quality_figure(runs: list[dict], reference: dict | None = None) -> go.Figure:
    """One point per method: x the fraction of the full cache's KV bytes it really holds (measured
    after the prompt), y the share of its answer tokens equal to the full cache's, position by
    position. Methods with different knobs (a budget, ZipVL's tau, MPIC's mode) meet on this axis."""
    fig = _empty("Same answer as the full cache vs KV held", "quality")
    if reference:
        fig.add_scatter(x=[1.0], y=[1.0], name=series_name(reference), mode="markers",
                        marker=dict(color=FULL_COLOR, symbol="star", size=16))
    for i, run in enumerate(runs):
        held, same = kept_fraction(run, reference), run.get("agreement")
        if held is None or same is None:  # still running, or no reference to measure against
            continue
        fig.add_scatter(x=[held], y=[same], name=series_name(run), mode="markers+text", text=[run["method"]],
                        textposition="top center", marker=dict(color=COLORS[i % len(COLORS)], size=12))
    fig.update_xaxes(title="fraction of the full cache's KV bytes held (measured)", range=[0, 1.08])
    fig.update_yaxes(title="answer tokens same as full", tickformat=".0%", range=[0, 1.1])
    return fig


TTFT_LABELS = {"recompute": "Full recompute", "prefix": "Prefix caching", "mpic": "MPIC"}


def ttft_figure(ttft: dict | None) -> go.Figure:
    """TTFT of one prompt under prefix caching vs MPIC-k, full recompute in grey as the reference
    (``ttft``: the service's ``mpic_ttft``; None draws an empty panel)."""
    fig = _empty("TTFT for this prompt: prefix caching vs MPIC", "mpic-ttft")
    if not ttft:
        return fig
    times = ttft["ttft_s"]
    modes = [m for m in ("recompute", "prefix", "mpic") if m in times]
    base = times.get("recompute")
    names = [TTFT_LABELS[m] + (f"-{ttft['k']}" if m == "mpic" else "") for m in modes]
    labels = [f"{times[m]:.3g} s" + ("" if m == "recompute" or not base else f" ({times[m] / base:.2f}x)")
              for m in modes]
    colors = [FULL_COLOR if m == "recompute" else COLORS[i % len(COLORS)] for i, m in enumerate(modes)]
    fig.add_bar(x=names, y=[times[m] for m in modes], text=labels, textposition="outside", cliponaxis=False,
                marker_color=colors)
    fig.update_yaxes(title="time to first token (s)", range=[0, 1.25 * max(times.values(), default=0) or 1])
    fig.update_xaxes(title=f"the last MPIC message ({ttft['tokens']} prompt tokens), its media already stored")
    return fig
