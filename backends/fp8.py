"""FP8 (vLLM's ``--kv-cache-dtype fp8_per_token_head``): every key and value vector of one token in
one KV head is stored as 8-bit floats, OCP E4M3 (``float8_e4m3fn``: 4 exponent bits, 3 mantissa
bits, largest finite 448), with one scale of its own. What a serving engine ships: vLLM's study finds
fp8 about doubles the KV capacity at almost no accuracy cost.

* Scale (vLLM's dynamic per-token write kernel, ``_reshape_cache_per_token`` in
  ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``, its quantisation range 448 for E4M3;
  fp8_per_token_head takes the maximum per KV head): s = max(amax / 448, 1e-6), amax the vector's
  largest magnitude; the code is x / s clamped to [-448, 448] and cast to E4M3 (round to nearest,
  ties to even: torch's cast, as Triton's store). Decoded: code x s.
* Where ours differs: vLLM keeps the scale in float32 (4 bytes a vector); here it is stored in the
  cache's dtype, rounded up (so no |x| / s exceeds 448), as every quantising method here stores its
  scales (:mod:`backends.quant`): 2 bytes a vector in bfloat16, 130 bytes instead of 132 for a
  128-wide head. On a float32 cache (the CPU) the scale is float32, as vLLM's.
* When: written, then read (:mod:`backends.token_quant`): a prefill's queries attend over the coded
  cache, their own tokens included, as vLLM's Triton attention reads its paged cache.
* Bytes held = 1 byte an element + one scale per token, KV head and key or value: (D + 2) / 2D of a
  bfloat16 cache (0.51 at D = 128, 0.53 at the offline model's D = 32), (D + 4) / 4D of a float32 one.

No budget: it keeps every token; its knob is the format (``none`` keeps the cache in its own dtype:
``lossless_params``). Stacked behind a method that chooses tokens (``snapkv+fp8``,
:mod:`backends.stack`) it codes what that method keeps. Report (:class:`TokenQuantReport`): per
layer ``bytes`` (codes, scales) and ``layer_budgets``; ``realised_fraction`` over all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import param
from .quant import round_outward
from .token_quant import TokenQuantStore

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1e-6  # vLLM's floor: an all-zero vector still gets a usable scale


class E4M3Codec:
    """Per token and head: one scale, D E4M3 codes held as their bytes (uint8)."""

    head_dim = 0

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.head_dim = x.shape[-1]
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = round_outward((amax / E4M3_MAX).clamp_min(MIN_SCALE), x.dtype, down=False)
        codes = (xf / scale.float()).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"codes": codes.view(torch.uint8), "scale": scale}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        values = parts["codes"].view(torch.float8_e4m3fn).float()
        return (values * parts["scale"].float()).to(dtype)


@dataclass(eq=False)
class FP8(TokenQuantStore):
    name = "fp8"
    title = "FP8 (vLLM)"
    summary = ("Keeps every token but stores each key and value vector as 8-bit floats (E4M3) with one scale per "
               "token and KV head, as vLLM's fp8_per_token_head cache: about half the bytes. No budget: the format "
               "sets the memory.")
    format: str = param("e4m3", "The cache's format: e4m3 (8-bit floats, vLLM's fp8), or none (= not quantised).",
                        choices=("e4m3", "none"))

    def codec(self) -> E4M3Codec:
        return E4M3Codec()


__all__ = ["E4M3Codec", "FP8"]
