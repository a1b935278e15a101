"""PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling", 2024, Sec. 3.2-3.3): attention funnels from broad in the lower layers to a
few tokens in the upper ones, so lower layers get more cache and upper layers less.

* Selection: SnapKV's, unchanged (observation window of the last 32 prompt queries, votes pooled
  along the keys with kernel 5, GQA groups averaged, top-k per KV head, window always kept); see
  :mod:`backends.snapkv`.
* Schedule (Sec. 3.3, as in the authors' code and kvpress): with k = ``budget x T`` entries per
  layer on average and w the window, the selectable part c = k - w is spread linearly, from
  k_0 = 2c - c/beta at the first layer down to k_{L-1} = c/beta at the last (beta = 20), so the
  total is L x k, the same as SnapKV's. If the first layer would need more entries than it holds,
  k_0 is capped at T - w and k_{L-1} = 2c - k_0 (authors' code). Counts are rounded on the
  cumulative sum, so the rounded total is still exactly L x c.
* A model with one layer, or a budget inside the window, has no pyramid: SnapKV's uniform budget.

Report (:class:`PyramidKVReport`): ``kept`` (per layer, (H_kv, S) positions), ``layer_budgets``
(per layer, realised entries kept / tokens seen), ``schedule`` (per layer, planned entries of the
last prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import AttentionCall, Report
from .params import param
from .snapkv import SnapKV


def pyramid_schedule(layers: int, tokens: int, mean_kept: int, window: int, beta: float = 20.0) -> list[int]:
    """Entries kept per layer (window included), decreasing linearly, summing to ``layers x mean_kept``."""
    selectable = mean_kept - window
    if layers < 2 or selectable <= 0:
        return [mean_kept] * layers
    top = 2 * selectable - selectable / beta
    if top > tokens - window:  # a layer cannot keep more than it holds
        top = tokens - window
    bottom = 2 * selectable - top
    step = (top - bottom) / (layers - 1)
    # round the running total, not each layer: the sum stays layers x selectable exactly
    cumulative = [round(n * top - step * n * (n - 1) / 2) for n in range(layers + 1)]
    return [window + cumulative[i + 1] - cumulative[i] for i in range(layers)]


@dataclass
class PyramidKVReport(Report):
    """SnapKV's report (``kept``, ``layer_budgets``) and the pyramid it planned."""

    # entries each layer may keep after the last prefill (one int per layer, first layer largest)
    schedule: list[int] | None = None


@dataclass(eq=False)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    streams_under_cap = False  # its pyramid is planned for one prompt's budget, not a cap per chunk
    title = "PyramidKV"
    does = "drops"
    paper = "https://arxiv.org/abs/2406.02069"
    summary = ("SnapKV's choice of tokens with a pyramid of budgets: the first layers keep the most, the last "
               "layers the least, the same total.")
    beta: float = param(20.0, "Pyramid steepness: the last layer keeps 1/beta of the mean selectable budget, "
                        "the first layer the rest of twice that (authors' default 20).", 1.0, 100.0, 1.0)
    report_type: ClassVar[type[Report]] = PyramidKVReport

    def layer_capacity(self, call: AttentionCall, held: int) -> int:
        tokens = call.seen
        window = min(self.window_size, call.positions.shape[0])
        schedule = pyramid_schedule(call.num_layers, tokens, self.budget_tokens(tokens), window, self.beta)
        self.report.schedule = schedule
        return schedule[call.layer_idx]
