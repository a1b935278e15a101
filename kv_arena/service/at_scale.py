"""What a measured KV fraction means on real architectures: arithmetic on the configs shipped in
``kv_arena/runtime/configs/``, computed, never measured.

A token costs ``2 (key and value) x layers x KV heads x head dim x bytes per number`` of cache in
every layer of a dense decoder; a method that holds a fraction f of the full cache's bytes holds f
times that per token, so a fixed amount of KV memory fits 1/f times as many tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from ..runtime.models import CONFIG_DIR

DTYPE_BYTES = 2  # bf16 / fp16, as these checkpoints are served
# visual tokens of one 448 x 448 video frame: Qwen-VL merges 2x2 patches of 14 px (Qwen3-VL: 16 px) and pairs of frames
FRAME_TOKENS = {"qwen2_vl": 128, "qwen2_5_vl": 128, "qwen3_vl": 98, "qwen3_vl_moe": 98, "llava": 576, "llava_next": 576,
                "llava_onevision": 196}


@dataclass(frozen=True)
class Hardware:
    """A GPU at its datasheet's peak rates (dense bf16), which real kernels approach but do not reach."""

    name: str
    bandwidth: float  # bytes/s of memory
    flops: float  # FLOP/s, dense bf16


A100 = Hardware("an A100 80GB", 2.039e12, 312e12)  # NVIDIA A100 datasheet (SXM)


@dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int = 0
    intermediate: int = 0
    vocab: int = 0
    heads: int = 0
    context: int = 0  # max_position_embeddings: the tokens one conversation can reach

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES

    @property
    def decoder_params(self) -> int:
        """Weights of the language model: attention (q, k, v, o), gated MLP, embeddings and head."""
        attention = self.hidden * (2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim)
        return self.layers * (attention + 3 * self.hidden * self.intermediate) + 2 * self.vocab * self.hidden


def architecture(name: str, config: dict) -> Architecture:
    """A hub config (its ``text_config`` when it has one) -> the figures the KV size depends on."""
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return Architecture(name, config.get("model_type", ""), text["num_hidden_layers"],
                        text.get("num_key_value_heads") or heads, head_dim, text["hidden_size"],
                        text.get("intermediate_size", 4 * text["hidden_size"]), text.get("vocab_size", 0), heads,
                        text.get("max_position_embeddings") or config.get("max_position_embeddings") or 0)


@lru_cache(maxsize=1)
def architectures() -> tuple[Architecture, ...]:
    """Every shipped config, by hub name (``Qwen__Qwen2-VL-2B-Instruct.json`` -> ``Qwen/Qwen2-VL-2B-Instruct``)."""
    return tuple(architecture(p.stem.replace("__", "/"), json.loads(p.read_text()))
                 for p in sorted(CONFIG_DIR.glob("*.json")))


@dataclass(frozen=True)
class Projection:
    """A prompt's KV bytes on an architecture, full cache and method, and what fits in a memory."""

    name: str
    bytes_per_token: int
    prompt_full_bytes: int
    prompt_method_bytes: float
    fit_full_tokens: int
    fit_method_tokens: int | None  # None: unbounded (the method holds nothing)
    fit_full_frames: int | None  # None: the family has no fixed count of tokens per frame
    fit_method_frames: int | None


def project(arch: Architecture, kept_fraction: float, prompt_tokens: int,
            memory_bytes: int = 16 * 2**30) -> Projection:
    """This prompt's KV bytes on ``arch`` with the full cache and with the method, and how many tokens
    (and 448 px video frames, where the family has a fixed count) fit in ``memory_bytes`` of KV."""
    full_tokens = memory_bytes // arch.bytes_per_token
    method_tokens = int(full_tokens / kept_fraction) if kept_fraction > 0 else None
    frame = FRAME_TOKENS.get(arch.model_type)
    return Projection(arch.name, arch.bytes_per_token, prompt_tokens * arch.bytes_per_token,
                      prompt_tokens * arch.bytes_per_token * kept_fraction, full_tokens, method_tokens,
                      full_tokens // frame if frame else None,
                      method_tokens // frame if frame and method_tokens else None)


@dataclass(frozen=True)
class SpeedAtScale:
    """Time to first token and one decode step on a GPU at peak rates (computed, not measured)."""

    name: str
    hardware: str
    ttft_s: float
    step_full_s: float
    step_method_s: float
    weight_bytes: int
    kv_full_bytes: int


def speed(arch: Architecture, kept_fraction: float, prompt_tokens: int, hardware: Hardware = A100) -> SpeedAtScale:
    """Time to first token and one decode step on ``hardware`` at peak rates, full cache and a
    method holding ``kept_fraction`` of its bytes (computed, not measured). The prefill is compute
    bound: 2 FLOPs per weight per token plus attention's 4 x layers x tokens^2 x heads x head dim;
    the methods compress after it (or alongside it), so it is the same for both. A batch-1 decode
    step is memory bound: it reads every weight and the whole cache once."""
    weights = arch.decoder_params * DTYPE_BYTES
    kv_full = prompt_tokens * arch.bytes_per_token
    flops = 2 * arch.decoder_params * prompt_tokens + 4 * arch.layers * prompt_tokens**2 * arch.heads * arch.head_dim
    return SpeedAtScale(arch.name, hardware.name, flops / hardware.flops, (weights + kv_full) / hardware.bandwidth,
                        (weights + kv_full * kept_fraction) / hardware.bandwidth, weights, kv_full)
