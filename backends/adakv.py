"""AdaKV on SnapKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
for Efficient LLM Inference", arXiv 2407.11550, Sec. 4, Algorithms 1-2 "Ada-SnapKV"): heads differ in
how concentrated their attention is, so instead of every KV head keeping the same number of
entries, a layer's budget goes to the entries with the highest scores over all its heads jointly.

* Scores: SnapKV's, unchanged (observation window of the last 32 prompt queries, votes pooled along
  the keys with kernel 5, GQA groups averaged); see :mod:`backends.snapkv`. Each head's votes are a
  softmax average, so heads' scores are comparable and can be ranked together (Sec. 4).
* Allocation (Algorithm 1): the layer keeps ``H_kv x budget x tokens seen`` entries, as SnapKV.
  Every head keeps its observation window; the rest of the layer's budget B (per head: its even
  share b = B / H_kv) is given out by the top scores over all heads at once. No head may be emptied,
  and two safeguards exist; ``allocation`` picks one, both weighting the even split by ``alpha``:

  - ``floor`` (default): kvpress's ``AdaKVPress`` (alpha 0.2): each head first keeps its own top
    floor(alpha x b), then the best remaining scores over all heads fill B. This is not the AdaKV
    authors' rule.
  - ``mix``: the AdaKV authors' code (FFY0/AdaKV, ``AdaptiveSnapKVCluster``, alpha 0.5): the joint
    top B gives head h c_h entries, and head h keeps its own top round((1 - alpha) c_h + floor(alpha b))
    (halves to even, as ``torch.round``), at most what it holds. The floor and the rounding can leave
    the layer off B by at most 1.5 entries per head (the reported budgets count what is held). The authors' scores are also
    max-pooled with kernel 7: ``allocation=mix, alpha=0.5, pooling=maxpool, kernel_size=7`` is their
    setting; the defaults keep SnapKV's (average pooling, kernel 5), as kvpress does.
* Storage: heads then hold different numbers of entries. A padded (H_kv, max) tensor would hold as
  many bytes as the most generous head gives every head, so the layer stores the kept entries of
  all heads back to back with one length per head (:class:`HeadwiseLayer`; the authors' code does
  the same with flash-attention's variable-length kernel). Realised bytes are SnapKV's at the same
  budget plus the H_kv int32 lengths. Attention over such a layer runs per KV head over its own
  entries (exact); decoded tokens are appended to every head alike, as SnapKV's.
* A later turn's prefill scores each head's held entries and its new tokens with that turn's
  window, and allocates again over the heads (the history is already head-wise).
* At budget 1.0 nothing is evicted and the layer stays dense: the full cache, byte for byte.
  Streaming under a byte cap is not offered (a cap per chunk would need the allocation per chunk).

Report (:class:`AdaKVReport`): ``kept`` (per layer, (H_kv, max) positions, a head with fewer entries
padded by repeating its last one, so the share of heads keeping a token is right), ``layer_budgets``
(entries per head on average / tokens seen) and ``head_budgets`` (per layer, entries each KV head keeps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_math import causal_attention
from .base import AttentionCall, KVLayer, Report
from .params import param
from .snapkv import SnapKV, snapkv_scores


def headwise_top_k(scores: list[torch.Tensor], budget: int, floor: int) -> list[torch.Tensor]:
    """Algorithm 1 with the safeguard: ascending indices per head into its own ``scores`` (1-D, lengths
    may differ). Each head keeps its top ``floor`` (all it has, if fewer); the rest of ``budget`` goes
    to the best remaining scores over all heads jointly. ``budget`` must not exceed the entries."""
    width = max(s.numel() for s in scores)
    ranked = scores[0].new_full((len(scores), width), float("-inf"))  # padding is never chosen
    for h, s in enumerate(scores):
        ranked[h, : s.numel()] = s
        ranked[h, s.topk(min(floor, s.numel())).indices] = float("inf")  # the safeguard: always chosen
    flat = ranked.flatten().topk(budget).indices
    head, index = flat // width, flat % width
    return [index[head == h].sort().values for h in range(len(scores))]


def mixed_top_k(scores: list[torch.Tensor], budget: int, alpha: float) -> list[torch.Tensor]:
    """The AdaKV authors' allocation: ascending indices per head into its own ``scores``. The joint top
    ``budget`` over all heads counts c_h per head; head h keeps its top round((1 - alpha) c_h +
    floor(alpha x budget / H)), capped at its entries. ``budget`` must not exceed the entries."""
    heads = len(scores)
    width = max(s.numel() for s in scores)
    ranked = scores[0].new_full((heads, width), float("-inf"))
    for h, s in enumerate(scores):
        ranked[h, : s.numel()] = s
    counts = torch.bincount(ranked.flatten().topk(budget).indices // width, minlength=heads)
    floor = int(budget // heads * alpha)  # the authors': int(base_capacity * floor_ratio)
    capacity = torch.round(counts * (1 - alpha) + floor).int().tolist()
    return [s.topk(min(c, s.numel())).indices.sort().values for s, c in zip(scores, capacity)]


class HeadwiseLayer(KVLayer):
    """A layer whose KV heads may hold different numbers of entries: the evicted prompt's entries of
    all heads back to back (``head_keys`` / ``head_values`` (N, D), ``lengths`` (H_kv,)), then the
    entries appended since, the same for every head (``keys`` / ``values`` / ``positions``).
    Until the first eviction it is a plain dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.head_keys: torch.Tensor | None = None
        self.head_values: torch.Tensor | None = None
        self.head_positions: torch.Tensor | None = None  # (N,) token indices, for the panels
        self.lengths: torch.Tensor | None = None  # (H_kv,) int32: the kernel's per-head lengths

    @property
    def headwise(self) -> bool:
        return self.lengths is not None

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head ``h``'s keys and values (1, 1, n_h, D) and positions (n_h,), in token order."""
        keys, values, positions = self.keys[:, h:h + 1], self.values[:, h:h + 1], self.positions[h]
        if not self.headwise:
            return keys, values, positions
        start = int(self.lengths[:h].sum())
        stop = start + int(self.lengths[h])
        return (torch.cat([self.head_keys[None, None, start:stop], keys], dim=2),
                torch.cat([self.head_values[None, None, start:stop], values], dim=2),
                torch.cat([self.head_positions[start:stop], positions]))

    def heads(self) -> int:
        return self.keys.shape[1]

    def append(self, keys, values, positions):
        """Dense until the first eviction; then only the appended part is returned, and attention
        and scoring read every head's own entries (:meth:`attend`, :meth:`head`)."""
        return KVLayer.append(self, keys, values, positions)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Exact attention of the new queries (the last entries of every head) per KV head."""
        group = query.shape[1] // self.heads()
        outs = []
        for h in range(self.heads()):
            keys, values, _ = self.head(h)
            outs.append(causal_attention(query[:, h * group:(h + 1) * group], keys, values, scaling))
        return torch.cat(outs, dim=1)

    def read_decode(self, query, scaling):
        """A head-wise layer answers a decode query per head (no softmax row: the heads' rows differ
        in length, and AdaKV scores nothing while decoding)."""
        return (self.attend(query, scaling), None) if self.headwise else None

    def keep_per_head(self, index: list[torch.Tensor]) -> None:
        """Keep, for each head h, the entries ``index[h]`` (ascending, into :meth:`head`'s order)."""
        kept = [(k[0, 0, i], v[0, 0, i], p[i]) for (k, v, p), i in zip(map(self.head, range(self.heads())), index)]
        self.head_keys = torch.cat([k for k, _, _ in kept])
        self.head_values = torch.cat([v for _, v, _ in kept])
        self.head_positions = torch.cat([p for _, _, p in kept])
        self.lengths = torch.tensor([i.numel() for i in index], dtype=torch.int32, device=self.head_keys.device)
        self.keys, self.values = self.keys[:, :, :0].clone(), self.values[:, :, :0].clone()  # no view of the old tensor
        self.positions = self.positions[:, :0].clone()

    def keep(self, index: torch.Tensor) -> None:
        if self.headwise:
            raise NotImplementedError("a head-wise layer keeps entries per head (keep_per_head)")
        super().keep(index)

    # --- what it holds -------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        extra = [self.head_keys, self.head_values, self.lengths] if self.headwise else []
        return super().tensors() + extra

    def entries(self) -> int:
        """Entries held over all heads."""
        tail = self.positions.numel() if self.positions is not None else 0
        return tail + (int(self.lengths.sum()) if self.headwise else 0)

    def head_lengths(self) -> list[int]:
        return [self.head(h)[2].numel() for h in range(self.heads())]

    def get_seq_length(self) -> int:
        """Entries per head on average (every head's, when they are equal)."""
        return 0 if self.positions is None else self.entries() // self.positions.shape[0]

    def kept_positions(self) -> torch.Tensor:
        """(H_kv, longest) positions; a shorter head repeats its last entry (the shares stay right)."""
        if not self.headwise:
            return self.positions
        rows = [self.head(h)[2] for h in range(self.heads())]
        width = max(r.numel() for r in rows)
        return torch.stack([torch.cat([r, r[-1:].expand(width - r.numel())]) for r in rows])


@dataclass
class AdaKVReport(Report):
    """SnapKV's report (``kept``, ``layer_budgets``) and the entries each head was given."""

    # per layer: entries each KV head keeps after the last prefill
    head_budgets: list[list[int] | None] | None = None


@dataclass(eq=False)
class AdaKV(SnapKV):
    name = "adakv"
    title = "AdaKV (SnapKV)"
    does = "drops"
    chooses_tokens = False  # unlike SnapKV, its heads keep different counts in layers of its own: no stack
    paper = "https://arxiv.org/abs/2407.11550"
    summary = ("SnapKV's scores, but a layer's budget is not split evenly between its heads: the best-scoring "
               "entries of all heads together are kept, so heads with spread-out attention keep more. Default: "
               "kvpress's AdaKVPress (each head keeps at least 0.2 of an even share); allocation 'mix' is the "
               "AdaKV authors' rule (half even share, half joint; they also max-pool with kernel 7).")
    alpha: float = param(0.2, "Weight of the even split: with 'floor' each head first keeps this share of it "
                         "(kvpress: 0.2); with 'mix' a head's share is alpha x even + (1 - alpha) x joint "
                         "(AdaKV authors: 0.5). 1.0 is SnapKV's even split.", 0.0, 1.0, 0.05)
    allocation: str = param("floor", "Safeguard against emptied heads: 'floor' (kvpress's AdaKVPress) or 'mix' "
                            "(the AdaKV authors' code; with alpha 0.5, maxpool, kernel 7 it is their setting).",
                            choices=("floor", "mix"))
    streams_under_cap = False  # a cap per streamed chunk would need the allocation per chunk
    report_type: ClassVar[type[Report]] = AdaKVReport

    def __post_init__(self) -> None:
        super().__post_init__()
        self._layers: dict[int, HeadwiseLayer] = {}

    def new_layer(self, layer_idx: int) -> KVLayer:
        self._layers[layer_idx] = HeadwiseLayer()
        return self._layers[layer_idx]

    def attend(self, call: AttentionCall, query, key, value, scaling: float):
        layer = self._layers.get(call.layer_idx)
        if not call.is_prefill or layer is None or not layer.headwise:
            return None  # dense: the runtime's attention; decoding: the layer's ``read_decode``
        return layer.attend(query, scaling)

    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        if not call.is_prefill:
            return
        self.report.ensure_layers(call.num_layers, "kept", "head_budgets")
        self.report.ensure_layers(call.num_layers, "layer_budgets", fill=1.0)
        heads = layer.heads()
        count = self.layer_capacity(call, layer.get_seq_length())
        if layer.entries() > heads * count:
            layer.keep_per_head(self.allocate(layer, query, scaling, count))
        i = call.layer_idx
        self.report.kept[i] = layer.kept_positions()
        self.report.head_budgets[i] = layer.head_lengths()
        self.report.layer_budgets[i] = layer.entries() / heads / call.seen

    def allocate(self, layer: HeadwiseLayer, query, scaling: float, count: int) -> list[torch.Tensor]:
        """Per head, the entries to keep: its window, then Algorithm 1 over every head's older entries."""
        heads, group = layer.heads(), query.shape[1] // layer.heads()
        lengths = layer.head_lengths()
        window = min(self.window_size, query.shape[2], count)
        recent = [torch.arange(n - window, n, device=query.device) for n in lengths]
        if count == window:
            return recent
        scores = [snapkv_scores(query[:, h * group:(h + 1) * group], layer.head(h)[0], scaling, window,
                                self.kernel_size, self.pooling)[0] for h in range(heads)]
        if self.allocation == "mix":
            chosen = mixed_top_k(scores, heads * (count - window), self.alpha)
        else:
            chosen = headwise_top_k(scores, heads * (count - window), int(self.alpha * (count - window)))
        return [torch.cat([c, r]) for c, r in zip(chosen, recent)]


__all__ = ["AdaKV", "AdaKVReport", "HeadwiseLayer", "headwise_top_k", "mixed_top_k"]
