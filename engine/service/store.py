"""MPIC's media KV store: one per process, shared by every session (each in its own namespace)."""

from __future__ import annotations

import os
import tempfile
import threading

from ..mpic.kv_store import KVStore

_STORE: KVStore | None = None
_STORE_LOCK = threading.Lock()
_SWEPT = False  # the folders of an earlier process's sessions were removed (once, in the app's process)


def media_store() -> KVStore:
    """The process's one media KV store: ``KV_ARENA_KV_STORE`` (a directory), or a temp one.
    ``KV_ARENA_KV_STORE_MB`` caps its disk use (memory: a quarter of that)."""
    global _STORE, _SWEPT
    with _STORE_LOCK:
        if _STORE is None:
            root = os.environ.get("KV_ARENA_KV_STORE") or os.path.join(tempfile.gettempdir(), "kv-arena-mpic")
            disk = int(float(os.environ.get("KV_ARENA_KV_STORE_MB", "8192")) * 2**20)
            _STORE = KVStore(root, memory_bytes=disk // 4, disk_bytes=disk)
            if not _SWEPT:  # sessions of an earlier run left folders (a crash, a kill): none is alive now
                _STORE.sweep_namespaces()
                _SWEPT = True
        return _STORE


def _after_fork() -> None:
    """A forked worker (ZeroGPU) opens the store anew: the parent's writer threads do not exist in
    it. What a worker stores reaches the app through the disk (GPU functions flush before they end)."""
    global _STORE, _STORE_LOCK, _SWEPT
    _STORE, _STORE_LOCK = None, threading.Lock()
    _SWEPT = True  # the parent's sessions are alive: a worker never sweeps


os.register_at_fork(after_in_child=_after_fork)
