"""The panels' figures as a reader meets them at 1280 px, in plotly terms (no browser): every
method's speed bar drawn, the footnote under the tick labels, Quality vs memory's legend clear of
its x title and its y title clear of the panel's label, methods at one point all visible, the
per-layer axis's ticks distinct under a small cap, and a 2-token answer's speed said too short."""

from __future__ import annotations

import plotly.graph_objects as go

from components import chat_status, plots
from kv_arena.service.view_types import CompareRun, CompareTurn, LayerFigures, Meters

BADGE_PX = 40  # the panel's label badge over the figure's top left corner (Gradio's block label)


def short_answers() -> go.Figure:
    """A 2-token answer (one decode step) beside the full cache's: no ratio can be told."""
    full = plots.Drawn("Full cache", Meters(ttft_s=1.2, step_s=[0.010], decode_tok_s=100.0))
    method = plots.Drawn("SnapKV", Meters(ttft_s=1.25, step_s=[0.001], decode_tok_s=958.7))
    return plots.speed_figure([method], full)


def test_every_method_gets_a_speed_bar_pale_where_its_ratio_is_not_told():
    figure = short_answers()
    for trace in figure.data:
        assert all(value > 0 for value in trace.x)  # the method's bar too, not only the full cache's
        assert list(trace.marker.opacity) == [1.0, plots.UNTOLD_OPACITY]
        assert list(trace.marker.pattern.shape) == ["", plots.UNTOLD_PATTERN]
        assert trace.text[1].endswith(plots.TOO_SHORT)
    told = plots.speed_figure([plots.Drawn("H2O", Meters(ttft_s=2.0, step_s=[0.005] * 10, decode_tok_s=200.0))],
                              plots.Drawn("Full cache", Meters(ttft_s=1.0, step_s=[0.010] * 10, decode_tok_s=100.0)))
    assert all(list(trace.marker.opacity) == [1.0, 1.0] for trace in told.data)  # measured ratios: solid bars
    assert not told.layout.annotations[-1].text.startswith(plots.NOT_TOLD)  # no footnote without a mark


def test_the_speed_footnote_sits_under_the_tick_labels():
    note = short_answers().layout.annotations[-1]
    margin = short_answers().layout.margin
    assert note.text.startswith(plots.NOT_TOLD) and note.yref == "paper" and note.y == 0 and note.yanchor == "top"
    assert note.yshift <= -20  # pixels under the axis line: the tick labels (12 px) come first
    lines = note.text.count("<br>") + 1
    assert margin.b >= -note.yshift + lines * 14  # its lines fit in the bottom margin


def compare_run(method: str, points: list[tuple[float, float]]) -> CompareRun:
    turns = tuple(CompareTurn(question="q", metrics=Meters(kv_bytes_prefill=int(x * 1000)), agreement=y, done=True)
                  for x, y in points)
    return CompareRun(name=method, method=method, turns=turns)


def quality() -> go.Figure:
    """H2O and SnapKV at the same points (the tiny model's budget 0.2 often gives that), two turns."""
    return plots.quality_figure((compare_run("Full cache", [(1, 1), (1, 1)]), compare_run("StreamingLLM", [(0.3, 1), (0.3, 0.5)]),
                                 compare_run("H2O (heavy hitters)", [(0.2, 1), (0.2, 0)]),
                                 compare_run("SnapKV", [(0.2, 1), (0.2, 0)])))


def test_methods_at_one_quality_point_are_all_visible():
    figure = quality()
    h2o, snap = (next(t for t in figure.data if t.name == name) for name in ("H2O (heavy hitters)", "SnapKV"))
    assert list(h2o.x) == list(snap.x) and list(h2o.y) == list(snap.y)  # the same points...
    assert h2o.marker.size > snap.marker.size  # ...drawn as rings: the later, smaller one over the larger
    assert figure.data.index(snap) > figure.data.index(h2o)
    assert figure.layout.legend.itemsizing == "constant"
    # and named beside the point they share (the rings alone did not say whose they were)
    labels = {(a.x, a.y): a.text for a in figure.layout.annotations}
    assert labels == {(0.2, 1): "H2O (heavy hitters), SnapKV", (0.2, 0): "H2O (heavy hitters), SnapKV"}


def test_quality_titles_and_legend_do_not_overlap():
    figure = quality()
    layout = figure.layout
    assert layout.margin.t >= BADGE_PX  # the plot, and the y title centred on it, start under the badge
    assert len(layout.yaxis.title.text) * 7 < layout.height - layout.margin.t - layout.margin.b  # ~7 px a character
    # the legend starts under the x title: tick labels (~20 px) and the title (~20 px) above it
    plot_height = layout.height - layout.margin.t - layout.margin.b
    assert layout.legend.yanchor == "top" and -layout.legend.y * plot_height >= 55
    assert layout.margin.b + layout.legend.y * plot_height >= 3 * 20  # three rows of legend fit under it
    turns = [t.name for t in figure.data if t.name and t.name.startswith("turn ")]
    assert turns == ["turn 1", "turn 2"]  # the symbols said in the legend, not in the y title


def test_the_per_layer_axis_ticks_differ_under_a_small_cap():
    def layers(nbytes):
        return LayerFigures(tokens=[1] * len(nbytes), nbytes=nbytes, seen=10)

    full = plots.Drawn("Full cache", Meters(), layers=layers([1000] * 4))
    small = plots.layer_figure([plots.Drawn("InfiniPot-V", Meters(), layers=layers([12, 11, 9, 10]))], full)
    assert small.layout.yaxis.tickformat == ".1%"  # 0.2%, 0.4%... where ".0%" read 1%, 1%, 1%, 0%
    large = plots.layer_figure([plots.Drawn("SnapKV", Meters(), layers=layers([300] * 4))], full)
    assert large.layout.yaxis.tickformat == ".0%"
    assert plots.percent_format(0.004) == ".2%" and plots.percent_format(1.0) == ".0%" and plots.percent_format(0) == ".0%"


def test_a_two_token_answer_says_its_speed_is_too_short_to_time():
    two = Meters(new_tokens=2, decode_tok_s=958.7, step_s=[0.001])
    assert chat_status.decode_speed(two) == "decode speed: too short to time (1 decode step, under 8)"
    assert chat_status.decode_speed(two, done=False) == "959 tokens/s"  # still streaming
    steady = Meters(new_tokens=20, decode_tok_s=100.0, step_s=[0.01] * 19)
    assert chat_status.decode_speed(steady) == "100 tokens/s"
