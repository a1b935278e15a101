"""Shared fixtures: the offline tiny models (loaded once per session) and synthetic media."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))

from engine.runtime.models import load_model  # noqa: E402
from tests.support import make_image, make_video  # noqa: E402


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
