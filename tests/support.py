"""What tests build their inputs with: the offline tiny models' names, seeded synthetic media, one
chat turn under a method, and the hand-made layers and attention calls the methods' unit tests feed."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backends.base import AttentionCall, KVLayer
from backends.layout import PromptLayout
from kv_arena.media import Video
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.testing import sample_image

TINY_MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-llava"]


def make_image(seed: int = 0, size=(448, 448)) -> Image.Image:
    return sample_image(seed, tuple(size))  # the noise picture kv_arena.testing's checks use


def make_video(seed: int = 0, frames: int = 4, size: int = 224) -> Video:
    rng = np.random.RandomState(seed)
    data = (rng.rand(frames, size, size, 3) * 255).astype("uint8")
    return Video(frames=data, timestamps=[i * 0.5 for i in range(frames)], fps=2.0)


def answer(loaded, backend, message: Message, max_new_tokens: int = 16):
    """Run one turn with ``backend``; returns (update, conversation)."""
    conv = Conversation(loaded, backend)
    return conv.ask(message, max_new_tokens=max_new_tokens), conv


def fill_layer(layer: KVLayer, tokens: int, heads: int = 2, dim: int = 4, seed: int = 0) -> KVLayer:
    """``layer`` holding ``tokens`` seeded random keys and values at positions 0..tokens-1."""
    g = torch.Generator().manual_seed(seed)
    layer.append(torch.randn(1, heads, tokens, dim, generator=g), torch.randn(1, heads, tokens, dim, generator=g),
                 torch.arange(tokens))
    return layer


def random_layer(tokens: int, heads: int = 2, dim: int = 8, seed: int = 0) -> KVLayer:
    return fill_layer(KVLayer(), tokens, heads, dim, seed)


def attention_call(phase: str, seen: int, q: int, layer_idx: int = 0, num_layers: int = 1,
                   layout: PromptLayout | None = None) -> AttentionCall:
    """The runtime's description of one layer's attention: ``q`` new tokens, ``seen`` in all."""
    positions = torch.arange(seen - q, seen)
    return AttentionCall(layer_idx=layer_idx, num_layers=num_layers, phase=phase, positions=positions,
                         rope_ids=positions[None], layout=layout, seen=seen, step=0)


def prefill_call(tokens: int, layer_idx: int = 0, num_layers: int = 1, layout: PromptLayout | None = None):
    return attention_call("prefill", tokens, tokens, layer_idx, num_layers, layout)


def causal_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """The whole (H, T, T) causal softmax, as a test reference only."""
    k = key[0].repeat_interleave(query.shape[1] // key.shape[1], dim=0)
    scores = query[0] @ k.transpose(-1, -2) * scaling
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def write_mjpeg_avi(path, frames: list[Image.Image], seconds_per_frame: int) -> None:
    """A Motion-JPEG AVI of ``frames``, each shown ``seconds_per_frame`` seconds (RIFF by hand:
    no video encoder is needed, and a long video stays a few kilobytes)."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return tag + struct.pack("<I", len(data)) + data + b"\0" * (len(data) % 2)

    jpegs = []
    for frame in frames:
        buffer = io.BytesIO()
        frame.save(buffer, "JPEG")
        jpegs.append(buffer.getvalue())
    (w, h), n = frames[0].size, len(jpegs)
    avih = struct.pack("<14I", seconds_per_frame * 10**6, 0, 0, 0x10, n, 0, 1, 0, w, h, 0, 0, 0, 0)
    strh = struct.pack("<4s4sIHHIIIIIIIIhhhh", b"vids", b"MJPG", 0, 0, 0, 0, seconds_per_frame, 1, 0, n, 0,
                       0xFFFFFFFF, 0, 0, 0, w, h)  # rate / scale = 1 / seconds_per_frame frames per second
    strf = struct.pack("<IiiHH4sIiiII", 40, w, h, 1, 24, b"MJPG", w * h * 3, 0, 0, 0, 0)
    strl = chunk(b"LIST", b"strl" + chunk(b"strh", strh) + chunk(b"strf", strf))
    header = chunk(b"LIST", b"hdrl" + chunk(b"avih", avih) + strl)
    movi = chunk(b"LIST", b"movi" + b"".join(chunk(b"00dc", j) for j in jpegs))
    index, offset = b"", 4
    for j in jpegs:
        index += struct.pack("<4sIII", b"00dc", 0x10, offset, len(j))
        offset += 8 + len(j) + len(j) % 2
    body = b"AVI " + header + movi + chunk(b"idx1", index)
    Path(path).write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def training_module(name: str):
    """training/<name>.py (the training scripts are a package, run as ``python -m training.<name>``)."""
    import importlib

    return importlib.import_module(f"training.{name}")
