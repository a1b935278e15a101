"""Uploads: a file is used by, and served to, only the client that uploaded it.

Gradio names an upload by a keyed hash of its bytes and serves it to whoever holds the path; it
does not say who uploaded a file, and neither its upload request nor its file request carries the
tab's session. So the app gives every client (a browser, a ``gradio_client.Client``) an id of its
own in a cookie, which both keep and send with every request: its uploads, its events, its file
requests. This module is the ledger: which clients uploaded each file (:func:`note_uploads`),
whether an event's session may use a file (:func:`check_uploads`) and whether a client may read a
file's URL (:func:`may_read`). An upload made without the cookie (a raw HTTP client that keeps no
cookies) belongs to no client: such an upload may be used by one session, the first that names its
path, as many times as it was uploaded that way.

The ledger is this process's own: a file another app process received (a replica on the same
temp folder, or this app before a restart) has no record here, so it is no one's to read or use
(each process keeps its uploads in a folder of its own: :mod:`.upload_folder`). Unused uploads are
capped per visitor and in all (:mod:`.upload_caps`)."""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import UserError
from ..paths import ASSETS
from .current import current_app
from .instance import own_folder, sweep_gone
from .upload_caps import refusal, room_refusal, unused
from .upload_folder import host_folder, upload_dir


class Uploader(Protocol):
    """What a session shows this module: its id, its client's id and the uploads it used."""

    id: str
    client: str | None
    uploads: set[str]


@dataclass
class _Upload:
    clients: set[str] = field(default_factory=set)  # ids of the clients that uploaded these bytes
    anonymous: int = 0  # uploads without a client id
    claimed: int = 0  # of those, the ones a session has used
    owners: set[str] = field(default_factory=set)  # ids of the live sessions using it
    users: set[str] = field(default_factory=set)  # ids of the clients whose sessions used it
    by_visitor: dict[str, str] = field(default_factory=dict)  # client id -> the visitor that uploaded it with it
    anonymous_by: list[str] = field(default_factory=list)  # the visitor of each upload without a client id
    noted: float = field(default_factory=time.monotonic)  # when it was last uploaded
    size: int = 0  # bytes on disk (an upload's; the app's own files count as none)

    def awaited(self) -> bool:
        """Whether an upload of it has not been used yet (its file must stay)."""
        return bool(self.clients - self.users) or self.claimed < self.anonymous

    def awaited_from(self, visitor: str, client: str | None) -> bool:
        """Whether the person ``client`` (None: the clients without a cookie) behind ``visitor``
        uploaded it and no session used it yet."""
        if client:
            return client in self.clients - self.users and self.by_visitor.get(client) == visitor
        return visitor in self.anonymous_by[self.claimed:]

    def awaited_by(self, visitor: str) -> bool:
        """Whether ``visitor`` (:mod:`.visitors`) uploaded it, under any cookie or none, and no session used it yet."""
        return (any(self.by_visitor.get(c) == visitor for c in self.clients - self.users)
                or visitor in self.anonymous_by[self.claimed:])


class UploadBook:
    """The ledger: each upload's record by resolved path, and the files the app drew (public)."""

    def __init__(self) -> None:
        self.files: dict[str, _Upload] = {}
        self.drawn: OrderedDict[tuple[int, str], None] = OrderedDict()  # (size, content hash) of media the app drew
        self.lock = threading.Lock()

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # the parent may have held it while forking


def _book() -> UploadBook:
    return current_app().uploads


def _visitor(client: str | None, visitor: str | None) -> str:
    """Whom an upload counts against: its visitor; a caller that names none (a test, a tool), its
    client, and the clients without a cookie as one."""
    return visitor or (f"client:{client}" if client else "no cookie")


def note_uploads(paths, client: str | None = None, visitor: str | None = None) -> str | None:
    """Gradio received these files from ``client`` (None: a request without the client cookie) of
    ``visitor`` (``Visitor.key``). Returns the line refusing them when they would take unused uploads
    over a cap (:mod:`.upload_caps`): then none is noted, and the files no one else uploaded are deleted."""
    book = _book()
    names = [str(Path(path).resolve()) for path in paths]
    visitor = _visitor(client, visitor)
    with book.lock:
        before = unused(book.files.values(), visitor, client)
        earlier = {name: copy.deepcopy(book.files[name]) for name in names if name in book.files}
        for name in names:
            record = book.files.setdefault(name, _Upload(size=_size(name)))
            record.noted = time.monotonic()
            if client:
                record.clients.add(client)
                record.by_visitor[client] = visitor
            else:
                record.anonymous += 1
                record.anonymous_by.append(visitor)
        refused = refusal(before, unused(book.files.values(), visitor, client))
        if refused:  # the ledger as it was
            for name in names:
                if name in earlier:
                    book.files[name] = earlier[name]
                else:
                    book.files.pop(name, None)
    for name in (n for n in names if n not in earlier) if refused else ():
        _unlink_upload(name)
    return refused


def upload_room(client: str | None, declared: int, visitor: str | None = None) -> str | None:
    """Before an upload request is read: the line refusing it when its declared size (the
    request's ``Content-Length``) cannot fit under the caps, else None (:func:`note_uploads` checks
    the files themselves once they are written)."""
    book = _book()
    with book.lock:
        now = unused(book.files.values(), _visitor(client, visitor), client)
    return room_refusal(now, declared)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


@functools.lru_cache(maxsize=1)
def _public_hashes() -> dict[int, set[str]]:
    """size -> content hashes of the shipped example media (Gradio's copies of them are public)."""
    out: dict[int, set[str]] = {}
    for path in ASSETS.glob("*.*"):
        if path.suffix.lower() in {".png", ".jpg", ".jpeg", ".mp4"}:
            out.setdefault(path.stat().st_size, set()).add(file_hash(str(path)))
    return out


def _in_upload_dir(path: Path) -> bool:
    """A file inside Gradio's upload folder (:func:`in_upload_dir`, a file there)."""
    return in_upload_dir(path) and path.is_file()


DRAWN_REMEMBERED = 4096  # the newest drawn files stay public (their files are capped far below that)


def make_public(paths) -> None:
    """Files the app wrote itself (drawn scenes): any session may use them in a message, as the
    examples (who may read them is :func:`note_private`'s)."""
    book = _book()
    with book.lock:
        for path in paths:
            book.drawn[(os.path.getsize(path), file_hash(str(path)))] = None
        while len(book.drawn) > DRAWN_REMEMBERED:
            book.drawn.popitem(last=False)


def _public(path: Path) -> bool:
    """Any session may use it: a copy of a shipped example, or media the app drew."""
    size, content = path.stat().st_size, file_hash(str(path))
    return content in _public_hashes().get(size, ()) or (size, content) in _book().drawn


def _shipped(path: Path) -> bool:
    """Anyone may read it: Gradio's copy of a shipped example (hashed only when a size matches)."""
    size = path.stat().st_size
    return size in _public_hashes() and file_hash(str(path)) in _public_hashes()[size]


def check_uploads(session: Uploader, files: list[str]) -> None:
    """Every file in Gradio's upload folder that an event receives must have been uploaded by the
    session's client (or be an unclaimed upload without a client, see the module's docstring); a
    path sent by anyone else, however it got it, is refused. Files outside the folder (tests
    calling the functions directly) are not uploads; Gradio's copies of the shipped examples are
    public."""
    book = _book()
    for name in files:
        path = Path(name).resolve()
        if not _in_upload_dir(path) or _public(path):
            continue
        with book.lock:
            record = book.files.get(str(path), _Upload())
            if session.id not in record.owners:
                if not (session.client and session.client in record.clients):
                    if record.claimed >= record.anonymous:
                        raise UserError(f"'{path.name}' was not uploaded in this session: "
                                        "attach it from your computer.")
                    record.claimed += 1
                record.owners.add(session.id)
                record.users.add(session.client or "")
                book.files[str(path)] = record
        session.uploads.add(str(path))


def in_upload_dir(name: str | Path) -> bool:
    """Whether the path names a place inside Gradio's upload folder (resolved as Gradio resolves it)."""
    try:
        return upload_dir() in Path(name).resolve().parents
    except (OSError, ValueError, RuntimeError):
        return False


def check_sent_files(files: list[str]) -> None:
    """Files an event received from a client must be in Gradio's upload folder (or be the shipped
    examples): a path anywhere else on the server is refused, whatever it names."""
    for name in files:
        if re.match(r"^[a-z][a-z0-9+.-]*://", str(name), re.IGNORECASE):  # never downloaded here
            raise UserError(f"'{str(name)[:80]}' is a URL: this app does not download files; attach it from your "
                            "computer.")
        try:
            path = Path(name).resolve()
        except (OSError, ValueError, RuntimeError):
            path = None
        if path is None or not (_in_upload_dir(path) or (ASSETS in path.parents and path.is_file())):
            shown = os.path.basename(str(name))[:80] or "(no name)"
            raise UserError(f"'{shown}' was not uploaded to this app: attach it from your computer.")


def may_read(name: str, client: str | None) -> bool:
    """Whether ``client`` may fetch the file at ``name`` (a path, absolute or relative to the working
    directory, as Gradio's file routes resolve it). Anything under Gradio's folder, this process's
    or another's (:func:`.upload_folder.host_folder`), only when this process's ledger says
    ``client`` uploaded it or the app wrote it for ``client`` (:func:`note_private`), or when it is
    a copy of a shipped example: what this process cannot prove is the caller's (another process's
    file, a previous run's, one gone) is no one's. Anything elsewhere as Gradio decides (it serves
    nothing else of ours)."""
    try:
        path = Path(name).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop: no file of ours
        return True
    if host_folder() not in path.parents:
        return True
    with _book().lock:
        record = _book().files.get(str(path))
    if record is not None and client and client in record.clients:
        return True
    try:
        return path.is_file() and _shipped(path)
    except (OSError, ValueError):  # removed meanwhile, or no path this system can name
        return False


def forget_uploads(session: Uploader) -> None:
    """The session ended: an upload no other session uses or may still use leaves Gradio's folder,
    so its URL stops working."""
    book = _book()
    with book.lock:
        for path in session.uploads:
            record = book.files.get(path)
            if record is None:
                continue
            record.owners.discard(session.id)
            if record.owners or record.awaited():
                continue
            del book.files[path]
            _unlink_upload(path)
    session.uploads = set()


# --- files the app writes for one session (overlays, drawn scenes) ------------------------------
# They live in Gradio's upload folder, so Gradio serves them where they are (no copy in its cache),
# under kv-arena/<this process>/<kind>/<session id>/ (another app process on the host has its own:
# :mod:`.instance`), and go with the session (:func:`drop_session_files`).
PRIVATE_ROOT = "kv-arena"
KEEP_PRIVATE = 48  # a session's newest private images kept (a gallery shows a few at a time)


def session_folder(session_id: str, kind: str) -> Path:
    """The folder for one session's files of one kind (made on first use)."""
    if not re.fullmatch(r"[0-9a-f]{32}|anonymous", session_id) or not re.fullmatch(r"[a-z]+", kind):
        raise ValueError("a session folder is named by a server-made session id and a kind")
    folder = private_root() / kind / session_id
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def private_root() -> Path:
    """This process's folder of private files in Gradio's upload folder."""
    return own_folder(upload_dir() / PRIVATE_ROOT)


def note_private(paths, client: str | None) -> None:
    """Files the app wrote for ``client`` alone: served to that client only (to none without a client)."""
    book = _book()
    with book.lock:
        for path in paths:
            book.files[str(Path(path).resolve())] = _Upload(clients={client} if client else set())


def note_served(paths, client: str) -> None:
    """Files under Gradio's folder that an event's messages handed ``client`` (Gradio's copies of
    what an output names): served to it as well as to whoever else they were for. Noted as seen
    by it (used), so they count against no cap on unused uploads."""
    book = _book()
    with book.lock:
        for path in paths:
            try:
                name = Path(path).resolve()
            except (OSError, ValueError, RuntimeError):
                continue
            if host_folder() in name.parents:
                record = book.files.setdefault(str(name), _Upload())
                record.clients.add(client)
                record.users.add(client)


def save_private_images(session: Uploader, images, kind: str = "overlays") -> list[str]:
    """PNG files of ``images`` in the session's folder, readable by its client only; the folder
    keeps the newest :data:`KEEP_PRIVATE` (older ones go, and with them their URLs)."""
    folder = session_folder(session.id, kind)
    paths = []
    for image in images:
        path = folder / f"{uuid.uuid4().hex}.png"
        image.save(path)
        paths.append(str(path.resolve()))
    note_private(paths, session.client)
    trim_folder(folder, KEEP_PRIVATE)
    return paths


def trim_folder(folder: Path, keep: int) -> None:
    """The folder's ``keep`` newest entries stay (files or folders)."""
    entries = sorted(folder.iterdir(), key=_mtime)
    for old in entries[:max(0, len(entries) - keep)]:
        _remove(old)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile (a session closing)
        return 0.0


def _remove(path: Path) -> None:
    book = _book()
    with book.lock:
        for name in [str(p.resolve()) for p in ([path] if path.is_file() else path.rglob("*"))]:
            book.files.pop(name, None)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def drop_session_files(session_id: str) -> None:
    """The session ended: every file the app wrote for it goes."""
    root = private_root()
    for kind in (k for k in root.iterdir() if k.is_dir()):
        folder = kind / session_id
        if folder.is_dir():
            _remove(folder)


def sweep_private_folders() -> None:
    """At start: the private files of app processes that are gone go (another app process on this
    host keeps its own)."""
    sweep_gone(upload_dir() / PRIVATE_ROOT)


def cap_folders(parent: Path, keep: int) -> None:
    """Keep the ``keep`` newest folders two levels under ``parent`` (<session>/<item>), oldest out."""
    items = [item for session in list(parent.iterdir()) if session.is_dir() for item in _entries(session)]
    items.sort(key=_mtime)
    for old in items[:max(0, len(items) - keep)]:
        _remove(old)


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def expire_unclaimed(max_age_s: float) -> None:
    """Uploads no session has used for ``max_age_s`` seconds since they arrived (a client that
    uploaded and never asked, or went away) leave Gradio's folder."""
    book = _book()
    now = time.monotonic()
    with book.lock:
        stale = [path for path, r in book.files.items() if not r.owners and now - r.noted > max_age_s
                 and not Path(path).is_relative_to(upload_dir() / PRIVATE_ROOT)]
        for path in stale:
            del book.files[path]
    for path in stale:
        _unlink_upload(path)


def _unlink_upload(path: str) -> None:
    try:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))  # Gradio's per-file folder, now empty
    except OSError:
        pass


def file_hash(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
