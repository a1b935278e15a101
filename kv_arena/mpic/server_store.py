"""MPIC's media KV on a Valkey or Redis server that several app replicas share (issue #41).

MPIC (Zhao et al., arXiv:2502.01960, Sec. 4.2-4.3) keeps each image's KV "on local or remote
disks" and loads it while the forward pass runs. :class:`ServerStore` is the remote half: the
process's :class:`~.kv_store.KVStore` (memory and local disk) stays in front of it, so

* ``get`` looks in the local store first; on a miss it reads the entry's metadata from the server
  and loads its tensors in the background in stored order (embeddings, rotary ids, then layer by
  layer), so the forward pass waits only for the layer it needs (the paper's Fig. 6), and the
  loaded entry joins the local memory tier;
* ``put`` keeps the entry in the local store, as without a server, and sends it to the server in
  the background: one hash per entry (one field per tensor and ``meta``), written in one
  transaction with the server's own expiry (``EXPIRE``, refreshed on every hit); its memory cap and
  eviction are the server's ``maxmemory`` and ``maxmemory-policy`` (docs/mpic_store.md).

Tenants: an entry's key name holds a digest of its tenant (vLLM's ``cache_salt``), so a session
reads only what its tenant stored, on any replica. ``tenant_of`` maps the store's session names to
tenants (the app: the client's cookie, so one browser's tabs on any replica share); opt-in,
``public_keys`` names content (the app's shipped examples) stored once for every tenant.

Integrity (:mod:`.server_entry`): the metadata carries a format version, the entry's name, key and
model, and each tensor's dtype, shape and a CRC-32 chained from the name; every field is checked
for its type and range. An entry that fails any check is deleted and is a miss (recomputed), never
read as wrong numbers or as another picture's KV. A load that fails in any way fails its entry
(deleted, one log line); a turn waits for a load at most the local store's ``load_timeout_s``. Faults (server down at start, gone mid-turn, slow past ``timeout_s``, full, or
read-only) degrade to the local store: one log line when it happens and one when the server is
back, :meth:`ServerStore.health_note` for the app's status line meanwhile; the server is tried
again after ``retry_s``. An entry whose load fails half-way raises :class:`CorruptEntry` to the
linker, which recomputes that prompt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import redis
import torch
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as ServerGone
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as ServerSlow
from redis.retry import Retry

from .kv_store import KEY, Entry, KVStore
from .server_entry import FORMAT, META, checked_meta, read_tensor, tensor_bytes, wire_meta

log = logging.getLogger(__name__)

PREFIX = f"kv-arena:mpic:v{FORMAT}"
PUBLIC_SALT = hashlib.sha256(b"public media").hexdigest()[:32]  # no tenant's digest: those hash "session:..."
LISTED = 500  # at most this many of a tenant's server entries in its library


def shown_url(url: str) -> str:
    """The URL without its password, for logs and the user."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{':' + str(parts.port) if parts.port else ''}{parts.path}"


class Health:
    """Whether the server is used now: "down" (nothing read or written) or "full" (reads go on,
    writes stop), each retried after ``retry_s``. One log line per change of state."""

    def __init__(self, url: str, retry_s: float):
        self.url, self.retry_s = url, retry_s
        self._lock = threading.Lock()
        self._down: tuple[float, str] | None = None  # (since, why)
        self._full: tuple[float, str] | None = None

    def _retrying(self, state: tuple[float, str] | None) -> bool:
        return state is None or time.monotonic() - state[0] > self.retry_s

    def readable(self) -> bool:
        with self._lock:
            return self._retrying(self._down)

    def writable(self) -> bool:
        with self._lock:
            return self._retrying(self._down) and self._retrying(self._full)

    def fault(self, exc: Exception) -> None:
        """A server error: down (gone, slow) or full (out of memory, read-only); anything else
        concerns one entry only (a foreign value under our name) and says nothing of the server."""
        full = isinstance(exc, (OutOfMemoryError, ReadOnlyError))
        if not (full or isinstance(exc, (ServerGone, ServerSlow))):
            return
        why = f"{exc.__class__.__name__}: {' '.join(str(exc).split())[:120]}"
        with self._lock:
            first = (self._full if full else self._down) is None
            if full:
                self._full = (time.monotonic(), why)
            else:
                self._down = (time.monotonic(), why)
        if first:
            log.warning("shared media store %s %s (%s): %s", self.url, "is full" if full else "unavailable", why,
                        "new media stay in this replica's local store" if full else "this replica's local store serves")

    def worked(self, wrote: bool = False) -> None:
        with self._lock:
            back = self._down is not None or (wrote and self._full is not None)
            self._down = None
            if wrote:
                self._full = None
        if back:
            log.warning("shared media store %s is back in use", self.url)

    def note(self) -> str:
        with self._lock:
            down, full = self._down, self._full
        if down:
            return f"the shared media store is unavailable ({down[1].split(':')[0]}): this replica's local store serves"
        if full:
            return "the shared media store is full: new media stay in this replica's local store"
        return ""


class ServerStore:
    """Media KV on a Valkey/Redis server at ``url``, with ``local`` in front (module docstring)."""

    def __init__(self, url: str, local: KVStore, *, ttl_s: float = 24 * 3600.0, timeout_s: float = 1.0,
                 retry_s: float = 30.0, tenant_of: Callable[[str], str] | None = None,
                 public_keys: Iterable[str] = ()):
        self.url, self.local, self.ttl_s = shown_url(url), local, ttl_s
        self.tenant_of = tenant_of or (lambda session: session)
        self.public_keys = frozenset(public_keys)
        self.health = Health(self.url, retry_s)
        # no retries inside the client: a fault must cost one timeout, then the local store serves
        self.server = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-server")
        self._writes: list = []
        self._lock = threading.Lock()
        self._call(self.server.ping)  # a server down at start is said now, once

    def hold_loads(self, until: threading.Event) -> None:
        """Every background loader waits until ``until`` is set (a fault drill: a server killed
        between a lookup and its load)."""
        for _ in range(self._io._max_workers):
            self._io.submit(until.wait)

    # --- names ---------------------------------------------------------------------------------
    def salt(self, session: str) -> str:
        return KVStore.namespace(self.tenant_of(session))

    def name(self, salt: str, model: str, key: str) -> str:
        if not isinstance(key, str) or not KEY.match(key):
            raise ValueError("a store key is a 64-digit lowercase hex content hash")
        return f"{PREFIX}:{salt}:{KVStore.model_dir(model)}:{key}"

    def _salts(self, session: str, key: str) -> list[str]:
        """Where this session may find ``key``: its tenant's entries, then public media's."""
        return [self.salt(session)] + ([PUBLIC_SALT] if key in self.public_keys else [])

    def _call(self, command: Callable, *args, wrote: bool = False, **kwargs):
        """``command``'s answer, or None after a fault (noted in :attr:`health`)."""
        try:
            answer = command(*args, **kwargs)
        except RedisError as exc:
            self.health.fault(exc)
            return None
        self.health.worked(wrote)
        return answer

    # --- writing -------------------------------------------------------------------------------
    def put(self, session: str, model: str, key: str, tensors: dict[str, torch.Tensor], meta: dict,
            to_disk: bool = True) -> Entry:
        """Keep the entry in the local store (as without a server), send it to the server in the background."""
        salt = PUBLIC_SALT if key in self.public_keys else self.salt(session)
        name = self.name(salt, model, key)
        entry = self.local.put(session, model, key, tensors, meta, to_disk)
        if self.health.writable():
            with self._lock:
                self._writes = [w for w in self._writes if not w.done()]
                self._writes.append(self._io.submit(self._send, name, key, entry))
        return entry

    def _send(self, name: str, key: str, entry: Entry) -> None:
        tensors = {n: entry.tensor(n).detach().cpu() for n in entry.names}
        fields = {n: tensor_bytes(t) for n, t in tensors.items()}
        fields[META] = json.dumps(wire_meta(entry.meta, name, key, tensors, fields)).encode()
        pipe = self.server.pipeline(transaction=True)  # a reader sees the whole entry or none of it
        pipe.delete(name)
        pipe.hset(name, mapping=fields)
        pipe.expire(name, max(1, int(self.ttl_s)))
        self._call(pipe.execute, wrote=True)

    def flush(self) -> None:
        """Wait for pending local disk writes and server writes (tests, shutdown, end of a GPU call)."""
        self.local.flush()
        with self._lock:
            writes, self._writes = self._writes, []
        for w in writes:
            w.result()

    # --- reading -------------------------------------------------------------------------------
    def get(self, session: str, model: str, key: str) -> Entry | None:
        """The local store's entry, else the server's (loading in the background), else None."""
        entry = self.local.get(session, model, key)
        if entry is not None or not self.health.readable():
            return entry
        for salt in self._salts(session, key):
            name = self.name(salt, model, key)
            pipe = self.server.pipeline(transaction=False)
            pipe.hget(name, META)
            pipe.expire(name, max(1, int(self.ttl_s)))  # a hit lives on, as in the local store
            answer = self._call(pipe.execute, raise_on_error=False)
            if answer is None:  # the server failed: the local store alone serves
                return None
            raw = answer[0] if not isinstance(answer[0], Exception) else None
            meta = checked_meta(raw, name, model, key)
            if meta is None:
                if raw is not None or isinstance(answer[0], ResponseError):
                    self._discard(name, key, "failed its checks")  # damaged or foreign: recomputed, stored anew
                continue
            entry = Entry(key, meta, timeout_s=self.local.load_timeout_s)
            self._io.submit(self._load, name, entry, (session, model, key))
            return entry
        return None

    def _load(self, name: str, entry: Entry, where: tuple[str, str, str]) -> None:
        """Tensors in stored order (layer by layer), each checked as it arrives. Whatever goes wrong
        fails the entry, so no turn waits on a loader that is gone."""
        try:
            for tensor_name in entry.names:
                if entry.failed:  # timed out: the turn recomputed without it
                    return
                data = self.server.hget(name, tensor_name)
                entry.deliver(tensor_name, read_tensor(data, entry.meta, tensor_name))
        except (ServerGone, ServerSlow) as exc:  # the server, not the entry: the linker recomputes this prompt
            self.health.fault(exc)
            entry.deliver("", error=exc)
            return
        except Exception as exc:  # noqa: BLE001 - damaged, foreign, or a fault of ours: never use it
            entry.deliver("", error=exc)
            self._discard(name, entry.key, f"could not be loaded ({exc.__class__.__name__}: {exc})")
            return
        if not entry.failed:
            self.local.remember(*where, entry)

    def _discard(self, name: str, key: str, why: str) -> None:
        """Delete an entry that cannot be used (it is recomputed and stored anew), in one log line."""
        log.warning("shared media store %s: entry %s %s: deleted, recomputed", self.url, key[:12], why[:200])
        self._call(self.server.unlink, name)

    # --- token prefixes: memory only, as serving engines keep them -------------------------------
    def put_prefix(self, session: str, model: str, identity: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        self.local.put_prefix(session, model, identity, tensors)

    def match_prefix(self, session: str, model: str, identity: torch.Tensor) -> tuple[int, Entry | None]:
        return self.local.match_prefix(session, model, identity)

    # --- housekeeping --------------------------------------------------------------------------
    def _server_entries(self, salt: str) -> list[str]:
        names = self._call(lambda: [n.decode() for _, n in zip(range(LISTED), self.server.scan_iter(f"{PREFIX}:{salt}:*",
                                                                                                   count=200))])
        return names or []

    def library(self, session: str) -> list[dict]:
        """The local store's rows for this session, with its tenant's entries on the server."""
        rows = {(r["model"], r["key"]): r for r in self.local.library(session)}
        names = self._server_entries(self.salt(session)) if self.health.readable() else []
        pipe = self.server.pipeline(transaction=False)
        for name in names:
            pipe.hget(name, META)
        metas = self._call(pipe.execute, raise_on_error=False) if names else []
        now = time.time()
        for name, raw in zip(names, metas or []):
            meta = checked_meta(raw, name, *self._model_key(raw)) if isinstance(raw, bytes) else None
            if meta is None:
                continue
            row = rows.setdefault((meta["model"], meta["key"]), {
                "key": meta["key"], "kind": meta.get("kind"), "model": meta["model"], "label": meta.get("label", ""),
                "tokens": meta.get("tokens"), "bytes": meta["bytes"], "in_memory": False, "on_disk": False,
                "age_s": now - meta["created"]})
            row["on_server"] = True
        return sorted(rows.values(), key=lambda r: -r["age_s"])

    @staticmethod
    def _model_key(raw: bytes) -> tuple[str, str]:
        try:
            meta = json.loads(raw)
            return str(meta["model"]), str(meta["key"])
        except (ValueError, KeyError, TypeError):
            return "", ""

    def drop_session(self, session: str) -> None:
        """The session's local entries go; on the server, its entries go too when the session is its
        own tenant (a tab); a client's entries serve its other tabs and replicas until they expire."""
        self.local.drop_session(session)
        if self.tenant_of(session) == session and self.health.readable():
            names = self._server_entries(self.salt(session))
            if names:
                self._call(self.server.unlink, *names)

    def sweep_namespaces(self) -> None:
        """The local store's folders of an earlier run; the server's entries belong to every replica."""
        self.local.sweep_namespaces()

    def health_note(self) -> str:
        return self.health.note()
