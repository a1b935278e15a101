"""v3.1's drawing variations: v3's scenes as other people draw them (issue #57).

v3 read its own drawings at 0.95-1.00 but shapes a visitor draws less well: turned 10-20 degrees
(shape 0.72), thicker strokes (0.70-0.88), outlined (0.85-0.93), web orange (255, 165, 0) read
"yellow" one time in five, a one-object picture's follow-up 0.86. ``varied_item`` draws v3's
question types with those variations; ``drawn_scenes.item`` is untouched (v3's held-out chats, the
app's examples and the benchmark's items stay byte for byte what they were).

Per object, independently: turned (half the objects, 10-20 degrees either way, a little more at
times), a thicker line (the ring's and the cross's arms, a third of them), a border in black, white
or grey (a quarter), a named shade of its colour (a third: SHADES). Per scene: a third of the
one-picture scenes of colour, shape and objects hold one object only, and a one-object chat's follow-up asks
the other property of that object.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import drawn_scenes as scenes
from .scene_items import Item

# The web's and paint programs' names for each colour, all of which a person calls by that name.
SHADES = {
    "red": ((255, 0, 0), (220, 20, 60), (200, 0, 0), (255, 60, 40)),
    "green": ((0, 128, 0), (0, 200, 0), (34, 139, 34), (50, 205, 50)),
    "blue": ((0, 0, 255), (65, 105, 225), (0, 0, 180), (30, 90, 255)),
    "yellow": ((255, 255, 0), (255, 215, 0), (250, 230, 60)),
    "purple": ((128, 0, 128), (160, 32, 240), (148, 0, 211), (110, 40, 150)),
    "orange": ((255, 165, 0), (255, 140, 0), (255, 120, 40), (240, 150, 30)),
}
BORDERS = ((0, 0, 0), (255, 255, 255), (70, 70, 70), (200, 200, 200))


@dataclasses.dataclass(frozen=True)
class Variations:
    """How often each variation is drawn (the defaults: v3.1's training and evaluation)."""

    turn: float = 0.5
    stroke: float = 0.35
    outline: float = 0.25
    shade: float = 0.35
    one_object: float = 0.3

    def thing(self, rng, t: scenes.Thing) -> scenes.Thing:
        """``t`` drawn another way (its shape, colour, place and size unchanged)."""
        angle = float(rng.uniform(10, 20) * rng.choice([-1, 1])) if rng.random() < self.turn else 0.0
        if angle and rng.random() < 0.2:
            angle = float(rng.uniform(-35, 35))  # now and then further round
        stroke = float(rng.uniform(1.25, 1.7)) if rng.random() < self.stroke else 1.0
        outline = BORDERS[int(rng.integers(len(BORDERS)))] if rng.random() < self.outline else None
        shades = SHADES[t.colour]
        rgb = shades[int(rng.integers(len(shades)))] if rng.random() < self.shade else None
        return dataclasses.replace(t, angle=angle, stroke=stroke, outline=outline, rgb=rgb)

    def count(self, rng, kind: str, low: int) -> int:
        """Objects in a scene: one, a third of the time, where a chat of ``kind`` can ask about one."""
        if kind in ("colour", "shape", "objects") and rng.random() < self.one_object:
            return 1
        return int(rng.integers(low, 6))

    def background(self, rng) -> dict:
        """v3's backgrounds, and far from every shade too (white and black shades are not used)."""
        while True:
            bg = scenes.background(rng)
            if min(sum((a - b) ** 2 for a, b in zip(bg["base"], c)) for s in SHADES.values() for c in s) > 70 ** 2:
                return bg


VARIED = Variations()


def varied_item(seed: int, kind: str, turns: int = 1, scale: float = 1.0, vary: Variations = VARIED) -> Item:
    """One conversation of a v3 question type about media drawn with the variations; seeded on a
    stream of its own (key 31), so no v3 item is the same scene varied."""
    if kind not in scenes.QUESTION_TYPES:
        raise ValueError(f"unknown question type '{kind}'; choose from: {', '.join(scenes.QUESTION_TYPES)}")
    rng = np.random.default_rng([seed, scenes.QUESTION_TYPES.index(kind), turns, round(scale * 1000), 31])
    if kind == "moving":
        return scenes._moving_item(rng, turns, scale, vary)
    return scenes._pictures_item(rng, kind, turns, scale, vary)


def held_out_varied(kind: str, count: int, turns: int = 2, offset: int = 10_000_000) -> list[Item]:
    """Evaluation items, from the held-out seeds (their own stream: other scenes than v3's held-out)."""
    return [varied_item(offset + i, kind, turns) for i in range(count)]
