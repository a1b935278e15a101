"""The application state this process uses now: one slot, and the only module-level state of the
service. ``app.py`` opens the app's own (:func:`open_app`); tests install theirs for a block
(:func:`using_app`); library use, the benches and a forked GPU worker use the one the package
installs when it is imported (:class:`~kv_arena.service.app_state.AppState` with its defaults).

A slot, not an argument, because GPU functions may run in a forked ZeroGPU worker that receives
pickled arguments: locks and loaded models do not pickle, so a worker reaches them here. After a
fork the worker's copy drops what it cannot use (its parent's locks, the store's writer threads).

This module imports no part of the state (each part's module reads the slot: importing them here
would make a cycle)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_app = None  # the AppState in use: replaced whole, never mutated here


def current_app():
    """The :class:`AppState` this process uses now."""
    if _app is None:
        raise LookupError("no application state is open: import kv_arena.service, which opens one")
    return _app


def open_app(app):
    """Use ``app`` from now on; returns the one it replaces (None at the package's import)."""
    global _app
    previous, _app = _app, app
    return previous


@contextmanager
def using_app(app) -> Iterator:
    """``app`` as the process's application state for the block (a test's own, a replica's)."""
    previous = open_app(app)
    try:
        yield app
    finally:
        open_app(previous)


def _after_fork() -> None:
    if _app is not None:
        _app.after_fork()


os.register_at_fork(after_in_child=_after_fork)
