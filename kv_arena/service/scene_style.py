"""Whether pictures look like the offline model's scenes: coloured shapes, in the scenes' colours
or the shades a paint program names, on a plain (or lightly textured) background. A visitor who
draws such a picture is not told it is none of the model's scenes (:func:`.scenes.media_hint`);
a photo, a chart or noise is. A judgement of how a picture looks, not what it holds: the answers
of the app's own scenes alone are marked right or wrong (their media are known by content).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image, ImageFilter

from ..tiny import generations
from ..tiny.scene_variations import SHADES

SIDE = 256  # px the picture is judged at: a scene's smallest object (28 px of 448) keeps ~16 px
BACKGROUND = 40  # RGB distance from the background's colour still counted as background
SHADE = 50  # RGB distance from a scene colour still counted as that colour (JPEG, antialiasing)
FLAT = 24  # a pixel whose 3 x 3 neighbours differ by less than this is inside a filled area


@lru_cache(maxsize=None)
def palette(generation: generations.Generation) -> np.ndarray:
    """The colours objects are drawn in: the generation's own and each colour's named shades."""
    colours = list(generation.scenes.COLOURS.values()) + [rgb for shades in SHADES.values() for rgb in shades]
    return np.array(colours, np.float32)


def _image(picture) -> Image.Image:
    """The picture at most SIDE px a side, a 3 x 3 median taken (a texture's dots and a JPEG's
    speckles go, filled shapes stay)."""
    image = (picture if isinstance(picture, Image.Image) else Image.fromarray(np.asarray(picture, np.uint8))).convert("RGB")
    image.thumbnail((SIDE, SIDE), Image.BOX)
    return image.filter(ImageFilter.MedianFilter(3))


def _flat(image: Image.Image) -> np.ndarray:
    """Pixels inside a filled area: their 3 x 3 neighbourhood one colour, give or take FLAT."""
    spread = (np.asarray(image.filter(ImageFilter.MaxFilter(3)), np.int16)
              - np.asarray(image.filter(ImageFilter.MinFilter(3)), np.int16)).max(-1)
    flat = spread < FLAT
    flat[[0, -1], :] = flat[:, [0, -1]] = False  # the edge's neighbourhood is cut short
    return flat


def picture_style(picture, colours: np.ndarray) -> tuple[bool, bool]:
    """(in the scenes' style, shows something): a background of one colour (its border's) over more
    than half the picture and mostly flat, and whatever else is there filled with the scenes'
    colours (where too small to hold a filled area, a third of it in those colours will do)."""
    image = _image(picture)
    pixels = np.asarray(image, np.float32)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    back = np.linalg.norm(pixels - np.median(border, axis=0), axis=-1) < BACKGROUND
    flat, shown = _flat(image), ~back
    if back.mean() < 0.55 or (flat & back).sum() < 0.8 * back.sum():
        return False, bool(shown.any())
    coloured = np.zeros_like(shown)  # only what is not background is compared with the colours
    coloured[shown] = np.linalg.norm(pixels[shown][:, None] - colours, axis=-1).min(-1) < SHADE
    filled = flat & shown
    if filled.sum() >= 8:
        return bool((coloured & filled).sum() >= 0.6 * filled.sum()), True
    return bool((coloured & shown).sum() >= 0.3 * shown.sum() or shown.mean() < 0.01), bool(shown.mean() >= 0.0005)


def in_scene_style(pictures) -> bool:
    """Every picture (an image, or a video's first frame) in the scenes' style, and at least one
    showing something: an image scene may hold a picture of background alone, never only those."""
    pictures = list(pictures)
    if not pictures:
        return False
    colours = palette(generations.of())
    judged = [picture_style(p, colours) for p in pictures]
    return all(style for style, _ in judged) and any(shown for _, shown in judged)


def message_pictures(message) -> list:
    """The pictures of a prepared message to judge: its images and each video's first frame (of a
    video streamed from disk, that one frame is decoded: a long video drawn like the scenes is the
    model's kind too)."""
    frames = [np.asarray(v.frames[0]) for v in message.videos if len(getattr(v, "frames", ()))]
    return list(message.images) + frames
