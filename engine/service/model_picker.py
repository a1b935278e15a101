"""The model picker: the model the app starts with (a GPU and a network probe decide), the choices
it offers, and what each model is (trained here, random weights, its description)."""

from __future__ import annotations

import os

import torch

from ..runtime.models import ARENA, DEFAULT_MODEL, MODELS, hub_reachable, model_spec
from ..tiny.arena_model import arena_weights_present

HUB_DEFAULT = "Qwen/Qwen2-VL-2B-Instruct"


def default_model() -> str:
    """``KV_ARENA_MODEL`` if set; a real hub model with a GPU and network; else the model trained here
    (it answers questions about its scenes), or a tiny random one if its weights are missing."""
    chosen = os.environ.get("KV_ARENA_MODEL")
    if chosen:
        return chosen
    if torch.cuda.is_available() and hub_reachable():
        return HUB_DEFAULT
    return ARENA if arena_weights_present() else DEFAULT_MODEL


def model_choices() -> list[tuple[str, str]]:
    """(label, name) for the model picker; hub models say that they download weights."""
    return [(f"{name} (download)" if spec.needs_download else name, name) for name, spec in MODELS.items()]


def has_random_weights(name: str) -> bool:
    return name in MODELS and model_spec(name).random_weights


def is_trained_here(name: str) -> bool:
    return name in MODELS and model_spec(name).source == "trained"


def model_description(name: str) -> str:
    return model_spec(name).description
