"""Room on a card: what fits beside a model's weights, as plain arithmetic (no torch), shared by the
capacity benchmark (:mod:`kv_arena.bench.capacity`, which measures each method's bytes per token)
and the app's computed lines (:mod:`kv_arena.service.capacity`), so the two say the same.

Memory is counted in GiB (2**30 bytes), as cards are labelled: an "80 GB" A100 shows 81,920 MiB to
CUDA. The "24 GB" A10G and L4 show about 22.5 GiB (23,028 MiB on an A10G: ECC keeps the rest), so
their figures here are the label's, a little above what a program gets.

Room for the KV cache = memory - the weights - a reserve (``RESERVE_GIB``, 1 GiB): the CUDA context,
the kernels' workspaces and a decode step's activations. A long prefill that is not run in chunks
needs more for its activations; the benchmark takes another reserve (``--reserve-gb``).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
RESERVE_GIB = 1.0
QUANTIZED_BYTES = {"8bit": 1.0, "4bit": 0.5}  # bytes a weight at bitsandbytes' widths (norms etc. aside)


@dataclass(frozen=True)
class Card:
    """A GPU by its name and the memory it is sold with."""

    name: str
    memory_gib: float

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.memory_gib:g} GB)"


# the Space's suggested card first (README: a10g-small), then the ones docs/gpu.md's table names
CARDS = (Card("A10G", 24), Card("L4", 24), Card("A100", 80), Card("H100", 80))
SPACE_CARD = CARDS[0]


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
