"""The live panels, as Plotly figures built from the service's typed views (no torch).

Each figure keeps a fixed ``uirevision`` so a user's zoom survives the redraws while tokens stream.
The full cache is always drawn in grey, dashed where it is a line, and named "(cached)" when its
figures come from an earlier run on the same input.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import plotly.graph_objects as go

from kv_arena.service.view_types import CompareRun, LayerFigures, Meters, StreamView, TtftView

FULL_COLOR = "#8c8c8c"
COLORS = ["#e4572e", "#2e86ab", "#f3a712", "#29bf12", "#a846a0"]
GRID = "#ebf0f8"
# plotly_white's look in a few fields: the template itself costs ~60 ms per figure (it is deep-copied),
# most of a short answer's time in the app
# no figure titles (each panel's label names it; a long title was clipped at half width); the legend
# above the plot, where it cannot cover the axis titles (right of the panel's own label)
# the legend right-aligned above the plot: Gradio's label badge sits at the top left
LAYOUT = dict(template="none", height=360, margin=dict(l=60, r=20, t=70, b=50), plot_bgcolor="white",
              paper_bgcolor="white", legend=dict(orientation="h", x=1, xanchor="right", y=1.02, yanchor="bottom"), font=dict(size=12),
              colorway=["#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a"])
AXIS = dict(gridcolor=GRID, linecolor=GRID, zerolinecolor=GRID, zerolinewidth=2, automargin=True)


def byte_unit(largest: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return scale, name
    return 1, "bytes"


def fmt_bytes(n: float) -> str:
    scale, unit = byte_unit(n)
    return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n:.0f} bytes"


@dataclass(frozen=True)
class Drawn:
    """One answer as the memory, speed and layer panels draw it (the full cache's is the reference)."""

    method: str
    metrics: Meters
    layers: LayerFigures | None = None
    cached: bool = False  # the full cache's figures, from an earlier run on the same input
    stream: StreamView | None = None  # its media streamed in under a cap


MIN_STEPS = 8  # decode steps each answer must have before its decode speed is compared
MIN_TIMED_S = 0.5  # a single timed event (a prefill) shorter than this is too short to compare (one run, no spread)
NOISE = 0.35  # this machine's run-to-run noise: a timing ratio within 1 +- NOISE is not told from 1
STEADY = 0.25  # decode steps whose interquartile range is within this share of their median: a quiet machine
NOT_TOLD = "≈"  # in place of a measured ratio within the noise
TOO_SHORT = "–"  # in place of a ratio with too few timed events behind it
NOT_TOLD_NOTE = (f"≈ within timing noise (±{NOISE:.0%}); – too short to time (under {MIN_STEPS} decode steps; "
                 f"a first token: under {MIN_TIMED_S} s, or its answer's steps uneven)")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _spread(values: list[float]) -> float:
    """The interquartile range over the median: robust to the odd slow step a shared machine has."""
    ordered, n = sorted(values), len(values)
    median = _median(values)
    return (ordered[(3 * n) // 4] - ordered[n // 4]) / median if median else 0.0


def _steady(steps: list[float]) -> bool:
    """Enough decode steps, evenly timed: the machine was not busy with something else meanwhile."""
    return len(steps) >= MIN_STEPS and _spread(steps) <= STEADY


def speed_ratio(run, reference, key: str) -> float | str:
    """A speed ratio to the full cache that the same input gives run after run, or why there is none:
    :data:`TOO_SHORT` where too few timed events stand behind it (fewer than MIN_STEPS decode steps
    in either answer; a first token, one event each, under MIN_TIMED_S or beside uneven steps, which
    say the machine was busy), :data:`NOT_TOLD` where it is
    within this machine's noise (NOISE, widened by the steps' own spread). ``key``: ``ttft_s`` (the
    method's time over the full cache's) or ``decode_tok_s`` (the full cache's median step over the
    method's: its speed over the full cache's). Four Compare runs of one example on this 2-core
    machine once read a decode ratio as ≈, ≈, 3.80x and 3.92x from two steps each: hence the rules."""
    m, f = run.metrics, reference.metrics
    if key == "ttft_s":  # one event each: trusted only when long, and when the steps say the machine was steady
        if min(m.ttft_s, f.ttft_s) < MIN_TIMED_S or not (_steady(m.step_s) and _steady(f.step_s)):
            return TOO_SHORT
        ratio, band = m.ttft_s / f.ttft_s, NOISE
    else:
        if min(len(m.step_s), len(f.step_s)) < MIN_STEPS:
            return TOO_SHORT
        ratio = _median(f.step_s) / _median(m.step_s)
        band = max(NOISE, 2 * max(_spread(m.step_s), _spread(f.step_s)))
    return ratio if not (1 / (1 + band) <= ratio <= 1 + band) else NOT_TOLD


def shown_ratio(ratio: float | str) -> str:
    return f"{ratio:.2f}x" if isinstance(ratio, float) else ratio


def vs_full(value: float, reference: float) -> str:
    """An exact "vs full" figure (bytes), a ratio to the full cache ("0.50x"); speed ratios are
    :func:`speed_ratio`'s."""
    return f"{value / reference:.2f}x" if reference else "n/a"


def kept_fraction(run, reference) -> float | None:
    """The fraction of the full cache's bytes ``run`` holds after the prompt (measured, not the
    budget); both have ``metrics`` (a :class:`Drawn`, a chat view, a Compare turn)."""
    full = reference.metrics.kv_bytes_prefill if reference else 0
    return run.metrics.kv_bytes_prefill / full if full else None


def series_name(method: str, cached: bool = False) -> str:
    return method + (" (cached)" if cached else "")


def _figure(uirevision: str, traces: list[dict] = (), xaxis: dict | None = None,
            yaxis: dict | None = None, **layout) -> go.Figure:
    """One figure built in one go (plotly's per-call updates cost milliseconds each)."""
    return go.Figure(data=list(traces), layout=LAYOUT | {"uirevision": uirevision,
                                                          "xaxis": AXIS | (xaxis or {}), "yaxis": AXIS | (yaxis or {})}
                     | layout)


def _empty(uirevision: str) -> go.Figure:
    return _figure(uirevision)


def memory_figure(runs: list[Drawn], reference: Drawn | None = None) -> go.Figure:
    """KV bytes held after the prompt (x = 0) and after each generated token, per method; a run
    whose media streamed in under a cap (its ``stream``) also has the bytes held after each chunk
    (x < 0: the last chunk at -1) and the cap as a dotted horizontal line.

    ``reference``: the full cache's, drawn dashed, and every method's name in the legend says its
    saving at its last point (labels on the lines overlapped when methods hold about the same).
    """
    everything = [r for r in ([reference] if reference else []) + runs if r and r.metrics.kv_trace]
    if not everything:
        return _empty("memory")
    streams = [(i, r.stream) for i, r in enumerate(runs) if r.stream]
    largest = [max(r.metrics.kv_trace) for r in everything]
    largest += [max([*s.kv_bytes, s.cap_bytes or 0]) for _, s in streams if s.kv_bytes]
    scale, unit = byte_unit(max(largest))
    full = reference.metrics.kv_trace if reference else None
    traces = []
    if full:
        traces.append(dict(type="scatter", y=[b / scale for b in full], mode="lines",
                           name=series_name(reference.method, reference.cached), line=dict(color=FULL_COLOR, dash="dash")))
    for i, run in enumerate(runs):
        trace = run.metrics.kv_trace
        if not trace:
            continue
        name = series_name(run.method, run.cached)
        if full:  # the saving at the same point of the answer
            last = len(trace) - 1
            held, ref = trace[last], full[min(last, len(full) - 1)]
            name += f": {1 - held / ref:.0%} saved" if ref else ""
        traces.append(dict(type="scatter", y=[b / scale for b in trace], name=name, mode="lines",
                           line=dict(color=COLORS[i % len(COLORS)])))
    for i, stream in streams:
        traces += stream_traces(stream, runs[i], COLORS[i % len(COLORS)], scale, unit)
    # short enough for a half-width panel at 1280 px (a longer one was cut on both sides)
    title = "chunks streamed (< 0), then tokens (0: after the question)" if streams else "generated tokens (0 = after the prompt)"
    steps = max(len(r.metrics.kv_trace) for r in everything) + max((len(s.kv_bytes) for _, s in streams), default=0)
    whole = dict(dtick=1, tick0=0) if steps <= 12 else dict(tickformat="d")  # tokens come whole: no tick at 0.2
    return _figure("memory", traces, xaxis=dict(title=title) | whole,
                   yaxis=dict(title=f"KV cache ({unit})", rangemode="tozero"))


def stream_traces(stream: StreamView, run: Drawn, color: str, scale: float, unit: str) -> list[dict]:
    """The bytes held after each streamed chunk (a full cache rises, a capped method saw-tooths
    under its cap), and the cap across the whole figure."""
    held = stream.kv_bytes
    x = list(range(-len(held), 0))
    traces = [dict(type="scatter", x=x, y=[b / scale for b in held], mode="lines+markers",
                   name=f"{run.method}: after each chunk of frames", line=dict(color=color, width=1),
                   marker=dict(color=color, size=5),
                   hovertext=[f"frame {f} of {stream.frames_total}" for f in stream.frames])]
    if stream.cap_bytes:
        end = max(0, len(run.metrics.kv_trace) - 1)
        name = f"cap {stream.cap_bytes / scale:.3g} {unit}" + ("" if stream.capped else " (the full cache streams without one)")
        traces.append(dict(type="scatter", x=[x[0] if x else 0, end], y=[stream.cap_bytes / scale] * 2, name=name,
                           mode="lines", line=dict(color="#222222", dash="dot", width=1)))
    return traces


# short enough for a phone's panel (about 300 px: "higher is better" was cut at its edge)
SPEED_ROWS = (("ttft_s", "<b>First token</b> (s), lower is better", (0.6, 1.0)),
              ("decode_tok_s", "<b>Decode</b> (tokens/s), higher is better", (0.0, 0.4)))


def speed_figure(runs: list[Drawn], reference: Drawn | None = None) -> go.Figure:
    """Time to first token and decode tokens/s, one horizontal bar per method (names never collide,
    however many), the full cache first. Every method gets its bar; where its ratio to the full
    cache is not shown (:func:`speed_ratio`: too short to time, or within the noise) the bar is pale
    and hatched beside its mark, so a bar drawn from noise does not read as a measured difference
    (with no bar at all a method looked missing)."""
    bars = ([reference] if reference else []) + [r for r in runs if r and r.metrics is not None]
    traces, axes, titles = [], {}, []
    for row, (key, title, domain) in enumerate(SPEED_ROWS, start=1):
        values = [getattr(r.metrics, key) for r in bars]
        ratios = [None if r is reference or reference is None else speed_ratio(r, reference, key) for r in bars]
        shown = [ratio is None or isinstance(ratio, float) for ratio in ratios]
        labels = [f"{value:.3g}" + ("" if ratio is None else f"  {shown_ratio(ratio)}")
                  for value, ratio in zip(values, ratios)]
        colors = [FULL_COLOR if r is reference else COLORS[(i - bool(reference)) % len(COLORS)] for i, r in enumerate(bars)]
        suffix = "" if row == 1 else str(row)
        marker = dict(color=colors, opacity=[1.0 if keep else UNTOLD_OPACITY for keep in shown],
                      pattern=dict(shape=["" if keep else UNTOLD_PATTERN for keep in shown], fillmode="overlay"))
        traces.append(dict(type="bar", y=[series_name(r.method, r.cached) for r in bars], x=values, orientation="h",
                           text=labels, textposition="outside", cliponaxis=False, marker=marker,
                           textfont=dict(size=12), xaxis=f"x{suffix}", yaxis=f"y{suffix}"))
        axes[f"xaxis{suffix}"] = AXIS | dict(range=[0, 2.2 * max(values, default=0) or 1], anchor=f"y{suffix}")  # room for the labels
        axes[f"yaxis{suffix}"] = AXIS | dict(domain=list(domain), autorange="reversed", tickfont=dict(size=12),
                                             anchor=f"x{suffix}")
        titles.append(dict(text=title, x=0.5, xref="paper", xanchor="center", y=domain[1], yref="paper",
                           yanchor="bottom", showarrow=False, font=dict(size=13)))
    marked = any(mark in label for trace in traces for label in trace["text"] for mark in (NOT_TOLD, TOO_SHORT))
    if marked:
        titles.append(speed_note())
    layout = LAYOUT | {"margin": dict(l=20, r=20, t=64, b=NOTE_MARGIN if marked else 56), "uirevision": "speed",
                       "showlegend": False, "annotations": titles, "uniformtext": dict(minsize=12, mode="show")} | axes
    return go.Figure(data=traces, layout=layout)


UNTOLD_OPACITY = 0.35  # a bar whose ratio to the full cache is not shown: pale...
UNTOLD_PATTERN = "/"  # ...and hatched
NOTE_SHIFT = -24  # px: the footnote starts under the bottom axis's tick labels (at y=0 it printed over them)
# the footnote in lines a phone's panel shows whole (a 66-character line was cut at its right edge)
NOTE_LINES = textwrap.wrap(NOT_TOLD_NOTE, 42)
NOTE_MARGIN = 40 + 15 * len(NOTE_LINES)  # px under the plot: the tick labels, then the footnote's lines


def speed_note() -> dict:
    """The footnote saying what ≈ and – mean, under the bottom axis's tick labels (shifted in pixels:
    a shift in paper units changes with the panel's height)."""
    return dict(text="<br>".join(NOTE_LINES), x=0, xref="paper", xanchor="left", y=0, yref="paper",
                yanchor="top", yshift=NOTE_SHIFT, showarrow=False, align="left", font=dict(size=11, color="#555555"))


def layer_figure(runs: list[Drawn], reference: Drawn | None = None) -> go.Figure:
    """Per layer: the share of the full cache's bytes each method holds (tokens held / tokens seen
    when there is no reference), with the method's planned per-layer budget where it reports one."""
    full = reference.layers.nbytes if reference and reference.layers else None
    traces, count, largest = [], 0, 0.0
    for i, run in enumerate(runs):
        layers = run.layers
        if not layers:
            continue
        color = COLORS[i % len(COLORS)]
        if full:
            shares = [b / f if f else 0.0 for b, f in zip(layers.nbytes, full)]
        else:
            shares = [t / layers.seen if layers.seen else 0.0 for t in layers.tokens]
        x = list(range(1, len(shares) + 1))
        count, largest = len(x), max([largest, *shares, *(layers.planned or [])])
        traces.append(dict(type="bar", x=x, y=shares, name=series_name(run.method, run.cached), marker_color=color))
        if layers.planned:
            traces.append(dict(type="scatter", x=x, y=layers.planned, name=f"{run.method}: planned", mode="markers",
                               marker=dict(color=color, symbol="line-ew-open", size=18, line=dict(width=3))))
    return _figure("layers", traces, xaxis=dict(title="layer", dtick=1 if count <= 40 else None),
                   yaxis=dict(title="share of the full cache's bytes" if full else "tokens held / tokens seen",
                              tickformat=percent_format(largest), rangemode="tozero"), barmode="group")


def percent_format(largest: float) -> str:
    """A percent tick format with the decimals an axis up to ``largest`` needs for its ticks to differ:
    under a small memory cap a layer holds about 1% of the full cache, and ".0%" read 1%, 1%, 1%, 0%."""
    if largest <= 0:
        return ".0%"
    return f".{max(0, 1 - math.floor(math.log10(largest * 100)))}%"


TURN_SYMBOLS = ["circle", "diamond", "square", "triangle-up"]
QUALITY_HEIGHT = 420  # px: the plot, its x title, then up to three rows of legend under it
QUALITY_MARGIN = dict(l=60, r=20, t=60, b=170)  # t: below the panel's label; b: the x title, then the legend
LEGEND_GAP = 64  # px from the plot's bottom edge to the legend: the tick labels and the x title fit between
MARKER_SIZES = (22, 17, 12, 8, 5)  # the first method's markers largest: methods at one point show as rings


def quality_figure(runs: tuple[CompareRun, ...]) -> go.Figure:
    """One marker per method and turn (the Compare runs; the full cache first): x the
    fraction of the full cache's KV bytes it really holds after that turn's prompt (measured), y
    the share of its answer tokens equal to the full cache's, position by position. A method's
    turns are joined by a line, first question (circle) to follow-up (diamond), said in the legend.
    Methods with different knobs (a budget, ZipVL's tau, MPIC's mode) meet on this axis. No labels on
    the markers: methods at one point would write over each other; the legend names them, and each
    method's markers are smaller than the one's before, drawn over it (two methods often hold the
    same bytes and agree as much: one marker hid the other)."""
    traces = []
    full = runs[0].turns if runs else ()
    if full:
        traces.append(dict(type="scatter", x=[1.0] * len(full), y=[1.0] * len(full),
                           name=series_name(runs[0].method, full[0].cached),
                           mode="markers", marker=dict(color=FULL_COLOR, symbol="star", size=16)))
    turns, shared = 0, {}
    for i, run in enumerate(runs[1:]):
        points = [(kept_fraction(turn, ref), turn.agreement, n)
                  for n, (turn, ref) in enumerate(zip(run.turns, full))
                  if turn.metrics is not None and ref.metrics is not None]
        points = [(x, y, n) for x, y, n in points if x is not None and y is not None]
        if not points:  # still running, or no reference to measure against
            continue
        color, turns = COLORS[i % len(COLORS)], max(turns, 1 + max(n for _, _, n in points))
        traces.append(dict(type="scatter", x=[x for x, _, _ in points], y=[y for _, y, _ in points], name=run.method,
                           mode="markers+lines", line=dict(color=color, width=1, dash="dot"),
                           hovertext=[f"{run.method}, turn {n + 1}" for _, _, n in points],
                           marker=dict(color=color, size=MARKER_SIZES[min(i, len(MARKER_SIZES) - 1)],
                                       line=dict(color="white", width=1),
                                       symbol=[TURN_SYMBOLS[n % len(TURN_SYMBOLS)] for _, _, n in points])))
        for x, y, n in points:
            shared.setdefault((round(x, 2), round(y, 2)), []).append(run.method)
    traces += turn_keys(turns)
    return _figure("quality", traces, height=QUALITY_HEIGHT, margin=QUALITY_MARGIN, legend=quality_legend(),
                   annotations=shared_labels(shared),
                   xaxis=dict(title="KV bytes held / full cache's (measured)", range=[0, 1.08]),
                   yaxis=dict(title="answer tokens same as full", tickformat=".0%", range=[-0.05, 1.1]))


def shared_labels(shared: dict[tuple[float, float], list[str]]) -> list[dict]:
    """Beside a point two methods or more land on (their markers stack, the smaller over the larger),
    their names: the rings alone did not say whose they were."""
    return [dict(x=x, y=y, text=", ".join(dict.fromkeys(names)), showarrow=False, xanchor="left", xshift=14,
                 font=dict(size=10, color="#555555"))
            for (x, y), names in shared.items() if len(set(names)) > 1]


def turn_keys(turns: int) -> list[dict]:
    """Legend entries for the turns' symbols (grey, no point drawn): in the y title they made it
    long enough to run into the panel's label."""
    if turns < 2:
        return []
    return [dict(type="scatter", x=[None], y=[None], mode="markers", name=f"turn {n + 1}", showlegend=True,
                 hoverinfo="skip", marker=dict(color=FULL_COLOR, size=10, symbol=TURN_SYMBOLS[n % len(TURN_SYMBOLS)]))
            for n in range(min(turns, len(TURN_SYMBOLS)))]


def quality_legend() -> dict:
    """The legend under the x title (above the plot, wrapped at half width, it ran under the panel's
    label): its top ``LEGEND_GAP`` px under the plot, in the paper units plotly places it by."""
    plot_height = QUALITY_HEIGHT - QUALITY_MARGIN["t"] - QUALITY_MARGIN["b"]
    # itemsizing: one symbol size in the legend, whatever size each method's markers have
    return dict(orientation="h", x=0, xanchor="left", y=-LEGEND_GAP / plot_height, yanchor="top", itemsizing="constant")


def ttft_figure(ttft: TtftView | None) -> go.Figure:
    """TTFT of one prompt under prefix caching vs MPIC-k, full recompute in grey as the reference
    (``ttft``: the service's ``mpic_ttft``, bars by name; None draws an empty panel)."""
    fig = _empty("mpic-ttft")
    if not ttft:
        return fig
    times, reference = ttft.ttft_s, ttft.reference
    names = list(times)
    base = times.get(reference)
    labels = [f"{times[n]:.3g} s" + ("" if n == reference or not base else f" ({times[n] / base:.2f}x)")
              for n in names]
    colors = [FULL_COLOR if n == reference else COLORS[i % len(COLORS)] for i, n in enumerate(names)]
    fig.add_bar(x=names, y=[times[n] for n in names], text=labels, textposition="outside", cliponaxis=False,
                marker_color=colors)
    fig.update_yaxes(title="time to first token (s)", range=[0, 1.25 * max(times.values(), default=0) or 1])
    fig.update_xaxes(title=f"the last MPIC message ({ttft.tokens} prompt tokens), its media already stored")
    return fig
