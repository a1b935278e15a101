"""KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
arXiv 2402.02750): keys have a few outlier channels and values none, so keys are quantised per
channel and values per token, asymmetrically, at 2 (or 4) bits; the newest tokens stay in full
precision until a whole group of them can be quantised together.

* Keys (Sec. 3.2-3.3, Algorithm 1 ``KeyQuant``): one scale and zero point per channel over a group
  of ``group_size`` tokens (G = 32, Sec. 4). The key residual holds ``l mod R`` full-precision
  tokens: once it reaches R (``residual`` = 128, Sec. 4) its R tokens are quantised at once, as
  R / G groups, and it empties.
* Values (Algorithm 1 ``GroupQuant`` along the channels): one scale and zero point per token over a
  group of G channels. The value residual is always the newest R tokens: a token is quantised as
  soon as it is R + 1 from the end (one per decode step). A head dimension that G does not divide
  is grouped by its largest divisor below G (the authors' kernels require G | D).
* When: a prefill attends over its own keys and values in full precision and is quantised
  afterwards. A decode step attends first, then quantises what left the residuals: its query reads
  up to R keys and R + 1 values in full precision, the new token's included, and ``after_forward``
  flushes. This is the authors' code (jy-yuan/KIVI ``LlamaAttention_KIVI``: attention, then
  ``triton_quantize_and_pack_along_last_dim``); Algorithm 1 as printed quantises before the
  attention, which differs in the one step of each flush. A later turn's prefill is appended like
  many decode tokens at once (the paper has one prompt): the same rule, one flush after its attention.
* Asymmetric min-max quantisation and bit packing are :mod:`backends.quant`'s (codes in uint8,
  four 2-bit or two 4-bit codes per byte; scales and zero points in the cache's dtype). The paper's
  authors store the same three tensors; transformers' ``QuantizedCache`` quantises keys and values
  along one axis and re-quantises the whole cache at every flush, which is not KIVI's scheme.
* Padding: codes are packed a token's D channels at a time, for values too (:class:`ValueCodes`:
  one row per token, the scales per group of g channels beside it), so a value group whose g x bits
  is not a multiple of 8 no longer pads to a whole byte on its own (packed group by group, D = 20 at
  G = 8, g = 5, took 8 bytes a token and head at 2 bits where 5 hold the codes). A row still ends in
  unused bits where D x bits is not a multiple of 8 (D = 6 at 2 bits: 12 bits in 2 bytes), for
  keys and values alike; the authors' kernels pack 32-bit words and assume sizes that divide
  evenly. That padding is held, counted in the bytes held and reported apart
  (``bytes[i]["padding"]``); none at any even D times 4 bits, none at 2 bits when 4 divides D.
* Bytes held = key and value codes (padding included) + scales + zero points + both
  full-precision residuals.

No budget: KIVI keeps every token and its knob is ``bits`` (2: "KIVI-2", the paper's main
setting; 4: "KIVI-4"); the method sits on the comparison axis at the fraction of the full cache's
bytes it realises (``realised_fraction``), like ZipVL. 16 bits keeps the cache dense
(``lossless_params``).

Reads: a prefill's attention runs over the dequantised cache ``append`` returns (transient). A
decode query is answered from the codes (``read_decode``): the keys are scored without being
dequantised, since a key channel's scale and zero point factor out of q . k within a group of tokens
(:func:`key_code_scores`); the values are unpacked and dequantised ``READ_BLOCK`` tokens at a time
and mixed block by block (:func:`value_code_mix`), never as a whole tensor. The
bytes held stay the packed ones: nothing unpacked outlives the step. Equal to attention over the
dequantised cache up to float rounding (tests/test_kivi.py).

Report (:class:`KIVIReport`), per layer: ``bytes`` (codes, padding, scales, residual), ``layer_budgets``
(bytes held / the same tokens in full precision) and ``overlay`` (the tokens whose key and value
are both still in full precision); ``realised_fraction`` over all layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import KVBackend, KVLayer, Report
from .params import param
from .quant import FULL_BITS, QuantTensor, check_bits, pack, quantize, unpack, unpack_float

READ_BLOCK = 2048  # tokens whose codes a decode query unpacks at a time: its float32 temporaries stay small


# ---------------------------------------------------------------------------------------------
# The two groupings (Algorithm 1's KeyQuant and GroupQuant)
# ---------------------------------------------------------------------------------------------


def channel_group(head_dim: int, group_size: int) -> int:
    """Channels per value group: ``group_size``, or its largest divisor of ``head_dim`` below it."""
    return max(d for d in range(1, min(group_size, head_dim) + 1) if head_dim % d == 0)


def quantize_keys(keys: torch.Tensor, bits: int, group_size: int) -> QuantTensor:
    """Keys (1, H, n, D), n a multiple of ``group_size``: per channel over each group of tokens.
    Held as (1, H, n / G, G, D) with one scale per (group, channel)."""
    one, heads, n, dim = keys.shape
    return quantize(keys.reshape(one, heads, n // group_size, group_size, dim), bits, reduce_dim=3)


@dataclass
class ValueCodes(QuantTensor):
    """Values as :func:`quantize_values` holds them: ``shape`` (1, H, n, D / w, w) with one scale and
    zero point per token and group of w channels, but each token's D codes packed as one row, as keys'
    are, so a group never pads to a whole byte on its own."""

    def dequantize(self) -> torch.Tensor:
        codes = unpack(self.codes, self.bits, self.shape[-2] * self.shape[-1]).float().view(self.shape)
        return (codes * self.scale.float() + self.zero.float()).to(self.dtype)


def quantize_values(values: torch.Tensor, bits: int, group_size: int) -> ValueCodes:
    """Values (1, H, n, D): per token over each group of w channels (w = :func:`channel_group`), the
    codes of a token's D channels packed together (:class:`ValueCodes`)."""
    one, heads, n, dim = values.shape
    w = channel_group(dim, group_size)
    q = quantize(values.reshape(one, heads, n, dim // w, w), bits, reduce_dim=4)
    codes = pack(unpack(q.codes, bits, w).reshape(one, heads, n, dim), bits)
    return ValueCodes(q.shape, bits, q.dtype, codes=codes, scale=q.scale, zero=q.zero)


def dequantize_tokens(q: QuantTensor | None, like: torch.Tensor) -> torch.Tensor:
    """A grouped key or value tensor back as (1, H, n, D) in ``like``'s dtype (empty if ``q`` is None)."""
    if q is None:
        return like[:, :, :0]
    one, heads = q.shape[:2]
    return q.dequantize().reshape(one, heads, -1, like.shape[-1])


def concat_tokens(first: QuantTensor | None, second: QuantTensor) -> QuantTensor:
    """Two quantised blocks of the same grouping, one after the other along dim 2."""
    if first is None:
        return second
    shape = first.shape[:2] + (first.shape[2] + second.shape[2],) + first.shape[3:]
    return type(first)(shape, first.bits, first.dtype, codes=torch.cat([first.codes, second.codes], dim=2),
                       scale=torch.cat([first.scale, second.scale], dim=2), zero=torch.cat([first.zero, second.zero], dim=2))


def key_code_scores(q: QuantTensor, query: torch.Tensor) -> torch.Tensor:
    """Scores (H_kv, g, n) of a grouped, pre-scaled float32 query (H_kv, g, D) against keys held as
    :func:`quantize_keys` codes, read from the codes: within a group of tokens channel c has one scale
    s_c and zero point z_c, so q . k_hat = sum_c (q_c s_c) code_c + sum_c q_c z_c. No dequantised key
    is built; the codes are unpacked to float ``READ_BLOCK`` tokens at a time."""
    heads, groups, size, dim = q.shape[1:]
    scale, zero = q.scale[0, :, :, 0].float(), q.zero[0, :, :, 0].float()  # (H_kv, n / G, D)
    scaled = query[:, None] * scale[:, :, None]  # (H_kv, n / G, g, D): q_c s_c per group
    step = max(1, READ_BLOCK // size)
    parts = [torch.matmul(scaled[:, start:start + step],
                          unpack_float(q.codes[0, :, start:start + step], q.bits, dim).transpose(-1, -2))
             for start in range(0, groups, step)]  # (H_kv, b, g, G) each
    scores = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    scores += torch.matmul(zero, query.transpose(-1, -2))[..., None]  # q . z, per group: (H_kv, n / G, g, 1)
    return scores.transpose(1, 2).reshape(heads, query.shape[1], groups * size)


def value_code_mix(q: ValueCodes, probs: torch.Tensor) -> torch.Tensor:
    """float32 probabilities (H_kv, g, n) times values held as :func:`quantize_values` codes: (H_kv, g, D).
    ``READ_BLOCK`` tokens at a time, their codes are unpacked, scaled and shifted in place (one scale
    and zero point per token and channel group) and mixed with one matrix product: only that block
    is ever dequantised. (The factored form, (p_t s_t) @ codes + sum_t p_t z_t, needs one small
    product per channel group, s_t being per token and group; on a CPU it measured 1.3-1.5x slower.)"""
    heads, n, groups, width = q.shape[1:]
    scale, zero = q.scale[0].float(), q.zero[0].float()  # (H_kv, n, D / w, 1)
    out = probs.new_zeros(heads, probs.shape[1], groups * width)
    for start in range(0, n, READ_BLOCK):
        stop = min(n, start + READ_BLOCK)
        block = unpack_float(q.codes[0, :, start:stop], q.bits, groups * width)  # (H_kv, b, D)
        block.view(heads, stop - start, groups, width).mul_(scale[:, start:stop]).add_(zero[:, start:stop])
        out += torch.matmul(probs[..., start:stop], block)
    return out


def padding_bytes(q: QuantTensor) -> int:
    """Bytes of ``q``'s codes that hold no code: a row of codes (a token's D channels) is packed into
    whole bytes, so rows of D x bits not a multiple of 8 end unused."""
    return (q.codes.numel() * 8 - math.prod(q.shape) * q.bits) // 8


# ---------------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------------


class KIVILayer(KVLayer):
    """Quantised keys and values, then each one's full-precision residual (``keys`` / ``values``:
    the key residual holds ``l mod R`` tokens, the value residual the newest R)."""

    def __init__(self, bits: int, group_size: int, residual: int) -> None:
        super().__init__()
        self.bits, self.group_size, self.residual = bits, group_size, residual
        self.quant_keys: QuantTensor | None = None
        self.quant_values: QuantTensor | None = None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's key and value, dequantised where quantised, in token order."""
        keys = torch.cat([dequantize_tokens(self.quant_keys, self.keys), self.keys], dim=2)
        values = torch.cat([dequantize_tokens(self.quant_values, self.values), self.values], dim=2)
        return keys, values

    def append(self, keys, values, positions):
        """Prefill: attention reads the new tokens in full precision, then they are flushed."""
        self.flush()  # a decode step's flush, if no ``after_forward`` ran it
        self._store(keys, values, positions)
        out = self.dense()
        self.flush()
        return out

    def append_decode(self, keys, values, positions):
        """Decode: store the token and return the residuals; the query reads the cache as it stands
        (:meth:`read_decode`: the new token in full precision) and ``KIVI.after_forward`` flushes
        after it, the authors' order."""
        self.flush()  # the previous step's flush, if no ``after_forward`` ran it
        self._store(keys, values, positions)
        return self.keys, self.values

    def read_decode(self, query, scaling):
        """One decode query from the codes and the residuals: the quantised keys are scored from their
        codes (:func:`key_code_scores`), the quantised values mixed a block at a time
        (:func:`value_code_mix`); equal to attention over :meth:`dense` up to float rounding."""
        heads, dim, kv_heads = query.shape[1], query.shape[-1], self.keys.shape[1]
        q = query[0, :, -1].float().reshape(kv_heads, heads // kv_heads, dim) * scaling
        scores = torch.matmul(q, self.keys[0].float().transpose(-1, -2))
        if self.quant_keys is not None:
            scores = torch.cat([key_code_scores(self.quant_keys, q), scores], dim=-1)
        probs = scores.softmax(dim=-1)
        quantised = 0 if self.quant_values is None else self.quant_values.shape[2]
        out = torch.matmul(probs[..., quantised:], self.values[0].float())
        if quantised:
            out += value_code_mix(self.quant_values, probs[..., :quantised])
        return out.reshape(1, heads, 1, dim).to(query.dtype), probs.view(heads, 1, -1)

    def _store(self, keys, values, positions) -> None:
        KVLayer.append(self, keys, values, positions)

    def flush(self) -> None:
        """Quantise what left the residuals: whole multiples of R keys, values beyond the newest R."""
        if self.keys is None:
            return
        ready = self.keys.shape[2] // self.residual * self.residual
        if ready:
            block = quantize_keys(self.keys[:, :, :ready], self.bits, self.group_size)
            self.quant_keys = concat_tokens(self.quant_keys, block)
            self.keys = self.keys[:, :, ready:].clone()  # a copy: a view would keep the whole old tensor alive
        aged = self.values.shape[2] - self.residual
        if aged > 0:
            block = quantize_values(self.values[:, :, :aged], self.bits, self.group_size)
            self.quant_values = concat_tokens(self.quant_values, block)
            self.values = self.values[:, :, aged:].clone()

    # --- what it holds -------------------------------------------------------------------------
    def quant_tensors(self) -> list[QuantTensor]:
        return [q for q in (self.quant_keys, self.quant_values) if q is not None]

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [t for q in self.quant_tensors() for t in q.tensors()]

    def byte_parts(self) -> dict[str, int]:
        """Bytes held by part; ``padding`` is the unused end of packed code rows (whole bytes, counted
        in the bytes held but not in ``codes``)."""
        padding = sum(padding_bytes(q) for q in self.quant_tensors())
        codes = sum(_nbytes(q.codes) for q in self.quant_tensors()) - padding
        scales = sum(_nbytes(q.scale) + _nbytes(q.zero) for q in self.quant_tensors())
        return {"codes": codes, "padding": padding, "scales": scales,
                "residual": _nbytes(self.keys) + _nbytes(self.values)}

    def full_precision_positions(self) -> torch.Tensor:
        """Tokens whose key and value are both in full precision (the key residual's)."""
        return self.positions[0, self.positions.shape[1] - self.keys.shape[2]:]

    def keep(self, index: torch.Tensor) -> None:
        raise NotImplementedError("KIVI keeps every token (in fewer bits); it never evicts")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def full_precision_bytes(layer: KVLayer) -> int:
    """What ``layer``'s tokens would hold as dense keys and values in the cache's dtype."""
    if layer.keys is None:
        return 0
    heads, dim = layer.keys.shape[1], layer.keys.shape[3]
    return 2 * layer.get_seq_length() * heads * dim * layer.keys.element_size()


# ---------------------------------------------------------------------------------------------
# The method
# ---------------------------------------------------------------------------------------------


@dataclass
class KIVIReport(Report):
    """KIVI's bytes per layer; ``layer_budgets`` is the share of the same tokens' full-precision bytes
    a layer holds, ``overlay`` its (1, n) tokens still in full precision."""

    # per layer: bytes held, {"codes": int, "padding": int, "scales": int, "residual": int}
    bytes: list[dict[str, int] | None] | None = None
    # the bit width the cache was quantised with
    bits: int | None = None


@dataclass(eq=False)
class KIVI(KVBackend):
    name = "kivi"
    title = "KIVI"
    does = "quantises"
    paper = "https://arxiv.org/abs/2402.02750"
    summary = ("Keeps every token but stores keys and values in 2 bits (keys per channel, values per token, in "
               "groups of 32 sharing a scale); the newest tokens, up to 128, stay exact. No budget: the bits set "
               "the memory.")
    overlay_meaning = "in full precision (the rest: fewer bits)"
    bits: int = param(2, "Bits per key and value: 2 (KIVI-2, the paper's main setting), 4 (KIVI-4), 8, or 16 "
                      "(= not quantised).", 2, 16, 1)
    group_size: int = param(32, "Tokens per key group and channels per value group sharing a scale and zero "
                            "point (Sec. 4: 32).", 1, 1024, 1)
    residual: int = param(128, "Newest tokens kept in full precision; a multiple of the group size "
                          "(Sec. 4: 128).", 1, 1_000_000, 1)
    uses_budget = False
    lossless_params: ClassVar[dict] = {"bits": FULL_BITS}
    report_type: ClassVar[type[Report]] = KIVIReport

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_bits(self.bits)
        except ValueError as exc:
            raise ValueError(f"parameter 'bits': {exc}") from None
        if self.residual % self.group_size:
            raise ValueError(f"residual ({self.residual}) must be a multiple of group_size ({self.group_size}): "
                             "keys are quantised a whole number of groups at a time")

    def new_layer(self, layer_idx: int) -> KVLayer:
        if self.bits == FULL_BITS:
            return KVLayer()
        return KIVILayer(self.bits, self.group_size, self.residual)

    def after_forward(self, cache, call) -> None:
        layers = cache.layers
        report = self.report
        report.ensure_layers(len(layers), "bytes", "layer_budgets", "overlay")
        for layer in layers:
            if isinstance(layer, KIVILayer):
                layer.flush()  # after the step's attention, as the authors' code does
        for i, layer in enumerate(layers):
            full = full_precision_bytes(layer)
            report.layer_budgets[i] = layer.nbytes() / full if full else None
            if isinstance(layer, KIVILayer):
                report.bytes[i] = layer.byte_parts()
                report.overlay[i] = layer.full_precision_positions().view(1, -1)
            else:
                report.bytes[i] = {"codes": 0, "padding": 0, "scales": 0, "residual": layer.nbytes()}
                report.overlay[i] = layer.kept_positions()[:1]
        full = sum(full_precision_bytes(layer) for layer in layers)
        report.realised_fraction = sum(layer.nbytes() for layer in layers) / full if full else None
        report.bits = self.bits


__all__ = ["KIVI", "KIVILayer", "KIVIReport", "ValueCodes", "channel_group", "quantize_keys", "quantize_values"]
