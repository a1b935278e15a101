"""This app process's own folders, beside those of other processes on the same host (two replicas
sharing a temp folder, a restart while the old process still ends): each process writes under
``<parent>/<its instance>/`` and holds an exclusive lock on ``<instance>/.alive`` while it lives.
At start a process sweeps the instance folders whose lock it can take (their process is gone),
never a live one's. The lock goes with the process, however it ends (a kill included).

Without ``fcntl`` (Windows) nothing of another process is swept: files a crash leaves stay."""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

INSTANCE = f"p{os.getpid()}-{uuid.uuid4().hex[:8]}"  # inherited by forked workers: they write where their parent does
NAMED = re.compile(r"p\d+-[0-9a-f]{8}")
ALIVE = ".alive"
YOUNG_S = 60.0  # a folder this new without its lock file may be a process starting: left alone
# Process identity, not application state: flock belongs to this process's open file, so every app
# state in the process (a test's own included) shares these folders and their locks.
_held: dict[Path, object] = {}  # folder -> the open lock file (kept open: closing it would release the lock)


def own_folder(parent: Path) -> Path:
    """This process's folder under ``parent``, made and locked on first use."""
    folder = Path(parent) / INSTANCE
    if folder not in _held:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ALIVE, "a")
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _held[folder] = handle
    return folder


def sweep_gone(parent: Path) -> list[Path]:
    """Remove the instance folders under ``parent`` whose process is gone; returns them."""
    parent = Path(parent)
    gone = [f for f in (parent.iterdir() if parent.is_dir() else [])
            if f.is_dir() and not f.is_symlink() and NAMED.fullmatch(f.name) and f.name != INSTANCE and abandoned(f)]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


def abandoned(folder: Path) -> bool:
    """Whether no live process holds ``folder``'s lock (False when that cannot be told)."""
    if fcntl is None:
        return False
    try:
        handle = open(folder / ALIVE, "r")
    except FileNotFoundError:  # a process that died before locking, or one starting now
        return time.time() - _mtime(folder) > YOUNG_S
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process lives
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()
