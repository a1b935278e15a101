"""v3.1's long videos (issue #57): questions about a video several times longer than v3's, at 1 frame
a second, as the app streams one (a few frames a chunk, the question after the whole video).

Two question types (LONG_TYPES):
  long_moving  40 to 72 frames, 8 cells a side: "Which shape moves?" (v3's moving scene, longer:
               the object goes to and fro, so neighbouring frames differ all through)
  glimpse      40 to 72 frames: "What colour is the ring?" about an object in view for only 6 to 16
               frames (whole video tokens: it enters and leaves between two tokens' frames), the
               others in view all through
Follow-ups ask about objects in view all through. A video sent whole shares one image's budget of
2,304 tokens (48 x 48 cells) among its tokens, so 72 frames of 8 x 8 cells is the longest that keeps
its grid; the app streams a longer one at a fixed size a frame, which these do not reach.

``minutes``: the same frames spread over a video of that length, as the app samples a 5-10 minute
video to its frame count (kv_arena.media.load_video: evenly over the whole video, the clip's fps
from their times). Only the times change, and with them the video's M-RoPE time ids (Qwen2.5-VL
spaces them by seconds): about ten times further apart than at 1 frame a second.
"""

from __future__ import annotations

import numpy as np

from . import drawn_scenes as scenes
from .scene_items import Item

LONG_TYPES = ("long_moving", "glimpse")
LONG_SIZES = ((8, 8), (40, 72))  # (cells a side, frames) at full size
LONG_FPS = 1.0


def long_item(seed: int, kind: str, turns: int = 1, scale: float = 1.0, minutes: float | None = None) -> Item:
    """One conversation about a long video of type ``kind`` (LONG_TYPES), at 1 frame a second or
    its frames spread over ``minutes``; seeded on a stream of its own (the same scene either way)."""
    if kind not in LONG_TYPES:
        raise ValueError(f"unknown long-video type '{kind}'; choose from: {', '.join(LONG_TYPES)}")
    if minutes is not None and minutes <= 0:
        raise ValueError("minutes must be positive")
    rng = np.random.default_rng([seed, 60 + LONG_TYPES.index(kind), turns, round(scale * 1000)])
    if kind == "long_moving":
        it = scenes._moving_item(rng, turns, scale, sizes=LONG_SIZES)
    else:
        it = _glimpse_item(rng, turns, scale)
    it.fps = LONG_FPS if minutes is None else len(it.pictures) / (60 * minutes)
    return it


def _glimpse_item(rng, turns: int, scale: float) -> Item:
    lo, hi = LONG_SIZES[1]
    frames = 2 * int(rng.integers(max(8, round(lo * scale) // 2), max(9, round(hi * scale) // 2) + 1))
    cols, rows = scenes._sides(rng, "moving", 1.0, LONG_SIZES[0])
    bg = scenes.background(rng)
    objects = scenes.kinds(rng, int(rng.integers(max(2, turns), 5)))
    canvas = scenes.Picture(cols, rows, bg)
    placed = []
    for shape, colour in objects:
        t = scenes.place(rng, canvas, shape, colour)
        if t is not None:
            canvas.things.append(t)
            placed.append(t)
    seen, stills = placed[0], placed[1:]
    groups, shown = frames // 2, int(rng.integers(3, 9))  # tokens (two frames each) it is in view for
    first = int(rng.integers(0, groups - shown + 1))
    jpeg = int(rng.integers(40, 95)) if rng.random() < 0.4 else 0
    pictures = [scenes.Picture(cols, rows, bg, stills + ([seen] if first <= f // 2 < first + shown else []),
                               {"colour_jitter": 25, "jpeg": jpeg}) for f in range(frames)]
    per = cols * rows

    def tokens(t, in_view, cells) -> tuple[int, ...]:
        return tuple(sorted(g * per + k for g in in_view for k in cells(t)))

    window, always = range(first, first + shown), range(groups)
    named = [(seen.shape, seen.colour, tokens(seen, window, canvas.cells_of), tokens(seen, window, canvas.core_of))]
    named += [(t.shape, t.colour, tokens(t, always, canvas.cells_of), tokens(t, always, canvas.core_of)) for t in stills]
    question = scenes.colour_question(*named[0])
    questions = [question] + scenes._follow_ups(rng, named, {0}, turns)
    return Item("glimpse", questions, pictures, video=True,
                informative=tuple(sorted({k for o in named for k in o[2]})), fps=LONG_FPS)


def held_out_long(kind: str, count: int, turns: int = 2, offset: int = 10_000_000,
                  minutes: float | None = None) -> list[Item]:
    return [long_item(offset + i, kind, turns, minutes=minutes) for i in range(count)]


EXAMPLE_SEED = 20_000_000  # above the training and held-out seeds, below drawn_scenes.fresh()'s
EXAMPLE_FILE = "scene_long.mp4"
EXAMPLE_FRAMES = 60  # at LONG_FPS: a video of a minute or more


def example() -> tuple[Item, list[str]]:
    """The app's long-video example, two turns: the first ``glimpse`` video from EXAMPLE_SEED of
    EXAMPLE_FRAMES frames or more (a minute or longer at 1 frame a second), and the file in
    assets/ that assets/make_examples.py draws it into. Its first question is about an object in
    view for a few seconds, which a method holding the stream under a cap may have let go."""
    it = next(it for it in (long_item(EXAMPLE_SEED + i, "glimpse", 2) for i in range(1000))
              if len(it.pictures) >= EXAMPLE_FRAMES and len(it.turns) == 2)
    return it, [EXAMPLE_FILE]
