"""Sessions: one per browser tab, freed when the tab closes, or after an idle time when its client
keeps no heartbeat open (a raw HTTP client never does, so Gradio never closes its session).

One visitor (:mod:`.visitors`: an address, whatever cookies it sends) holds at most
``KV_ARENA_MAX_SESSIONS_PER_VISITOR`` (16) sessions: a new one past that frees the visitor's
session idle longest (one whose client keeps no heartbeat open first; never one answering), so the
memory one address holds is at most that many sessions' (each at most its model's context of KV).
A session whose client never opened a heartbeat (raw HTTP: each ``/call`` is a session of its own)
is kept ``KV_ARENA_SESSION_NO_HEARTBEAT_S`` (120) seconds idle, not the idle time of a tab."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
import weakref
from collections import Counter

from ..runtime.generate import Conversation, ConversationState
from .current import current_app
from .env import env_number
from .inputs import Prepared, Settings
from .model_pool import free_memory
from .state import ChatState
from .store import bind_tenant, media_store
from .uploads import drop_session_files, expire_unclaimed, forget_uploads, sweep_private_folders
from .view_types import KeptVisual


class SessionBook:
    """The app's open sessions: which tab holds each, when each was last active, which asked their
    answer to end, and the thread that ends idle ones."""

    def __init__(self) -> None:
        self.stopping: set[str] = set()  # ids of sessions whose answer should end (seen by in-process GPU work only)
        # session hash -> its session, held weakly: Gradio holds it while the tab lives
        self.open: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        self.last_seen: dict[str, float] = {}  # session hash -> when its last event started or ended
        self.busy: Counter[str] = Counter()  # session hash -> events running, heartbeats open
        self.beating: Counter[str] = Counter()  # session hash -> heartbeats open
        self.heard: set[str] = set()  # session hashes that opened a heartbeat (a tab, gradio_client)
        self.lock = threading.Lock()  # guards last_seen, busy and sweeper
        self.sweeper: threading.Thread | None = None

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # the parent may have held it while forking
        self.sweeper = None  # threads do not survive a fork (a worker never starts one: it tracks no tab)


def _book() -> SessionBook:
    return current_app().sessions


def stopping(session_id: str) -> bool:
    """Whether that session asked its answer to end."""
    return session_id in _book().stopping


class Session:
    """One browser tab. Starts empty (Gradio deep-copies it per session) and is freed on close."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex  # the media store's namespace: made here, never sent by a client
        self.media_model: str | None = None  # the model the session's stored media KV belongs to
        self.last_mpic: tuple[Settings, Prepared] | None = None  # the last MPIC turn, for the TTFT panel
        # the conversation, its messages, its reused tokens and the full-cache references: what a
        # GPU function takes and hands back whole (:mod:`.turns`)
        self.chat = ChatState()
        # (question, attachments, answer) of each turn in ``chat.conv``: what a chat showing this
        # conversation must show since its last new-conversation marker
        self.transcript: list[tuple[str, int, str]] = []
        self.visuals: list[KeptVisual] = []  # kept-token maps of the last answer, for the overlay
        self.uploads: set[str] = set()  # paths of the uploads it used (see check_uploads)
        self.client: str | None = None  # the id of the browser or API client the tab belongs to (uploads.py)
        self.visitor: str | None = None  # the visitor it belongs to (visitors.py), what its limits count by
        self.blind: dict = {}  # blind conversations it may continue, by first battle id (blind/battles.py)
        self.stop_requested = False

    @property
    def visitor_key(self) -> str:
        """What its limits count by: its visitor, else (a session made without a request) itself."""
        return self.visitor or f"session:{self.id}"

    @property
    def stop_requested(self) -> bool:
        return self.id in _book().stopping

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        stops = _book().stopping
        (stops.add if value else stops.discard)(self.id)

    @property
    def conv(self) -> Conversation | ConversationState | None:
        """The chat's conversation (its compressed cache; its state after a ZeroGPU call), None
        before the first message."""
        return self.chat.conv

    @property
    def history(self) -> list[Prepared]:
        """The messages ``conv`` holds, in order."""
        return self.chat.history

    def continues(self, settings: Settings) -> bool:
        """Whether a message with these settings continues this chat's cache."""
        return self.chat.continues(settings)

    def fate(self, settings: Settings, transcript: list[tuple[str, int, str]]) -> str:
        """What a message with these settings, sent after a chat showing ``transcript``, does to this
        session's conversation: "continues" it; "switches" it to other settings of the same model
        (the new method re-reads it first); or starts a new one, because the "history" shown is not
        this conversation or the "model" changed ("new": nothing was shown)."""
        if not transcript:
            return "new"
        if transcript != self.transcript:
            return "history"
        if self.continues(settings):
            return "continues"
        return "switches" if self.chat.rereadable(settings) else "model"

    def new_chat(self) -> None:
        """The chat's cache and messages go; its full-cache references stay (they are per input)."""
        self.chat = ChatState(references=self.chat.references)
        self.visuals, self.transcript = [], []

    def use_model(self, model: str) -> None:
        """Another model: the stored media KV of the previous one is useless, so it goes."""
        if self.media_model not in (None, model):
            media_store().drop_session(self.id)
            self.last_mpic = None
        self.media_model = model

    def close(self, free: bool = True) -> None:
        """Everything the session holds goes; ``free``: collect the memory now (one collection
        after closing many sessions at once costs a fraction of one each)."""
        self.new_chat()
        self.chat = ChatState()  # the full-cache references too
        if self.media_model is not None:
            media_store().drop_session(self.id)
        self.media_model, self.last_mpic = None, None
        forget_uploads(self)
        drop_session_files(self.id)  # its overlays and drawn scenes
        self.stop_requested = False
        if free:
            free_memory()


def close_session(session: Session | None) -> None:
    if isinstance(session, Session):
        session.close()


def track(session: Session, session_hash: str | None, client: str | None = None, visitor: str | None = None) -> None:
    """Remember which browser session owns ``session`` so closing the tab frees it at once, which
    client it belongs to (the id its requests carry; see :mod:`.uploads`) and which visitor
    (``Visitor.key``: what its limits count by, :mod:`.visitors`)."""
    if visitor:
        session.visitor = visitor
    if session_hash:
        new = _book().open.get(session_hash) is not session
        _book().open[session_hash] = session
        _seen(session_hash)
        start_sweeper()
        if new and visitor:
            make_room(visitor, keep=session_hash)
    if client:
        session.client = client
        bind_tenant(session.id, client)  # its media on a shared store are its client's, on any replica


def open_session(session_hash: str | None) -> Session | None:
    """The session a browser tab (or API client) with this hash holds now, if any."""
    return _book().open.get(session_hash) if session_hash else None


def release(session_hash: str | None, free: bool = True) -> None:
    book = _book()
    session = book.open.pop(session_hash, None) if session_hash else None
    with book.lock:
        book.last_seen.pop(session_hash, None)
        book.heard.discard(session_hash)
    if isinstance(session, Session):
        session.close(free)
        bind_tenant(session.id, None)


# --- sessions whose client went away without a word ----------------------------------------------
# Gradio closes a session when its heartbeat stream ends; a client that never opens one (raw HTTP)
# is never closed by it. Such a session ends after ``KV_ARENA_SESSION_NO_HEARTBEAT_S`` seconds without
# an event; one that opened a heartbeat once, ``KV_ARENA_SESSION_IDLE_S`` after its last (a session
# with a heartbeat open, or an event running, is never idle).
def idle_seconds() -> float:
    return env_number("KV_ARENA_SESSION_IDLE_S", 1800)


def unheard_idle_seconds() -> float:
    """How long a session whose client never opened a heartbeat is kept idle (at most :func:`idle_seconds`)."""
    return min(idle_seconds(), env_number("KV_ARENA_SESSION_NO_HEARTBEAT_S", 120))


def max_sessions() -> int:
    """Sessions one visitor may hold at once (``KV_ARENA_MAX_SESSIONS_PER_VISITOR``; 0: no limit)."""
    return int(env_number("KV_ARENA_MAX_SESSIONS_PER_VISITOR", 16))


def _seen(session_hash: str) -> None:
    book = _book()
    with book.lock:
        book.last_seen[session_hash] = time.monotonic()


@contextlib.contextmanager
def active(session_hash: str | None, heartbeat: bool = False):
    """An event running, or (``heartbeat``) a heartbeat stream open, for that session: it is not idle meanwhile."""
    if not session_hash:
        yield
        return
    book = _book()
    with book.lock:
        book.busy[session_hash] += 1
        if heartbeat:
            book.beating[session_hash] += 1
            book.heard.add(session_hash)
    try:
        yield
    finally:
        with book.lock:
            for counter in (book.busy, book.beating) if heartbeat else (book.busy,):
                counter[session_hash] -= 1
                if counter[session_hash] <= 0:
                    del counter[session_hash]
        _seen(session_hash)


def held_by(visitor: str) -> list[str]:
    """The session hashes of the open sessions ``visitor`` holds."""
    return [h for h, s in list(_book().open.items()) if s.visitor == visitor]


def make_room(visitor: str, keep: str | None = None) -> list[str]:
    """Free ``visitor``'s sessions over :func:`max_sessions`, idle longest first (a session whose
    client keeps no heartbeat open before one whose does), never ``keep`` nor one answering; returns
    the session hashes freed."""
    limit, book = max_sessions(), _book()
    held = held_by(visitor)
    if not limit or len(held) <= limit:
        return []
    with book.lock:
        answering = {h for h in held if book.busy.get(h, 0) > book.beating.get(h, 0)}
        idle = sorted((h for h in held if h != keep and h not in answering),
                      key=lambda h: (bool(book.beating.get(h)), book.last_seen.get(h, 0.0)))
    freed = idle[:len(held) - limit]
    for session_hash in freed:  # their tensors go with their last reference; no collection each time
        release(session_hash, free=False)
    return freed


def expire_idle() -> list[str]:
    """Close the sessions idle for longer than their idle time (:func:`idle_seconds`, or
    :func:`unheard_idle_seconds` for a client that never opened a heartbeat), and drop uploads no
    session took within :func:`idle_seconds`; returns the session hashes closed."""
    limit, unheard, now, book = idle_seconds(), unheard_idle_seconds(), time.monotonic(), _book()
    with book.lock:
        idle = [h for h in list(book.open.keys()) if not book.busy.get(h)
                and now - book.last_seen.get(h, now) > (limit if h in book.heard else unheard)]
        for gone in set(book.last_seen) - set(book.open.keys()):  # sessions Gradio closed itself
            del book.last_seen[gone]
        # a tab opens its heartbeat before its first event opens its session: keep what still beats
        book.heard &= set(book.open.keys()) | set(book.beating)
    for session_hash in idle:
        release(session_hash, free=False)
    if idle:
        free_memory()
    expire_unclaimed(limit)
    return idle


def _sweep_forever(book: SessionBook) -> None:
    while _book() is book:  # another app opened: its own sweeper serves it (start_sweeper)
        time.sleep(min(5.0, max(0.2, unheard_idle_seconds() / 4)))
        if _book() is book:
            expire_idle()


def start_sweeper() -> None:
    """The thread that ends idle sessions and unclaimed uploads (one per open app)."""
    book = _book()
    with book.lock:
        if book.sweeper is None or not book.sweeper.is_alive():
            book.sweeper = threading.Thread(target=_sweep_forever, args=(book,), name="kv-arena-idle-sessions",
                                            daemon=True)
            book.sweeper.start()



def sweep_dead_sessions() -> None:
    """At the app's start: what sessions of an earlier run left on disk (MPIC's store folders, the
    app's private files in Gradio's folder) goes, since none of them can come back."""
    media_store()  # made once per process; it sweeps its folders then
    sweep_private_folders()
