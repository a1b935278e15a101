"""The votes database's faults, each one line and nothing acknowledged lost (issue 56): a SQLite file
deleted, replaced or emptied under a running app is reopened and migrated on the next use (the
board then shows the file that is there now); a line a visitor reads names no host, port or user;
one salt for every replica of a deployment (``KV_ARENA_SALT``, its older name, else a row of the
database itself); migration 0002 upgrades a database 0001 made, rows kept, on SQLite and (where
installed) PostgreSQL. No model runs here: battles are written as rows."""

from __future__ import annotations

import os
import uuid

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from kv_arena import service
from kv_arena.service import blind
from kv_arena.service.blind.store import MIGRATIONS, VoteStore, VotesUnavailable
from tests.postgres_server import LocalPostgres, binaries

MODEL = "tiny-arena-vl"


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "data"))
    for name in ("KV_ARENA_DB_URL", "KV_ARENA_SALT", "KV_ARENA_BLIND_SALT", "KV_ARENA_BLIND_REQUIRE_LOGIN", "SPACE_ID"):
        monkeypatch.delenv(name, raising=False)
    with service.using_app(service.AppState()) as state:
        yield state


def battle_row(db: VoteStore, client: str = "alice", method: str = "snapkv") -> str:
    """A battle as ``blind.start`` writes it (no model run), owned by ``client``; its id."""
    battle_id = uuid.uuid4().hex
    db.add_battle({"id": battle_id, "thread": battle_id, "turn": 1, "model": MODEL, "method": method, "budget": 0.2,
                   "kv_fraction": 0.2, "full_kv_bytes": 1000, "method_kv_bytes": 200, "full_s": 1.0, "method_s": 0.5,
                   "full_side": "A", "hash_a": "0" * 64, "hash_b": "1" * 64, "truth": None, "full_right": None,
                   "method_right": None, "client": db.client(client), "visitor": db.client("visitor:192.0.2.1")})
    return battle_id


def voted(db: VoteStore, client: str = "alice") -> str:
    battle_id = battle_row(db, client)
    blind.vote(battle_id, "A", client=client)
    return battle_id


def test_a_deleted_sqlite_file_is_made_again_on_the_next_use(app, tmp_path):
    db = blind.open_votes()
    voted(db)
    assert [r.votes for r in blind.leaderboard()] == [1]
    (tmp_path / "data" / "votes.db").unlink()  # today: the old rows are still shown, every battle refused
    assert blind.leaderboard() == []  # the file there now: a new, empty one, migrated
    voted(db)  # battles and votes go on
    assert [r.votes for r in blind.leaderboard()] == [1] and (tmp_path / "data" / "votes.db").is_file()


def test_a_replaced_sqlite_file_is_read_on_the_next_use(app, tmp_path):
    db = blind.open_votes()
    voted(db)
    other = VoteStore(f"sqlite:///{tmp_path / 'restored.db'}")  # say, a backup restored over it
    for _ in range(3):
        battle_id = battle_row(other)
        assert other.add_vote({"battle_id": battle_id, "choice": "B", "verdict": "method", "right": None,
                               "client": other.client("alice"), "visitor": None, "account": None})
    other.close()
    os.replace(tmp_path / "restored.db", tmp_path / "data" / "votes.db")
    assert [r.votes for r in blind.leaderboard()] == [3]


def test_a_file_emptied_in_place_is_migrated_again(app, tmp_path):
    db = blind.open_votes()
    voted(db)
    (tmp_path / "data" / "votes.db").write_bytes(b"")  # the same inode, no tables: the query fails, then reopens
    assert blind.leaderboard() == []
    voted(db)
    assert [r.votes for r in blind.leaderboard()] == [1]


def test_a_database_that_cannot_be_reached_names_no_host_to_visitors(app, monkeypatch):
    monkeypatch.setenv("KV_ARENA_DB_URL", "postgresql://kvuser:secret@127.0.0.1:1/votesdb")
    for attempt in (lambda: blind.vote("0" * 32, "A", client="alice"), blind.leaderboard):
        with pytest.raises(VotesUnavailable) as caught:  # the first use opens it: refused
            attempt()
        line = str(caught.value)
        assert "unreachable" in line and "\n" not in line
        for secret in ("127.0.0.1", "port", ":1", "kvuser", "secret", "votesdb", "postgresql"):
            assert secret not in line, line
    with pytest.raises(VotesUnavailable, match="127.0.0.1"):  # the operator's line at start still says where
        blind.open_votes()


def test_a_query_that_fails_later_names_no_host_either(app, tmp_path):
    db = blind.open_votes(f"sqlite:///{tmp_path / 'votes.db'}")
    # the server goes away under an open store: its engine now points at a port nothing listens on
    db.engine = sa.create_engine("postgresql+psycopg://kvuser@127.0.0.1:1/votesdb", connect_args={"connect_timeout": 2})
    db._file = None
    with pytest.raises(VotesUnavailable) as caught:
        db.tallies()
    assert "unreachable" in str(caught.value) and "127.0.0.1" not in str(caught.value)
    assert "127.0.0.1" in caught.value.detail  # the log's line says where


def test_every_replica_on_one_database_hashes_alike(app, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "one"))
    one = VoteStore(url)
    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "two"))  # data folders not shared
    two = VoteStore(url)
    assert one.key == two.key and len(one.key) == 64 and one.client("alice") == two.client("alice")
    assert not (tmp_path / "one" / "blind-salt").exists() and not (tmp_path / "two" / "blind-salt").exists()
    monkeypatch.setenv("KV_ARENA_BLIND_SALT", "older-name")  # the older setting is still read
    assert VoteStore(url).key == b"older-name"
    monkeypatch.setenv("KV_ARENA_SALT", "the-deployment's")
    assert VoteStore(url).key == b"the-deployment's"


def test_a_battle_written_by_one_replica_is_voted_through_another(app, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "one"))
    battle_id = battle_row(blind.open_votes(url))
    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "two"))
    with service.using_app(service.AppState()):  # the other replica
        blind.open_votes(url)
        assert blind.vote(battle_id, "same", client="alice").verdict == "same"


def upgraded_from_0001(url: str) -> None:
    """A database as the previous release left it (0001, a battle and its vote), then opened now."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0001")
        connection.execute(sa.text(
            "INSERT INTO battles (id, thread, turn, model, method, budget, kv_fraction, full_kv_bytes, "
            "method_kv_bytes, full_s, method_s, full_side, hash_a, hash_b, client, created_at) VALUES ('" + "a" * 32
            + "', '" + "a" * 32 + f"', 1, '{MODEL}', 'snapkv', 0.2, 0.2, 10, 2, 1.0, 1.0, 'A', 'x', 'y', 'c', "
            "CURRENT_TIMESTAMP)"))
        connection.execute(sa.text("INSERT INTO votes (battle_id, choice, verdict, client, created_at) VALUES ('"
                                   + "a" * 32 + "', 'A', 'full', 'c', CURRENT_TIMESTAMP)"))
    engine.dispose()


def check_upgraded(url: str) -> None:
    db = VoteStore(url)
    try:
        with db.engine.connect() as c:
            assert c.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() == "0002"
            columns = {t: {col["name"] for col in sa.inspect(c).get_columns(t)} for t in ("battles", "votes")}
            assert "visitor" in columns["battles"] and {"visitor", "account"} <= columns["votes"]
            assert c.execute(sa.text("SELECT visitor, account FROM votes")).one() == (None, None)  # kept as it was
            salt = c.execute(sa.text("SELECT value FROM deployment WHERE name = 'salt'")).scalar_one()
        assert db.key == salt.encode()
        assert [(t.method, t.votes) for t in db.tallies()] == [("snapkv", 1)]
        assert db.tallies(signed_in_only=True) == [] and db.signed_out_votes() == 1
        assert VoteStore(url).key == db.key  # a second replica: the same salt, no second row
    finally:
        db.close()


def test_migration_0002_upgrades_a_sqlite_database_of_0001(app, tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgraded_from_0001(url)
    check_upgraded(url)


@pytest.mark.skipif(binaries() is None, reason="no PostgreSQL installed (apt-get install postgresql)")
def test_migration_0002_upgrades_a_postgresql_database_of_0001(app):
    with LocalPostgres() as db:
        upgraded_from_0001(db.url)
        check_upgraded(db.url)

