"""One forward pass of a text model through the runtime's attention seam, as the conversation, the
benchmarks and the public entry point run it: the model's position ids from rotary ids, the cache
told which tokens arrive, the backend's ``before_forward`` / ``after_forward`` around the pass."""

from __future__ import annotations

import functools
import inspect

import torch

from kv_arena.backends.base import AttentionCall

from .attention import ForwardRun, forward_run
from .cache import KVCache
from .narrowing import narrowing
from .vision_tokens import selecting_visual_tokens


def position_ids(rope_ids: torch.Tensor) -> torch.Tensor:
    """(P, n) rotary ids -> the ``position_ids`` the model takes: M-RoPE's three rows (temporal,
    height, width) as (3, 1, n), with the batch of one in the middle; 1-D positions (1, n) as they are."""
    return rope_ids[:, None, :] if rope_ids.shape[0] == 3 else rope_ids


def rotary_of(decoder):
    """``AttentionCall.rotary`` for a decoder built alone (a text model with its ``rotary_emb``): (P, n)
    rotary ids -> (cos, sin) as the model computes them; a method that rotates stored keys (AttentionPack)
    needs it in every prefill."""
    dummy = torch.zeros(1, dtype=decoder.dtype, device=decoder.device)

    def rotary(rope_ids: torch.Tensor):
        return decoder.rotary_emb(dummy, position_ids(rope_ids.to(decoder.device)))

    return rotary


@functools.cache
def _keyword_of(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward (and so ``generate``) takes its KV cache by: ``cache`` from
    transformers 5.24 on, where ``past_key_values`` is renamed on the way in with a FutureWarning
    (removal announced for 5.40 on the forward, 6.0 on ``generate``), ``past_key_values`` before."""
    return _keyword_of(type(model).forward)


def run_forward(model, cache: KVCache, call: AttentionCall, sync: bool = False, **inputs):
    """``model(**inputs)`` on ``cache`` for the new tokens ``call`` describes (their token indices,
    rotary ids, layout): the cache learns which tokens the new keys belong to, the backend opens
    and closes the pass (and, if it ``narrows_prefill``, drops rows between layers), its
    ``after_forward`` is timed with its other hooks. The inputs and ``call.positions`` are on the model's device (``call.rope_ids`` may be on the CPU); ``sync``:
    CUDA, where hooks are timed with events. Returns (the model's output, the :class:`ForwardRun`),
    whose ``settle()`` gives the seconds spent in the backend's hooks, read when the caller chooses
    (a timed caller reads it after its own clock)."""
    cache.pending_positions = call.positions
    run = ForwardRun(cache, call, sync=sync)
    # a method may run later layers on fewer rows, or choose an image's tokens before the decoder
    with forward_run(run), narrowing(model, cache.backend), selecting_visual_tokens(model, cache.backend):
        out = model(position_ids=position_ids(call.rope_ids.to(call.positions.device)), use_cache=True,
                    **{cache_keyword(model): cache}, **inputs)
        run.timed(cache.backend.after_forward, cache, call)
    return out, run
