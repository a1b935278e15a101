"""What a measured KV fraction buys a user in room, in their words: on the Space's card (an A10G,
24 GB) beside the weights of the model it serves there (Qwen2-VL-2B in bf16), how many frames of
this video (else pictures like this one, else tokens) the method's cache holds against the full
cache's. Computed, not measured: the full cache's bytes per token from the shipped config
(:mod:`.at_scale`), the method's as the fraction of them it held here, the room as
:mod:`kv_arena.runtime.capacity` (and so ``--mode capacity``, whose measured table is docs/gpu.md's) reckons it.
"""

from __future__ import annotations

from ..runtime import capacity
from ..runtime.models import parameter_count
from .at_scale import DTYPE_BYTES, architectures
from .view_types import KeptVisual

ARCHITECTURE = "Qwen/Qwen2-VL-2B-Instruct"  # what the app serves on a GPU (model_picker.HUB_DEFAULT)


def room_sentence(full_bytes_per_token: float, fractions: dict[str, float], weight_bytes: int,
                  tokens_per_frame: float | None = None, tokens_per_picture: float | None = None,
                  card: capacity.Card = capacity.SPACE_CARD, model: str = "",
                  reserve_bytes: float = capacity.RESERVE_GIB * capacity.GIB, context: int = 0) -> str:
    """Markdown: what ``card`` holds beside ``weight_bytes`` with each method (name -> fraction of
    the full cache's bytes it held) and with the full cache, in frames of this video at
    ``tokens_per_frame``, else pictures at ``tokens_per_picture``, else tokens. Pure arithmetic.
    Where the full cache already holds more than one conversation reaches (``context`` tokens, the
    model's positions), the room is said to be for several conversations at once: one user's chat
    gains no room from a smaller cache there."""
    room = capacity.room(card.memory_bytes, weight_bytes, reserve_bytes)
    per_item, what = ((tokens_per_frame, f"frames of this video ({tokens_per_frame:g} tokens a frame, as here)")
                      if tokens_per_frame else
                      (tokens_per_picture, f"pictures like this one ({tokens_per_picture:g} tokens each, as here)")
                      if tokens_per_picture else (1, "tokens"))
    full = capacity.fits(room, full_bytes_per_token * per_item)

    def held(fraction: float) -> str:
        n = capacity.fits(room, full_bytes_per_token * fraction * per_item)
        return "any number of" if n is None else f"about {n:,}"

    several = (f" (in several conversations at once: one stops at the model's {context:,}-token context)"
               if context and full * per_item > context else "")
    beside = f"beside {model}'s weights ({weight_bytes / capacity.GIB:.1f} GiB)" if model else "beside the weights"
    where = f"*Computed, not measured:* on an {card.label} {beside}"
    if len(fractions) == 1:
        (fraction,) = fractions.values()
        caveat = visible_caveat(card, weight_bytes, reserve_bytes)
        if capacity.fits(room, full_bytes_per_token * fraction * per_item) == full:
            return f"{where}, this cache holds about {full:,} {what}, as the full cache does.{caveat}"
        return f"{where}, this budget holds {held(fraction)} {what} instead of {full:,} with the full cache{several}.{caveat}"
    (first, f0), *rest = fractions.items()
    each = "".join(f", {held(f).removeprefix('about ')} with {name}" for name, f in rest)
    return (f"{where}, these budgets hold {held(f0)} {what} with {first}{each}, instead of {full:,} with the full "
            f"cache{several}.{visible_caveat(card, weight_bytes, reserve_bytes)}")


def visible_caveat(card: capacity.Card, weight_bytes: int, reserve_bytes: float) -> str:
    """Where CUDA shows less than the card is sold with: how many fewer fit in what it shows ("" elsewhere)."""
    visible = card.visible_gib  # an A10G shows 23,028 MiB (docs/gpu.md)
    if visible is None:
        return ""
    try:
        shown = capacity.room(visible * capacity.GIB, weight_bytes, reserve_bytes)
    except ValueError:
        return ""
    fewer = 1 - shown / capacity.room(card.memory_bytes, weight_bytes, reserve_bytes)
    return f" The card shows CUDA {visible:.1f} GiB, so about {fewer:.0%} fewer fit."


def media_of(visuals: list[KeptVisual] | None) -> tuple[float | None, float | None]:
    """(tokens a frame of the chat's last video, tokens of its last picture): None where it has none."""
    videos = [v for v in visuals or [] if v.kind == "video" and v.tokens and v.frames]
    pictures = [v for v in visuals or [] if v.kind == "image" and v.tokens]
    return (videos[-1].tokens / videos[-1].frames if videos else None,
            pictures[-1].tokens if pictures else None)


def space_room(fractions: dict[str, float], visuals: list[KeptVisual] | None = None) -> str:
    """:func:`room_sentence` on the Space's card for the model it serves there, for this chat's media."""
    fractions = {name: f for name, f in fractions.items() if f is not None}  # None: nothing measured
    if not fractions:
        return ""
    arch = next(a for a in architectures() if a.name == ARCHITECTURE)
    weights = capacity.weight_bytes(parameter_count("random:" + ARCHITECTURE), DTYPE_BYTES)
    per_frame, per_picture = media_of(visuals)
    return room_sentence(arch.bytes_per_token, fractions, weights, per_frame, per_picture,
                         model=ARCHITECTURE.split("/")[-1].removesuffix("-Instruct"), context=arch.context)
