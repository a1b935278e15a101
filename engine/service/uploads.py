"""Uploads: a file is used by, and served to, only the client that uploaded it.

Gradio names an upload by a keyed hash of its bytes and serves it to whoever holds the path; it
does not say who uploaded a file, and neither its upload request nor its file request carries the
tab's session. So the app gives every client (a browser, a ``gradio_client.Client``) an id of its
own in a cookie, which both keep and send with every request: its uploads, its events, its file
requests. This module is the ledger: which clients uploaded each file (:func:`note_uploads`),
whether an event's session may use a file (:func:`check_uploads`) and whether a client may read a
file's URL (:func:`may_read`). An upload made without the cookie (a raw HTTP client that keeps no
cookies) belongs to no client: such an upload may be used by one session, the first that names its
path, as many times as it was uploaded that way."""

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
    """What a session shows this module: its id, its client's id and the uploads it used."""

    id: str
    client: str | None
    uploads: set[str]


ASSETS = Path(__file__).resolve().parents[2] / "assets"


@dataclass
class _Upload:
    clients: set[str] = field(default_factory=set)  # ids of the clients that uploaded these bytes
    anonymous: int = 0  # uploads without a client id
    claimed: int = 0  # of those, the ones a session has used
    owners: set[str] = field(default_factory=set)  # ids of the live sessions using it
    users: set[str] = field(default_factory=set)  # ids of the clients whose sessions used it

    def awaited(self) -> bool:
        """Whether an upload of it has not been used yet (its file must stay)."""
        return bool(self.clients - self.users) or self.claimed < self.anonymous


_UPLOADS: dict[str, _Upload] = {}
_UPLOADS_LOCK = threading.Lock()


def upload_dir() -> Path:
    """Where Gradio keeps uploads (its own rule: ``GRADIO_TEMP_DIR``, else <temp>/gradio)."""
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()


def note_uploads(paths, client: str | None = None) -> None:
    """Gradio received these files from ``client`` (None: a request without the client cookie)."""
    with _UPLOADS_LOCK:
        for path in paths:
            record = _UPLOADS.setdefault(str(Path(path).resolve()), _Upload())
            if client:
                record.clients.add(client)
            else:
                record.anonymous += 1


@functools.lru_cache(maxsize=1)
def _public_hashes() -> dict[int, set[str]]:
    """size -> content hashes of the shipped example media (Gradio's copies of them are public)."""
    out: dict[int, set[str]] = {}
    for path in ASSETS.glob("*.*"):
        if path.suffix.lower() in {".png", ".jpg", ".jpeg", ".mp4"}:
            out.setdefault(path.stat().st_size, set()).add(file_hash(str(path)))
    return out


def _in_upload_dir(path: Path) -> bool:
    return upload_dir() in path.parents and path.is_file()


_DRAWN_HASHES: dict[int, set[str]] = {}  # size -> content hashes of media the app drew itself


def make_public(paths) -> None:
    """Files the app wrote itself (drawn scenes): Gradio's copies of them are public, as the examples'."""
    with _UPLOADS_LOCK:
        for path in paths:
            _DRAWN_HASHES.setdefault(os.path.getsize(path), set()).add(file_hash(str(path)))


def _public(path: Path) -> bool:
    size, content = path.stat().st_size, file_hash(str(path))
    return content in _public_hashes().get(size, ()) or content in _DRAWN_HASHES.get(size, ())


def check_uploads(session: Uploader, files: list[str]) -> None:
    """Every file in Gradio's upload folder that an event receives must have been uploaded by the
    session's client (or be an unclaimed upload without a client, see the module's docstring); a
    path sent by anyone else, however it got it, is refused. Files outside the folder (tests
    calling the functions directly) are not uploads; Gradio's copies of the shipped examples are
    public."""
    for name in files:
        path = Path(name).resolve()
        if not _in_upload_dir(path) or _public(path):
            continue
        with _UPLOADS_LOCK:
            record = _UPLOADS.get(str(path), _Upload())
            if session.id not in record.owners:
                if not (session.client and session.client in record.clients):
                    if record.claimed >= record.anonymous:
                        raise UserError(f"'{path.name}' was not uploaded in this session: "
                                        "attach it from your computer.")
                    record.claimed += 1
                record.owners.add(session.id)
                record.users.add(session.client or "")
                _UPLOADS[str(path)] = record
        session.uploads.add(str(path))


def may_read(name: str, client: str | None) -> bool:
    """Whether ``client`` may fetch the file at ``name`` through Gradio's file route: an upload only
    by a client that uploaded it; anything else (the examples, what the app drew) as Gradio decides."""
    path = Path(name).resolve()
    with _UPLOADS_LOCK:
        record = _UPLOADS.get(str(path))
    if record is None or not _in_upload_dir(path) or _public(path):
        return True
    return bool(client) and client in record.clients


def forget_uploads(session: Uploader) -> None:
    """The session ended: an upload no other session uses or may still use leaves Gradio's folder,
    so its URL stops working."""
    with _UPLOADS_LOCK:
        for path in session.uploads:
            record = _UPLOADS.get(path)
            if record is None:
                continue
            record.owners.discard(session.id)
            if record.owners or record.awaited():
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
