"""What tests build their inputs with: the offline tiny models' names, seeded synthetic media, and
one chat turn under a method."""

from __future__ import annotations

import numpy as np
from PIL import Image

from engine.media import Video
from engine.runtime.generate import Conversation
from engine.runtime.inputs import Message

TINY_MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-llava"]


def make_image(seed: int = 0, size=(448, 448)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def make_video(seed: int = 0, frames: int = 4, size: int = 224) -> Video:
    rng = np.random.RandomState(seed)
    data = (rng.rand(frames, size, size, 3) * 255).astype("uint8")
    return Video(frames=data, timestamps=[i * 0.5 for i in range(frames)], fps=2.0)


def answer(loaded, backend, message: Message, max_new_tokens: int = 16):
    """Run one turn with ``backend``; returns (update, conversation)."""
    conv = Conversation(loaded, backend)
    return conv.ask(message, max_new_tokens=max_new_tokens), conv
