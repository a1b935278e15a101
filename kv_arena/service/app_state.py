"""The application's state: one object per job, each from the module that does that job and each
with its own lock. ``app.py`` builds one (:func:`~kv_arena.service.current.open_app`), a test
builds its own (:func:`~kv_arena.service.current.using_app`); nothing of it is module-level."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .blind.store import VoteHolder
from .model_pool import ModelPool
from .rereads import RereadBook
from .scenes import SceneBook
from .sessions import SessionBook
from .store import StoreHolder
from .uploads import UploadBook


@dataclass
class AppState:
    models: ModelPool = field(default_factory=ModelPool)  # loaded models, shared by every session
    scenes: SceneBook = field(default_factory=SceneBook)  # drawn scenes with their true answers
    sessions: SessionBook = field(default_factory=SessionBook)  # open sessions, their activity, stops asked
    store: StoreHolder = field(default_factory=StoreHolder)  # MPIC's media KV store and its tenants
    uploads: UploadBook = field(default_factory=UploadBook)  # who uploaded which file; files the app drew
    rereads: RereadBook = field(default_factory=RereadBook)  # each visitor's re-read tokens of the last minute
    votes: VoteHolder = field(default_factory=VoteHolder)  # the blind tab's votes database, opened on first use

    def after_fork(self) -> None:
        """In a forked worker (ZeroGPU): each part drops what the fork broke (its parent's locks)."""
        for part in fields(self):
            getattr(self, part.name).after_fork()
