"""Seeded drawings for tiny-arena-vl v3: shapes anywhere on any background, answers of several words.

Unlike v2's pixel-exact tiles, a v3 scene is a *drawing*: objects at any position (not aligned with
the 28 px token grid), 1 to 2.2 token cells across, on a background of any colour (dark ones
too) with one of several textures, rendered at a random resolution, resized (as a user's picture
is) and sometimes JPEG-compressed. Geometry is kept in fractions of the picture, so the visual
tokens an object covers are computed on the grid the image processor really produces.

Every object in one item has its own colour and its own shape, so a colour or a shape names one
object. Question types (QUESTION_TYPES):
  colour   one image (23-30 cells a side)       "What colour is the star?"       -> "red"
  shape    one image                            "Which shape is red?"            -> "star"
  images   4 to 8 images (10-16 cells a side)   "What colour is the star?"       -> "red" (in one of them)
  moving   a video of 16 to 32 frames (12 cells) "Which shape moves?"           -> "star"
  objects  one image                            "What is in the picture?"        -> "red star blue ring"
  pair     one image                            "What colours are the star and the ring?" -> "red blue"
"objects" lists every object as colour then shape, in the fixed order of COLOURS (red, green,
blue, yellow, purple, orange), so each pair of words is read from another object's tokens.
Follow-up turns ask colour or shape questions about other objects of the same media.

Out of scope (``out_of_scope``): noise, blank or gradient images, photo-like blobs and bar charts,
asked any of the questions, are answered UNKNOWN.

The pictures themselves (objects, grid, background, rendering) are :mod:`.scene_drawing`'s.
``Item`` and ``Question`` are scene_items.py's, v2's own, so the accuracy benchmark and the app read
this generation as they read v2 (:mod:`.generations` picks the one the weights were trained on; its
training: training/train_arena_v3.py, training/train_arena_v3_eyes.py).
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# the pictures themselves (re-exported: what a question is asked about, drawn): scene_drawing.py
from .scene_drawing import CELL, COLOURS, SHAPES, Picture, Thing, background, draw, rendering  # noqa: F401
from .scene_items import Item, Question

UNKNOWN = "unknown"
QUESTION_TYPES = ("colour", "shape", "images", "moving", "objects", "pair")
MAX_TURNS = 3
# The processor's bounds in cells (tokens): smaller pictures are upscaled, larger ones downscaled.
MIN_CELLS, MAX_CELLS = 8 * 8, 48 * 48
# An object's side, in cells (tokens) of the processed picture. From 0.6 cells the frozen tower read
# under 0.8 of the objects smaller than one cell (stage 1), and they were most of the decoder's errors
# (probe_v3 --by-size, docs/offline-model.md): v3 reads objects a cell across (28 px) and larger.
OBJECT_CELLS = (1.0, 2.2)
WORDS = ("what", "colour", "colours", "is", "are", "the", "which", "shape", "moves", "in", "picture", "and", "?",
         UNKNOWN) + tuple(COLOURS) + SHAPES
# (sides of one picture in cells at full size, pictures per item or frames per video)
SIZES = {"single": ((23, 30), (1, 1)), "images": ((10, 16), (4, 8)), "moving": ((10, 12), (16, 32))}


# --- scenes --------------------------------------------------------------------------------------
def kinds(rng, count: int) -> list[tuple[str, str]]:
    """``count`` objects of different shapes and different colours: (shape, colour) pairs."""
    shapes = rng.choice(len(SHAPES), size=count, replace=False)
    colours = rng.choice(len(COLOURS), size=count, replace=False)
    return [(SHAPES[s], list(COLOURS)[c]) for s, c in zip(shapes, colours)]


def place(rng, p: Picture, shape: str, colour: str, tries: int = 200, size=None, avoid=()) -> Thing | None:
    """An object somewhere in ``p`` not touching the others (nor the boxes in ``avoid``)."""
    for _ in range(tries):
        side = size if size is not None else float(rng.uniform(*OBJECT_CELLS)) / p.rows
        half_x, half_y = side / 2 * p.rows / p.cols, side / 2
        x, y = float(rng.uniform(half_x, 1 - half_x)), float(rng.uniform(half_y, 1 - half_y))
        clash = any(abs(x - o.x) < (o.size / 2 + side / 2) * p.rows / p.cols + 0.5 / p.cols
                    and abs(y - o.y) < o.size / 2 + side / 2 + 0.5 / p.rows for o in list(p.things) + list(avoid))
        if not clash:
            return Thing(shape, colour, x, y, side)
    return None


MIN_SIDE = 8  # cells: a picture at least MIN_SIDE a side holds MIN_CELLS tokens, so the processor keeps its grid


def _sides(rng, key: str, scale: float, sides: tuple[int, int] | None = None) -> tuple[int, int]:
    """(cols, rows) of a picture of ``key`` at ``scale``, never under MIN_SIDE a side: a smaller one the
    processor enlarges past its minimum of MIN_CELLS tokens, and the cells named here would index a grid
    the model never sees. ``sides``: (least, most) cells a side instead of SIZES[key]'s."""
    lo, hi = sides or SIZES[key][0]
    side = max(MIN_SIDE, round(rng.integers(lo, hi + 1) * scale))
    aspect = float(rng.uniform(0.75, 1.33)) if key != "moving" else 1.0
    cols = max(MIN_SIDE, round(side * math.sqrt(aspect)))
    return cols, max(MIN_SIDE, round(side * side / cols))


# An object of a scene: (shape, colour, the tokens it overlaps, its core: the tokens that show its shape).
# A question depends on all its tokens (``Question.tokens``: what an eviction must keep); the word that
# names it is tied to its core (``Question.parts``: what the pointer loss of training points at).


def colour_question(shape: str, colour: str, tokens, core) -> Question:
    return Question("colour", f"What colour is the {shape}?", colour, tuple(tokens), (tuple(core),))


def shape_question(shape: str, colour: str, tokens, core) -> Question:
    return Question("shape", f"Which shape is {colour}?", shape, tuple(tokens), (tuple(core),))


def _follow_ups(rng, objects, first: set[int], turns: int) -> list[Question]:
    others = [o for i, o in enumerate(objects) if i not in first]
    out = []
    for i in rng.permutation(len(others))[: turns - 1]:
        out.append((colour_question if rng.random() < 0.5 else shape_question)(*others[i]))
    return out


def _pictures_item(rng, kind: str, turns: int, scale: float, vary=None) -> Item:
    """``vary``: v3.1's drawing variations (scene_variations.Variations), None for v3's scenes."""
    single = kind != "images"
    n = 1 if single else int(rng.integers(SIZES["images"][1][0], SIZES["images"][1][1] + 1))
    paint_bg = background if vary is None else vary.background
    bg = paint_bg(rng)
    pictures = []
    for _ in range(n):
        cols, rows = _sides(rng, "single" if single else "images", scale)
        pictures.append(Picture(cols, rows, bg if rng.random() < 0.7 else paint_bg(rng), [], rendering(rng, cols, rows)))
    need = {"pair": 2, "objects": 1}.get(kind, 1)
    low = max(need, min(turns + (1 if kind == "pair" else 0), 5))
    count = int(rng.integers(low, 6)) if vary is None else vary.count(rng, kind, low)
    objects, offset = [], np.cumsum([0] + [p.rows * p.cols for p in pictures])
    for shape, colour in kinds(rng, count):
        for _ in range(10):
            i = int(rng.integers(n))
            thing = place(rng, pictures[i], shape, colour)
            if thing is not None:
                thing = thing if vary is None else vary.thing(rng, thing)
                pictures[i].things.append(thing)
                objects.append((shape, colour, tuple(int(offset[i] + k) for k in pictures[i].cells_of(thing)),
                                tuple(int(offset[i] + k) for k in pictures[i].core_of(thing))))
                break
    order = [i for c in COLOURS for i, o in enumerate(objects) if o[1] == c]
    if kind == "objects":
        words = " ".join(f"{objects[i][1]} {objects[i][0]}" for i in order)
        first = Question("objects", "What is in the picture?", words, tuple(sorted(k for o in objects for k in o[2])),
                         tuple(objects[i][3] for i in order for _ in range(2)))  # "red star": both words read it
        asked = set(range(len(objects)))
    elif kind == "pair":
        a, b = (int(v) for v in rng.choice(len(objects), size=2, replace=False))
        (sa, ca, ta, core_a), (sb, cb, tb, core_b) = objects[a], objects[b]
        first = Question("pair", f"What colours are the {sa} and the {sb}?", f"{ca} {cb}", tuple(sorted(ta + tb)),
                         (core_a, core_b))
        asked = {a, b}
    else:
        a = int(rng.integers(len(objects)))
        first = (shape_question if kind == "shape" else colour_question)(*objects[a])
        asked = {a}
    follow = _follow_ups(rng, objects, asked, turns) if kind != "objects" else _follow_ups(rng, objects, set(), turns)
    if vary is not None and len(objects) == 1 and turns > 1:  # one object: its follow-up asks the other property
        follow = [(colour_question if first.kind == "shape" else shape_question)(*objects[0])]
    return Item(kind, [first] + follow, pictures, informative=tuple(sorted({k for o in objects for k in o[2]})))


def _to_and_fro(rng, frames: int, step: float, length: float) -> list[float]:
    """Positions along a segment of ``length``, ``step`` apart from frame to frame, turning back at
    the ends, only ever between two tokens' frames (2g + 1 to 2g + 2): inside every token's two frames
    the object moves a whole step."""
    pos, way, out = float(rng.uniform(0, length)), 1.0 if rng.random() < 0.5 else -1.0, []
    for _ in range(frames // 2):
        if not 0 <= pos + way * step <= length:
            way = -way
        out += [pos, pos + way * step]
        pos += way * step
        if not 0 <= pos + way * step <= length:
            way = -way
        pos += way * step
    return out


def _moving_item(rng, turns: int, scale: float, vary=None, sizes=None) -> Item:
    """One object moves about a cell per frame, to and fro along a straight segment of 2 to 4 cells
    (any direction), so it moves inside the two frames of every token however many frames there are
    (a path straight across the frame, a cell a frame, does not fit 16-32 frames into 10-12 cells: drawn
    that way, the "moving" object of nearly every full-size video stood still); 1 to 4 objects stay put."""
    sides, (lo, hi) = sizes or SIZES["moving"]  # ``sizes``: v3.1's long videos (long_videos.py)
    frames = 2 * int(rng.integers(max(2, round(lo * scale) // 2), max(3, round(hi * scale) // 2) + 1))
    cols, rows = _sides(rng, "moving", min(1.0, scale + 0.3), sides if sizes else None)
    bg = background(rng) if vary is None else vary.background(rng)
    objects = kinds(rng, int(rng.integers(max(2, turns), 6)))
    (mshape, mcolour), rest = objects[0], objects[1:]
    size = float(rng.uniform(*OBJECT_CELLS)) / rows
    hx, hy = size / 2 * rows / cols, size / 2
    speed = float(rng.uniform(0.8, 1.3)) / rows  # cells per frame, as a fraction of the height
    length = float(rng.uniform(2.0, 4.0)) / rows  # the segment, likewise
    angle = float(rng.uniform(0, 2 * math.pi))
    ux, uy = math.cos(angle) * rows / cols, math.sin(angle)
    span_x, span_y = abs(ux) * length, abs(uy) * length  # the segment fits: 4 cells + an object < 8 cells a side
    x0 = float(rng.uniform(hx, 1 - hx - span_x)) + (span_x if ux < 0 else 0)
    y0 = float(rng.uniform(hy, 1 - hy - span_y)) + (span_y if uy < 0 else 0)
    path = [Thing(mshape, mcolour, x0 + a * ux, y0 + a * uy, size) for a in _to_and_fro(rng, frames, speed, length)]
    if vary is not None:  # the same look in every frame
        look = vary.thing(rng, path[0])
        path = [dataclasses.replace(look, x=t.x, y=t.y) for t in path]
    canvas = Picture(cols, rows, bg)
    statics = []
    for shape, colour in rest:
        t = place(rng, canvas, shape, colour, avoid=path)
        if t is not None:
            t = t if vary is None else vary.thing(rng, t)
            canvas.things.append(t)
            statics.append(t)
    jpeg = int(rng.integers(40, 95)) if rng.random() < 0.4 else 0
    pictures = [Picture(cols, rows, bg, statics + [path[f]], {"colour_jitter": 25, "jpeg": jpeg}) for f in range(frames)]
    per = cols * rows

    def tokens_of(things_by_frame, cells=canvas.cells_of):  # a video token spans frames 2g and 2g+1
        out = set()
        for g in range(frames // 2):
            for t in things_by_frame(g):
                out.update(g * per + k for k in cells(t))
        return tuple(sorted(out))

    moving = tokens_of(lambda g: [path[2 * g], path[2 * g + 1]])
    objects = [(mshape, mcolour, moving, moving)]  # every token it crosses shows it moving
    objects += [(t.shape, t.colour, tokens_of(lambda g, t=t: [t]), tokens_of(lambda g, t=t: [t], canvas.core_of))
                for t in statics]
    first = Question("shape", "Which shape moves?", mshape, moving, (moving,))
    questions = [first] + _follow_ups(rng, objects, {0}, turns)
    fps = float(rng.choice([1.0, 2.0, 2.0, 3.0]))
    return Item("moving", questions, pictures, video=True,
                informative=tuple(sorted({k for o in objects for k in o[2]})), fps=fps)


def item(seed: int, kind: str, turns: int = 1, scale: float = 1.0) -> Item:
    """One conversation of ``turns`` questions about seeded media of type ``kind``; ``scale`` < 1
    draws smaller pictures and shorter videos (the training curriculum; the app and the benchmarks
    use 1)."""
    if kind not in QUESTION_TYPES:
        raise ValueError(f"unknown question type '{kind}'; choose from: {', '.join(QUESTION_TYPES)}")
    if not 1 <= turns <= MAX_TURNS:
        raise ValueError(f"turns must lie in [1, {MAX_TURNS}], got {turns}")
    rng = np.random.default_rng([seed, QUESTION_TYPES.index(kind), turns, round(scale * 1000)])
    return _moving_item(rng, turns, scale) if kind == "moving" else _pictures_item(rng, kind, turns, scale)


# --- out of scope --------------------------------------------------------------------------------
def _odd_image(rng, w: int, h: int) -> Image.Image:
    """Noise, a blank or gradient image, soft photo-like blobs, or a bar chart."""
    kind = int(rng.integers(5))
    if kind == 0:
        arr = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
        return Image.fromarray(arr).filter(ImageFilter.GaussianBlur(float(rng.uniform(0, 2))))
    if kind == 1:
        return Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 256, 3)))
    if kind == 2:
        a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        t = np.linspace(0, 1, w)[None, :, None] if rng.random() < 0.5 else np.linspace(0, 1, h)[:, None, None]
        return Image.fromarray((a + (b - a) * np.broadcast_to(t, (h, w, 1))).astype(np.uint8))
    if kind == 3:  # many soft overlapping blobs of every colour: a stand-in for a photo
        img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 256, 3)))
        d = ImageDraw.Draw(img)
        for _ in range(int(rng.integers(15, 60))):
            x, y, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.05, 0.4) * min(w, h)
            d.ellipse((x - r, y - r * rng.uniform(0.3, 1.5), x + r, y + r), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        return img.filter(ImageFilter.GaussianBlur(float(rng.uniform(1, 6))))
    img = Image.new("RGB", (w, h), (255, 255, 255))  # a bar chart with axes
    d = ImageDraw.Draw(img)
    bars = int(rng.integers(3, 9))
    x0, y0 = 0.12 * w, 0.9 * h
    d.line((x0, 0.05 * h, x0, y0), fill=(0, 0, 0), width=2)
    d.line((x0, y0, 0.97 * w, y0), fill=(0, 0, 0), width=2)
    step = (0.85 * w) / bars
    for i in range(bars):
        top = y0 - rng.uniform(0.1, 0.8) * h
        d.rectangle((x0 + i * step + 0.15 * step, top, x0 + (i + 0.85) * step, y0 - 1),
                    fill=tuple(int(v) for v in rng.integers(0, 200, 3)))
    return img


class OddPicture(Picture):
    """A picture outside the scenes (``background['odd']`` seeds it)."""

    def image(self) -> Image.Image:
        rng = np.random.default_rng(self.background["odd"])
        img = _odd_image(rng, self.cols * CELL, self.rows * CELL)
        if self.render.get("jpeg"):
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=self.render["jpeg"])
            img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
        return img


def out_of_scope(seed: int, turns: int = 1, scale: float = 1.0) -> Item:
    """Media the model was not made for, asked any question of the scene types: answered UNKNOWN."""
    rng = np.random.default_rng([seed, 99, turns, round(scale * 1000)])
    n = 1 if rng.random() < 0.7 else int(rng.integers(2, 5))
    pictures = []
    for _ in range(n):
        cols, rows = _sides(rng, "single" if n == 1 else "images", scale)
        pictures.append(OddPicture(cols, rows, {"odd": int(rng.integers(2**31))}, [],
                                   {"jpeg": int(rng.integers(40, 95)) if rng.random() < 0.3 else 0}))
    shapes, colours = list(SHAPES), list(COLOURS)
    asks = [f"What colour is the {shapes[int(rng.integers(5))]}?", f"Which shape is {colours[int(rng.integers(6))]}?",
            "What is in the picture?", f"What colours are the {shapes[0]} and the {shapes[int(rng.integers(1, 5))]}?"]
    questions = [Question("unknown", asks[int(rng.integers(len(asks)))], UNKNOWN, ()) for _ in range(turns)]
    return Item("unknown", questions, pictures)


def held_out(kind: str, count: int, turns: int = 1, offset: int = 10_000_000) -> list[Item]:
    """Evaluation items: seeds far above any training seed (training draws from [0, offset))."""
    if kind == "unknown":
        return [out_of_scope(offset + i, turns) for i in range(count)]
    return [item(offset + i, kind, turns) for i in range(count)]


def fresh(kind: str, turns: int = 2, seed: int | None = None) -> Item:
    """A new scene of ``kind`` with its true answers, for the app's "new scene" button: a seed
    above every training and held-out seed (random when none is given)."""
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31))
    return item(30_000_000 + seed, kind, turns)


EXAMPLE_SEED = 20_000_000  # above the training and held-out seeds, below fresh()'s


def examples() -> dict[str, tuple[Item, list[str]]]:
    """The app's clickable example of each type, two turns each: the item and the files in assets/
    that assets/make_examples.py draws it into (``scene_<type>.png``, ``scene_images_<i>.png``,
    ``scene_moving.mp4``). Each is the first seed from EXAMPLE_SEED with three objects or more."""
    out = {}
    for kind in QUESTION_TYPES:
        it = next(it for it in (item(EXAMPLE_SEED + i, kind, 2) for i in range(1000)) if len(it.turns) == 2
                  and len({t.colour for p in it.pictures for t in p.things}) >= 3)
        files = ([f"scene_{kind}.mp4"] if it.video else [f"scene_{kind}.png"] if len(it.pictures) == 1 else
                 [f"scene_{kind}_{i}.png" for i in range(1, len(it.pictures) + 1)])
        out[kind] = (it, files)
    return out
