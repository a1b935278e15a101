"""Seeded boards whose facts sit at known places, with short-answer questions about them.

A board is a GRID x GRID grid of coloured cells, CELL px each. With Qwen2.5-VL's 14 px patches
merged 2x2, one cell is exactly one visual token, so every fact lives in a known token and
dropping the wrong tokens changes the answer. A cell's four patches: top left, a grey square whose
shade codes the row; top right, one that codes the column (the "tick marks" that let a token know
where it is from its content alone, as the tiny model's vision tower sees one cell at a time);
bottom left, the cell's name (A, B, ... in reading order) on a white plate, for people; bottom
right, the colour, which also fills the rest of the cell. Colours are drawn uniformly, so guessing
the board's commonest colour does not pay (count questions vary the shares: see random_scene).

Question types (one-word answers); tiny-arena-vl is trained on the first two (QUESTION_TYPES), the
others (EXTRA_TYPES) are for models that read several images or a video:
  count        "How many cells are red?"                    -> "5"
  colour       "Colour of cell F?"                          -> "blue"
  which_image  "Which image has the most red cells?"        -> "2"   (two or three boards)
  direction    "Which way does the red square move?"        -> "left" (a short video)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

GRID = 3
CELL = 28
SIZE = GRID * CELL  # 84 px: 9 visual tokens for Qwen2.5-VL
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 205, 40)}
LABELS = "ABCDEFGHIJKLMNOP"[: GRID * GRID]
SHADES = [(round(255 * i / (GRID - 1)),) * 3 for i in range(GRID)]  # row / column code: black ... white
QUESTION_TYPES = ("count", "colour")
EXTRA_TYPES = ("which_image", "direction")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

# 3 x 5 pixel glyphs of the cell names, drawn here so that every machine renders the same pixels
GLYPHS = {
    "A": (".#.", "#.#", "###", "#.#", "#.#"), "B": ("##.", "#.#", "##.", "#.#", "##."),
    "C": (".##", "#..", "#..", "#..", ".##"), "D": ("##.", "#.#", "#.#", "#.#", "##."),
    "E": ("###", "#..", "##.", "#..", "###"), "F": ("###", "#..", "##.", "#..", "#.."),
    "G": (".##", "#..", "#.#", "#.#", ".##"), "H": ("#.#", "#.#", "###", "#.#", "#.#"),
    "I": ("###", ".#.", ".#.", ".#.", "###"), "J": ("..#", "..#", "..#", "#.#", ".#."),
    "K": ("#.#", "#.#", "##.", "#.#", "#.#"), "L": ("#..", "#..", "#..", "#..", "###"),
    "M": ("#.#", "###", "###", "#.#", "#.#"), "N": ("##.", "#.#", "#.#", "#.#", "#.#"),
    "O": (".#.", "#.#", "#.#", "#.#", ".#."), "P": ("##.", "#.#", "##.", "#..", "#.."),
}
PIXEL = 2  # glyph pixel size in px: a 6 x 10 px letter


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    cells: tuple[tuple[int, int], ...]  # (row, column) of the cells the answer depends on (0-based)

    def unrelated_cells(self) -> list[tuple[int, int]]:
        """The board's cells the answer does not depend on, in reading order."""
        return [(r, c) for r in range(GRID) for c in range(GRID) if (r, c) not in self.cells]


def cell_name(row: int, column: int) -> str:
    return LABELS[row * GRID + column]


@dataclass
class Scene:
    colours: list[list[str]]  # [row][column] colour names

    def image(self, scale: int = 1) -> Image.Image:
        """The board; ``scale`` > 1 enlarges it with nearest-neighbour (the model sees it downsized)."""
        image = Image.new("RGB", (SIZE, SIZE))
        d = ImageDraw.Draw(image)
        half = CELL // 2
        for r in range(GRID):
            for c in range(GRID):
                x, y = c * CELL, r * CELL
                d.rectangle((x, y, x + CELL - 1, y + CELL - 1), fill=COLOURS[self.colours[r][c]], outline=(60, 60, 60))
                d.rectangle((x + 2, y + 2, x + half - 2, y + half - 2), fill=SHADES[r])
                d.rectangle((x + half + 1, y + 2, x + CELL - 3, y + half - 2), fill=SHADES[c])
                d.rectangle((x + 2, y + half, x + 11, y + CELL - 2), fill=(255, 255, 255))  # the name plate
                for gy, line in enumerate(GLYPHS[cell_name(r, c)]):
                    for gx, on in enumerate(line):
                        if on == "#":
                            px, py = x + 4 + gx * PIXEL, y + half + 1 + gy * PIXEL
                            d.rectangle((px, py, px + PIXEL - 1, py + PIXEL - 1), fill=(0, 0, 0))
        return image.resize((SIZE * scale, SIZE * scale), Image.NEAREST) if scale > 1 else image

    def cells_of(self, colour: str) -> tuple[tuple[int, int], ...]:
        return tuple((r, c) for r in range(GRID) for c in range(GRID) if self.colours[r][c] == colour)


def random_scene(rng: np.random.Generator, varied: bool = False) -> Scene:
    """Uniform colours; ``varied`` draws the colours' shares from a flat Dirichlet first, so a
    colour's count spans 0 to GRID x GRID (uniform boards make "2" right a third of the time)."""
    names = list(COLOURS)
    weights = rng.dirichlet(np.ones(len(names))) if varied else None
    picks = rng.choice(len(names), size=(GRID, GRID), p=weights)
    return Scene([[names[i] for i in row] for row in picks])


def count_question(scene: Scene, colour: str) -> Question:
    cells = scene.cells_of(colour)
    return Question("count", f"How many cells are {colour}?", str(len(cells)), cells)


def colour_question(scene: Scene, row: int, column: int) -> Question:
    return Question("colour", f"Colour of cell {cell_name(row, column)}?", scene.colours[row][column], ((row, column),))


def random_question(scene: Scene, rng: np.random.Generator, kind: str) -> Question:
    if kind == "count":
        return count_question(scene, list(COLOURS)[int(rng.integers(len(COLOURS)))])
    if kind == "colour":
        return colour_question(scene, int(rng.integers(GRID)), int(rng.integers(GRID)))
    raise ValueError(f"unknown board question type '{kind}'; choose from: {', '.join(QUESTION_TYPES)}")


def sample(seed: int, kind: str | None = None) -> tuple[Scene, Question]:
    """One board and one question about it, fully determined by ``seed``."""
    rng = np.random.default_rng(seed)
    kind = kind or QUESTION_TYPES[int(rng.integers(len(QUESTION_TYPES)))]
    scene = random_scene(rng, varied=kind == "count")
    return scene, random_question(scene, rng, kind)


@dataclass
class Item:
    """A question with what it is asked about: boards shown as images, or a short video."""

    question: Question
    scenes: list[Scene] = field(default_factory=list)
    frames: np.ndarray | None = None  # (N, H, W, 3) uint8

    def media(self) -> dict:
        """Keyword arguments for :class:`engine.inputs.Message`."""
        if self.frames is not None:
            from .media import Video

            return {"videos": [Video(self.frames, [i / 2 for i in range(len(self.frames))], fps=2.0)],
                    "num_frames": len(self.frames)}
        return {"images": [scene.image() for scene in self.scenes]}


def which_image_item(rng: np.random.Generator) -> Item:
    """Two or three boards; one of them has strictly the most cells of the asked colour."""
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    while True:
        scenes = [random_scene(rng) for _ in range(int(rng.integers(2, 4)))]
        counts = [len(s.cells_of(colour)) for s in scenes]
        if counts.count(max(counts)) == 1:
            best = counts.index(max(counts))
            return Item(Question("which_image", f"Which image has the most {colour} cells?", str(best + 1), ()), scenes)


def direction_item(rng: np.random.Generator, frames: int = 8) -> Item:
    """A red square crossing a grey field in one of four directions."""
    direction = list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))]
    dx, dy = DIRECTIONS[direction]
    side, half = 2 * SIZE, CELL // 2
    out = []
    for i in range(frames):
        image = Image.new("RGB", (side, side), (150, 150, 150))
        travel = (i - (frames - 1) / 2) * (side - 2 * CELL) / (frames - 1)
        cx, cy = side / 2 + dx * travel, side / 2 + dy * travel
        ImageDraw.Draw(image).rectangle((cx - half, cy - half, cx + half, cy + half), fill=COLOURS["red"])
        out.append(np.asarray(image))
    return Item(Question("direction", "Which way does the red square move?", direction, ()), frames=np.stack(out))


def item(seed: int, kind: str) -> Item:
    """One question of any type with its media, fully determined by ``seed``."""
    if kind in QUESTION_TYPES:
        scene, question = sample(seed, kind)
        return Item(question, [scene])
    rng = np.random.default_rng(seed)
    if kind == "which_image":
        return which_image_item(rng)
    if kind == "direction":
        return direction_item(rng)
    raise ValueError(f"unknown question type '{kind}'; choose from: {', '.join(QUESTION_TYPES + EXTRA_TYPES)}")


def held_out(kind: str, count: int, offset: int = 10_000_000) -> list[Item]:
    """Evaluation items: seeds far above any training seed (training draws from [0, offset))."""
    kinds = QUESTION_TYPES + EXTRA_TYPES
    if kind not in kinds:
        raise ValueError(f"unknown question type '{kind}'; choose from: {', '.join(kinds)}")
    return [item(offset + i * 7919 + kinds.index(kind), kind) for i in range(count)]
