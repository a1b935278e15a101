"""Loaded models, shared between sessions (read-only weights): each loads once, and at most one
large (hub-sized) model stays loaded so a GPU holds one set of weights."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import torch
from PIL import Image

from kv_arena import backends

from ..errors import UserError
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import LoadedModel, load_model, model_spec
from . import zerogpu
from .current import current_app
from .model_picker import check_model_allowed

Progress = Callable[[float, str], None]


def silent(fraction: float, text: str) -> None:
    pass


class ModelPool:
    """The models this process loaded, by name; a forked worker keeps its parent's (copied by the fork)."""

    def __init__(self) -> None:
        self.models: dict[str, LoadedModel] = {}
        self.lock = threading.Lock()

    def get(self, name: str, progress: Progress = silent) -> LoadedModel:
        """:func:`get_model` on this pool."""
        check_model_allowed(name)
        with self.lock:
            if name not in self.models:
                if not model_spec(name).small:  # free the previous large model before loading another
                    for other in [n for n in self.models if not model_spec(n).small]:
                        del self.models[other]
                    free_memory()
                self.models[name] = loaded_and_warm(name, progress)
            return self.models[name]

    def after_fork(self) -> None:
        """A forked worker (ZeroGPU) cannot wait on a lock its parent held while forking."""
        self.lock = threading.Lock()


def get_model(name: str, progress: Progress = silent) -> LoadedModel:
    """Load (once) and return a model a visitor may pick (:func:`check_model_allowed`); one hub
    model at a time so a GPU holds one set of weights."""
    return current_app().models.get(name, progress)


def loaded_and_warm(name: str, progress: Progress) -> LoadedModel:
    """``name`` loaded and run once; a failure said in one line (:class:`UserError`)."""
    try:
        loaded = load_model(name, progress=progress)
        if not zerogpu.ZERO_GPU:  # on ZeroGPU the GPU exists only inside a GPU function: no forward here
            progress(0.95, "Warming up (so the first timings are not start-up costs)...")
            # an image too: the vision tower's and the processor's first call cost more than a prefill
            # (a Compare's first full-cache run once read 0.9 s where the next ones read 0.05 s)
            picture = Image.new("RGB", (224, 224), (128, 128, 128))
            Conversation(loaded, backends.make_reference()).ask(Message("Hi", images=[picture]), max_new_tokens=2)
    except UserError:
        raise
    except torch.OutOfMemoryError:
        free_memory()
        raise UserError(f"Not enough memory to load {name}; pick a smaller model.") from None
    except Exception as exc:  # a broken download, a missing package: readable, never a traceback
        first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise UserError(f"{name} failed to load: {exc.__class__.__name__}: {first_line}") from None
    return loaded


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

