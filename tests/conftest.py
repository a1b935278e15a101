"""Shared fixtures: the offline tiny models (loaded once per session) and synthetic media."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))

from kv_arena.runtime.models import load_model
from tests.support import make_image, make_video


@pytest.fixture(scope="session")
def models():
    """name -> LoadedModel, built lazily and shared by every test."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(name)
        return cache[name]

    return get


@pytest.fixture
def image():
    return make_image(0)


@pytest.fixture
def video():
    return make_video(0)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Small inputs: a 112 px image is 16 visual tokens, so a turn takes a fraction of a second."""
    root = tmp_path_factory.mktemp("media")
    paths = {"image": root / "a.png", "image2": root / "b.png", "corrupt": root / "corrupt.png",
             "fake_video": root / "notes.mp4", "big_video": root / "big.mp4"}
    make_image(1, (112, 112)).save(paths["image"])
    make_image(2, (112, 84)).save(paths["image2"])
    paths["corrupt"].write_bytes(b"\x89PNG\r\n\x1a\n this is not really a picture")
    paths["fake_video"].write_text("plain text, not a video")
    paths["big_video"].write_bytes(b"\0" * (2 * 2**20))
    paths["video"] = ROOT / "assets" / "bouncing_ball.mp4"  # the committed example: 2 s, 224 px
    return {k: str(v) for k, v in paths.items()}
