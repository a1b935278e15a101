"""Loaded models, shared between sessions (read-only weights): each loads once, and at most one
large (hub-sized) model stays loaded so a GPU holds one set of weights."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable

import torch
from PIL import Image

import backends

from ..errors import UserError
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import ARENA, DEFAULT_MODEL, MODELS, LoadedModel, hub_reachable, load_model, model_spec
from ..tiny import arena_scenes
from ..tiny.arena_model import arena_weights_present
from . import zerogpu

Progress = Callable[[float, str], None]
HUB_DEFAULT = "Qwen/Qwen2-VL-2B-Instruct"
# The app's clickable examples for the trained model, one per question type: (question, media files in assets/),
# each answered right.
ARENA_EXAMPLES: list[tuple[str, list[str]]] = [(it.question.text, files)
                                               for it, files in arena_scenes.examples().values()]


def silent(fraction: float, text: str) -> None:
    pass


_MODELS: dict[str, LoadedModel] = {}
_MODEL_LOCK = threading.Lock()


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


def get_model(name: str, progress: Progress = silent) -> LoadedModel:
    """Load (once) and return a model; one hub model at a time so a GPU holds one set of weights."""
    with _MODEL_LOCK:
        if name in _MODELS:
            return _MODELS[name]
        spec = model_spec(name)
        if not spec.small:  # free the previous large model before loading another
            for other in [n for n in _MODELS if not model_spec(n).small]:
                del _MODELS[other]
            free_memory()
        try:
            loaded = load_model(name, progress=progress)
            if not zerogpu.ZERO_GPU:  # on ZeroGPU the GPU exists only inside a GPU function: no forward here
                progress(0.95, "Warming up (so the first timings are not start-up costs)...")
                Conversation(loaded, backends.make_backend("full")).ask(Message("Hi"), max_new_tokens=2)
        except UserError:
            raise
        except torch.OutOfMemoryError:
            free_memory()
            raise UserError(f"Not enough memory to load {name}; pick a smaller model.") from None
        except Exception as exc:  # a broken download, a missing package: readable, never a traceback
            first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
            raise UserError(f"{name} failed to load: {exc.__class__.__name__}: {first_line}") from None
        _MODELS[name] = loaded
        return loaded


def image_tokens(name: str, side: int = 448) -> int:
    """Visual tokens the model makes of one ``side`` x ``side`` image (its processor's own resize)."""
    loaded = get_model(name)
    chunk = loaded.adapter.encode_turn(Message("", images=[Image.new("RGB", (side, side))]), 0, 0, None)
    return chunk.layout.visuals[0].length


def mpic_default_k(name: str, paper_k: int = 32) -> int:
    """MPIC-k's k for this model: the paper's 32 recomputed tokens per image (of 256 and more in
    its models), capped at a quarter of the model's tokens for a 448 px image, so a model with
    few tokens per image still reuses most of each stored image."""
    return max(1, min(paper_k, image_tokens(name) // 4))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()



def _after_fork() -> None:
    """A forked worker (ZeroGPU) cannot wait on a lock its parent held while forking."""
    global _MODEL_LOCK
    _MODEL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
