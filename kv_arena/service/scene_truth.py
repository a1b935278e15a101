"""What a scene of the offline model knows: every object in it (shape, colour, which image, whether
it moves), so any question of the kinds the model answers is marked, not only the two a scene was
drawn with: the colour of a shape, the shape of a colour, which shape moves (in any of its images).
A question the objects cannot answer gets a short reason instead of a mark (:func:`judge`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..tiny import arena_scenes

SHAPES = arena_scenes.SHAPES
COLOURS = tuple(arena_scenes.COLOURS)
MOVES = {"move", "moves", "moving", "moved"}
ASK_COLOUR = {"colour", "color", "colours", "colors"}
ASK_SHAPE = {"shape", "shapes"}
KINDS = "the colour of a shape, the shape of a colour, or which shape moves"


@dataclass(frozen=True)
class SceneObject:
    """One object of a scene: its shape and colour, the image it is in (0 in a video), whether it
    moves (in a video, one does)."""

    shape: str
    colour: str
    image: int = 0
    moves: bool = False


def objects_of(item) -> tuple[SceneObject, ...]:
    """The objects of an ``arena_scenes`` item, from its geometry: in a video, from its first two
    frames (the one whose cell changes moves)."""
    if item.video:
        first, second = item.pictures[0].things, item.pictures[1].things
        return tuple(SceneObject(t.shape, t.colour, 0, second.get(cell) != t) for cell, t in first.items())
    return tuple(SceneObject(t.shape, t.colour, i) for i, p in enumerate(item.pictures) for t in p.things.values())


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _named(found: list[str], names: tuple[str, ...]) -> list[str]:
    """The names of ``names`` a question's words mention (plurals too: circles, crosses)."""
    return [n for n in names if n in found or f"{n}s" in found or f"{n}es" in found]


def judge(objects: tuple[SceneObject, ...], video: bool, question: str) -> tuple[str | None, str]:
    """(true answer, "") for a question the scene's objects answer, else (None, why it is not
    marked, a few words)."""
    found = words(question)
    shapes, colours = _named(found, SHAPES), _named(found, COLOURS)
    asks_colour, asks_shape = bool(ASK_COLOUR & set(found)), bool(ASK_SHAPE & set(found))
    if MOVES & set(found):
        if not video:
            return None, "nothing moves in a still picture"
        mover = next((o for o in objects if o.moves), None)
        if mover is None or shapes or colours:
            return None, f"it asks something else than which shape moves; the scene answers {KINDS}"
        first = next((w for w in found if w in ASK_COLOUR | ASK_SHAPE), "shape")  # "what colour is the shape..."
        return (mover.colour, "") if first in ASK_COLOUR else (mover.shape, "")
    if asks_colour and len(shapes) == 1 and not colours:
        hit = [o.colour for o in objects if o.shape == shapes[0]]
        return (hit[0], "") if hit else (None, f"this scene has no {shapes[0]}")
    if asks_shape and len(colours) == 1 and not shapes:
        hit = [o.shape for o in objects if o.colour == colours[0]]
        return (hit[0], "") if hit else (None, f"nothing in this scene is {colours[0]}")
    return None, f"the scene answers {KINDS}, one object at a time"
