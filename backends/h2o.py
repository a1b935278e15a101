"""H2O, the heavy-hitter oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", NeurIPS 2023, Sec. 4 / Alg. 1): keep the tokens that have
received the most attention so far (the heavy hitters) plus a window of the most recent ones.

* Score: the attention each cached entry has received, accumulated. At prefill, the column sums
  over every causal prompt query (exp(q k - lse) with the prefill attention's own log-sum-exp,
  chunked, float32: no second softmax); then, at
  every decode step, the new query's softmax row is added, so the ranking keeps moving as the
  answer grows (the "dynamic" part of Alg. 1).
* Granularity: per KV head, the query heads of a GQA group averaged. H2O selects heavy hitters
  per head (Alg. 1 runs per head), and heads do attend to different tokens; a KV head is the
  finest unit whose entries can really be dropped when query heads share keys, and per-head
  ``keep`` saves the same bytes as a shared one. (The Elastic Cache authors' H2O baseline averaged
  all heads and layers into one score; that is a coarser variant, not the paper's.)
* Budget: the fraction of the full cache's bytes held, at prefill and during decoding. H2O must
  hold its (H_kv, S) float32 score buffer next to the keys and values to rank them (Alg. 1 keeps
  the accumulated scores), so the buffer is counted and the entries per KV head are the most whose
  keys, values and scores fit: floor(budget x seen x kv / (kv + score)), kv = 2 x D x itemsize,
  score = 4 bytes. A share of them (``recent_share``, 10% as in VL-Cache's fair-comparison setting,
  see METHODS.md) is the most recent tokens; the rest are the highest accumulated scores among the
  older entries. Budget 1.0 evicts nothing, so it needs no scores: a plain layer, the full cache.
* Multi-turn: scores persist with their entries, so the next turn's prompt is scored on top of
  the history's accumulated attention, as H2O's running statistic would be.

Report (:class:`H2OReport`, ``self.report``): ``kept`` (per layer, (H_kv, S) positions held per
head) and ``scores`` (per layer, (H_kv, S) accumulated attention of those entries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_math import kv_group_mean, prompt_column_sums
from .base import AttentionCall, KVBackend, KVLayer, Report
from .params import param


class ScoredLayer(KVLayer):
    """A dense layer whose entries carry their accumulated attention, gathered along on ``keep``."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None  # (H_kv, S) float32

    def append(self, keys, values, positions):
        # new entries start at zero; the attention they receive is added after this step's attention
        fresh = torch.zeros(keys.shape[1], keys.shape[2], dtype=torch.float32, device=keys.device)
        self.scores = fresh if self.scores is None else torch.cat([self.scores, fresh], dim=1)
        return super().append(keys, values, positions)

    def keep(self, index: torch.Tensor) -> None:
        super().keep(index)
        if index.dim() == 1:
            index = index.view(1, -1).expand(self.scores.shape[0], -1)
        self.scores = self.scores.gather(1, index.to(self.scores.device))

    def tensors(self) -> list[torch.Tensor]:
        """The score buffer is held to rank the entries, so it counts like any other tensor held."""
        return super().tensors() + ([self.scores] if self.scores is not None else [])

    def token_share(self) -> float:
        """Share of one entry's bytes that is keys and values (the rest is its score)."""
        kv = 2 * self.keys.shape[3] * self.keys.element_size()
        return kv / (kv + self.scores.element_size())


@dataclass
class H2OReport(Report):
    """``kept`` per layer ((H_kv, S) positions held) and the scores that chose them."""

    # per layer: (H_kv, S) float32 accumulated attention each held entry received (``ScoredLayer.scores``)
    scores: list[torch.Tensor | None] | None = None


@dataclass(eq=False)
class H2O(KVBackend):
    name = "h2o"
    title = "H2O (heavy hitters)"
    does = "drops"
    paper = "https://arxiv.org/abs/2306.14048"
    summary = ("Keeps the tokens that received the most attention so far, updated at every generated token, "
               "plus the most recent ones; evicts the rest.")
    recent_share: float = param(0.1, "Share of the kept entries reserved for the most recent tokens "
                                "(10% of the budget, VL-Cache's setting for H2O).", 0.0, 1.0, 0.05)
    holds_budget_while_decoding = True
    report_type: ClassVar[type[Report]] = H2OReport

    @property
    def needs_decode_attention(self) -> bool:
        return self.budget < 1.0  # each decode query's row updates the scores; the full cache ranks nothing

    @property
    def needs_prefill_column_sums(self) -> bool:
        return self.budget < 1.0  # summed by the prefill attention itself, in its one pass

    def new_layer(self, layer_idx: int) -> KVLayer:
        return ScoredLayer() if self.budget < 1.0 else KVLayer()  # nothing to evict: no scores to hold

    def target(self, seen: int, layer: ScoredLayer) -> int:
        """Entries per KV head whose keys, values and scores fit budget x the full cache's bytes."""
        if self.budget >= 1.0:
            return seen
        return min(seen, max(1, math.floor(self.budget * seen * layer.token_share() + 1e-9)))

    def after_attention(self, call: AttentionCall, layer: ScoredLayer, query, key, scaling: float, attn_row=None) -> None:
        if not isinstance(layer, ScoredLayer):
            return
        self.report.ensure_layers(call.num_layers, "kept", "scores")
        if call.is_prefill:
            received = prompt_column_sums(query, key, scaling, call.column_sums)
        else:
            received = attn_row[:, 0]  # (H, S): the decode query's softmax row
        layer.scores += kv_group_mean(received, key.shape[1])
        self.evict(layer, self.target(call.seen, layer))
        self.report.kept[call.layer_idx] = layer.positions
        self.report.scores[call.layer_idx] = layer.scores

    def evict(self, layer: ScoredLayer, target: int) -> None:
        """Keep ``target`` entries per KV head: the recent window and the heaviest older ones."""
        held = layer.get_seq_length()
        if held <= target:
            return
        recent = min(target, max(1, round(self.recent_share * target)))  # the newest token always stays
        heavy = layer.scores[:, : held - recent].topk(target - recent, dim=1).indices.sort(dim=1).values
        window = torch.arange(held - recent, held, device=heavy.device).expand(heavy.shape[0], -1)
        layer.keep(torch.cat([heavy, window], dim=1))  # ascending per head: cache order is token order
