"""What a scene of the offline model knows: every object in it (shape, colour, which image, whether
it moves), so any question of the kinds the model answers is marked, not only the two a scene was
drawn with: the colour of a shape, the shape of a colour, which shape moves (in any of its images),
and where the scene's generation asks them (v3), what is in the picture and the colours of two
shapes. A question the objects cannot answer gets a short reason instead of a mark (:func:`judge`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..tiny import arena_scenes

SHAPES = arena_scenes.SHAPES  # every generation's: v3's drawings have v2's shapes and colours
COLOURS = tuple(arena_scenes.COLOURS)
MOVES = {"move", "moves", "moving", "moved"}
ASK_COLOUR = {"colour", "color", "colours", "colors"}
ASK_SHAPE = {"shape", "shapes"}
PICTURE = {"picture", "image", "scene"}
# what a scene answers, per question type of its generation ("images" asks colours, as "colour")
PHRASES = {"colour": "the colour of a shape", "shape": "the shape of a colour", "moving": "which shape moves",
           "objects": "what is in the picture", "pair": "the colours of two shapes"}


@dataclass(frozen=True)
class SceneObject:
    """One object of a scene: its shape and colour, the image it is in (0 in a video), whether it
    moves (in a video, one does)."""

    shape: str
    colour: str
    image: int = 0
    moves: bool = False


def _placed(picture) -> list[tuple]:
    """(where, object) for each object of a picture: v2's by their cell, v3's whose own position is
    part of them (where is None)."""
    things = picture.things
    return list(things.items()) if isinstance(things, dict) else [(None, t) for t in things]


def objects_of(item) -> tuple[SceneObject, ...]:
    """The objects of a scene generator's item (any generation), from its geometry: in a video,
    from its first two frames (the one placed elsewhere in the second moves)."""
    if item.video:
        first, second = _placed(item.pictures[0]), _placed(item.pictures[1])
        return tuple(SceneObject(t.shape, t.colour, 0, (where, t) not in second) for where, t in first)
    return tuple(SceneObject(t.shape, t.colour, i) for i, p in enumerate(item.pictures) for _, t in _placed(p))


def kinds(types: tuple[str, ...]) -> str:
    """What a scene of a generation with these question types answers, in words."""
    said = list(dict.fromkeys(PHRASES[t] for t in types if t in PHRASES))
    return ", ".join(said[:-1]) + ", or " + said[-1]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _named(found: list[str], names: tuple[str, ...]) -> list[str]:
    """The names of ``names`` a question's words mention (plurals too: circles, crosses), in the
    order it mentions them."""
    forms = {form: n for n in names for form in (n, f"{n}s", f"{n}es")}
    return list(dict.fromkeys(forms[w] for w in found if w in forms))


def _contents(objects: tuple[SceneObject, ...], video: bool) -> tuple[str | None, str]:
    """"What is in the picture?": every object, colour then shape, in the order of the colours
    (drawn_scenes' answer); one still picture only."""
    if video or len({o.image for o in objects}) > 1:
        return None, "what is in the picture is marked for a scene of one still picture"
    return " ".join(f"{o.colour} {o.shape}" for c in COLOURS for o in objects if o.colour == c), ""


def judge(objects: tuple[SceneObject, ...], video: bool, question: str,
          types: tuple[str, ...]) -> tuple[str | None, str]:
    """(true answer, "") for a question the scene's objects answer, else (None, why it is not
    marked, a few words). ``types``: the question types of the scene's generation (its
    ``QUESTION_TYPES``): a list of the objects or a pair of colours is marked where they hold one."""
    found = words(question)
    shapes, colours = _named(found, SHAPES), _named(found, COLOURS)
    asks_colour, asks_shape = bool(ASK_COLOUR & set(found)), bool(ASK_SHAPE & set(found))
    if MOVES & set(found):
        if not video:
            return None, "nothing moves in a still picture"
        mover = next((o for o in objects if o.moves), None)
        if mover is None or shapes or colours:
            return None, f"it asks something else than which shape moves; the scene answers {kinds(types)}"
        first = next((w for w in found if w in ASK_COLOUR | ASK_SHAPE), "shape")  # "what colour is the shape..."
        return (mover.colour, "") if first in ASK_COLOUR else (mover.shape, "")
    if asks_colour and len(shapes) in ((1, 2) if "pair" in types else (1,)) and not colours:
        hit = {o.shape: o.colour for o in reversed(objects)}  # the first of a shape, were there two
        missing = [s for s in shapes if s not in hit]
        return (" ".join(hit[s] for s in shapes), "") if not missing else (None, f"this scene has no {missing[0]}")
    if asks_shape and len(colours) == 1 and not shapes:
        hit = [o.shape for o in objects if o.colour == colours[0]]
        return (hit[0], "") if hit else (None, f"nothing in this scene is {colours[0]}")
    if "objects" in types and {"what", "in"} <= set(found) and PICTURE & set(found) and not (
            shapes or colours or asks_colour or asks_shape):
        return _contents(objects, video)
    one_at_a_time = "" if {"objects", "pair"} & set(types) else ", one object at a time"
    return None, f"the scene answers {kinds(types)}{one_at_a_time}"
