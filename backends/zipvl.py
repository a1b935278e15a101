"""ZipVL (He et al., "ZipVL: Efficient Large Vision-Language Models with Dynamic Token
Sparsification and KV Cache Compression", the version with quantisation: ``zipvl.txt``): one split
of the tokens per layer into important and other ones drives both a token-sparse prefill and a
mixed-precision KV cache.

* Probes (App. A, Eq. 10): the 64 most recent prompt tokens and 64 others drawn at random
  (seeded) are the only query rows whose softmax is computed, in float32 against every held key,
  per query head. A prompt of at most 128 new tokens uses all its rows (Eqs. 5-7 exactly).
* Adaptive count (Sec. 4.1, Eq. 6): accumulated scores a_j summed over probe rows and heads;
  p = the fewest tokens whose largest a_j reach tau x (probe rows x heads), per layer.
  tau >= 1 makes every token important (the float sum can miss n by rounding).
* Important set (Sec. 4.2, Eqs. 7-9): the top p by the normalised score a_j / (probe rows that see
  j), one set per layer shared by its heads (the paper writes one head; a shared set is what keeps
  the sparse attention dense). The last prompt token is always important: it produces the first
  logit, and padding its attention output would change the answer; the paper leaves it open. Text
  tokens compete with visual ones, as in the paper (Eq. 8 ranks all n tokens).
* Token-sparse prefill (Sec. 4.2, Alg. 1): in the ``attend`` seam, attention runs on Q[T], K[T],
  V[T] only (SDPA, offset-causal); the other tokens' outputs are zero, so their residual stream
  passes the layer unchanged. In a later turn the history (already quantised) stays visible to the
  new important queries; only the new and still-buffered tokens are split.
* Mixed-precision cache (Sec. 4.2, Sec. 5.1, Alg. 1): right after each layer's prefill attention,
  important tokens' K/V are quantised to ``bits_important`` (4) and the others to ``bits_other``
  (2), keys per channel and values per token, codes bit-packed into uint8 (``backends/quant.py``,
  our own packing; it says why not optimum-quanto / HQQ). 16 bits keeps a set dense. A prefill
  reads dense dequantised K/V, then the full-precision buffer; a decode query is scored against the
  key codes with scaled queries and mixes the value codes, nothing dequantised (``read_decode``).
* Decoding (Sec. 4.2, "Computation in the decoding phase"): attention is dense; generated tokens
  stay full precision in the buffer until ``period`` (100) have accumulated, then the last query's
  attention over them (summed over heads, Eq. 6 against its own total) splits and quantises them.

No budget: ZipVL's own knob is ``tau``, the attention mass the important tokens must cover (Eq. 6;
0.975, Sec. 5.3.2), a named parameter; the bytes it holds follow from the split it finds, so it sits
on the comparison axis at its realised fraction (``realised_fraction`` in the report), like MPIC.
``budget`` is accepted and ignored (``uses_budget`` is False). tau 1.0 makes every token important:
with both bit widths at 16 (``lossless_params``) that is the full cache.

Report (:class:`ZipVLReport`, ``self.report``), per layer: ``important`` / ``other`` (1-D token
indices held at each precision), ``important_ratio`` (important / tokens split so far),
``layer_budgets`` (the bytes that split plans, as a share of the full cache's: the layer panel's
scale), ``p`` (Eq. 6's count at the last split, over every key the
probes saw: a later turn's count includes the history), ``bytes`` (codes, scales, buffer) and
``overlay`` ((1, n) important indices, which the service draws instead of the kept tokens);
``realised_fraction`` (bytes held / the same tokens' bytes in full precision, all layers) and ``tau``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention_math import attend_segments, attention_probs, causal_attention, dense_segment
from .base import AttentionCall, KVBackend, KVLayer, Report
from .params import param
from .quant import FULL_BITS, PACKED_BITS, QuantTensor, check_bits, quantize

DEFAULT_TAU = 0.975  # Sec. 5.3.2: "the optimal range for tau lies around 0.97"
PROBE_CHUNK = 32  # probe rows per softmax pass: bounds the float32 (H, rows, S) block at long contexts


# ---------------------------------------------------------------------------------------------
# Scoring: probes, Eq. 6, Eqs. 7-9
# ---------------------------------------------------------------------------------------------


def probe_rows(new: int, recent: int, random: int, seed: int) -> torch.Tensor:
    """Sorted indices (among ``new`` prompt rows) of the probes: the last ``recent`` rows plus
    ``random`` distinct others drawn with ``seed``; every row when that covers them all (App. A)."""
    if recent + random >= new:
        return torch.arange(new)
    recent_rows = torch.arange(new - recent, new)
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randperm(new - recent, generator=generator)[:random]
    return torch.cat([drawn.sort().values, recent_rows])


def probe_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: torch.Tensor):
    """Accumulated scores a_j (Eq. 5) and normalised scores (Eq. 7) over every held key, (S,) each,
    from the probe ``rows`` of the new queries (the new tokens are the last keys), summed over heads.
    Also returns the number of probe rows (rows x heads): the total the a_j sum to."""
    held, new = key.shape[2], query.shape[2]
    index = rows.to(key.device) + (held - new)  # each probe's own key index: it sees keys 0..index
    accumulated = torch.zeros(held, device=key.device)
    for start in range(0, rows.numel(), PROBE_CHUNK):
        part = rows[start:start + PROBE_CHUNK].to(query.device)
        probs = attention_probs(query[:, :, part], key, scaling, index[start:start + PROBE_CHUNK])
        accumulated += probs.sum(dim=(0, 1))
    heads = query.shape[1]
    seen_by = (index[None, :] >= torch.arange(held, device=key.device)[:, None]).sum(dim=1) * heads  # nnz(A[:, j])
    return accumulated, accumulated / seen_by.clamp_min(1), rows.numel() * heads


def adaptive_count(scores: torch.Tensor, tau: float, total: float | None = None) -> int:
    """Eq. 6: the fewest tokens whose largest ``scores`` sum to at least tau x ``total`` (default:
    their sum). tau >= 1 returns every token."""
    n = scores.numel()
    if tau >= 1.0 or n == 0:
        return n
    total = float(scores.sum()) if total is None else total
    cumulative = scores.sort(descending=True).values.cumsum(0)
    return min(n, int((cumulative < tau * total).sum()) + 1)


def important_mask(normalised: torch.Tensor, count: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Eqs. 8-9: bool mask of the ``count`` best normalised scores; ``forced`` indices are always in."""
    scores = normalised.clone()
    if forced is not None:
        scores[forced] = float("inf")
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    mask[scores.topk(min(count, scores.numel())).indices] = True
    return mask


# ---------------------------------------------------------------------------------------------
# Storage: packed blocks + a full-precision buffer
# ---------------------------------------------------------------------------------------------


class QuantBlock:
    """Tokens quantised together: the important ones at high bits, the others at low bits."""

    def __init__(self, keys, values, positions, important: torch.Tensor, bits_high: int, bits_low: int) -> None:
        self.important = positions[important]
        self.other = positions[~important]
        self.parts: list[tuple[QuantTensor, QuantTensor]] = []
        for chosen, bits in ((important, bits_high), (~important, bits_low)):
            if chosen.any():
                k, v = keys[:, :, chosen], values[:, :, chosen]
                self.parts.append((quantize(k, bits, reduce_dim=2), quantize(v, bits, reduce_dim=3)))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([k.dequantize() for k, _ in self.parts], dim=2)
        values = torch.cat([v.dequantize() for _, v in self.parts], dim=2)
        return keys, values

    @property
    def positions(self) -> torch.Tensor:
        return torch.cat([self.important, self.other])  # the read order

    def segments(self) -> list:
        """The parts for :func:`attend_segments`, in the read order: scored and mixed from the codes."""
        return [(k.key_scores, v.value_mix) for k, v in self.parts]

    def quant_tensors(self) -> list[QuantTensor]:
        return [t for pair in self.parts for t in pair]


class ZipVLLayer(KVLayer):
    """Packed blocks, then the full-precision buffer (``keys``/``values``/``positions``)."""

    def __init__(self, bits_high: int, bits_low: int) -> None:
        super().__init__()
        self.bits_high, self.bits_low = bits_high, bits_low
        self.blocks: list[QuantBlock] = []

    @property
    def buffered(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys, values, positions):
        dense_k, dense_v = super().append(keys, values, positions)
        if not self.blocks:
            return dense_k, dense_v
        parts = [b.dense() for b in self.blocks]
        return (torch.cat([k for k, _ in parts] + [dense_k], dim=2),
                torch.cat([v for _, v in parts] + [dense_v], dim=2))

    def append_decode(self, keys, values, positions):
        """Store only; the decode query reads the blocks through ``read_decode``."""
        return KVLayer.append(self, keys, values, positions)

    def read_decode(self, query, scaling):
        """Decode attention read from the codes (scaled queries against key codes, probabilities
        against value codes) and the full-precision buffer, without dequantising a block."""
        segments = [seg for b in self.blocks for seg in b.segments()] + [dense_segment(self.keys, self.values)]
        return attend_segments(query, scaling, self.keys.shape[1], segments) if self.blocks else None

    def compress(self, important: torch.Tensor) -> None:
        """Quantise the whole buffer; ``important`` is its (n,) bool split. The buffer empties."""
        self.blocks.append(QuantBlock(self.keys, self.values, self.positions[0], important.to(self.keys.device),
                                      self.bits_high, self.bits_low))
        self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
        self.positions = self.positions[:, :0]

    def byte_parts(self) -> dict[str, int]:
        codes = sum(_nbytes(t.codes) + _nbytes(t.dense) for b in self.blocks for t in b.quant_tensors())
        scales = sum(_nbytes(t.scale) + _nbytes(t.zero) for b in self.blocks for t in b.quant_tensors())
        return {"codes": codes, "scales": scales, "buffer": _nbytes(self.keys) + _nbytes(self.values)}

    # --- what it holds -------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [t for b in self.blocks for q in b.quant_tensors() for t in q.tensors()]

    def get_seq_length(self) -> int:
        return super().get_seq_length() + sum(b.important.numel() + b.other.numel() for b in self.blocks)

    def kept_positions(self) -> torch.Tensor:
        heads = self.keys.shape[1]
        packed = [b.positions.view(1, -1).expand(heads, -1) for b in self.blocks]
        return torch.cat(packed + [self.positions], dim=1)

    def keep(self, index: torch.Tensor) -> None:
        raise NotImplementedError("ZipVL keeps every token (at 4 or 2 bits); it never evicts")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _width_bytes(layer: KVLayer) -> int:
    """Bytes of one token's keys (or values) in the cache dtype: H_kv x D x itemsize."""
    return layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size() if layer.keys is not None else 0


# ---------------------------------------------------------------------------------------------
# The method
# ---------------------------------------------------------------------------------------------


@dataclass
class ZipVLReport(Report):
    """ZipVL's split per layer; ``layer_budgets`` is the share of the full cache's bytes the split
    plans for the layer (its codes: important tokens at ``bits_important``, the rest at
    ``bits_other``; scales and the full-precision buffer come on top), on the same scale as the
    bytes the layer panel draws; ``overlay`` holds the (1, n) important indices and ``realised_fraction`` the bytes held / full."""

    # per layer: 1-D token indices held at ``bits_important``
    important: list[torch.Tensor | None] | None = None
    # per layer: 1-D token indices held at ``bits_other``
    other: list[torch.Tensor | None] | None = None
    # per layer: important / tokens split so far
    important_ratio: list[float | None] | None = None
    # per layer: Eq. 6's count at the last split, over every key the probes saw (a later turn's includes the history)
    p: list[int | None] | None = None
    # per layer: bytes held, {"codes": int, "scales": int, "buffer": int}
    bytes: list[dict[str, int] | None] | None = None
    # the method's tau (Eq. 6) the split was made with
    tau: float | None = None


@dataclass(eq=False)
class ZipVL(KVBackend):
    name = "zipvl"
    overlay_meaning = "at high precision (the rest: fewer bits)"
    title = "ZipVL"
    does = "drops, quantises"
    paper = "https://arxiv.org/abs/2410.08584"
    summary = ("Per layer, finds the fewest tokens holding tau (paper 0.975) of the probes' attention; prefill "
               "attends over those only, and the cache keeps them at 4 bits, the rest at 2 bits. No budget: the "
               "memory it saves follows from tau.")
    tau: float = param(DEFAULT_TAU, "Share of the probes' attention the important tokens must hold, per layer (Eq. 6; "
                       "Sec. 5.3.2: 0.975). 1.0 makes every token important.", 0.01, 1.0, 0.005)
    recent_probes: int = param(64, "Probe queries: the most recent prompt tokens (App. A: 64).", 0, 4096, 1)
    random_probes: int = param(64, "Probe queries drawn at random among the other prompt tokens (App. A: 64).", 0, 4096, 1)
    seed: int = param(0, "Seed of the random probe positions.", 0, 2**31 - 1, 1)
    bits_important: int = param(4, "Bits per key/value of important tokens: 2, 4, 8 or 16 (= not quantised; "
                                "Sec. 5.1: 4).", 2, 16, 1)
    bits_other: int = param(2, "Bits per key/value of the other tokens: 2, 4, 8 or 16 (Sec. 5.1: 2).", 2, 16, 1)
    period: int = param(100, "Generated tokens kept in full precision before they are scored and quantised "
                        "(Sec. 4.2: 100).", 1, 100000, 1)
    lossless_params: ClassVar[dict] = {"tau": 1.0, "bits_important": FULL_BITS, "bits_other": FULL_BITS}
    shortens_prefill: ClassVar[bool] = True
    uses_budget = False
    report_type: ClassVar[type[Report]] = ZipVLReport

    def __post_init__(self) -> None:
        super().__post_init__()
        for p in ("bits_important", "bits_other"):
            try:
                check_bits(getattr(self, p))
            except ValueError as exc:
                raise ValueError(f"parameter '{p}': {exc}") from None
        if self.bits_other > self.bits_important:
            raise ValueError(f"bits_other ({self.bits_other}) must not exceed bits_important ({self.bits_important})")
        if self.recent_probes + self.random_probes < 1:
            raise ValueError("ZipVL needs at least one probe query (recent_probes + random_probes >= 1)")
        self._split: dict[int, torch.Tensor] = {}  # layer -> important mask over its buffered tokens
        self._important: dict[int, list[torch.Tensor]] = {}
        self._other: dict[int, list[torch.Tensor]] = {}
        self._layers: dict[int, KVLayer] = {}

    @property
    def quantises(self) -> bool:
        return self.bits_important != FULL_BITS or self.bits_other != FULL_BITS

    def new_layer(self, layer_idx: int) -> KVLayer:
        layer = ZipVLLayer(self.bits_important, self.bits_other) if self.quantises else KVLayer()
        self._layers[layer_idx] = layer
        return layer

    @property
    def needs_decode_attention(self) -> bool:
        return True  # the buffer's split reads the decode query's row (free from ``read_decode``)

    # --- prefill: split, then attend over the important tokens only -----------------------------
    def attend(self, call: AttentionCall, query, key, value, scaling: float):
        if not call.is_prefill:
            return None  # decoding is dense (Sec. 4.2)
        new, held = query.shape[2], key.shape[2]
        # the tokens to split: the new ones plus generated ones still waiting in the buffer
        layer = self._layers.get(call.layer_idx)
        split = min(held, max(new, layer.buffered if isinstance(layer, ZipVLLayer) else 0))
        if self.tau >= 1.0:
            mask = torch.ones(split, dtype=torch.bool, device=key.device)
            self._record(call.layer_idx, mask, split, call)
            return None
        rows = probe_rows(new, self.recent_probes, self.random_probes, self.seed)
        accumulated, normalised, total = probe_scores(query, key, scaling, rows)
        p = adaptive_count(accumulated, self.tau, total)
        forced = torch.tensor([held - 1], device=key.device)  # the last prompt token: the first logit
        mask = important_mask(normalised, p, forced)[held - split:]
        self._record(call.layer_idx, mask, p, call)
        chosen = mask[split - new:]  # the new queries that attend
        if chosen.all() and mask.all():
            return None
        keys_used = torch.cat([torch.ones(held - split, dtype=torch.bool, device=key.device), mask])
        out = query.new_zeros(query.shape)  # padded rows: zero output, the residual passes through
        out[:, :, chosen] = causal_attention(query[:, :, chosen], key[:, :, keys_used], value[:, :, keys_used], scaling)
        return out

    def _record(self, layer_idx: int, mask: torch.Tensor, p: int, call: AttentionCall) -> None:
        self._split[layer_idx] = mask
        self.report.ensure_layers(call.num_layers, "p")
        self.report.p[layer_idx] = p

    # --- cache: quantise what was split -------------------------------------------------------
    def after_attention(self, call: AttentionCall, layer: KVLayer, query, key, scaling: float, attn_row=None) -> None:
        i = call.layer_idx
        if call.is_prefill:
            mask = self._split.pop(i, None)
            if mask is None:
                return
            positions = layer.positions[0, -mask.numel():]
        else:
            if not isinstance(layer, ZipVLLayer):
                return
            if layer.buffered < self.period:
                if self.report.bytes is not None:  # the buffer grew
                    self.report.bytes[i] = layer.byte_parts()
                return
            # Alg. 1 (decoding): the last query's attention over the buffered tokens, summed over heads
            buffered = layer.buffered
            scores = attn_row[:, 0, -buffered:].sum(dim=0)
            p = adaptive_count(scores, self.tau)
            mask = important_mask(scores, p)
            self.report.ensure_layers(call.num_layers, "p")
            self.report.p[i] = p
            positions = layer.positions[0]
        if isinstance(layer, ZipVLLayer):
            layer.compress(mask)
        self._important.setdefault(i, []).append(positions[mask])
        self._other.setdefault(i, []).append(positions[~mask])
        self._report(call, layer)

    def _report(self, call: AttentionCall, layer: KVLayer) -> None:
        n, i = call.num_layers, call.layer_idx
        report = self.report
        report.ensure_layers(n, "important", "other", "important_ratio", "layer_budgets", "overlay", "bytes")
        important, other = torch.cat(self._important[i]), torch.cat(self._other[i])
        ratio = important.numel() / max(1, important.numel() + other.numel())
        report.important[i], report.other[i] = important, other
        report.important_ratio[i] = ratio
        full_bits = 8 * (layer.keys.element_size() if layer.keys is not None else 2)
        report.layer_budgets[i] = (ratio * self.bits_important + (1 - ratio) * self.bits_other) / full_bits
        report.overlay[i] = important.view(1, -1)
        report.bytes[i] = (layer.byte_parts() if isinstance(layer, ZipVLLayer)
                           else {"codes": layer.nbytes(), "scales": 0, "buffer": 0})
        report.tau = self.tau
        held = sum(layer.nbytes() for layer in self._layers.values())
        full = sum(2 * layer.get_seq_length() * _width_bytes(layer) for layer in self._layers.values())
        report.realised_fraction = held / full if full else None


__all__ = ["DEFAULT_TAU", "PACKED_BITS", "ZipVL", "ZipVLLayer", "ZipVLReport", "adaptive_count", "important_mask",
           "probe_rows", "probe_scores"]
