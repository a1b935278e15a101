"""Loaded models, shared between sessions (read-only weights): each loads once, and at most one
large (hub-sized) model stays loaded so a GPU holds one set of weights."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable

import torch

import backends

from ..errors import UserError
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import LoadedModel, load_model, model_spec
from . import zerogpu
from .model_picker import check_model_allowed

Progress = Callable[[float, str], None]


def silent(fraction: float, text: str) -> None:
    pass


_MODELS: dict[str, LoadedModel] = {}
_MODEL_LOCK = threading.Lock()


def get_model(name: str, progress: Progress = silent) -> LoadedModel:
    """Load (once) and return a model a visitor may pick (:func:`check_model_allowed`); one hub
    model at a time so a GPU holds one set of weights."""
    check_model_allowed(name)
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
                Conversation(loaded, backends.make_reference()).ask(Message("Hi"), max_new_tokens=2)
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


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()



def _after_fork() -> None:
    """A forked worker (ZeroGPU) cannot wait on a lock its parent held while forking."""
    global _MODEL_LOCK
    _MODEL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
