"""AttentionPack (Ilhan et al., "Attention-aware Inference Optimizations for Large Vision-Language
Models with Memory-efficient Decoding", CVPR 2026, arXiv:2603.23914; Sec. 3-4 and Algorithm 1 in
Sec. 6): a low-rank visual KV cache, read from its factors.

* Per layer, the visual tokens of a prompt form one T x W matrix for the pre-RoPE keys and one for
  the values, all KV heads side by side (W = H_kv * D, the paper's multi-head compression). Each is
  factorised by randomized SVD (:func:`backends.low_rank.randomized_svd`) into a T x R factor and an R x W
  decompression matrix; only those are stored. Text tokens stay dense (Sec. 8.2: compressing them
  with the visual ones cost ~20% accuracy).
* A prefill read (``append``) rebuilds the keys from their factors, re-rotates them with the
  model's own RoPE tables for the stored rotary ids (1-D RoPE or M-RoPE) and rebuilds the values;
  the dense tokens come after them. A decode query (``read_decode``) uses the values in factor space,
  (p U) W instead of p (U W), so a step never builds a dense value; with M-RoPE it also scores the
  keys from their factors, the query rotated back once per distinct time, row and column value
  (``rotary_groups.py``: about sqrt(T) rotations for a picture of T tokens), so a step builds no
  dense key either. With 1-D RoPE each token has its own angle and the keys are rebuilt.
* Attention-aware decompression, F = 2 groups (Sec. 7.1.1): a per-token statistic, Eq. 1
  ``I <- a^Tq I + (1 - a^Tq) mean_rows(A)``, ranks the compressed tokens; the top r1 = 25% are rebuilt
  with all R components, the rest with the first R/4. The paper does this for the values only;
  ``partial_on`` can move it to the keys or both (its Fig. 4). The statistic is seeded at prefill
  from the last 32 prompt rows (the question) and updated with every decode query's attention row.
* Tokens generated while decoding stay dense by default (``period`` 0): the paper compresses the
  visual tokens and found compressing text harmful (Sec. 8.2). ``period`` T_p > 0 factorises every
  T_p generated tokens too (Algorithm 1's T_p; the paper gives no value).
* Randomized SVD with oversampling (Halko, Martinsson and Tropp, "Finding structure with
  randomness", arXiv:0909.4061, Sec. 1.3 and 4.2): R + 10 test vectors are drawn and the top R components are kept; with exactly R vectors
  the fit is measurably worse than the best rank-R fit. The vectors come from a generator seeded
  with ``seed``, never the global one: the same request gives the same factors and answer.

Budget -> rank (METHODS.md: budget = fraction of the layer's full bytes held): the prompt's visual
block gets the largest R whose factors fit what the budget leaves after everything else the layer
holds (dense text, earlier blocks, the statistic) and the block's scalars (rotary ids, groups):
``R = floor((budget * full_bytes - other_bytes - scalars) / (2 * (T + W) * itemsize))`` in
[1, min(T, W)] (R = 1 when text alone outgrows the budget). A generated block of T_p tokens fits
its own share.
``rank_k`` / ``rank_v`` > 0 override it (the paper uses 64 for images, 128 for video). A block whose
factors and scalars would not be smaller than its dense keys and values stays dense, and a layer
with no block to rank holds no statistic, so the layer never holds more than the full cache. Budget
1.0 is the full cache whatever the ranks.

Deviations, on purpose: a layer's visual tokens are factorised right after its prefill attention
rather than at the first decode step (same cache, lower peak); and each period's tokens become a
block of their own instead of re-factorising the whole cache (Algorithm 1, line 15), which would
compound the error of the R/4-rebuilt tokens and mix modalities.

Report (:class:`AttentionPackReport`, ``self.report``): per layer ``full_rank`` / ``reduced_rank``
(token indices rebuilt at full and at reduced rank at the next read), ``ranks`` (R_k, R_v per block)
and ``bytes`` (factors, dense, scalars: the statistic, rotary ids and groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_math import attend_segments, attention_probs, dense_segment
from .base import KVBackend, KVLayer, Report
from .low_rank import block_ranks, factor_bytes, factorise, mix_factors, rebuild
from .params import param
from .rope import rotate, unrotate
from .rotary_groups import RotaryGroups

STAT_ROWS = 32  # prompt rows that seed the statistic: the question sits at the end of the prompt
REDUCED = 4  # the low-attention group keeps R / 4 components (paper: R^(1) = 4 R^(2))
@dataclass
class LowRankBlock:
    """Tokens held as factors: pre-RoPE keys ~ k_coef @ k_basis, values ~ v_coef @ v_basis."""

    positions: torch.Tensor  # (T,) token indices
    rope_ids: torch.Tensor  # (P, T) int32 rotary ids, to re-rotate rebuilt keys
    k_coef: torch.Tensor
    k_basis: torch.Tensor
    v_coef: torch.Tensor
    v_basis: torch.Tensor
    score: torch.Tensor  # (T,) float32 attention statistic (Eq. 1)
    groups: RotaryGroups | None = None  # M-RoPE: a decode query is scored without rebuilding the keys
    full: torch.Tensor | None = None  # (T,) bool: rebuilt with every component at the next read

    def tensors(self) -> list[torch.Tensor]:
        held = [self.rope_ids, self.k_coef, self.k_basis, self.v_coef, self.v_basis, self.score]
        return held + (self.groups.tensors() if self.groups is not None else [])


class PassTables:
    """What the layers of one forward pass share: the runtime's rope_ids -> (cos, sin) for this pass
    (``AttentionCall.rotary``) and the RoPE tables computed with it. Both go when the pass ends, so
    between passes a cache holds tensors only: the runtime's function is bound to its model and
    must not travel with the cache (a ZeroGPU worker pickles the cache every turn)."""

    def __init__(self) -> None:
        self.rotary = None
        self.memo: dict = {}  # (first position, tokens, kind) -> a block's tables

    def begin(self, rotary) -> None:
        self.rotary, self.memo = rotary, {}

    def end(self) -> None:
        self.rotary, self.memo = None, {}

    def tables(self, key: tuple, compute):
        if key not in self.memo:
            if self.rotary is None:
                raise RuntimeError("AttentionPack read its RoPE tables outside a forward pass")
            self.memo[key] = compute(self.rotary)
        return self.memo[key]


class PackedLayer(KVLayer):
    """Low-rank blocks, then dense tokens (``keys``/``values``/``positions`` hold the dense part).
    ``tables`` is the forward pass's :class:`PassTables`, shared by the layers of one cache (a layer
    built alone gets its own)."""

    def __init__(self, full_share: float, partial_on: str, tables: PassTables | None = None, seed: int = 0) -> None:
        super().__init__()
        self.full_share, self.partial_on, self.seed = full_share, partial_on, seed
        self.blocks: list[LowRankBlock] = []
        self.score: torch.Tensor | None = None  # (S_dense,) statistic of the dense tokens
        self.buffered: torch.Tensor | None = None  # (S_dense,) bool: generated, waiting for the period
        self.buffer_rope: torch.Tensor | None = None  # (P, n) rotary ids of the buffered tokens
        self.tables = tables if tables is not None else PassTables()

    def append(self, keys, values, positions):
        dense_k, dense_v = self.append_decode(keys, values, positions)
        if not self.blocks:
            return dense_k, dense_v
        heads, dim = keys.shape[1], keys.shape[3]
        parts_k, parts_v = [], []
        for b in self.blocks:
            v = rebuild(b.v_coef, b.v_basis, self._partial(b, "values"), max(1, b.v_coef.shape[1] // REDUCED))
            parts_k.append(self.block_keys(b, heads, dim))
            parts_v.append(_heads(v, heads, dim))
        return torch.cat(parts_k + [dense_k], dim=2), torch.cat(parts_v + [dense_v], dim=2)

    def append_decode(self, keys, values, positions):
        """Store only; the decode query reads the blocks through ``read_decode``."""
        dense_k, dense_v = KVLayer.append(self, keys, values, positions)
        new = keys.shape[2]
        self.score = _cat(self.score, torch.zeros(new, device=keys.device))
        self.buffered = _cat(self.buffered, torch.zeros(new, dtype=torch.bool, device=keys.device))
        return dense_k, dense_v

    def _partial(self, b: LowRankBlock, which: str) -> torch.Tensor | None:
        """The block's full-rank rows if the reduced group applies to ``which``, else None."""
        return b.full if self.partial_on in (which, "both") else None

    def block_keys(self, b: LowRankBlock, heads: int, dim: int) -> torch.Tensor:
        """The block's keys rebuilt and re-rotated: (1, H_kv, T, D), for a prefill read, or a decode
        read when each token has its own rotation (1-D RoPE: no :class:`RotaryGroups`)."""
        k = rebuild(b.k_coef, b.k_basis, self._partial(b, "keys"), max(1, b.k_coef.shape[1] // REDUCED))
        cos, sin = self.rope_tables(b)
        return rotate(_heads(k, heads, dim), cos, sin)

    def rope_tables(self, b: LowRankBlock, kind: str = "tokens"):
        """The model's (cos, sin) for the block's rotary ids (``kind`` "tokens"), or for one token per
        value of each grouped component ("groups"). Every layer packs the same tokens with the same
        ids, so within one forward pass they are computed once (``tables``, emptied by the backend
        after each pass) instead of once per layer."""
        compute = ((lambda rotary: rotary(b.rope_ids)) if kind == "tokens" else
                   (lambda rotary: [rotary(ids) for ids in b.groups.representatives(b.rope_ids)]))
        key = (int(b.positions[0]), b.positions.numel(), kind)  # a token sits in one block only
        return self.tables.tables(key, compute)

    def block_scores(self, b: LowRankBlock, query: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """Scores (H_kv, G, T) of the grouped, pre-scaled decode query against the block's keys: from
        the factors per distinct rotation when the block has rotary groups (M-RoPE), else against
        the rebuilt keys."""
        if b.groups is None:
            return torch.matmul(query, self.block_keys(b, heads, dim)[0].float().transpose(-1, -2))
        coef, full, reduced = b.k_coef, self._partial(b, "keys"), max(1, b.k_coef.shape[1] // REDUCED)
        if full is not None and reduced < coef.shape[1]:  # the reduced group meets only R/4 components
            coef = coef.clone()
            coef[~full, reduced:] = 0
        return b.groups.scores(query, coef, b.k_basis, self.rope_tables(b, "groups"))

    def read_decode(self, query, scaling):
        """Decode attention without rebuilding a value, and with M-RoPE without rebuilding a key:
        scores come from the factors per distinct rotation (``block_scores``), values are used in
        factor space, (p U) W instead of p (U W) (Sec. 4), the reduced group's probabilities meeting
        only the first R/4 components."""
        if not self.blocks:
            return None
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        segments = [(lambda q, b=b: self.block_scores(b, q, heads, dim),
                     lambda p, b=b: mix_factors(p, b.v_coef, b.v_basis, self._partial(b, "values"),
                                                max(1, b.v_coef.shape[1] // REDUCED)))
                    for b in self.blocks]
        return attend_segments(query, scaling, heads, segments + [dense_segment(self.keys, self.values)])

    def choose_groups(self) -> None:
        """F = 2: the top ``full_share`` of all compressed tokens by statistic get full rank."""
        scores = torch.cat([b.score for b in self.blocks])
        full = torch.zeros_like(scores, dtype=torch.bool)
        full[scores.topk(math.ceil(self.full_share * scores.numel())).indices] = True
        for b, part in zip(self.blocks, full.split([b.score.numel() for b in self.blocks])):
            b.full = part

    def observe(self, stat: torch.Tensor, rows: int, alpha: float) -> None:
        """Eq. 1 over the read order (blocks, then dense): ``rows`` queries gave ``stat``."""
        keep = alpha ** rows
        parts = stat.float().split([b.score.numel() for b in self.blocks] + [self.score.numel()])
        for b, s in zip(self.blocks, parts):
            b.score = keep * b.score + (1 - keep) * s
        self.score = keep * self.score + (1 - keep) * parts[-1]

    def pack(self, index: torch.Tensor, rope_ids: torch.Tensor, rotary, ranks: tuple[int, int], spare: float = 0.0,
             query_heads: int | None = None) -> bool:
        """Factorise the dense entries at ``index`` (their rotary ids ``rope_ids``) into a block at
        ``ranks`` (0: the largest fitting ``spare`` bytes); a block whose factors would not be smaller
        than its dense keys and values stays dense (False). ``query_heads`` (default: one per KV head)
        decides whether scoring per distinct rotation pays (:class:`RotaryGroups`)."""
        width, tokens = self.keys.shape[1] * self.keys.shape[3], index.numel()
        itemsize = self.keys.element_size()
        rope_ids = rope_ids.to(self.keys.device, torch.int32)
        if self.tables.rotary is None:  # a layer used alone, outside a backend's forward pass
            self.tables.begin(rotary)
        cos, sin = rotary(rope_ids)
        groups = RotaryGroups.build(rope_ids, cos, sin, query_heads or self.keys.shape[1], self.keys.shape[1])
        scalars = _nbytes(rope_ids) + sum(_nbytes(t) for t in (groups.tensors() if groups else []))
        rank_k, rank_v = block_ranks(ranks, spare, tokens, width, itemsize, scalars)
        if factor_bytes(tokens, width, rank_k, rank_v, itemsize, scalars) >= 2 * tokens * width * itemsize:
            return False
        keys = unrotate(self.keys[:, :, index].float(), cos, sin)  # float32: half precision would add error
        dtype = self.keys.dtype
        k_mat = keys[0].transpose(0, 1).reshape(-1, width)
        v_mat = self.values[0, :, index].transpose(0, 1).reshape(-1, width)
        self.blocks.append(LowRankBlock(self.positions[0, index], rope_ids,
                                        *factorise(k_mat, rank_k, dtype, self.seed),
                                        *factorise(v_mat, rank_v, seed=self.seed), self.score[index], groups))
        rest = torch.ones(self.keys.shape[2], dtype=torch.bool, device=self.keys.device)
        rest[index] = False
        self.keys, self.values = self.keys[:, :, rest], self.values[:, :, rest]
        self.positions, self.score, self.buffered = self.positions[:, rest], self.score[rest], self.buffered[rest]
        return True

    def hold(self, rope_ids: torch.Tensor) -> int:
        """Mark the newest dense tokens as waiting for the period; returns how many wait."""
        self.buffered[-rope_ids.shape[1]:] = True
        self.buffer_rope = _cat(self.buffer_rope, rope_ids.to(self.keys.device, torch.int32), dim=1)
        return int(self.buffered.sum())

    def pack_buffer(self, rotary, ranks: tuple[int, int], spare: float, query_heads: int) -> None:
        if not self.pack(self.buffered.nonzero().squeeze(1), self.buffer_rope, rotary, ranks, spare, query_heads):
            self.buffered[:] = False  # too few tokens to pay: they stay dense for good
        self.buffer_rope = None

    def track_statistic(self) -> None:
        """Zeros for the dense tokens that have no statistic (it was dropped while nothing used it)."""
        held = 0 if self.score is None else self.score.numel()
        missing = self.keys.shape[2] - held
        if missing > 0:
            self.score = _cat(torch.zeros(missing, device=self.keys.device), self.score)

    def drop_statistic(self) -> None:
        """No block and no buffer: nothing to rank, so hold no statistic (the layer stays <= dense)."""
        self.score = None

    def full_bytes(self) -> int:
        """What the full cache holds for the same tokens: dense keys and values."""
        return 2 * self.get_seq_length() * self.keys.shape[1] * self.keys.shape[3] * self.keys.element_size()

    # --- what it holds -------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        extra = [t for t in (self.score, self.buffer_rope) if t is not None]
        return super().tensors() + extra + [t for b in self.blocks for t in b.tensors()]

    def get_seq_length(self) -> int:
        return super().get_seq_length() + sum(b.positions.numel() for b in self.blocks)

    def kept_positions(self) -> torch.Tensor:
        heads = self.keys.shape[1]
        packed = [b.positions.view(1, -1).expand(heads, -1) for b in self.blocks]
        return torch.cat(packed + [self.positions], dim=1)

    def keep(self, index: torch.Tensor) -> None:
        raise NotImplementedError("AttentionPack keeps every token; its factors cannot be gathered")


@dataclass
class AttentionPackReport(Report):
    """Per layer, which factorised tokens are rebuilt at which rank, the ranks and the bytes."""

    # per layer: 1-D token indices of the factorised blocks rebuilt at full rank at the next read
    full_rank: list[torch.Tensor | None] | None = None
    # per layer: 1-D token indices rebuilt at the reduced rank (R/4) at the next read
    reduced_rank: list[torch.Tensor | None] | None = None
    # per layer: (R_k, R_v) per low-rank block, in block order
    ranks: list[list[tuple[int, int]] | None] | None = None
    # per layer: bytes held, {"factors": int, "dense": int, "scalars": int} (scalars: statistic, rotary ids)
    bytes: list[dict[str, int] | None] | None = None


@dataclass(eq=False)
class AttentionPack(KVBackend):
    name = "attention_pack"
    title = "AttentionPack"
    does = "low-rank"
    paper = "https://arxiv.org/abs/2603.23914"
    summary = ("Stores the image tokens' keys and values as low-rank factors (all heads together) and reads "
               "them from the factors at every step: full rank for the most-attended 25%, a quarter of it for the rest.")
    rank_k: int = param(0, "Rank of the key factors; 0 derives it from the budget (paper: 64 images, 128 video).", 0, 4096, 1)
    rank_v: int = param(0, "Rank of the value factors; 0 derives it from the budget.", 0, 4096, 1)
    full_share: float = param(0.25, "Share of compressed tokens, by attention, rebuilt at full rank (the rest at R/4).", 0.0, 1.0, 0.05)
    partial_on: str = param("values", "Which factors the reduced-rank group applies to (paper: values).",
                            choices=("values", "keys", "both", "none"))
    ema_alpha: float = param(0.25, "Decay of the running attention statistic per query (Eq. 1).", 0.0, 1.0, 0.05)
    period: int = param(0, "Generated tokens collected dense before they are factorised too; 0 never (the "
                        "paper compresses visual tokens only, Sec. 8.2).", 0, 4096, 1)
    seed: int = param(0, "Seed of the randomized SVD's test vectors (the same request gives the same factors).",
                      0, 2**31 - 1, 1)
    report_type: ClassVar[type[Report]] = AttentionPackReport
    # every token is held, as factors: the overlay shows which ones at full rank
    overlay_meaning = "at full rank (the rest: rank R/4)"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._pass = PassTables()  # the forward pass's RoPE function and tables, shared by the layers

    @property
    def needs_decode_attention(self) -> bool:
        return self.budget < 1.0  # the decode query's attention row feeds the statistic; the full cache needs none

    def new_layer(self, layer_idx: int) -> KVLayer:
        if self.budget >= 1.0:  # the full cache, exactly
            return KVLayer()
        return PackedLayer(self.full_share, self.partial_on, self._pass, self.seed)

    def before_forward(self, cache, call) -> None:
        self._pass.begin(call.rotary)

    def after_forward(self, cache, call) -> None:
        self._pass.end()  # nothing of the runtime stays in the cache between passes

    def after_attention(self, call, layer, query, key, scaling, attn_row=None) -> None:
        if not isinstance(layer, PackedLayer):
            return
        index = self._visual_index(call, layer)
        if not (layer.blocks or index.numel() or self.period > 0):  # nothing to rank now
            layer.drop_statistic()
            self._report(call, layer)
            return
        layer.track_statistic()
        if attn_row is not None:  # decode: the runtime's softmax row, averaged over heads
            stat, rows = attn_row.reshape(-1, attn_row.shape[-1]).mean(0), 1
        else:  # prefill: the last prompt rows against every key they see
            rows, total = min(STAT_ROWS, query.shape[2]), key.shape[2]
            own = torch.arange(total - rows, total, device=key.device)
            stat = attention_probs(query[:, :, -rows:], key, scaling, own).mean(dim=(0, 1))
        layer.observe(stat, rows, self.ema_alpha)
        width, itemsize = key.shape[1] * key.shape[3], layer.keys.element_size()
        ranks, heads = (self.rank_k, self.rank_v), query.shape[1]
        if index.numel():
            dense = layer.positions[0]
            rope = call.rope_ids.to(dense.device)[:, dense[index] - int(call.positions[0])]
            # the budget is the layer's: what it leaves once everything else it holds is counted
            spare = self.budget * layer.full_bytes() - (layer.nbytes() - 2 * index.numel() * width * itemsize)
            layer.pack(index, rope, call.rotary, ranks, spare, heads)
        elif not call.is_prefill and self.period > 0 and layer.hold(call.rope_ids) >= self.period:
            spare = self.budget * 2 * self.period * width * itemsize  # the block's own share
            layer.pack_buffer(call.rotary, ranks, spare, heads)
        if layer.blocks:  # the groups of the next read (Algorithm 1, line 6), from the updated statistic
            layer.choose_groups()
        elif self.period == 0:
            layer.drop_statistic()
        self._report(call, layer)

    @staticmethod
    def _visual_index(call, layer: PackedLayer) -> torch.Tensor:
        """Dense-part indices of this prefill's visual tokens (empty while decoding or without media)."""
        dense = layer.positions[0]
        visual = torch.zeros_like(dense, dtype=torch.bool)
        if call.is_prefill and call.layout is not None:
            for v in call.layout.visuals:
                for first, end in v.token_spans:  # a video's timestamp text stays text
                    visual |= (dense >= first) & (dense < end)
        return visual.nonzero().squeeze(1)

    def _report(self, call, layer: PackedLayer) -> None:
        report = self.report
        report.ensure_layers(call.num_layers, "full_rank", "reduced_rank", "ranks", "bytes", "overlay")
        i, blocks = call.layer_idx, layer.blocks
        full = [b.positions[b.full] for b in blocks]
        reduced = [b.positions[~b.full] for b in blocks]
        report.full_rank[i] = torch.cat(full) if full else torch.zeros(0, dtype=torch.long)
        report.reduced_rank[i] = torch.cat(reduced) if reduced else torch.zeros(0, dtype=torch.long)
        report.ranks[i] = [(b.k_coef.shape[1], b.v_coef.shape[1]) for b in blocks]
        # the overlay: tokens held densely or rebuilt at full rank (what a reduced-rank token lacks)
        dense_positions = layer.positions[0] if getattr(layer, "positions", None) is not None else None
        shown = [report.full_rank[i]] + ([dense_positions.reshape(-1)] if dense_positions is not None else [])
        report.overlay[i] = torch.cat(shown).view(1, -1)
        factors = sum(_nbytes(t) for b in blocks for t in (b.k_coef, b.k_basis, b.v_coef, b.v_basis))
        dense = _nbytes(layer.keys) + _nbytes(layer.values)
        report.bytes[i] = {"factors": factors, "dense": dense, "scalars": layer.nbytes() - factors - dense}


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def _heads(matrix: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """(T, H_kv * D) -> (1, H_kv, T, D)."""
    return matrix.view(-1, heads, dim).transpose(0, 1).unsqueeze(0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
