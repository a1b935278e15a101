"""Seeded scenes for tiny-arena-vl v2: mostly background, a few objects, one-word answers.

A scene is a grid of CELL px cells; with Qwen2.5-VL's 14 px patches merged 2x2 one cell is exactly
one visual token. Every cell is background (one of three plain or lightly textured styles, the same
in every cell of a scene) except 1 to 4 objects, each one cell: a shape in a colour. Within one
item every object has its own shape and its own colour, so a shape or a colour names one object,
and every question is answered by finding that object's token and copying a property of it
(a lookup, which a tiny model learns; see training/train_arena.py).

Question types (QUESTION_TYPES), with the media each is asked about:
  colour   one 10x10 image (100 visual tokens)   "What colour is the star?"   -> "red"
  shape    one 10x10 image                        "Which shape is red?"        -> "star"
  images   2 to 4 8x8 images (64 tokens each)     "What colour is the star?"   -> "red" (in one of them)
  moving   a 4, 6 or 8 frame 8x8 video            "Which shape moves?"         -> "star"
In the video one object moves one cell per frame in a straight line, the others stay put.
Qwen2.5-VL's video patches span two frames, so a token of the moving object holds it in one of
its two frames only: which object moves is a property of its tokens, found by lookup, not a
comparison of positions across frames (which a tiny model cannot learn quickly).

Follow-up turns ask about a different object of the same media (colour or shape question).
Every question names the visual tokens its answer depends on (``Question.tokens``, indices into
the prompt's visual tokens in order), and every item names all its object tokens
(``Item.informative``): the accuracy probes and the eviction training use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

from .scene_items import Item, Question

CELL = 28
BIG, SMALL = 10, 8  # cells a side: one image alone, several images or video frames
VIDEO_FRAMES = (4, 6, 8)  # a moving scene's frame counts
COLOURS = {"red": (215, 35, 35), "green": (30, 160, 50), "blue": (35, 75, 215), "yellow": (240, 200, 20),
           "purple": (140, 45, 170), "orange": (245, 125, 20)}
SHAPES = ("square", "circle", "triangle", "cross", "ring")
BACKGROUNDS = ("plain", "dots", "lines")
QUESTION_TYPES = ("colour", "shape", "images", "moving")
MAX_TURNS = 3
# every word the questions use; with the chat markers and the system prompt: the v2 vocabulary
WORDS = ("what", "colour", "is", "the", "which", "shape", "moves", "?") + tuple(COLOURS) + SHAPES
DIRECTIONS = ((0, 1), (0, -1), (1, 0), (-1, 0))  # (row, column) step per frame


@dataclass(frozen=True)
class Thing:
    shape: str
    colour: str


@lru_cache(maxsize=None)
def cell_pixels(background: str, thing: Thing | None) -> np.ndarray:
    """One CELL x CELL cell: its background texture, and the object drawn on it if any."""
    base = {"plain": (205, 205, 205), "dots": (222, 214, 196), "lines": (196, 208, 220)}[background]
    image = Image.new("RGB", (CELL, CELL), base)
    d = ImageDraw.Draw(image)
    faint = tuple(v - 18 for v in base)
    if background == "dots":
        for y in (6, 20):
            for x in (6, 20):
                d.rectangle((x, y, x + 1, y + 1), fill=faint)
    elif background == "lines":
        for k in range(-CELL, CELL, 9):
            d.line((k, 0, k + CELL, CELL), fill=faint)
    if thing is not None:
        colour, lo, hi = COLOURS[thing.colour], 4, CELL - 5
        if thing.shape == "square":
            d.rectangle((lo + 1, lo + 1, hi - 1, hi - 1), fill=colour)
        elif thing.shape == "circle":
            d.ellipse((lo, lo, hi, hi), fill=colour)
        elif thing.shape == "triangle":
            d.polygon([(CELL // 2, lo), (lo, hi), (hi, hi)], fill=colour)
        elif thing.shape == "cross":
            d.rectangle((lo, 11, hi, 16), fill=colour)
            d.rectangle((11, lo, 16, hi), fill=colour)
        else:  # ring
            d.ellipse((lo, lo, hi, hi), outline=colour, width=4)
    return np.asarray(image)


@dataclass
class Picture:
    """One image (or one video frame): a background style and objects at (row, column) cells."""

    side: int
    background: str
    things: dict[tuple[int, int], Thing]

    def pixels(self) -> np.ndarray:
        rows = [np.concatenate([cell_pixels(self.background, self.things.get((r, c))) for c in range(self.side)], axis=1)
                for r in range(self.side)]
        return np.concatenate(rows, axis=0)

    def image(self) -> Image.Image:
        return Image.fromarray(self.pixels())

    @property
    def token_count(self) -> int:
        return self.side * self.side


def colour_question(thing: Thing, tokens) -> Question:
    return Question("colour", f"What colour is the {thing.shape}?", thing.colour, tuple(tokens))


def shape_question(thing: Thing, tokens) -> Question:
    return Question("shape", f"Which shape is {thing.colour}?", thing.shape, tuple(tokens))


def _things(rng: np.random.Generator, count: int) -> list[Thing]:
    shapes = rng.choice(len(SHAPES), size=count, replace=False)
    colours = rng.choice(len(COLOURS), size=count, replace=False)
    return [Thing(SHAPES[s], list(COLOURS)[c]) for s, c in zip(shapes, colours)]


def _cells(rng: np.random.Generator, side: int, count: int, taken=()) -> list[tuple[int, int]]:
    free = [(r, c) for r in range(side) for c in range(side) if (r, c) not in set(taken)]
    return [free[i] for i in rng.choice(len(free), size=count, replace=False)]


def _follow_ups(rng, objects: list[tuple[Thing, tuple[int, ...]]], first: int, turns: int) -> list[Question]:
    """Questions about other objects than the ``first`` one, colour or shape at random."""
    others = [o for i, o in enumerate(objects) if i != first]
    out = []
    for i in rng.permutation(len(others))[: turns - 1]:
        thing, tokens = others[i]
        out.append((colour_question if rng.random() < 0.5 else shape_question)(thing, tokens))
    return out


def pictures_item(rng: np.random.Generator, kind: str, turns: int) -> Item:
    """colour / shape (one BIG image) or images (2 to 4 SMALL ones)."""
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    images = 1 if kind in ("colour", "shape") else int(rng.integers(2, 5))
    side = BIG if images == 1 else SMALL
    low = max(images, min(turns, 4))  # enough objects for the follow-ups
    count = int(rng.integers(low, (4 if images == 1 else 5) + 1))
    things = _things(rng, count)
    owner = list(range(images)) + [int(i) for i in rng.integers(images, size=count - images)]  # each image has one
    pictures = [Picture(side, background, {}) for _ in range(images)]
    objects = []
    for thing, i in zip(things, owner):
        cell = _cells(rng, side, 1, pictures[i].things)[0]
        pictures[i].things[cell] = thing
        objects.append((thing, (i * side * side + cell[0] * side + cell[1],)))
    first = int(rng.integers(count))
    thing, tokens = objects[first]
    ask = shape_question if kind == "shape" else colour_question
    questions = [ask(thing, tokens)] + _follow_ups(rng, objects, first, turns)
    return Item(kind, questions, pictures, informative=tuple(sorted(t for _, ts in objects for t in ts)))


def moving_item(rng: np.random.Generator, turns: int) -> Item:
    """A SMALL-grid video of 4, 6 or 8 frames: one object moves a cell per frame, 1 to 3 stay."""
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    frames = int(rng.choice(VIDEO_FRAMES))
    dr, dc = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    span = SMALL - (frames - 1) * max(abs(dr), abs(dc))  # start cells that keep the path inside

    def start(step):
        return int(rng.integers(span)) if step > 0 else int(rng.integers(frames - 1, SMALL)) if step < 0 else int(rng.integers(SMALL))

    r0, c0 = start(dr), start(dc)
    path = [(r0 + f * dr, c0 + f * dc) for f in range(frames)]
    static = int(rng.integers(max(1, turns - 1), 4))
    things = _things(rng, static + 1)
    mover, rest = things[0], things[1:]
    cells = _cells(rng, SMALL, static, path)
    pictures = [Picture(SMALL, background, {**dict(zip(cells, rest)), path[f]: mover}) for f in range(frames)]
    per = SMALL * SMALL

    def tokens_of(where):  # a video token spans frames 2g and 2g+1
        return tuple(sorted({g * per + r * SMALL + c for g in range(frames // 2) for (r, c) in where(g)}))

    moving = tokens_of(lambda g: [path[2 * g], path[2 * g + 1]])
    objects = [(mover, moving)] + [(t, tokens_of(lambda g, cell=cell: [cell])) for cell, t in zip(cells, rest)]
    questions = [Question("shape", "Which shape moves?", mover.shape, moving)] + _follow_ups(rng, objects, 0, turns)
    return Item("moving", questions, pictures, video=True, informative=tuple(sorted(t for _, ts in objects for t in ts)))


def item(seed: int, kind: str, turns: int = 1) -> Item:
    """One conversation of ``turns`` questions (1 to MAX_TURNS) about seeded media of type ``kind``."""
    if kind not in QUESTION_TYPES:
        raise ValueError(f"unknown question type '{kind}'; choose from: {', '.join(QUESTION_TYPES)}")
    if not 1 <= turns <= MAX_TURNS:
        raise ValueError(f"turns must lie in [1, {MAX_TURNS}], got {turns}")
    rng = np.random.default_rng([seed, QUESTION_TYPES.index(kind), turns])
    return moving_item(rng, turns) if kind == "moving" else pictures_item(rng, kind, turns)


def held_out(kind: str, count: int, turns: int = 1, offset: int = 10_000_000) -> list[Item]:
    """Evaluation items: seeds far above any training seed (training draws from [0, offset))."""
    return [item(offset + i, kind, turns) for i in range(count)]


EXAMPLE_SEED = 20_000_000  # above the training and held-out seeds


def examples() -> dict[str, tuple[Item, list[str]]]:
    """The app's clickable example of each type: the item and the files in assets/ that
    assets/make_examples.py draws it into. Each is the first seed from EXAMPLE_SEED on whose media
    show three objects or more (one image) or two images or more, and an 8-frame video."""
    def fits(it: Item) -> bool:
        return len(it.pictures) == 8 if it.video else len(it.informative) >= 3 or len(it.pictures) > 1

    out = {}
    for kind in QUESTION_TYPES:
        it = next(it for it in (item(EXAMPLE_SEED + i, kind) for i in range(1000)) if fits(it))
        files = ([f"arena_{kind}.mp4"] if it.video else
                 [f"arena_{kind}.png"] if len(it.pictures) == 1 else
                 [f"arena_{kind}_{i}.png" for i in range(1, len(it.pictures) + 1)])
        out[kind] = (it, files)
    return out


def fresh(kind: str, turns: int = 2, seed: int | None = None) -> Item:
    """A new scene of ``kind`` with its true answers, for the app's "new scene" button: a seed
    above every training, held-out and example seed (random when none is given)."""
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31))
    return item(30_000_000 + seed, kind, turns)
