"""The model picker: the model the app starts with (a GPU and a network probe decide), the choices
it offers, and what each model is (trained here, random weights, its description)."""

from __future__ import annotations

import os

import torch

from ..errors import UserError
from ..runtime.models import ARENA, DEFAULT_MODEL, MODELS, describe, hub_reachable, model_spec, parameter_count
from ..tiny.arena_model import arena_weights_present

HUB_DEFAULT = "Qwen/Qwen2-VL-2B-Instruct"
# random:<repo> builds a hub architecture with random weights in the server's memory (benches and
# tests): a visitor may pick one only where an operator allows it, and then only under a size cap
RANDOM_MODELS = "KV_ARENA_RANDOM_MODELS"  # "1": random: architectures may be picked
RANDOM_MAX_PARAMS = "KV_ARENA_RANDOM_MAX_PARAMS"  # their cap in parameters (default 3e9)


def random_models_allowed() -> bool:
    return os.environ.get(RANDOM_MODELS, "0") == "1"


def check_model_allowed(name) -> None:
    """Refuse a model a visitor may not pick: an unknown name, or a ``random:`` architecture unless
    the operator allows them (and then one over the cap, measured before anything is allocated)."""
    if not isinstance(name, str):
        raise UserError(f"The model must be a name (text); got {type(name).__name__}.")
    spec = model_spec(name)
    if spec.source != "random":
        return
    if not random_models_allowed():
        raise UserError(f"'{name}' (random weights at full size) is not offered on this server; pick one of the "
                        f"listed models (an operator allows them with {RANDOM_MODELS}=1).")
    cap = float(os.environ.get(RANDOM_MAX_PARAMS, 3e9))
    count = parameter_count(name)
    if count > cap:
        raise UserError(f"'{name}' has {count / 1e9:.1f} billion parameters; this server builds random "
                        f"architectures of at most {cap / 1e9:g} billion.")


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
    return [(f"{name} (download)" if spec.needs_download else name, name) for name, spec in MODELS.items()
            if spec.source != "random" or random_models_allowed()]


def has_random_weights(name: str) -> bool:
    return name in MODELS and model_spec(name).random_weights


def is_trained_here(name: str) -> bool:
    return name in MODELS and model_spec(name).source == "trained"


def model_description(name: str) -> str:
    """What the model is (the trained one's: what its served generation reads)."""
    return describe(name)
