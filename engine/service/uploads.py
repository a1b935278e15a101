"""Uploads: a session may only use files it uploaded (Gradio names a file by a keyed hash of its
bytes and serves it to whoever holds the path, so the app keeps its own ledger of who uploaded what)."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import UserError


class Uploader(Protocol):
    """What a session shows this module: its id and the uploads it used."""

    id: str
    uploads: set[str]


ASSETS = Path(__file__).resolve().parents[2] / "assets"


@dataclass
class _Upload:
    uploads: int = 0  # times the bytes were uploaded (Gradio names a file by a keyed hash of its bytes)
    used: int = 0  # uploads some session has used
    owners: set[str] = field(default_factory=set)  # ids of the live sessions using it


_UPLOADS: dict[str, _Upload] = {}
_UPLOADS_LOCK = threading.Lock()


def upload_dir() -> Path:
    """Where Gradio keeps uploads (its own rule: ``GRADIO_TEMP_DIR``, else <temp>/gradio)."""
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()


def note_uploads(paths) -> None:
    """Gradio received these files (one upload each); the app's upload hook calls this."""
    with _UPLOADS_LOCK:
        for path in paths:
            _UPLOADS.setdefault(str(Path(path).resolve()), _Upload()).uploads += 1


@functools.lru_cache(maxsize=1)
def _public_hashes() -> dict[int, set[str]]:
    """size -> content hashes of the shipped example media (Gradio's copies of them are public)."""
    out: dict[int, set[str]] = {}
    for path in ASSETS.glob("*.*"):
        if path.suffix.lower() in {".png", ".jpg", ".jpeg", ".mp4"}:
            out.setdefault(path.stat().st_size, set()).add(file_hash(str(path)))
    return out


_DRAWN_HASHES: dict[int, set[str]] = {}  # size -> content hashes of media the app drew itself


def make_public(paths) -> None:
    """Files the app wrote itself (drawn scenes): Gradio's copies of them are public, as the examples'."""
    with _UPLOADS_LOCK:
        for path in paths:
            _DRAWN_HASHES.setdefault(os.path.getsize(path), set()).add(file_hash(str(path)))


def _is_public(path: Path) -> bool:
    size, content = path.stat().st_size, file_hash(str(path))
    return content in _public_hashes().get(size, ()) or content in _DRAWN_HASHES.get(size, ())


def check_uploads(session: Uploader, files: list[str]) -> None:
    """Every file in Gradio's upload folder that an event receives must be one this session
    uploaded. Two uploads of the same bytes share one path, so a path uploaded n times serves at
    most n sessions: a client that sends another session's path without uploading the bytes
    itself is refused. (Not closed: an upload that no session has used yet, e.g. a chat history an
    API client uploads again with each turn, can be used by the first session that names its path.)
    Files outside the folder (tests calling the functions directly) are not
    uploads; Gradio's copies of the shipped examples are public."""
    root = upload_dir()
    for name in files:
        path = Path(name).resolve()
        if root not in path.parents or not path.is_file():
            continue
        if _is_public(path):
            continue
        with _UPLOADS_LOCK:
            record = _UPLOADS.get(str(path), _Upload())
            if session.id not in record.owners:
                if record.used >= record.uploads:
                    raise UserError(f"'{path.name}' was not uploaded in this session: attach it from your computer.")
                record.used += 1
                record.owners.add(session.id)
                _UPLOADS[str(path)] = record
        session.uploads.add(str(path))


def forget_uploads(session: Uploader) -> None:
    """The session ended: an upload no other session uses or may still use leaves Gradio's folder,
    so its URL stops working."""
    with _UPLOADS_LOCK:
        for path in session.uploads:
            record = _UPLOADS.get(path)
            if record is None:
                continue
            record.owners.discard(session.id)
            if record.owners or record.used < record.uploads:
                continue
            del _UPLOADS[path]
            try:
                os.unlink(path)
                os.rmdir(os.path.dirname(path))  # Gradio's per-file folder, now empty
            except OSError:
                pass
    session.uploads = set()


def file_hash(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
