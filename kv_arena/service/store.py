"""MPIC's media KV store: one per application (:class:`StoreHolder`), shared by every session (each
in its own namespace).

The one place the store is chosen: ``KV_ARENA_KV_STORE_URL`` (``redis://host:port/db``, Valkey or
Redis) puts a shared server behind the local store (:class:`~kv_arena.mpic.server_store.ServerStore`);
without it the store is memory and local disk (:class:`~kv_arena.mpic.kv_store.KVStore`).
docs/mpic_store.md says how to run replicas on one server and what they share."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..media import load_image
from ..mpic.kv_store import LOAD_TIMEOUT_S, KVStore
from ..mpic.linking import media_key
from ..mpic.store_api import MediaStore
from ..paths import ASSETS
from .current import current_app, using_app
from .instance import own_folder, sweep_gone

EXAMPLES = ASSETS  # the app's shipped example media


class StoreHolder:
    """The app's one media store, opened on first use (:func:`store_at_start`, which sweeps), and
    which client each session's stored media belong to."""

    def __init__(self, store: MediaStore | None = None, tenants: dict[str, str] | None = None) -> None:
        self.store = store
        # session id -> its client's id (the cookie every replica sees)
        self.tenants: dict[str, str] = {} if tenants is None else tenants
        self.swept = store is not None  # a store given is used as it is: nothing of it to sweep
        self.lock = threading.Lock()

    def get(self) -> MediaStore:
        with self.lock:
            if self.store is None:
                self.store = make_store() if self.swept else store_at_start()
                self.swept = True
            return self.store

    def holding(self, store: MediaStore) -> StoreHolder:
        """A holder of ``store`` that knows the same tenants (a replica's own store, a drill)."""
        return StoreHolder(store, self.tenants)

    def after_fork(self) -> None:
        """A forked worker (ZeroGPU) opens the store anew: the parent's writer threads do not exist in
        it. What a worker stores reaches the app through the disk (GPU functions flush before they end)."""
        self.store, self.lock = None, threading.Lock()
        self.swept = True  # the parent's sessions are alive: a worker never sweeps


def bind_tenant(session_id: str, client: str | None) -> None:
    """The session's stored media belong to its client (its browser or API client), on any replica."""
    tenants = current_app().store.tenants
    if client:
        tenants[session_id] = f"client:{client}"
    else:
        tenants.pop(session_id, None)


def tenant_of(session_id: str) -> str:
    """A session's tenant on a shared server: its client's, else the session alone."""
    return current_app().store.tenants.get(session_id, session_id)


@functools.cache
def example_keys() -> frozenset[str]:
    """Content hashes of the shipped example images: shared across tenants where enabled."""
    return frozenset(media_key(load_image(str(p))) for p in sorted(EXAMPLES.glob("*.png")))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def make_store() -> MediaStore:
    """The store the environment asks for (the module docstring)."""
    root = local_root()
    disk = int(float(os.environ.get("KV_ARENA_KV_STORE_MB", "8192")) * 2**20)
    ttl = float(os.environ.get("KV_ARENA_KV_STORE_TTL_S", 24 * 3600))
    # the longest a turn waits for a stored entry's load (local disk or server) before it recomputes
    load_timeout = float(os.environ.get("KV_ARENA_KV_STORE_LOAD_TIMEOUT_S", LOAD_TIMEOUT_S))
    local = KVStore(own_folder(Path(root)), memory_bytes=disk // 4, disk_bytes=disk, ttl_s=ttl,
                    load_timeout_s=load_timeout)
    url = os.environ.get("KV_ARENA_KV_STORE_URL", "").strip()
    if not url:
        return local
    from ..mpic.server_store import ServerStore  # the client library is needed only with a server

    return ServerStore(url, local, ttl_s=ttl, timeout_s=float(os.environ.get("KV_ARENA_KV_STORE_TIMEOUT_S", "1")),
                       tenant_of=tenant_of,
                       public_keys=example_keys() if _flag("KV_ARENA_KV_STORE_SHARE_EXAMPLES") else ())


def media_store() -> MediaStore:
    """The process's one media KV store (:func:`make_store`). ``KV_ARENA_KV_STORE`` (a directory,
    else a temp one) holds its local tier, ``KV_ARENA_KV_STORE_MB`` caps that tier's disk use
    (memory: a quarter of that)."""
    return current_app().store.get()


def store_at_start() -> MediaStore:
    """The store as the app's process first opens it: the folders app processes that are gone left
    (a crash, a kill) are removed; another live app process on this host keeps its own."""
    sweep_gone(Path(local_root()))
    return make_store()


def local_root() -> str:
    """Where the local tier's processes each keep their folder: ``KV_ARENA_KV_STORE``, else a temp folder."""
    return os.environ.get("KV_ARENA_KV_STORE") or os.path.join(tempfile.gettempdir(), "kv-arena-mpic")


@contextmanager
def using_store(store: MediaStore) -> Iterator[MediaStore]:
    """``store`` as the app's media store for the block (a replica's own store, a drill): the
    current application state with another store holder, its other parts shared."""
    app = current_app()
    with using_app(dataclasses.replace(app, store=app.store.holding(store))):
        yield store
