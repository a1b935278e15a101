"""Elastic Cache (Liu et al., "Efficient Inference of Vision Instruction-Following Models with
Elastic Cache", ECCV 2024): "one sequence, two policies" (Sec. 3.3).

Instruction encoding (importance-driven cache merging, Sec. 3.2-3.3):

* Importance of held entry n in layer i: I_n = (1/K) sum_heads sum_m A[m, n], the layer-wise *sum*
  of the attention it receives from every causal prompt query m (the ablation, Tab. 3d, finds the
  sum far better than the mean or a moving average). Read as exp(q k - lse) with the prefill
  attention's own log-sum-exp, in float32, chunked, never as a T x T matrix.
* Anchors: the true top gamma x T entries by I_n (gamma = budget), shared by all heads of the layer
  (Tab. 3c: layer-wise beats head-wise). The first ``protected_tokens`` tokens and the last prompt
  token are always anchors. The authors' code ranks with ``argsort(score) > forget`` (indices used
  as ranks), which keeps neither the top-k nor the requested count; we keep the top-k, as the
  paper describes.
* Buckets by the midpoint rule of Eq. 2 over token positions: token p joins anchor t_k when
  floor((t_{k-1}+t_k)/2) < p <= floor((t_k+t_{k+1})/2). Eq. 2 writes the last bucket's start
  without the "+1", which would put one token in two buckets; we read it as a partition.
* Each bucket is stored as the plain mean of its keys and of its values, per head (Eq. 3); the
  merged entry keeps its anchor's position. Keys are averaged post-RoPE, as the authors' cache
  holds them.

Output generation (fixed-point elimination, Sec. 3.3): the cache is held at gamma x tokens seen;
when a new token pushes it over, the entry at the fixed truncation index N_tl is removed, so the
first entries and a recent tail both survive. Nothing is merged while decoding. With M the merged
prompt length and d = ``truncation_distance`` (25 in Sec. 4.1):

    N_tl = max(M - d, min(M, d)), and never past the newest entry (N_tl <= held budget - 1).

For M >= 2d this is the paper's M - d. The paper's prompts are hundreds of tokens; on a short one
M - d falls to the first entries and the rule would evict the prompt's anchors oldest-first, like
StreamingLLM. So a short merged prompt keeps at least its first min(M, d) anchors: at M <= d every
anchor survives and the recent tail is the generated tokens (the truncation point sits right after
the prompt). The anchors kept, min(M, max(d, M - d)), never fall as M grows. Only when gamma x
seen has not yet grown past M (a rounding step) does the newest token push out the last anchor.

Multi-turn: each new prefill (a next user turn, or the question in question-after mode) scores
every held entry with the new queries, re-selects anchors over the whole history (the paper
compresses "system prompts, user instructions, and chat history" together) and resets N_tl.

Report (:class:`ElasticReport`): ``kept`` (per layer, (S,) anchor positions, shared by heads),
``merged`` (per layer, tokens folded into another entry by the last merge), ``truncation_index``
(per layer N_tl).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_math import prompt_column_sums
from .base import AttentionCall, KVBackend, KVLayer, Report
from .params import param


def select_anchors(importance: torch.Tensor, count: int, forced: torch.Tensor) -> torch.Tensor:
    """Indices (ascending) of the ``count`` entries with the highest importance; ``forced`` (bool,
    same shape) entries are always among them."""
    score = importance.float().masked_fill(forced, float("inf"))
    return score.topk(count).indices.sort().values


def midpoint_buckets(positions: torch.Tensor, anchor_positions: torch.Tensor) -> torch.Tensor:
    """Bucket (anchor ordinal) of every entry by Eq. 2: ties at a midpoint go to the left anchor."""
    bounds = (anchor_positions[:-1] + anchor_positions[1:]).div(2, rounding_mode="floor")
    return torch.searchsorted(bounds, positions, right=False)


def bucket_means(states: torch.Tensor, bucket: torch.Tensor, count: int) -> torch.Tensor:
    """Plain mean of ``states`` (1, H, S, D) over each bucket, per head (Eq. 3): (1, H, count, D)."""
    sums = states.new_zeros(*states.shape[:2], count, states.shape[-1], dtype=torch.float32)
    sums.index_add_(2, bucket, states.float())
    sizes = torch.bincount(bucket, minlength=count).clamp_min(1)
    return (sums / sizes[:, None]).to(states.dtype)


@dataclass
class ElasticReport(Report):
    """``kept`` per layer ((S,) anchor positions, shared by the heads) and what the prefill merged."""

    # per layer: entries folded into an anchor's bucket by the last prefill (0: none)
    merged: list[int] | None = None
    # per layer: the fixed truncation index N_tl that decoding evicts at (None before the layer's prefill)
    truncation_index: list[int | None] | None = None


@dataclass(eq=False)
class ElasticCache(KVBackend):
    name = "elastic_cache"
    title = "Elastic Cache"
    does = "merges"
    paper = "https://arxiv.org/abs/2407.18121"
    summary = ("Merges every prompt token into its nearest important anchor (top attention received), "
               "then holds the cache at the budget while decoding by dropping the entry at a fixed point.")
    truncation_distance: int = param(25, "While decoding, entries are removed this many positions before the "
                                     "end of the merged prompt (Sec. 4.1: 25).", 1, 1024, 1)
    protected_tokens: int = param(1, "First tokens always kept as anchors (Sec. 4.1 protects the first one).", 1, 64, 1)
    holds_budget_while_decoding = True
    report_type: ClassVar[type[Report]] = ElasticReport

    def __post_init__(self) -> None:
        super().__post_init__()
        self._cut: dict[int, int] = {}  # layer -> fixed truncation index N_tl

    @property
    def needs_prefill_column_sums(self) -> bool:
        # importance summed by the prefill attention itself, in its one pass; the full cache merges nothing
        return self.budget < 1.0

    def target(self, seen: int) -> int:
        """Entries held for ``seen`` tokens: gamma x seen, never fewer than the forced anchors."""
        return self.budget_tokens(seen, minimum=self.protected_tokens + 1)

    def truncation_index(self, merged: int) -> int:
        """N_tl for a merged prompt of ``merged`` entries: the paper's M - d, and at least the first
        min(M, d) entries on short prompts, so their anchors are not evicted oldest-first."""
        d = self.truncation_distance
        return max(self.protected_tokens, merged - d, min(merged, d))

    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        if self.report.kept is None:
            self.report.ensure_layers(call.num_layers, "kept", "truncation_index")
            self.report.ensure_layers(call.num_layers, "merged", fill=0)
        i = call.layer_idx
        target = self.target(call.seen)
        if call.is_prefill:
            held = key.shape[2]
            if held > target:
                received = prompt_column_sums(query, key, scaling, call.column_sums)
                importance = received.mean(dim=0)  # (1/K) sum_j
                self.merge(layer, importance, target)
            self.report.merged[i] = max(0, held - target)
            self._cut[i] = self.truncation_index(layer.get_seq_length())
            self.report.truncation_index[i] = self._cut[i]
        else:
            self.evict(layer, self._cut.get(i, self.protected_tokens), target)
        self.report.kept[i] = layer.positions[0]

    def merge(self, layer: KVLayer, importance: torch.Tensor, count: int) -> None:
        """Keep ``count`` anchors of the layer; fold every other entry into its bucket's mean."""
        positions = layer.positions[0]  # shared by all heads: merging is layer-wise
        forced = torch.zeros_like(positions, dtype=torch.bool)
        forced[: self.protected_tokens] = True
        forced[-1] = True  # the last prompt token
        anchors = select_anchors(importance, count, forced)
        bucket = midpoint_buckets(positions, positions[anchors])
        layer.replace(bucket_means(layer.keys, bucket, count), bucket_means(layer.values, bucket, count),
                      positions[anchors])

    def evict(self, layer: KVLayer, cut: int, target: int) -> None:
        """Fixed-point elimination: drop the entries at index ``cut`` until ``target`` remain."""
        held = layer.get_seq_length()
        excess = held - target
        if excess <= 0:
            return
        cut = min(cut, target - 1)  # the newest token always survives
        index = torch.cat([torch.arange(cut), torch.arange(cut + excess, held)])
        layer.keep(index)
