"""The KV store behind MPIC (Zhao et al., "MPIC: Position-Independent Multimodal Context Caching",
arXiv:2502.01960, Sec. 4.2-4.3): each uploaded image or video's KV cache, kept in
memory and on local disk (safetensors), keyed by model and content hash, namespaced per session.

* Namespaces: a session's entries live under ``sha256(session)`` in memory and on disk, and keys
  must be 64 hex digits, so no session id, key or path can reach another session's files (the
  paper's "each user can access only his/her own files").
* Tiers: ``put`` keeps the entry in memory and copies it to disk in the background ("concurrently,
  these caches are copied to disks"). A disk hit starts a background load, layer by layer, so the
  forward pass that needs layer ``i`` waits only for layer ``i`` while the rest still loads (the
  paper's parallel transfer, Fig. 6).
* Caps: memory and disk each have a byte cap with least-recently-used eviction (an entry evicted
  from memory is still read from disk); entries expire ``ttl_s`` seconds after their last use.
* Integrity: every tensor carries a CRC-32 in the file's metadata and the header's offsets must
  match the file size, so a truncated or damaged file is detected, deleted and reported as a miss
  (the caller recomputes) rather than read as wrong numbers.
* Loads never hold a turn: a load that fails (any exception) fails its entry, and a wait for a
  tensor ends :data:`LOAD_TIMEOUT_S` seconds after the load began with :class:`LoadTimeout`.

Token prefixes (for the prefix-caching baseline) are kept in memory only, as serving engines do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

KEY = re.compile(r"^[0-9a-f]{64}$")
SUFFIX = ".safetensors"
LOAD_TIMEOUT_S = 30.0  # the longest a turn waits for a load (KV_ARENA_KV_STORE_LOAD_TIMEOUT_S)

log = logging.getLogger(__name__)


class CorruptEntry(RuntimeError):
    """A stored file failed its integrity check while loading."""


class LoadTimeout(CorruptEntry):
    """A load did not deliver in time: the waiting turn recomputes (the store may only be slow)."""


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().cpu().view(torch.uint8).numpy().data)


def _touch(path: Path) -> None:
    """Mark a file as used now (its mtime drives expiry and the disk LRU)."""
    try:
        os.utime(path)
    except FileNotFoundError:  # not written yet, or evicted from disk: the memory copy still serves
        pass


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Entry:
    """One stored item: tensors by name (``embeds``, ``rope``, ``k.<layer>``, ``v.<layer>``).

    ``tensor(name)`` blocks until that tensor is loaded and raises :class:`CorruptEntry` if the
    file turned out damaged, :class:`LoadTimeout` once ``timeout_s`` have passed since the entry
    was made (its load began) without it; tensors read from disk come back on the CPU.
    """

    def __init__(self, key: str, meta: dict, tensors: dict[str, torch.Tensor] | None = None,
                 timeout_s: float = LOAD_TIMEOUT_S):
        self.key, self.meta = key, meta
        self.names: list[str] = meta["names"]
        self._tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self._arrived = threading.Condition()
        self._error: Exception | None = None
        self.timeout_s, self._deadline = timeout_s, time.monotonic() + timeout_s
        self.used = time.time()

    @property
    def nbytes(self) -> int:
        return int(self.meta["bytes"])

    @property
    def complete(self) -> bool:
        return len(self._tensors) == len(self.names)

    @property
    def failed(self) -> bool:
        """The load failed or timed out: its loader stops, and nothing keeps the entry."""
        with self._arrived:
            return self._error is not None

    def tensor(self, name: str) -> torch.Tensor:
        with self._arrived:
            while name not in self._tensors and self._error is None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._time_out()
                    break
                self._arrived.wait(left)
            if name in self._tensors:
                return self._tensors[name]
            if isinstance(self._error, LoadTimeout):
                raise self._error
            raise CorruptEntry(f"stored entry {self.key[:12]} is damaged: {self._error}")

    def _time_out(self) -> None:
        """Fail the load for every waiter (called holding the condition): said once, in the log."""
        self._error = LoadTimeout(f"stored entry not loaded within {self.timeout_s:g} s")
        self._arrived.notify_all()
        log.warning("media store: entry %s not loaded within %g s (KV_ARENA_KV_STORE_LOAD_TIMEOUT_S): recomputed",
                    self.key[:12], self.timeout_s)

    def deliver(self, name: str, value: torch.Tensor | None = None, error: Exception | None = None) -> None:
        """A loaded tensor, or the load's failure; nothing after a failure (a late loader's tensors)."""
        with self._arrived:
            if self._error is not None:
                return
            if error is not None:
                self._error = error
            else:
                self._tensors[name] = value
            self._arrived.notify_all()


class KVStore:
    """Media KV by (session, model, content hash), in memory and under ``root`` on disk."""

    def __init__(self, root: str | Path, memory_bytes: int = 4 << 30, disk_bytes: int = 32 << 30,
                 ttl_s: float = 24 * 3600.0, load_timeout_s: float = LOAD_TIMEOUT_S):
        self.root = Path(root)
        self.memory_bytes, self.disk_bytes, self.ttl_s = memory_bytes, disk_bytes, ttl_s
        self.load_timeout_s = load_timeout_s  # also the server tier's (ServerStore)
        self._memory: OrderedDict[tuple[str, str, str], Entry] = OrderedDict()  # LRU order, newest last
        self._lock = threading.RLock()
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-store")  # loads and writes
        self._writes: list = []

    # --- names ---------------------------------------------------------------------------------
    @staticmethod
    def namespace(session: str) -> str:
        """A session's directory name: a digest, so no session id can name a path."""
        return hashlib.sha256(f"session:{session}".encode()).hexdigest()[:32]

    @staticmethod
    def model_dir(model: str) -> str:
        readable = re.sub(r"[^A-Za-z0-9._-]", "_", model)[:48]
        return f"{readable}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"

    def path(self, session: str, model: str, key: str) -> Path:
        if not isinstance(key, str) or not KEY.match(key):
            raise ValueError("a store key is a 64-digit lowercase hex content hash")
        return self.root / self.namespace(session) / self.model_dir(model) / (key + SUFFIX)

    # --- writing -------------------------------------------------------------------------------
    def put(self, session: str, model: str, key: str, tensors: dict[str, torch.Tensor], meta: dict,
            to_disk: bool = True) -> Entry:
        """Keep ``tensors`` in memory now and write them to disk in the background."""
        path = self.path(session, model, key)
        tensors = {n: t.detach().contiguous() for n, t in tensors.items()}  # memory tier: on their device
        meta = dict(meta, model=model, names=list(tensors), bytes=_nbytes(tensors), created=time.time())
        entry = Entry(key, meta, tensors)
        with self._lock:
            self._remember((self.namespace(session), model, key), entry)
        if to_disk:
            self._writes = [w for w in self._writes if not w.done()]
            self._writes.append(self._io.submit(self._write, path, tensors, meta))
        return entry

    def _write(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {n: t.cpu() for n, t in tensors.items()}
        meta = dict(meta, crc={n: _crc(t) for n, t in tensors.items()})
        partial = path.with_suffix(f".{threading.get_ident()}.part")
        save_file(tensors, str(partial), metadata={"meta": json.dumps(meta)})
        os.replace(partial, path)  # atomic: a reader sees the old file, the new one or none
        self._trim_disk()

    def flush(self) -> None:
        """Wait for every pending disk write (tests, shutdown)."""
        while self._writes:
            self._writes.pop().result()

    # --- reading -------------------------------------------------------------------------------
    def get(self, session: str, model: str, key: str) -> Entry | None:
        """The entry if this session stored it and it is still valid; else None (recompute)."""
        path = self.path(session, model, key)
        mem_key = (self.namespace(session), model, key)
        now = time.time()
        with self._lock:
            entry = self._memory.get(mem_key)
            if entry is not None and now - entry.used > self.ttl_s:
                self._memory.pop(mem_key)
                entry = None
                path.unlink(missing_ok=True)
            if entry is not None:
                entry.used = now
                self._memory.move_to_end(mem_key)
                _touch(path)
                return entry
        meta = self._check_file(path, now)
        if meta is None:
            return None
        _touch(path)
        entry = Entry(key, meta, timeout_s=self.load_timeout_s)
        self._io.submit(self._load, path, entry, mem_key)
        return entry

    def _check_file(self, path: Path, now: float) -> dict | None:
        """The file's metadata if it is fresh and its header's offsets match its size; a stale or
        damaged file is deleted."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        try:
            if now - stat.st_mtime > self.ttl_s:
                raise TimeoutError("expired")
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > stat.st_size - 8:
                    raise CorruptEntry("header runs past the end of the file")
                header = json.loads(f.read(length))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
            if 8 + length + max(ends, default=0) != stat.st_size:
                raise CorruptEntry("file size does not match its header")
            return json.loads(header["__metadata__"]["meta"])
        except (OSError, ValueError, KeyError, TypeError, CorruptEntry, struct.error):
            path.unlink(missing_ok=True)
            return None

    def _load(self, path: Path, entry: Entry, mem_key) -> None:
        """Read tensors in stored order (layer by layer), checking each CRC as it arrives."""
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in entry.names:
                    if entry.failed:  # timed out: the turn has recomputed
                        return
                    tensor = f.get_tensor(name)
                    if _crc(tensor) != entry.meta["crc"][name]:
                        raise CorruptEntry(f"checksum mismatch in '{name}'")
                    entry.deliver(name, tensor)
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use this file
            entry.deliver("", error=exc)
            path.unlink(missing_ok=True)
            return
        if entry.failed:
            return
        with self._lock:
            self._remember(mem_key, entry)

    # --- token prefixes (prefix caching baseline) -------------------------------------------------
    def put_prefix(self, session: str, model: str, identity: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Remember a prompt's KV under its token identities (memory only)."""
        key = hashlib.sha256(identity.cpu().numpy().tobytes()).hexdigest()
        tensors = {n: t.clone() for n, t in tensors.items()}  # never alias a live cache
        self.put(session, model, key, dict(tensors, identity=identity.cpu()), {"kind": "prefix"}, to_disk=False)

    def match_prefix(self, session: str, model: str, identity: torch.Tensor) -> tuple[int, Entry | None]:
        """The stored prompt sharing the longest exact token prefix with ``identity``."""
        best, found = 0, None
        ns = self.namespace(session)
        with self._lock:
            for (n, m, _), entry in reversed(self._memory.items()):
                if n != ns or m != model or entry.meta.get("kind") != "prefix":
                    continue
                stored = entry.tensor("identity")
                common = min(len(stored), len(identity))
                differ = (stored[:common] != identity[:common].cpu()).nonzero()
                length = int(differ[0]) if len(differ) else common
                if length > best:
                    best, found = length, entry
            if found is not None:
                found.used = time.time()
        return best, found

    # --- housekeeping --------------------------------------------------------------------------
    def remember(self, session: str, model: str, key: str, entry: Entry) -> None:
        """Keep an entry loaded from elsewhere (a shared server) in the memory tier."""
        with self._lock:
            self._remember((self.namespace(session), model, key), entry)

    def health_note(self) -> str:
        return ""  # memory and local disk: nothing to degrade to

    def _remember(self, mem_key, entry: Entry) -> None:
        if entry.nbytes > self.memory_bytes:
            return  # larger than the whole memory tier: disk only
        self._memory[mem_key] = entry
        self._memory.move_to_end(mem_key)
        while sum(e.nbytes for e in self._memory.values()) > self.memory_bytes:
            self._memory.popitem(last=False)

    def _files(self, under: Path | None = None) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every stored file, oldest first."""
        found = []
        for p in (under or self.root).glob(f"**/*{SUFFIX}"):
            try:
                stat = p.stat()
            except FileNotFoundError:  # removed meanwhile (eviction, another thread)
                continue
            found.append((stat.st_mtime, stat.st_size, p))
        return sorted(found, key=lambda f: f[0])

    def _trim_disk(self) -> None:
        with self._lock:
            files = self._files()
            total = sum(size for _, size, _ in files)
            for _, size, p in files:
                if total <= self.disk_bytes:
                    break
                p.unlink(missing_ok=True)
                total -= size

    def memory_nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._memory.values())

    def disk_nbytes(self) -> int:
        return sum(size for _, size, _ in self._files())

    def library(self, session: str) -> list[dict]:
        """This session's stored media: key, kind, model, tokens, bytes, where, age (plain values)."""
        ns, now, rows = self.namespace(session), time.time(), {}
        for _, _, p in self._files(self.root / ns):
            meta = self._check_file(p, now)
            if meta is not None:
                rows[(meta["model"], p.stem)] = dict(meta, key=p.stem, on_disk=True, in_memory=False)
        with self._lock:
            for (n, model, key), e in self._memory.items():
                if n == ns and e.meta.get("kind") != "prefix":
                    rows.setdefault((model, key), dict(e.meta, key=key, on_disk=False))["in_memory"] = True
        return [{"key": r["key"], "kind": r.get("kind"), "model": r["model"], "label": r.get("label", ""),
                 "tokens": r.get("tokens"), "bytes": r["bytes"], "in_memory": r["in_memory"],
                 "on_disk": r["on_disk"], "on_server": False, "age_s": now - r["created"]}
                for r in sorted(rows.values(), key=lambda r: r["created"])]

    def sweep_namespaces(self) -> None:
        """Forget every session's folder on disk (at a process's start, none of them is alive:
        session ids are made anew by each process). Only folders named as namespaces go."""
        if not self.root.is_dir():
            return
        for folder in self.root.iterdir():
            if folder.is_dir() and not folder.is_symlink() and re.fullmatch(r"[0-9a-f]{32}", folder.name):
                shutil.rmtree(folder, ignore_errors=True)

    def drop_session(self, session: str) -> None:
        """Forget everything a session stored (memory and disk)."""
        ns = self.namespace(session)
        with self._lock:
            for k in [k for k in self._memory if k[0] == ns]:
                del self._memory[k]
        for _, _, p in self._files(self.root / ns):
            p.unlink(missing_ok=True)
        shutil.rmtree(self.root / ns, ignore_errors=True)  # its folders too: none stays behind per closed tab
