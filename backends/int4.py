"""INT4 (vLLM's ``--kv-cache-dtype int4_per_token_head``): every key and value vector of one token in
one KV head is rotated, then stored as 4-bit integers, two to a byte, with a scale and a zero point of
its own. vLLM's study puts it at about three times the KV capacity for 1-4 points of accuracy.

Read from vLLM's ``vllm/v1/attention/ops/int4_per_token_head.py`` (the write kernel
``_reshape_cache_int4_kernel`` and ``single_rht``); written here from its rules:

* Rotation: a randomized Hadamard transform first (a fixed +-1 sign per channel, then the Walsh-Hadamard
  transform), which spreads an outlier channel over the whole vector before it is quantised; vLLM
  rotates the query too and the output back, the same as decoding the keys and values back through
  the inverse rotation, which is what is done here. Ours is orthonormal (H / sqrt(D)) and its signs
  are our own fixed draw (seed 0). Only a power-of-two head size is rotated (vLLM requires one); any
  other is quantised as it is.
* Asymmetric, per vector: s = max((max - min) / 15, 1e-6); zero point z = round(-min / s) clamped to
  [0, 15]; code = round(x / s + z) clamped to [0, 15], rounding half away from zero (the kernel's
  +-0.5 then truncate); decoded: (code - z) x s.
* Where ours differs: vLLM hides the 4-bit zero point in the low mantissa bits of a float32 scale (4
  bytes a vector); here the scale is stored in the cache's dtype, rounded up (as :mod:`backends.quant`
  stores every scale), and the zero point in a byte of its own: 3 bytes a vector in bfloat16.
* When: written, then read (:mod:`backends.token_quant`), as vLLM's Triton attention reads the cache.
* Bytes held = half a byte an element + scale + zero point per token, KV head and key or value:
  (D / 2 + 3) / 2D of a bfloat16 cache (0.26 at D = 128, 0.30 at the offline model's D = 32).

No budget: it keeps every token; its knob is the format (``none``: not quantised, ``lossless_params``).
Stacked behind a method that chooses tokens (``snapkv+int4``, :mod:`backends.stack`) it codes what
that method keeps. Report (:class:`TokenQuantReport`): per layer ``bytes`` and ``layer_budgets``;
``realised_fraction`` over all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .params import param
from .quant import pack, round_outward, unpack_float
from .token_quant import TokenQuantStore

LEVELS = 15  # codes 0..15
MIN_SCALE = 1e-6  # vLLM's floor: a constant vector still gets a usable scale
SIGN_SEED = 0


@lru_cache(maxsize=8)
def hadamard(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal (dim, dim) Walsh-Hadamard matrix (Sylvester's construction), float32, built
    once per device (not copied there at every call)."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / dim ** 0.5).to(device)


@lru_cache(maxsize=8)
def signs(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation's fixed +-1 per channel (float32, dim)."""
    draw = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(SIGN_SEED))
    return (draw.float() * 2 - 1).to(device)


def rotates(dim: int) -> bool:
    return dim > 1 and dim & (dim - 1) == 0


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H (signs * x) along the last dim (float32)."""
    dim = x.shape[-1]
    return (x * signs(dim, x.device)) @ hadamard(dim, x.device)  # H is symmetric


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate`: signs * (H y)."""
    dim = y.shape[-1]
    return (y @ hadamard(dim, y.device)) * signs(dim, y.device)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


class Int4Codec:
    """Per token and head: packed 4-bit codes, a scale (cache dtype) and a zero point (uint8)."""

    def __init__(self, rotated: bool = True) -> None:
        self.rotated = rotated
        self.head_dim = 0

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.head_dim = x.shape[-1]
        y = rotate(x.float()) if self.rotating else x.float()
        low, high = y.amin(dim=-1, keepdim=True), y.amax(dim=-1, keepdim=True)
        scale = round_outward(((high - low) / LEVELS).clamp_min(MIN_SCALE), x.dtype, down=False)
        s = scale.float()
        zero = round_half_away(-low / s).clamp_(0, LEVELS)
        codes = round_half_away(y / s + zero).clamp_(0, LEVELS)
        return {"codes": pack(codes, 4), "scale": scale, "zero": zero.to(torch.uint8)}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_float(parts["codes"], 4, self.head_dim)
        y = (codes - parts["zero"].float()) * parts["scale"].float()
        return (unrotate(y) if self.rotating else y).to(dtype)

    @property
    def rotating(self) -> bool:
        return self.rotated and rotates(self.head_dim)


@dataclass(eq=False)
class INT4(TokenQuantStore):
    name = "int4"
    title = "INT4 (vLLM)"
    summary = ("Keeps every token but stores each key and value vector, rotated, as 4-bit integers with a scale and "
               "zero point per token and KV head, as vLLM's int4_per_token_head cache: about a quarter of the bytes. "
               "No budget: the format sets the memory.")
    format: str = param("int4", "The cache's format: int4 (vLLM's int4_per_token_head), or none (= not quantised).",
                        choices=("int4", "none"))
    rotate: bool = param(True, "Rotate each vector (a randomized Hadamard transform) before quantising, as vLLM does; "
                         "only a power-of-two head size is rotated.")

    def codec(self) -> Int4Codec:
        return Int4Codec(self.rotate)


__all__ = ["INT4", "Int4Codec", "hadamard", "rotate", "unrotate"]
