"""A scene generator's question and item, one definition for every generation of tiny-arena-vl's
scenes (v2's tiles, arena_scenes.py, and v3's drawings, drawn_scenes.py), so the app, the accuracy
benchmark and the training scripts read them alike.

A picture (an image, or a video frame) is the generator's own; an item needs of it only
``image()`` (a PIL image) and ``token_count`` (its visual tokens as one image).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Question:
    kind: str  # what is asked: colour / shape (and a generation's own kinds)
    text: str
    answer: str
    tokens: tuple[int, ...]  # visual tokens the answer depends on
    # per answer word, the visual tokens that show the object it names (generation 3's scenes: the
    # cells whose centre lies in the object, for the pointer loss of its training); empty where a
    # generator does not say
    parts: tuple[tuple[int, ...], ...] = ()


@dataclass
class Item:
    """Media and a conversation about them: ``turns`` are asked one after another in one chat."""

    kind: str
    turns: list[Question]
    pictures: list = field(default_factory=list)  # images, or the frames of one video
    video: bool = False
    informative: tuple[int, ...] = ()  # every object token
    fps: float = 2.0

    @property
    def question(self) -> Question:
        return self.turns[0]

    def images(self) -> list:
        return [p.image() for p in self.pictures]

    def frames(self) -> np.ndarray:
        return np.stack([np.asarray(im) for im in self.images()])

    def media(self) -> dict:
        """Keyword arguments for :class:`kv_arena.runtime.inputs.Message`."""
        if self.video:
            from ..media import Video

            frames = self.frames()
            return {"videos": [Video(frames, [i / self.fps for i in range(len(frames))], fps=self.fps)],
                    "num_frames": len(frames)}
        return {"images": self.images()}

    def visual_tokens(self) -> int:
        """Qwen2.5-VL's count: a video's token spans two frames."""
        per = [p.token_count for p in self.pictures]
        return sum(per) // 2 if self.video else sum(per)
