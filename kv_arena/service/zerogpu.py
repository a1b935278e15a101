"""Where the GPU work runs: ``spaces.GPU`` on a Hugging Face Space, a plain call elsewhere.

On a ZeroGPU Space (``SPACES_ZERO_GPU=true``) a function under ``spaces.GPU`` runs in a worker
process forked from the app's (``spaces/zero/wrappers.py`` in the ``spaces`` package 0.51.3): its
arguments are pickled in, its results (a generator's yields too) pickled out, and what it changes
in Python objects stays in the worker. So the app's GPU functions are pure: they take a
session's state and hand the new one back in their results (see ``kv_arena/service/``).

* :func:`gpu_function` marks such a function and says how long it may hold the GPU, as a
  callable of the same arguments (ZeroGPU schedules by it; a fixed 120 s would refuse a long video
  and over-book a short question).
* :func:`use_decorator` swaps what wraps them (a test's stand-in that forks like ZeroGPU).
* A forked worker computes on one CPU thread: OpenMP's thread pool does not survive ``fork``,
  so a worker whose parent had already used it hangs at its first parallel CPU op (a pixel
  tensor's normalisation, say); PyTorch's DataLoader workers do the same for the same reason.
* :func:`relocate` moves a state's tensors (a chat's cache) between the GPU and the CPU: on
  ZeroGPU the GPU is gone between calls, so a state crosses on the CPU; on dedicated hardware it
  stays where it is (no copy).
"""

from __future__ import annotations

import functools
import inspect
import io
import os
from collections.abc import Callable

import torch

ZERO_GPU = os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")
MAX_SECONDS = int(os.environ.get("KV_ARENA_GPU_SECONDS_MAX", 300))

Duration = Callable[..., float]


def on_gpu(loaded) -> bool:
    """Whether a loaded model's turns run on a GPU (on ZeroGPU it waits on the CPU between them)."""
    return ZERO_GPU or loaded.device.type == "cuda"


def spaces_decorator(fn: Callable, duration: Duration) -> Callable:
    """``spaces.GPU(duration=...)`` where the ``spaces`` package is installed (a no-op outside a
    ZeroGPU Space); the function itself elsewhere."""
    try:
        import spaces
    except ImportError:
        return fn
    return spaces.GPU(duration=duration)(fn)


_PARENT_PID = os.getpid()


def _single_threaded_if_forked() -> None:
    if os.getpid() != _PARENT_PID and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def fork_safe(fn: Callable) -> Callable:
    """``fn`` that first drops to one CPU thread when it runs in a forked worker (a generator
    function stays one: ``spaces.GPU`` picks its streaming wrapper by that)."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(*args, **kwargs):
            _single_threaded_if_forked()
            yield from fn(*args, **kwargs)
        return stream

    @functools.wraps(fn)
    def call(*args, **kwargs):
        _single_threaded_if_forked()
        return fn(*args, **kwargs)
    return call


_decorator: Callable[[Callable, Duration], Callable] = spaces_decorator
_functions: list[tuple[Callable, Duration, dict]] = []  # (function, duration, {"run": its wrapped form})


def gpu_function(duration: Duration) -> Callable[[Callable], Callable]:
    """Run the decorated function where the GPU is; ``duration`` takes the same arguments and
    returns seconds (capped at ``KV_ARENA_GPU_SECONDS_MAX``, default 300)."""
    def capped(*args, **kwargs) -> int:
        return int(min(MAX_SECONDS, max(5.0, duration(*args, **kwargs))))

    def wrap(fn: Callable) -> Callable:
        safe = fork_safe(fn)
        slot = {"run": _decorator(safe, capped)}
        _functions.append((safe, capped, slot))

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return slot["run"](*args, **kwargs)
        call.duration = capped
        return call
    return wrap


def use_decorator(decorator: Callable[[Callable, Duration], Callable]) -> Callable:
    """Wrap every GPU function with ``decorator(fn, duration)`` from now on; returns the previous one."""
    global _decorator
    previous, _decorator = _decorator, decorator
    for fn, duration, slot in _functions:
        slot["run"] = decorator(fn, duration)
    return previous


def relocate(state, device: torch.device | str):
    """``state`` with every tensor on ``device`` (a copy through torch's serialiser, which handles
    any object graph; objects drop their live parts through ``__getstate__`` on the way)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location=device, weights_only=False)
