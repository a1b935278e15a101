"""Shared fixtures: the offline tiny models (loaded once per session) and synthetic media."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))

from engine.runtime.generate import Conversation  # noqa: E402
from engine.runtime.inputs import Message  # noqa: E402
from engine.media import Video  # noqa: E402
from engine.runtime.models import load_model  # noqa: E402

TINY_MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-llava"]


@pytest.fixture(scope="session")
def models():
    """name -> LoadedModel, built lazily and shared by every test."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(name)
        return cache[name]

    return get


def make_image(seed: int = 0, size=(448, 448)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def make_video(seed: int = 0, frames: int = 4, size: int = 224) -> Video:
    rng = np.random.RandomState(seed)
    data = (rng.rand(frames, size, size, 3) * 255).astype("uint8")
    return Video(frames=data, timestamps=[i * 0.5 for i in range(frames)], fps=2.0)


@pytest.fixture
def image():
    return make_image(0)


@pytest.fixture
def video():
    return make_video(0)


def answer(loaded, backend, message: Message, max_new_tokens: int = 16):
    """Run one turn with ``backend``; returns (update, conversation)."""
    conv = Conversation(loaded, backend)
    return conv.ask(message, max_new_tokens=max_new_tokens), conv
