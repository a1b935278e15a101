"""VL-Cache (Tu et al., "VL-Cache: Sparsity and Modality-Aware KV Cache Compression for
Vision-Language Model Inference Acceleration", ICLR 2025, Sec. 4 / Alg. 1): per-layer budgets from
the sparsity of the post-vision attention, tokens ranked by that same attention.

* Post-vision queries (Sec. 3.2): the prompt tokens after the last visual token, tau of them. Only
  their rows are recomputed (post-RoPE queries, float32, chunked): O(tau x T), never T x T.
* Sparsity (Sec. 3.1, Alg. 1 l.14-19): ThresholdFilter zeroes entries below p x row max (p = 0.01);
  gamma_l = zeros / causal entries of those rows, per query head, averaged over heads.
* Budgets (Alg. 1 l.9-12): beta_l = clip((1 - gamma_l) / sum_l (1 - gamma_l) x alpha x L, 0.01, 1),
  alpha = budget. Clipping at 1 leaves budget unspent, as in the paper; ``redistribute`` gives it
  to the unclipped layers in proportion to their density (METHODS.md allows it; at alpha = 1 it
  gives every layer 1). alpha = 1 is the full cache either way (the paper's 100% point), not
  Alg. 1's clip, which would still evict from the sparse layers; nothing is scored then.
  The floor at 0.01 would *add* budget to very sparse layers (Alg. 1 clips after the split, so the
  total can exceed alpha x L); here the floor is paid for by the other layers, in proportion to
  their density, so sum_l beta_l <= alpha x L and the realised total, after rounding each layer up
  to whole tokens, is at most alpha x L x T + L: alpha plus one token per layer.
* Token scores (Sec. 4.2): column sums of the post-vision attention over its rows and all heads;
  layer l keeps ceil(beta_l x T) entries, shared by its heads: the post-vision tokens first (the
  most recent of them if the budget is smaller), then the highest scores.
* Text before the image: the chat template still puts the closing markers after it, so tau is
  small but not zero (App. A.1). With tau = 0 (a chunk that ends on a visual token) the last
  ``fallback_window`` prompt tokens stand in, the paper's speed-benchmark setting (Sec. 5.2: 50).
  A follow-up turn without images is all post-vision: the history's images come before it.

Alg. 1 needs every layer's sparsity before any layer's budget, so each layer's statistics (a (S,)
score and a scalar) are stashed in ``after_attention`` and all layers are compressed once in
``after_forward``; the full prompt cache is alive until then, as in the paper's prefill.
T is the number of tokens seen; a later turn re-scores the compressed history with its own rows.

Report (:class:`VLCacheReport`): ``kept`` (per layer, (S,) positions), ``layer_budgets`` (per
layer, realised entries / T), ``planned_budgets`` (beta_l), ``sparsity`` (gamma_l),
``post_vision_tokens`` (tau, or the fallback rows), ``realised_budget`` (all entries kept / (L x T)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_math import attention_probs
from .base import AttentionCall, KVBackend, KVLayer, Report
from .params import param
from .snapkv import window_and_top_k

MIN_LAYER_BUDGET = 0.01  # Alg. 1 l.12: the lower clip


def threshold_sparsity(probs: torch.Tensor, query_index: torch.Tensor, threshold: float = 0.01):
    """(H,) zeros left by ThresholdFilter(p) among the causal entries of rows ``probs`` (H, q, S),
    and their count; row i sees keys 0..query_index[i]. Masked entries are 0 < p x max: never kept."""
    kept = (probs >= threshold * probs.amax(dim=-1, keepdim=True)).sum(dim=(1, 2))
    causal = (query_index + 1).sum()
    return causal - kept, causal


def post_vision_statistics(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: int,
                           threshold: float = 0.01, chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """For the last ``rows`` queries (the last entries of ``key``): per-head sparsity (H,) and the
    attention each entry receives summed over rows and heads (S,). One softmax pass, chunked."""
    held = key.shape[2]
    query = query[:, :, query.shape[2] - rows:]
    index = torch.arange(held - rows, held, device=query.device)
    zeros, causal, received = 0, 0, torch.zeros(held, device=query.device)
    for start in range(0, rows, chunk):
        probs = attention_probs(query[:, :, start : start + chunk], key, scaling, index[start : start + chunk])
        z, c = threshold_sparsity(probs, index[start : start + chunk], threshold)
        zeros, causal = zeros + z, causal + c
        received += probs.sum(dim=(0, 1))
    return zeros.float() / causal, received


def allocate_budgets(sparsity: torch.Tensor, alpha: float, redistribute: bool = False) -> torch.Tensor:
    """beta_l of Alg. 1 l.9-12 for the (L,) head-averaged sparsities, the floor paid for by the other
    layers (their sum never exceeds alpha x L); optionally re-spend what the clip at 1 leaves over
    on the other layers, in proportion to their density."""
    density = (1 - sparsity).clamp_min(1e-6)  # a fully sparse layer still gets the floor
    floored = torch.zeros_like(density, dtype=torch.bool)
    capped = torch.zeros_like(density, dtype=torch.bool)
    while True:  # water-filling: at most L rounds, each fixes at least one more layer at a bound
        fixed = floored | capped
        free = alpha * len(density) - MIN_LAYER_BUDGET * floored.sum() - capped.sum()
        share = torch.where(floored, MIN_LAYER_BUDGET, torch.where(capped, 1.0, density / density[~fixed].sum() * free))
        low = ~fixed & (share < MIN_LAYER_BUDGET)
        high = ~fixed & (share > 1) if redistribute else torch.zeros_like(low)
        if not (low.any() or high.any()) or bool((fixed | low | high).all()):
            break
        floored, capped = floored | low, capped | high
    return share.clamp(MIN_LAYER_BUDGET, 1.0)


@dataclass
class VLCacheReport(Report):
    """``kept`` (per layer, (S,) positions shared by the heads) and ``layer_budgets`` (per layer, realised
    entries / tokens seen), with the plan of Alg. 1 that chose them."""

    # tau: the post-vision query rows the prefill scored with (or the fallback window's rows)
    post_vision_tokens: int | None = None
    # per layer: beta_l, the budget Alg. 1 planned (share of the tokens seen)
    planned_budgets: list[float] | None = None
    # per layer: gamma_l, the share of the post-vision attention below the threshold, mean over heads
    sparsity: list[float] | None = None
    # all entries kept / (layers x tokens seen)
    realised_budget: float | None = None


@dataclass(eq=False)
class VLCache(KVBackend):
    name = "vl_cache"
    title = "VL-Cache"
    does = "drops"
    chooses_tokens = True
    paper = "https://arxiv.org/abs/2410.23317"
    summary = ("Gives denser layers more cache (sparsity of the attention of the text after the image) and keeps "
               "the tokens that text attends to most.")
    threshold: float = param(0.01, "ThresholdFilter p: attention below p x the row maximum counts as zero "
                             "(Sec. 3.1: 1%).", 1e-4, 0.5, 1e-4)
    redistribute: bool = param(False, "Give the budget that layers clipped at 100% cannot use to the other layers "
                               "(not in the paper, whose Alg. 1 leaves it unspent).")
    fallback_window: int = param(50, "Scoring rows when no token follows the last visual token: the last "
                                 "prompt tokens (Sec. 5.2 uses 50).", 1, 512, 1)
    report_type: ClassVar[type[Report]] = VLCacheReport

    def __post_init__(self) -> None:
        super().__post_init__()
        self._stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (sparsity (H,), scores (S,))

    def observed_rows(self, call: AttentionCall) -> int:
        """How many of the new tokens are post-vision (or the fallback window)."""
        new = call.positions.shape[0]
        if call.layout is not None:
            tau = int((call.positions >= call.layout.post_vision[0]).sum())
            if tau > 0:
                return tau
        return min(self.fallback_window, new)

    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        if call.is_prefill and self.budget < 1.0:  # alpha = 1 keeps every entry: nothing to score
            rows = self.observed_rows(call)
            self._stats[call.layer_idx] = post_vision_statistics(query, key, scaling, rows, self.threshold)
            self.report.post_vision_tokens = rows

    def after_forward(self, cache, call: AttentionCall) -> None:
        if not call.is_prefill or len(self._stats) != call.num_layers:
            return
        stats, self._stats = self._stats, {}
        sparsity = torch.stack([stats[i][0].mean() for i in range(call.num_layers)])
        betas = allocate_budgets(sparsity, self.budget, self.redistribute)
        rows = self.report.post_vision_tokens
        for i, layer in enumerate(cache.layers):
            held = layer.get_seq_length()
            count = min(held, math.ceil(float(betas[i]) * call.seen - 1e-9))
            if count < held:
                layer.keep(window_and_top_k(stats[i][1], held, rows, count))
        kept = [layer.get_seq_length() for layer in cache.layers]
        report = self.report
        report.kept = [layer.positions[0] for layer in cache.layers]  # shared by the heads of a layer
        report.layer_budgets = [k / call.seen for k in kept]
        report.planned_budgets = betas.tolist()
        report.sparsity = sparsity.tolist()
        report.realised_budget = sum(kept) / (len(kept) * call.seen)
