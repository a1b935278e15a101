"""kv_arena: KV-cache compression methods for vision-language models, on stock transformers models
and in the app (``app.py``). The library's front door::

    import kv_arena

    kv_arena.methods()                       # the registered methods, the full cache first
    with kv_arena.compress(model, "snapkv", budget=0.2) as press:
        out = model.generate(**inputs, cache=press.cache, max_new_tokens=64)

Its packages, one per job; each layer imports only the ones below it (checked by ``lint-imports``,
see pyproject.toml):

* :mod:`kv_arena.service`: the app's facade (sessions, turns, the figures the panels draw).
* :mod:`kv_arena.bench`: the benchmark CLIs (``python -m kv_arena.bench``, or ``kv-arena-bench``).
* :mod:`kv_arena.hf`: any method on a stock transformers model through ``model.generate``.
* :mod:`kv_arena.testing`: the checks every method passes, for a method's own tests (a plugin's too:
  a method from another package, declared in the entry-point group ``kv_arena.methods``, docs/plugins.md).
* :mod:`kv_arena.mpic`: MPIC's media KV store and how stored media is linked into a prompt.
* :mod:`kv_arena.runtime`: models, inputs and prompt layout, the cache, the attention seam, generation.
* :mod:`kv_arena.tiny`: the offline tiny models: built-in random ones, and tiny-arena-vl (trained
  here) with its word tokenizer and scenes.
* :mod:`kv_arena.media`: images and videos read from disk within limits.
* :mod:`kv_arena.errors`: errors a user can fix.

The methods themselves, one file each, are :mod:`kv_arena.backends`: the repository's top-level
``backends/``, installed under this package's name (a checkout imports them as ``backends`` too, the
same modules); they know nothing of the rest of kv_arena.
"""

from __future__ import annotations

from importlib import import_module

# loaded on first use: ``import kv_arena`` stays light (torch and transformers come with these)
_LAZY = {"compress": "kv_arena.hf", "Press": "kv_arena.hf", "Chat": "kv_arena.hf",
         "save_offline": "kv_arena.hf", "make_backend": "kv_arena.backends",
         "backend_class": "kv_arena.backends"}


def methods() -> list[str]:
    """The registered KV-cache methods' names, the reference (the full cache) first."""
    return import_module("kv_arena.backends").available()


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kv_arena' has no attribute {name!r}")


__all__ = ["methods", *_LAZY]
