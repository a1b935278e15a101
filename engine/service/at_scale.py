"""What a measured KV fraction means on real architectures: arithmetic on the configs shipped in
``engine/runtime/configs/``, computed, never measured (issue #17's "what this means at real scale").

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
class Architecture:
    name: str
    model_type: str
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES


def architecture(name: str, config: dict) -> Architecture:
    """A hub config (its ``text_config`` when it has one) -> the figures the KV size depends on."""
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return Architecture(name, config.get("model_type", ""), text["num_hidden_layers"],
                        text.get("num_key_value_heads") or heads, head_dim)


@lru_cache(maxsize=1)
def architectures() -> tuple[Architecture, ...]:
    """Every shipped config, by hub name (``Qwen__Qwen2-VL-2B-Instruct.json`` -> ``Qwen/Qwen2-VL-2B-Instruct``)."""
    return tuple(architecture(p.stem.replace("__", "/"), json.loads(p.read_text()))
                 for p in sorted(CONFIG_DIR.glob("*.json")))


def project(arch: Architecture, kept_fraction: float, prompt_tokens: int, memory_bytes: int = 16 * 2**30) -> dict:
    """This prompt's KV bytes on ``arch`` with the full cache and with the method, and how many tokens
    (and 448 px video frames, where the family has a fixed count) fit in ``memory_bytes`` of KV."""
    full_tokens = memory_bytes // arch.bytes_per_token
    method_tokens = int(full_tokens / kept_fraction) if kept_fraction > 0 else None
    frame = FRAME_TOKENS.get(arch.model_type)
    return {"name": arch.name, "bytes_per_token": arch.bytes_per_token,
            "prompt_full_bytes": prompt_tokens * arch.bytes_per_token,
            "prompt_method_bytes": prompt_tokens * arch.bytes_per_token * kept_fraction,
            "fit_full_tokens": full_tokens, "fit_method_tokens": method_tokens,
            "fit_full_frames": full_tokens // frame if frame else None,
            "fit_method_frames": method_tokens // frame if frame and method_tokens else None}
