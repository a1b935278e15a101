"""Low-bit KV storage: asymmetric integer quantisation with one scale and zero point per group,
codes bit-packed into ``uint8`` (four 2-bit or two 4-bit codes per byte), and the exact byte count.

Keys are quantised per channel (one scale per head and channel over the tokens of a set), values
per token (one scale per head and token over its channels): the split ZipCache and KIVI use,
because key outliers sit in fixed channels while values have none (ZipVL Sec. 4.2 / 5.1 defers to
ZipCache, He et al. 2024b, for the scheme).

Why not optimum-quanto or HQQ (transformers' ``QuantizedCache`` backends; both install here,
0.2.7 and 0.2.8.post1)? They quantise a whole tensor at one bit width with fixed-size groups along
one axis: quanto's groups must divide the axis and HQQ's optimiser is built for weights. ZipVL
needs two bit widths chosen per token, and per-channel key scales over token sets whose size
changes per layer and per turn; using them would mean padding each set to a group multiple and
counting their private buffers. The packing itself is a few shifts, so it is written here and the
project gains no dependency.

Scales and zero points are stored in the cache's dtype, rounded outward (scale up, zero point
down) so that every value stays inside the representable range: the error bound
``|x - x_hat| <= scale / 2`` holds with the stored scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACKED_BITS = (2, 4, 8)
FULL_BITS = 16  # "quantisation off": the tensor is kept as it is


def check_bits(bits: int) -> int:
    if bits not in PACKED_BITS + (FULL_BITS,):
        raise ValueError(f"bit width must be one of {', '.join(map(str, PACKED_BITS + (FULL_BITS,)))}; got {bits}")
    return bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes in [0, 2^bits) along the last dim -> uint8, 8 // bits codes per byte.

    Plane-major: with m bytes per row, byte b holds codes b, b + m, b + 2m... (low bits first), so
    unpacking is one shift per plane and the planes side by side are the codes in order: a decode
    step reads codes without a gather or an interleave."""
    per_byte = 8 // bits
    n = codes.shape[-1]
    pad = (-n) % per_byte
    codes = codes.to(torch.uint8)
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
    planes = codes.view(*codes.shape[:-1], per_byte, -1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)[:, None]
    return (planes << shifts).sum(dim=-2, dtype=torch.uint8)  # disjoint bits: the sum is an OR


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes of the last dim, as uint8."""
    if bits == 8:
        return packed[..., :n]
    mask = (1 << bits) - 1
    return torch.cat([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)[..., :n]


def unpack_float(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`unpack` straight into float32 (..., n): each plane is shifted, masked and written into
    its slice of the result, with no uint8 copy of the whole unpacked tensor."""
    out = torch.empty(*packed.shape[:-1], n, dtype=torch.float32, device=packed.device)
    width, mask = packed.shape[-1], (1 << bits) - 1
    for start, shift in zip(range(0, n, width), range(0, 8, bits)):
        stop = min(n, start + width)
        out[..., start:stop].copy_(((packed >> shift) & mask)[..., : stop - start])
    return out


@dataclass
class QuantTensor:
    """A tensor held as packed codes + per-group scale and zero point (or dense at 16 bits)."""

    shape: tuple[int, ...]
    bits: int
    dtype: torch.dtype
    codes: torch.Tensor | None = None  # uint8, last dim packed
    scale: torch.Tensor | None = None  # broadcastable to ``shape``, in ``dtype``
    zero: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # bits == 16 only

    def dequantize(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        codes = unpack(self.codes, self.bits, self.shape[-1]).float()
        return (codes * self.scale.float() + self.zero.float()).to(self.dtype)

    def key_scores(self, query: torch.Tensor) -> torch.Tensor:
        """Scores of a grouped query (H_kv, G, D) against these keys (1, H_kv, n, D), float32
        (H_kv, G, n), read from the codes: with one scale and zero per channel,
        q . k_hat = (q * scale) . codes + q . zero, so no dequantised key is built."""
        if self.dense is not None:
            return torch.matmul(query, self.dense[0].float().transpose(-1, -2))
        assert self.scale.shape[2] == 1, "per-channel scales (keys) expected"
        codes = unpack(self.codes, self.bits, self.shape[-1])[0].float()
        scale, zero = self.scale[0].float(), self.zero[0].float()  # (H_kv, 1, D)
        return torch.matmul(query * scale, codes.transpose(-1, -2)) + (query * zero).sum(-1, keepdim=True)

    def value_mix(self, probs: torch.Tensor) -> torch.Tensor:
        """probs (H_kv, G, n) @ these values (1, H_kv, n, D), float32 (H_kv, G, D), from the codes:
        with one scale and zero per token, p @ v_hat = (p * scale) @ codes + p . zero."""
        if self.dense is not None:
            return torch.matmul(probs, self.dense[0].float())
        assert self.scale.shape[3] == 1, "per-token scales (values) expected"
        codes = unpack(self.codes, self.bits, self.shape[-1])[0].float()
        scale, zero = self.scale[0, :, None, :, 0].float(), self.zero[0, :, None, :, 0].float()  # (H_kv, 1, n)
        return torch.matmul(probs * scale, codes) + (probs * zero).sum(-1, keepdim=True)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero, self.dense) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def quantize(x: torch.Tensor, bits: int, reduce_dim: int) -> QuantTensor:
    """Asymmetric ``bits``-bit quantisation with one (scale, zero) per slice along ``reduce_dim``
    (keys (1, H, S, D): ``reduce_dim=2`` -> per channel; values: ``reduce_dim=3`` -> per token)."""
    check_bits(bits)
    shape, dtype = tuple(x.shape), x.dtype
    if bits == FULL_BITS or x.numel() == 0:
        return QuantTensor(shape, FULL_BITS, dtype, dense=x.clone())
    xf = x.float()
    levels = (1 << bits) - 1
    low, high = xf.amin(dim=reduce_dim, keepdim=True), xf.amax(dim=reduce_dim, keepdim=True)
    zero = round_outward(low, dtype, down=True)
    scale = round_outward(((high - zero.float()) / levels).clamp_min(torch.finfo(dtype).tiny * levels), dtype, down=False)
    codes = ((xf - zero.float()) / scale.float()).round().clamp_(0, levels)
    return QuantTensor(shape, bits, dtype, codes=pack(codes, bits), scale=scale, zero=zero)


def round_outward(value: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """``value`` (float32) in ``dtype``, rounded toward -inf (``down``) or +inf, so the stored range
    still covers every value."""
    stored = value.to(dtype)
    outside = stored.float() > value if down else stored.float() < value
    if outside.any():
        target = torch.full_like(stored, float("-inf") if down else float("inf"))
        stored = torch.where(outside, torch.nextafter(stored, target), stored)
    return stored
