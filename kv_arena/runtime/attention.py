"""The attention function the text model runs, registered through transformers'
``AttentionInterface``: exact causal attention over whatever the cache holds, with the backend's
seams called around it. The model files are untouched."""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kv_arena.backends.attention_math import attention_probs, causal_attention, causal_attention_column_sums, decode_attention
from kv_arena.backends.base import AttentionCall

from .cache import KVCache

ATTENTION_NAME = "kv_arena"  # the text model's attn_implementation (models.load_model sets it)


@dataclass
class ForwardRun:
    """What one forward pass is: the cache, the backend, and the call template for its layers."""

    cache: KVCache
    call: AttentionCall
    overhead_s: float = 0.0
    sync: bool = False  # CUDA: hooks are timed with events, read once per forward pass (``settle``)
    events: list = field(default_factory=list)

    def call_for(self, layer_idx: int) -> AttentionCall:
        return replace(self.call, layer_idx=layer_idx)

    def narrow(self, rows: torch.Tensor) -> None:
        """Only ``rows`` of the new tokens go on to the next layers (CacheBlend drops the others
        between layers): the next layers' calls, and the keys the cache receives, are theirs."""
        call = self.call
        self.call = replace(call, positions=call.positions[rows.to(call.positions.device)],
                            rope_ids=call.rope_ids[:, rows.to(call.rope_ids.device)])
        self.cache.pending_positions = self.call.positions

    def timed(self, fn, *args, **kwargs):
        """Run a backend hook and add its time to the method's overhead. On CUDA the hook is
        bracketed by two events, so nothing waits for the device here."""
        if self.sync:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return result
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.overhead_s += time.perf_counter() - start
        return result

    def settle(self) -> float:
        """The overhead so far, in seconds: on CUDA one synchronisation reads every pending event."""
        if self.events:
            self.events[-1][1].synchronize()
            self.overhead_s += sum(start.elapsed_time(end) for start, end in self.events) / 1000
            self.events.clear()
        return self.overhead_s


_ACTIVE: ContextVar[ForwardRun | None] = ContextVar("kv_arena_forward", default=None)


def active_run() -> ForwardRun | None:
    """The forward pass now running in this thread, if any (for hooks around the decoder layers)."""
    return _ACTIVE.get()


@contextmanager
def forward_run(run: ForwardRun):
    """One forward pass through the runtime: the backend's ``before_forward`` opens it."""
    run.timed(run.cache.backend.before_forward, run.cache, run.call)  # a method may compress here (InfiniPot-V)
    token = _ACTIVE.set(run)
    try:
        yield run
    finally:
        _ACTIVE.reset(token)


def kv_arena_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    run = _ACTIVE.get()
    if run is None:  # a forward pass outside the runtime (e.g. training): plain causal attention
        return causal_attention(query, key, value, scaling).transpose(1, 2).contiguous(), None
    backend = run.cache.backend
    call = run.call_for(module.layer_idx)
    layer = run.cache.layers[module.layer_idx]
    out, row = backend.attend(call, query, key, value, scaling), None
    if out is None:
        out, row = exact_attention(backend, call, layer, query, key, value, scaling)
    if row is None and not call.is_prefill and backend.needs_decode_attention:
        row = run.timed(attention_probs, query, key, scaling)
    run.timed(backend.after_attention, call, layer, query, key, scaling, row)
    return out.transpose(1, 2).contiguous(), None


def exact_attention(backend, call: AttentionCall, layer, query, key, value, scaling: float):
    """The runtime's exact attention, computed so that it also yields what the backend scores
    with: (output, decode softmax row or None); a prefill may set ``call.column_sums``."""
    if call.is_prefill:
        if backend.needs_prefill_column_sums:
            out, call.column_sums = causal_attention_column_sums(query, key, value, scaling)
            return out, None
        return causal_attention(query, key, value, scaling), None
    read = layer.read_decode(query, scaling)  # a compressed layer answers from its stored form
    if read is not None:
        return read
    if backend.needs_decode_attention:
        return decode_attention(query, key, value, scaling)
    return causal_attention(query, key, value, scaling), None


def _no_mask(*args, **kwargs):
    """The attention function builds its own offset-causal mask; no 4-D mask is needed."""
    return None


AttentionInterface.register(ATTENTION_NAME, kv_arena_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
