"""The votes database: SQLite by default (a file in the app's data folder, made on first use), any
SQLAlchemy URL in ``KV_ARENA_DB_URL`` (PostgreSQL for several replicas). Its schema is migrated
by Alembic when the store opens (``migrations/``). Every failure of the database reaches the
caller as one line (:class:`VotesUnavailable`); a vote is acknowledged only once committed.

The rules that must hold across replicas live in the database: one vote per battle is a unique
key, the rates and the expiry are read from the rows every replica writes."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, SQLAlchemyError

from ...errors import UserError
from .schema import battles, votes

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).resolve().parent / "migrations"


class VotesUnavailable(UserError):
    """The votes database cannot be used (bad settings, unreachable, refused): said in one line."""


def data_dir() -> Path:
    """The app's data folder (``KV_ARENA_DATA_DIR``; default ``~/.local/share/kv-arena``; on a Space
    with persistent storage, point it at ``/data``)."""
    return Path(os.environ.get("KV_ARENA_DATA_DIR") or Path.home() / ".local" / "share" / "kv-arena")


def db_url() -> str:
    """``KV_ARENA_DB_URL`` if set, else the SQLite file ``votes.db`` in the data folder."""
    url = os.environ.get("KV_ARENA_DB_URL")
    if url is not None:
        if not url.strip():
            raise VotesUnavailable("KV_ARENA_DB_URL is set but empty: unset it for SQLite in the data folder, "
                                   "or give an SQLAlchemy URL (postgresql://user:password@host/db).")
        return url.strip()
    return f"sqlite:///{data_dir() / 'votes.db'}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(getattr(exc, "orig", None) or exc).split())
    return text[:200] or exc.__class__.__name__


def shown_url(url: sa.URL) -> str:
    return url.render_as_string(hide_password=True)


def _engine(url: str) -> sa.Engine:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise VotesUnavailable(f"KV_ARENA_DB_URL is not an SQLAlchemy URL: {url.split('@')[-1]!r} "
                               "(e.g. postgresql://user:password@host/db, sqlite:////path/votes.db).") from None
    if parsed.drivername == "postgresql":  # psycopg 3 is the driver requirements.txt installs
        parsed = parsed.set(drivername="postgresql+psycopg")
    options: dict = {"pool_pre_ping": True}  # a restarted database: the next use reconnects
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        options["connect_args"] = {"timeout": 30}  # replicas on one file wait for its lock
    elif parsed.get_backend_name() == "postgresql":
        options["connect_args"] = {"connect_timeout": 5}  # a database gone says so in seconds
    try:
        return sa.create_engine(parsed, **options)
    except (ArgumentError, ImportError, SQLAlchemyError) as exc:
        raise VotesUnavailable(f"the votes database {shown_url(parsed)} cannot be used: {_one_line(exc)}") from None


def salt() -> bytes:
    """The deployment's salt for client ids: ``KV_ARENA_BLIND_SALT``, else a random one kept in the
    data folder (made on first use, readable by the app's user only)."""
    given = os.environ.get("KV_ARENA_BLIND_SALT")
    if given:
        return given.encode()
    path = data_dir() / "blind-salt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # O_EXCL: two replicas starting together keep the same one
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
        except FileExistsError:
            pass
    return path.read_text().strip().encode()


def salted(client: str, key: bytes) -> str:
    """HMAC-SHA256 of a client id: the same client is the same row owner, its cookie is never stored."""
    return hmac.new(key, client.encode(), hashlib.sha256).hexdigest()


def now() -> datetime:
    return datetime.now(timezone.utc)


def aware(moment: datetime) -> datetime:
    """SQLite gives back a naive time (it stores no zone); every time written here is UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class Tally:
    """One leaderboard row's counts: votes, "can't tell" (same, or the compressed answer preferred),
    the votes that agree with the truth and those on a known scene, the method right and known."""

    model: str
    method: str
    budget: float
    votes: int
    cant_tell: int
    kv_fraction: float
    votes_right: int
    votes_known: int
    method_right: int


class VoteStore:
    """The database behind the tab: battles written, votes counted once, the leaderboard's counts."""

    def __init__(self, url: str | None = None) -> None:
        self.engine = _engine(url or db_url())
        self.url = shown_url(self.engine.url)
        self.key = salt()
        self._migrate()

    def _migrate(self) -> None:
        """The schema at Alembic's head (two replicas on one SQLite file retry once the other is done)."""
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        config.set_main_option("path_separator", "os")
        for attempt in range(3):
            try:
                with self.engine.begin() as connection:
                    config.attributes["connection"] = connection
                    command.upgrade(config, "head")
                return
            except SQLAlchemyError as exc:
                if attempt == 2 or self.engine.url.get_backend_name() != "sqlite":
                    raise VotesUnavailable(f"the votes database {self.url} cannot be used: {_one_line(exc)}") from None

    def client(self, client_id: str) -> str:
        return salted(client_id, self.key)

    def _run(self, work):
        """``work(connection)`` in one transaction; a database failure becomes one line."""
        try:
            with self.engine.begin() as connection:
                return work(connection)
        except IntegrityError:
            raise
        except SQLAlchemyError as exc:
            log.warning("votes database: %s", _one_line(exc))
            raise VotesUnavailable(f"The votes database is unreachable ({_one_line(exc)}); nothing was recorded: "
                                   "try again in a moment.") from None

    def recent(self, table: sa.Table, client: str, seconds: float) -> int:
        """Rows ``client`` wrote in ``table`` in the last ``seconds``."""
        since = now() - timedelta(seconds=seconds)
        query = sa.select(sa.func.count()).select_from(table).where(table.c.client == client,
                                                                   table.c.created_at > since)
        return self._run(lambda c: c.execute(query).scalar_one())

    def add_battle(self, row: dict) -> None:
        self._run(lambda c: c.execute(battles.insert().values(**row, created_at=now())))

    def battle(self, battle_id: str) -> dict | None:
        query = sa.select(battles).where(battles.c.id == battle_id)
        found = self._run(lambda c: c.execute(query).mappings().first())
        return None if found is None else dict(found) | {"created_at": aware(found["created_at"])}

    def vote_of(self, battle_id: str) -> dict | None:
        query = sa.select(votes).where(votes.c.battle_id == battle_id)
        found = self._run(lambda c: c.execute(query).mappings().first())
        return None if found is None else dict(found)

    def add_vote(self, row: dict) -> bool:
        """Whether the vote was recorded (committed); False when the battle already has one."""
        try:
            self._run(lambda c: c.execute(votes.insert().values(**row, created_at=now())))
        except IntegrityError:
            return False
        return True

    def tallies(self) -> list[Tally]:
        """Per model, method and budget level: the counts the leaderboard shows."""
        cant = sa.case((votes.c.verdict.in_(("same", "method")), 1), else_=0)
        right = sa.case((votes.c.right.is_(True), 1), else_=0)
        known = sa.case((votes.c.right.is_not(None), 1), else_=0)
        method_right = sa.case((battles.c.method_right.is_(True), 1), else_=0)
        query = (sa.select(battles.c.model, battles.c.method, battles.c.budget, sa.func.count(votes.c.id),
                           sa.func.sum(cant), sa.func.avg(battles.c.kv_fraction), sa.func.sum(right),
                           sa.func.sum(known), sa.func.sum(method_right))
                 .select_from(votes.join(battles, votes.c.battle_id == battles.c.id))
                 .group_by(battles.c.model, battles.c.method, battles.c.budget)
                 .order_by(battles.c.model, battles.c.method, battles.c.budget))
        rows = self._run(lambda c: c.execute(query).all())
        return [Tally(m, meth, float(b), int(n), int(ct or 0), float(kv or 0), int(r or 0), int(k or 0), int(mr or 0))
                for m, meth, b, n, ct, kv, r, k, mr in rows]

    def close(self) -> None:
        self.engine.dispose()


class VoteHolder:
    """The application's votes store, opened on first use (or at start by ``app.py``)."""

    def __init__(self) -> None:
        self._store: VoteStore | None = None
        self._lock = threading.Lock()

    def get(self) -> VoteStore:
        """The store, opened with ``KV_ARENA_DB_URL`` (or the SQLite default) on first use."""
        with self._lock:
            if self._store is None:
                self._store = VoteStore()
            return self._store

    def open(self, url: str | None = None) -> VoteStore:
        """A store opened now on ``url`` (default: the environment's), replacing any open one."""
        store = VoteStore(url)
        with self._lock:
            previous, self._store = self._store, store
        if previous is not None:
            previous.close()
        return store

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        if self._store is not None:  # the parent's connections are not this process's to use
            self._store.engine.dispose(close=False)
