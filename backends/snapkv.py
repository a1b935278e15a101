"""SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", NeurIPS 2024,
Sec. 4.2 / Listing 1): the last prompt queries (the observation window) already attend to what
the answer will need, so their attention "votes" for the prompt entries worth keeping.

* Votes: softmax of the last ``window_size`` (32) prompt queries against every held key,
  recomputed from post-RoPE queries in float32 (O(window x T), never T x T), averaged over the
  window rows (the authors sum; the ranking is the same).
* Clustering: the votes are pooled along the keys with ``kernel_size`` 5, stride 1, so a token
  is kept together with its neighbours (Listing 1's ``pool1d``). Average pooling, as the authors'
  released code, PyramidKV and kvpress do; max pooling is an option.
* GQA: the pooled votes of the query heads sharing a KV head are averaged (kvpress), then the
  top-k is taken per KV head: heads keep different tokens, the same count, via ``KVLayer.keep``
  with an (H_kv, S') index, so the memory is really freed.
* The window itself is always kept; the budget counts it. Below the window size the cache is the
  most recent ``budget x T`` tokens (the authors refuse that case).
* Budget: after each prefill a layer holds ``budget x tokens seen`` entries; decoded tokens are
  appended (the paper compresses the prompt only). A later turn's prefill scores the compressed
  history and the new tokens together with its own observation window.

Each layer is compressed in ``after_attention``, right after its attention, which lowers the
prefill peak too.

Streamed prefill under a byte cap: each chunk's attention is scored as a prefill of its own, its
last ``window_size`` tokens voting, and the layer keeps what fits its equal share of the cap
(per chunk, as SnapKV compresses each new prompt on top of the history). While video chunks
stream the voters are the newest frames' tokens, so the choice is query-agnostic; it sees a
question only in a chunk that holds one. Report (the base :class:`~backends.base.Report`): ``kept`` (per layer, (H_kv, S)
positions), ``layer_budgets`` (per layer, entries kept / tokens seen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention_math import attention_probs, kv_group_mean
from .base import AttentionCall, KVBackend, KVLayer
from .params import param


def pool_votes(votes: torch.Tensor, kernel_size: int, pooling: str = "avgpool") -> torch.Tensor:
    """Smooth (..., S) votes along the keys with a same-length, stride-1 window (Listing 1)."""
    if kernel_size <= 1:
        return votes
    flat = votes.reshape(-1, 1, votes.shape[-1])
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    pooled = pool(flat, kernel_size, stride=1, padding=kernel_size // 2)
    return pooled[..., : votes.shape[-1]].reshape(votes.shape)  # an even kernel yields one extra column


def snapkv_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int, kernel_size: int,
                  pooling: str = "avgpool") -> torch.Tensor:
    """Pooled votes of the last ``window`` queries for every held entry before them: (H_kv, S - window).

    ``query`` holds the new tokens, which are the last entries of ``key`` (causal inside the window).
    """
    held = key.shape[2]
    rows = torch.arange(held - window, held, device=query.device)  # the window queries' own key indices
    probs = attention_probs(query[:, :, -window:], key, scaling, rows)  # (H, window, S)
    votes = probs[:, :, : held - window].mean(dim=1)
    return kv_group_mean(pool_votes(votes, kernel_size, pooling), key.shape[1])


def window_and_top_k(scores: torch.Tensor, held: int, window: int, count: int) -> torch.Tensor:
    """Ascending indices of ``count`` of ``held`` entries: the last ``window`` ones, then the best
    ``scores`` (..., held - window) among the older ones. If ``count <= window``: the last ``count``."""
    lead = scores.shape[:-1]
    window = min(window, count)
    recent = torch.arange(held - window, held, device=scores.device).expand(*lead, window)
    if count == window:
        return recent
    best = scores[..., : held - window].topk(count - window, dim=-1).indices.sort(dim=-1).values
    return torch.cat([best, recent], dim=-1)  # cache order stays token order


@dataclass(eq=False)
class SnapKV(KVBackend):
    name = "snapkv"
    title = "SnapKV"
    does = "drops"
    chooses_tokens = True
    paper = "https://arxiv.org/abs/2404.14469"
    summary = ("Keeps, per KV head, the prompt entries the last 32 prompt tokens attend to most (pooled so "
               "neighbours come along) plus those 32 tokens; decoded tokens are appended.")
    window_size: int = param(32, "Observation window: the last prompt tokens whose attention votes; always kept "
                             "(Sec. 4.2: 32).", 1, 512, 1)
    kernel_size: int = param(5, "Pooling kernel along the keys, so neighbours of a chosen token are kept too "
                             "(authors' code: 5; 1 disables pooling).", 1, 63, 2)
    streams_under_cap = True
    pooling: str = param("avgpool", "How votes are pooled along the keys: average (authors' code, kvpress) or max.",
                         choices=("avgpool", "maxpool"))

    def layer_capacity(self, call: AttentionCall, held: int) -> int:
        """Entries layer ``call.layer_idx`` keeps after this prefill: ``budget x tokens seen``."""
        return self.budget_tokens(call.seen)

    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        if not call.is_prefill:
            return
        if self.report.kept is None or len(self.report.kept) != call.num_layers:
            self.report.kept, self.report.layer_budgets = [None] * call.num_layers, [1.0] * call.num_layers
        held = key.shape[2]
        count = min(held, self.layer_capacity(call, held))
        cap = call.cap_entries(layer)  # a streamed prefill's cap, if lower
        if cap is not None:
            count = min(count, cap)
        if count < held:
            window = min(self.window_size, query.shape[2], count)
            scores = (snapkv_scores(query, key, scaling, window, self.kernel_size, self.pooling)
                      if count > window else key.new_zeros(key.shape[1], held - window))
            layer.keep(window_and_top_k(scores, held, window, count))
        self.report.kept[call.layer_idx] = layer.positions
        self.report.layer_budgets[call.layer_idx] = layer.get_seq_length() / call.seen
