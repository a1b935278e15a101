"""Time to first token of one prompt under MPIC's modes, in a session's current store state: the
app's "prefix caching vs MPIC" panel and ``python -m kv_arena.bench --mode mpic`` both measure with it.

Besides the TTFT, :func:`time_prompt` says where it went: ``vision_s`` (the vision encoder),
``lm_s`` (the language model's forward passes), ``linking_s`` (the rest of the prefill: store
lookups and loads, rotary shifts of stored keys, assembling the input embeddings; input
preparation alone when nothing is linked) and ``other_s`` (before and after the prefill: the
processor, tokenisation, sampling the token). The four add up to ``ttft_s``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from kv_arena import backends
from kv_arena.backends.media_reuse import ReusesMedia

from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import LoadedModel
from .store_api import MediaStore
from .linking import Linker


class StageClock:
    """Seconds spent inside given modules' forward passes, summed per stage; waits for the device
    where it runs asynchronously. A pass that never returns (an early stop) is not counted."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def watching(self, stages: dict[str, list]):
        """Time every module of ``stages`` (stage name -> modules) while the block runs."""
        handles = []
        for stage, modules in stages.items():
            self.seconds.setdefault(stage, 0.0)
            for module in modules:
                handles.append(module.register_forward_pre_hook(self._enter(stage)))
                handles.append(module.register_forward_hook(self._leave(stage)))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, stage: str):
        def hook(module, args):
            self._started[stage] = self.now()
        return hook

    def _leave(self, stage: str):
        def hook(module, args, output):
            self.seconds[stage] += self.now() - self._started.pop(stage)
        return hook


def reuse_method(**params) -> ReusesMedia:
    """The registered method that reuses stored media KV (MPIC), built: found by what it does."""
    names = backends.names_where(lambda cls: issubclass(cls, ReusesMedia))
    if not names:
        raise ImportError("no registered method reuses stored media KV (a ReusesMedia subclass)")
    return backends.make_backend(names[0], **params)


def time_prompt(loaded: LoadedModel, store: MediaStore, session: str, message: Message, mode: str, **params) -> dict:
    """One answer token under ``mode``: its TTFT and its parts (module docstring), the token, what
    the linker did per visual, and how many prompt tokens' KV this prompt computed (mean over
    layers; the rest were reused). CacheBlend still runs a layer's projections and MLP over every
    row until it narrows them (after its check layer), so its KV count understates its work there."""
    conv = Conversation(loaded, reuse_method(mode=mode, **params), linker=Linker(store, session))
    clock = StageClock(loaded.device.type == "cuda")
    with clock.watching({"vision": loaded.vision_modules(), "lm": [loaded.language_model()]}):
        update = conv.ask(message, max_new_tokens=1)
    m, report = update.metrics, conv.backend.report
    recomputed = getattr(report, "recomputed", None)
    new_kv = (sum(len(r) for r in recomputed) / len(recomputed)) if recomputed else m.prompt_tokens
    vision, lm = clock.seconds["vision"], clock.seconds["lm"]
    return {"ttft_s": m.ttft_s, "first_token": update.token_ids[0], "status": list(conv.linker.status),
            "prompt_tokens": m.prompt_tokens, "new_kv_tokens": new_kv,
            "vision_s": vision, "lm_s": lm, "linking_s": max(m.prefill_s - vision - lm, 0.0),
            "other_s": max(m.ttft_s - m.prefill_s, 0.0)}


# the app's panel: full recompute (the reference every TTFT is divided by), prefix caching, MPIC-k
PANEL_MODES = ("recompute", "prefix", "mpic")


def measure_ttft(loaded, store: MediaStore, session: str, message: Message, modes=PANEL_MODES,
                 **params) -> dict[str, dict]:
    """TTFT of this prompt under each mode, in the session's current store state (the app's
    "prefix caching vs MPIC" panel): mode -> :func:`time_prompt`'s figures, with ``label``, the
    mode as a reader names it (``"MPIC-32"``)."""
    return {mode: time_prompt(loaded, store, session, message, mode, **params)
            | {"label": reuse_method(mode=mode, **params).reuse_label} for mode in modes}
