"""The votes database: SQLite by default (a file in the app's data folder, made on first use), any
SQLAlchemy URL in ``KV_ARENA_DB_URL`` (PostgreSQL for several replicas). Its schema is migrated
by Alembic when the store opens (``migrations/``). Every failure of the database reaches the
caller as one line (:class:`VotesUnavailable`); a vote is acknowledged only once committed.

The rules that must hold across replicas live in the database: one vote per battle is a unique
key, the rates and the expiry are read from the rows every replica writes, and so is the salt
(``KV_ARENA_SALT`` aside), so every replica hashes a client, a visitor and an account alike.

Faults, each one line, nothing acknowledged lost: a SQLite file deleted or replaced under a
running app is noticed on the next use (its inode changed, or a query failed) and reopened,
migrated; a line a visitor sees names no host, port or user (the server's log and the line at
start say where the database is)."""

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
from sqlalchemy.exc import ArgumentError, IntegrityError, ProgrammingError, SQLAlchemyError

from ...errors import UserError
from .schema import battles, deployment, votes

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).resolve().parent / "migrations"


UNREACHABLE = ("The votes database is unreachable; nothing was recorded: try again in a moment "
               "(the server's log says why).")


class VotesUnavailable(UserError):
    """The votes database cannot be used (bad settings, unreachable, refused): said in one line.
    Its text is what a visitor may read (no host, port or user); ``detail`` is the operator's line
    (where the database is, why it failed: the log, and ``error:`` at start)."""

    def __init__(self, line: str, detail: str | None = None) -> None:
        super().__init__(line)
        self.detail = detail or line


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
        raise VotesUnavailable(UNREACHABLE, f"KV_ARENA_DB_URL is not an SQLAlchemy URL: {url.split('@')[-1]!r} "
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
        raise VotesUnavailable(UNREACHABLE, f"the votes database {shown_url(parsed)} cannot be used: "
                               f"{_one_line(exc)}") from None


def given_salt() -> bytes | None:
    """The deployment's salt from the environment: ``KV_ARENA_SALT`` (``KV_ARENA_BLIND_SALT``, its
    older name, still read), else None (the database's own, :func:`stored_salt`)."""
    given = os.environ.get("KV_ARENA_SALT") or os.environ.get("KV_ARENA_BLIND_SALT")
    return given.encode() if given else None


def stored_salt(connection: sa.Connection) -> bytes:
    """The salt kept in the database (migration 0002 makes it), made now if someone deleted it:
    every replica on the database reads the same one, whatever its data folder."""
    query = sa.select(deployment.c.value).where(deployment.c.name == "salt")
    found = connection.execute(query).scalar_one_or_none()
    if found is None:
        connection.execute(deployment.insert().values(name="salt", value=secrets.token_hex(32)))
        found = connection.execute(query).scalar_one()
    return found.encode()


def sqlite_file(url: sa.URL) -> Path | None:
    """The file of a SQLite database (None for another database or one in memory)."""
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return Path(url.database)


def identity(path: Path | None) -> tuple[int, int] | None:
    """Which file ``path`` is now (device and inode; None: no file there): a replaced file is another."""
    try:
        found = path.stat() if path is not None else None
    except OSError:
        return None
    return None if found is None else (found.st_dev, found.st_ino)


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
        self._given = url or db_url()
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        """The engine, the schema at the head, the salt, and which file a SQLite database is."""
        self.engine = _engine(self._given)
        self.url = shown_url(self.engine.url)
        self._file = sqlite_file(self.engine.url)
        self._migrate()
        self._seen = identity(self._file)
        try:
            with self.engine.begin() as connection:
                self.key = given_salt() or stored_salt(connection)
        except SQLAlchemyError as exc:
            raise VotesUnavailable(UNREACHABLE, f"the votes database {self.url} cannot be used: "
                                   f"{_one_line(exc)}") from None

    def _reopen(self, why: str) -> None:
        """Open the database again (migrated: a file made anew gets its tables), this engine's
        connections dropped: they may hold a deleted file, or none."""
        log.warning("votes database %s: %s; reopened", self.url, why)
        previous = self.engine
        try:
            self._open()
        finally:
            if self.engine is not previous:
                previous.dispose()

    def _fresh(self) -> None:
        """A SQLite file deleted or replaced since it was opened (another inode, or none) is reopened:
        otherwise its connections keep reading the old one, and a new one cannot be opened."""
        if self._file is not None and identity(self._file) != self._seen:
            with self._lock:
                if identity(self._file) != self._seen:
                    self._reopen("its file was deleted or replaced")

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
                    raise VotesUnavailable(UNREACHABLE, f"the votes database {self.url} cannot be used: "
                                           f"{_one_line(exc)}") from None

    def client(self, client_id: str) -> str:
        return salted(client_id, self.key)

    def _reopens_on(self, exc: SQLAlchemyError) -> bool:
        """Whether a failure may be a database replaced under the app (a SQLite file, a table gone),
        so opening it again and retrying once is worth it; not a server that is down (each try
        would wait for its timeout: the pool's pre-ping reconnects once it is back)."""
        if isinstance(exc, ProgrammingError):
            return True
        busy = any(word in str(getattr(exc, "orig", exc)).lower() for word in ("locked", "busy"))
        return self._file is not None and not busy  # a file another replica holds: wait, not reopen

    def _run(self, work):
        """``work(connection)`` in one transaction; a database failure becomes one line (the
        visitor's names no host: the log says where and why)."""
        try:
            self._fresh()
            try:
                return self._once(work)
            except SQLAlchemyError as exc:
                if isinstance(exc, IntegrityError) or not self._reopens_on(exc):
                    raise
                with self._lock:
                    self._reopen(f"a query failed ({_one_line(exc)})")
                return self._once(work)
        except IntegrityError:
            raise
        except SQLAlchemyError as exc:
            log.warning("votes database %s: %s", self.url, _one_line(exc))
            raise VotesUnavailable(UNREACHABLE, f"the votes database {self.url}: {_one_line(exc)}") from None
        except VotesUnavailable as exc:  # reopening failed
            log.warning("%s", exc.detail)
            raise

    def _once(self, work):
        with self.engine.begin() as connection:
            return work(connection)

    def recent(self, column: sa.Column, value: str, seconds: float) -> int:
        """Rows of ``column``'s table with ``value`` in it, written in the last ``seconds``."""
        since = now() - timedelta(seconds=seconds)
        table = column.table
        query = sa.select(sa.func.count()).select_from(table).where(column == value, table.c.created_at > since)
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

    def tallies(self, signed_in_only: bool = False) -> list[Tally]:
        """Per model, method and budget level: the counts the leaderboard shows (only the votes of
        signed-in accounts with ``signed_in_only``)."""
        cant = sa.case((votes.c.verdict.in_(("same", "method")), 1), else_=0)
        right = sa.case((votes.c.right.is_(True), 1), else_=0)
        known = sa.case((votes.c.right.is_not(None), 1), else_=0)
        method_right = sa.case((battles.c.method_right.is_(True), 1), else_=0)
        query = (sa.select(battles.c.model, battles.c.method, battles.c.budget, sa.func.count(votes.c.id),
                           sa.func.sum(cant), sa.func.avg(battles.c.kv_fraction), sa.func.sum(right),
                           sa.func.sum(known), sa.func.sum(method_right))
                 .select_from(votes.join(battles, votes.c.battle_id == battles.c.id))
                 .where(votes.c.account.is_not(None) if signed_in_only else sa.true())
                 .group_by(battles.c.model, battles.c.method, battles.c.budget)
                 .order_by(battles.c.model, battles.c.method, battles.c.budget))
        rows = self._run(lambda c: c.execute(query).all())
        return [Tally(m, meth, float(b), int(n), int(ct or 0), float(kv or 0), int(r or 0), int(k or 0), int(mr or 0))
                for m, meth, b, n, ct, kv, r, k, mr in rows]

    def signed_out_votes(self) -> int:
        """Votes cast without a signed-in account (kept, shown apart where sign-in is required)."""
        query = sa.select(sa.func.count()).select_from(votes).where(votes.c.account.is_(None))
        return self._run(lambda c: c.execute(query).scalar_one())

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
                try:
                    self._store = VoteStore()
                except VotesUnavailable as exc:  # the visitor's line names no host; the log says where
                    log.warning("%s", exc.detail)
                    raise
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
            self._store._lock = threading.Lock()
