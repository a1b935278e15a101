"""Room on a card: what fits beside a model's weights, as plain arithmetic (no torch), shared by the
capacity benchmark (:mod:`kv_arena.bench.capacity`, which measures each method's bytes per token)
and the app's computed lines (:mod:`kv_arena.service.capacity`), so the two say the same.

Memory is counted in GiB (2**30 bytes), as cards are labelled: an "80 GB" A100 shows 81,920 MiB to
CUDA. The "24 GB" A10G and L4 show about 22.5 GiB (23,028 MiB on an A10G: ECC keeps the rest), so
their figures here are the label's, a little above what a program gets.

Room for the KV cache = memory - the weights - a reserve (``RESERVE_GIB``, 1 GiB): the CUDA context,
the kernels' workspaces and a decode step's activations. A long prefill that is not run in chunks
needs more for its activations; the benchmark takes another reserve (``--reserve-gb``).

vLLM's figures (:func:`vllm_kv`) beside ours, in its own words: at start-up vLLM logs "GPU KV cache
size: N tokens" and "Maximum concurrency for L tokens per request: C x". It gives the cache
``gpu_memory_utilization`` (0.92 by default, vllm/config/cache.py) of the card's memory, less the
weights, the activation peak of a profiled forward pass and memory outside torch, in blocks of 16
tokens (``CacheConfig.DEFAULT_BLOCK_SIZE``); N is the blocks times 16, C is N over L (L: the model's
maximum length, ``max_model_len``). The profiled peak is not measured here: :func:`profiled_peak`
approximates it (one chunk of 8,192 tokens through a decoder layer's widest activations, and the
sampler's float32 logits for 256 sequences), and memory outside torch is the same reserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
RESERVE_GIB = 1.0
QUANTIZED_BYTES = {"8bit": 1.0, "4bit": 0.5}  # bytes a weight at bitsandbytes' widths (norms etc. aside)


@dataclass(frozen=True)
class Card:
    """A GPU by its name and the memory it is sold with."""

    name: str
    memory_gib: float
    visible_gib: float | None = None  # what CUDA shows of it, where measured (ECC keeps the rest)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.memory_gib:g} GB)"


# the Space's suggested card first (README: a10g-small), then the others Spaces offer (ZeroGPU: half
# an RTX Pro 6000; H100 is no longer offered)
CARDS = (Card("A10G", 24, visible_gib=23_028 / 1024), Card("T4", 16), Card("L4", 24), Card("L40S", 48), Card("ZeroGPU", 48),
         Card("RTX Pro 6000", 96), Card("A100", 80))
SPACE_CARD = CARDS[0]


def card(name: str) -> Card | None:
    """The card called ``name`` (case and spaces aside), or None."""
    key = name.replace(" ", "").lower()
    return next((c for c in CARDS if c.name.replace(" ", "").lower() == key), None)


def room(memory_bytes: float, weight_bytes: float, reserve_bytes: float = RESERVE_GIB * GIB) -> int:
    """Bytes left for the KV cache; ValueError (a sentence) when the weights and the reserve take it all."""
    if memory_bytes <= 0:
        raise ValueError(f"the memory must be positive, got {memory_bytes / GIB:g} GiB")
    if reserve_bytes < 0:
        raise ValueError(f"the reserve cannot be negative, got {reserve_bytes / GIB:g} GiB")
    left = int(memory_bytes - weight_bytes - reserve_bytes)
    if left <= 0:
        raise ValueError(f"{memory_bytes / GIB:g} GiB holds no cache: the weights take {weight_bytes / GIB:.2f} GiB "
                         f"and the reserve {reserve_bytes / GIB:g} GiB")
    return left


def fits(room_bytes: int, item_bytes: float) -> int | None:
    """Whole items of ``item_bytes`` in ``room_bytes``; None: unbounded (an item that holds nothing)."""
    return int(room_bytes // item_bytes) if item_bytes > 0 else None


def weight_bytes(parameters: int, dtype_bytes: int, quantization: str | None = None) -> int:
    """Every parameter at the dtype's width, or at 8 or 4 bits (a lower bound: bitsandbytes keeps
    norms, biases and by default the LM head in 16 bits)."""
    if quantization is None:
        return parameters * dtype_bytes
    if quantization not in QUANTIZED_BYTES:
        raise ValueError(f"quantization must be 8bit or 4bit, got '{quantization}'")
    return int(parameters * QUANTIZED_BYTES[quantization])


@dataclass(frozen=True)
class MediaTokens:
    """A model's visual tokens for a picture and for a video's frames at given sizes."""

    picture: int  # tokens of one picture
    frame_group: int  # tokens of one group of frames (Qwen-VL: a temporal patch of 2 frames)
    frames_per_group: int
    note: str = ""  # where the count is a floor (tiled pictures)

    @property
    def per_frame(self) -> float:
        return self.frame_group / self.frames_per_group


def parse_size(text: str, flag: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` in pixels -> (width, height); ValueError (a sentence) otherwise."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{flag} expects WIDTHxHEIGHT in pixels, e.g. 1280x720; got '{text}'") from None
    if width < 1 or height < 1:
        raise ValueError(f"{flag} needs a positive width and height, got '{text}'")
    return width, height


def media_tokens(config, picture: tuple[int, int], frame: tuple[int, int]) -> MediaTokens:
    """Visual tokens of a ``picture`` and of the frames of a video at ``frame`` (width, height), from
    ``config``'s vision settings. Qwen-VL: the processor's rounding of each side to patch x merge
    pixels (``smart_resize``; 448x448 and 1280x720 lie between its min and max pixels), one token
    per merged patch, a temporal patch of frames per group (448x448: 256 tokens a pair of frames).
    LLaVA: one base-resolution view, (image size / patch)^2 tokens whatever the size (LLaVA-NeXT
    and OneVision tile a larger picture into more: a floor, said in ``note``)."""
    vision = config.vision_config
    merge = getattr(vision, "spatial_merge_size", None)
    if merge:
        factor = vision.patch_size * merge

        def tokens(size: tuple[int, int]) -> int:
            return max(1, round(size[0] / factor)) * max(1, round(size[1] / factor))

        return MediaTokens(tokens(picture), tokens(frame), vision.temporal_patch_size)
    view = (vision.image_size // vision.patch_size) ** 2
    tiled = config.model_type in ("llava_next", "llava_onevision")
    return MediaTokens(view, view, 1, "a floor: larger pictures are tiled into more tokens" if tiled else "")


VLLM_UTILIZATION = 0.92  # vllm/config/cache.py: gpu_memory_utilization's default
VLLM_BLOCK = 16  # CacheConfig.DEFAULT_BLOCK_SIZE: tokens a cache block holds
VLLM_CHUNK = 8192  # tokens of the forward pass vLLM profiles (max_num_batched_tokens)
VLLM_SEQS = 256  # max_num_seqs: the sampler's logits are profiled for as many sequences


def profiled_peak(text_config, dtype_bytes: int) -> int:
    """Approximately the activation peak of vLLM's profile run: :data:`VLLM_CHUNK` tokens through a
    decoder layer's widest moment (residual, norm and attention's four hidden-wide tensors; the MLP's
    gate, up and product, intermediate-wide) at the dtype's width, and float32 logits of
    :data:`VLLM_SEQS` sequences. An approximation: vLLM measures it (and, for a vision model, the
    vision encoder's profile too, which is not counted here)."""
    hidden, inner = text_config.hidden_size, text_config.intermediate_size
    return VLLM_CHUNK * (4 * hidden + 3 * inner) * dtype_bytes + VLLM_SEQS * text_config.vocab_size * 4


@dataclass(frozen=True)
class VllmKV:
    """What vLLM would log for a cache of ``bytes_per_token`` on a card."""

    available_bytes: int  # utilization x memory - weights - profiled peak - reserve
    tokens: int  # "GPU KV cache size: N tokens": whole blocks of 16
    concurrency: float  # "Maximum concurrency for L tokens per request: C x"


def vllm_kv(memory_bytes: float, weight_bytes: float, peak_bytes: float, reserve_bytes: float,
            bytes_per_token: float, max_len: int, utilization: float = VLLM_UTILIZATION) -> VllmKV:
    """vLLM's KV cache size and concurrency (see the module's docstring); ValueError (a sentence) when
    nothing is left for the cache."""
    available = int(memory_bytes * utilization - weight_bytes - peak_bytes - reserve_bytes)
    if available <= 0:
        raise ValueError(f"vLLM would find no room for the cache: {utilization:g} x {memory_bytes / GIB:g} GiB less "
                         f"the weights ({weight_bytes / GIB:.2f} GiB), a profiled peak ({peak_bytes / GIB:.2f} GiB) "
                         f"and the reserve ({reserve_bytes / GIB:g} GiB)")
    blocks = int(available // (bytes_per_token * VLLM_BLOCK))
    return VllmKV(available, blocks * VLLM_BLOCK, blocks / math.ceil(max_len / VLLM_BLOCK))
