"""The "Can you tell?" tab's engine (kv_arena.service.blind) on the offline model's scenes, with a
SQLite file of its own: the Wilson interval against hand-worked values, the migration, a battle
shown blind and revealed by its vote, every refusal in one line (a second vote, another client's
battle, an expired one, too many votes a minute, a follow-up before the vote), a follow-up on the
compressed cache, the truth stored, the leaderboard's counts, and bad database settings."""

from __future__ import annotations

import sqlalchemy as sa
import pytest

from kv_arena import service
from kv_arena.errors import UserError
from kv_arena.service import blind
from kv_arena.service.blind.store import VotesUnavailable, db_url

MODEL = "tiny-arena-vl"


@pytest.mark.parametrize("k, n, low, high", [
    (5, 10, 0.2366, 0.7634),  # p = 0.5: centre 0.5, half 1.96 sqrt(0.025 + 0.0096) / 1.384 = 0.2634
    (0, 10, 0.0, 0.2775),  # p = 0: high = z^2/n / (1 + z^2/n) = 0.38415 / 1.38415
    (10, 10, 0.7225, 1.0),
    (1, 4, 0.0456, 0.6994),  # centre (0.25 + 0.4802) / 1.9604 = 0.3725, half 0.3269
    (0, 0, 0.0, 1.0),  # no votes: nothing known
])
def test_the_wilson_interval_matches_hand_worked_values(k, n, low, high):
    got = blind.wilson(k, n)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_a_vote_against_the_truth():
    assert blind.vote_right("same", True, True) and blind.vote_right("same", False, False)
    assert blind.vote_right("full", True, False) and not blind.vote_right("method", True, False)
    assert blind.vote_right("method", False, True) and blind.vote_right("full", None, True) is None


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("KV_ARENA_DB_URL", raising=False)
    for name in ("KV_ARENA_BLIND_SALT", "KV_ARENA_SALT", "KV_ARENA_BLIND_REQUIRE_LOGIN", "SPACE_ID"):
        monkeypatch.delenv(name, raising=False)
    with service.using_app(service.AppState()) as state:
        yield state


def scene_turn():
    scene = service.scene_examples()[0]
    settings = service.Settings.make(model=MODEL, max_new_tokens=6)
    return settings, scene, service.prepare(scene.questions[0], list(scene.files))


def test_the_default_store_is_a_sqlite_file_in_the_data_folder_migrated_to_the_head(app, tmp_path):
    assert db_url() == f"sqlite:///{tmp_path / 'data' / 'votes.db'}"
    store = blind.open_votes()
    with store.engine.connect() as c:
        assert c.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() == "0002"
        assert {"battles", "votes", "deployment"} <= set(sa.inspect(c).get_table_names())
        salt = c.execute(sa.text("SELECT value FROM deployment WHERE name = 'salt'")).scalar_one()
    assert store.key == salt.encode() and len(salt) == 64  # the database's own: every replica's
    assert not (tmp_path / "data" / "blind-salt").exists()
    assert blind.salted("abc", store.key) != "abc" and len(blind.salted("abc", store.key)) == 64


def test_a_battle_is_blind_until_its_vote_then_revealed_once(app, monkeypatch):
    settings, scene, prepared = scene_turn()
    session = service.Session()
    battle = blind.start(session, settings, prepared, method="snapkv", budget="0.2", client="alice")
    assert len(battle.id) == 32 and battle.turn == 1 and battle.a and battle.b
    with pytest.raises(UserError, match="only on a battle you were shown"):
        blind.vote(battle.id, "A", client="mallory")
    with pytest.raises(UserError, match="Vote on this battle's answers first"):
        blind.start(session, settings, service.prepare(scene.questions[1], []), client="alice", follow=battle.id)
    reveal = blind.vote(battle.id, "a", client="alice")
    assert reveal.choice == "A" and reveal.method == "snapkv" and reveal.budget == 0.2
    assert reveal.verdict == ("full" if reveal.full_side == "A" else "method")
    assert 0 < reveal.kv_fraction < 1 and reveal.method_kv_bytes < reveal.full_kv_bytes and reveal.full_s > 0
    assert reveal.truth == scene.answers[0] and reveal.full_right is True  # the offline model knows its scenes
    with pytest.raises(UserError, match="one vote per battle"):
        blind.vote(battle.id, "B", client="alice")
    # the follow-up: the same method and budget, on the compressed cache, voted again
    then = blind.start(session, settings, service.prepare(scene.questions[1], []), client="alice", follow=battle.id)
    assert then.turn == 2 and then.id != battle.id
    again = blind.vote(then.id, "same", client="alice")
    assert again.turn == 2 and again.method == "snapkv" and again.truth == scene.answers[1]
    rows = blind.leaderboard()
    assert [(r.model, r.method, r.budget, r.votes) for r in rows] == [(MODEL, "snapkv", 0.2, 2)]
    row = rows[0]
    assert row.cant_tell == (reveal.verdict != "full") / 2 + 0.5 and row.low <= row.cant_tell <= row.high
    assert row.votes_right is not None and row.method_right is not None
    # expired: no vote after KV_ARENA_BLIND_EXPIRE_S
    late = blind.start(session, settings, prepared, client="alice")
    assert late.id not in (battle.id, then.id)
    monkeypatch.setenv("KV_ARENA_BLIND_EXPIRE_S", "0")
    with pytest.raises(UserError, match="expired"):
        blind.vote(late.id, "A", client="alice")


def test_a_battle_may_draw_snapkv_on_a_quantised_store(app):
    """FP8 and INT4 take no budget, so a battle meets them stacked under SnapKV, which does."""
    assert {"snapkv+fp8", "snapkv+int4"} <= {name for name, _ in blind.battle_methods()}
    settings, _, prepared = scene_turn()
    shown = blind.start(service.Session(), settings, prepared, method="snapkv+fp8", budget="0.5", client="bob")
    reveal = blind.vote(shown.id, "same", client="bob")
    assert reveal.method == "snapkv+fp8" and reveal.kv_fraction < 0.35  # half the tokens at about half the bytes
    assert [r.method_title for r in blind.leaderboard()] == ["SnapKV + FP8 (vLLM)"]


def test_rates_and_bad_values_are_refused_in_one_line(app, monkeypatch):
    settings, _, prepared = scene_turn()
    session = service.Session()
    for bad, match in (({"method": "full"}, "method must be one of"), ({"budget": "0.25"}, "budget must be one of"),
                       ({"budget": "abc"}, "budget must be one of")):
        with pytest.raises(UserError, match=match):
            blind.start(session, settings, prepared, client="bob", **bad)
    with pytest.raises(UserError, match="Ask about a picture"):
        blind.start(session, settings, service.prepare("What colour is it?", []), client="bob")
    for choice, said in (("C", '"A", "B" or "same"'), (None, "Pick A is better"), (["A"], '"A", "B" or "same"')):
        with pytest.raises(UserError, match=said):
            blind.vote("0" * 32, choice, client="bob")
    with pytest.raises(UserError, match="32 hex digits"):
        blind.vote("../etc", "A", client="bob")
    with pytest.raises(UserError, match="Ask a question first"):  # a vote before any battle
        blind.vote("", None, client="bob")
    with pytest.raises(UserError, match="method must be one of") as refused:  # each method named once
        blind.start(session, settings, prepared, client="bob", method="full")
    named = str(refused.value).split("one of ")[1].split(", or")[0].split(", ")
    assert len(named) == len(set(named)) and "random" in named  # Random eviction is a method here too
    monkeypatch.setenv("KV_ARENA_BLIND_BATTLES_PER_MINUTE", "1")
    battle = blind.start(session, settings, prepared, method="streamingllm", client="bob")
    with pytest.raises(UserError, match="At most 1 battles a minute"):
        blind.start(session, settings, prepared, client="bob")
    monkeypatch.setenv("KV_ARENA_BLIND_VOTES_PER_MINUTE", "1")
    blind.vote(battle.id, "B", client="bob")
    with pytest.raises(UserError, match="At most 1 votes a minute"):
        blind.vote(battle.id, "A", client="bob")
    assert [r.votes for r in blind.leaderboard()] == [1]


@pytest.mark.parametrize("url, match", [("not a url", "not an SQLAlchemy URL"), ("", "set but empty"),
                                        ("nosuchdb://x/y", "cannot be used"),
                                        ("postgresql://u:secret@127.0.0.1:1/db", "cannot be used")])
def test_bad_database_settings_are_one_line(app, monkeypatch, url, match):
    monkeypatch.setenv("KV_ARENA_DB_URL", url)
    with pytest.raises(VotesUnavailable, match=match) as caught:
        blind.open_votes()
    assert "\n" not in str(caught.value) and "secret" not in str(caught.value)
