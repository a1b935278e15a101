"""The blind test measures what it says (issue 56), called as the tab's events call it: battles and
votes counted per visitor (the address behind the trusted proxy), never per cookie; no progress or
status line before the vote names the method, its budget or the side; every battle's answers come
with the vote control emptied; no battle of a method that compresses nothing on its input
(InfiniPot-V, which holds a picture whole); where sign-in is required, votes kept from everyone but
counted only from signed-in Hugging Face accounts, the others' number apart."""

from __future__ import annotations

import secrets
import uuid
from types import SimpleNamespace

import gradio as gr
import pytest
import sqlalchemy as sa

from components import blind as tab
from components.chat import NOT_ANSWERED
from components.clients import COOKIE
from kv_arena import backends, service
from kv_arena.errors import UserError
from kv_arena.service import blind
from kv_arena.service.blind import battles

MODEL = "tiny-arena-vl"
PROXY = "203.0.113.5"  # the address the trusted proxy saw


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_ARENA_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "1")
    for name in ("KV_ARENA_DB_URL", "KV_ARENA_SALT", "KV_ARENA_BLIND_SALT", "KV_ARENA_BLIND_REQUIRE_LOGIN", "SPACE_ID",
                 "KV_ARENA_BLIND_BATTLES_PER_MINUTE", "KV_ARENA_BLIND_VOTES_PER_MINUTE"):
        monkeypatch.delenv(name, raising=False)
    with service.using_app(service.AppState()) as state:
        blind.open_votes()
        yield state


def request(address: str = PROXY, cookie: str | None = None):
    """An event's request as a script acting as the proxy sends it: a fresh cookie, a forged entry."""
    return SimpleNamespace(session_hash=None, cookies={COOKIE: cookie or secrets.token_urlsafe(18)},
                           headers={"x-forwarded-for": f"198.51.100.{secrets.randbelow(250)}, {address}"},
                           client=SimpleNamespace(host="127.0.0.1"))


def message(scene, question: int = 0):
    return {"text": scene.questions[question], "files": list(scene.files)}


class Recorded:
    """A gr.Progress stand-in: every line it was given."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, fraction, desc=None, **_) -> None:
        self.lines.append(str(desc))


def play(req, scene=None, method="snapkv", budget="0.2", progress=None) -> list[tab.BlindOutputs]:
    scene = scene or service.scene_examples()[0]
    return list(tab.blind(message(scene), MODEL, method, budget, "", service.Session(), req, progress or Recorded()))


def battle_row(db, cookie: str, method: str = "snapkv") -> str:
    """A battle as ``blind.start`` writes it, shown to ``cookie`` (no model run); its id."""
    battle_id = uuid.uuid4().hex
    db.add_battle({"id": battle_id, "thread": battle_id, "turn": 1, "model": MODEL, "method": method, "budget": 0.2,
                   "kv_fraction": 0.2, "full_kv_bytes": 1000, "method_kv_bytes": 200, "full_s": 1.0, "method_s": 0.5,
                   "full_side": "A", "hash_a": "0" * 64, "hash_b": "1" * 64, "truth": None, "full_right": None,
                   "method_right": None, "client": db.client(cookie), "visitor": None})
    return battle_id


def test_battles_count_per_visitor_whatever_cookie_it_sends(app, monkeypatch):
    monkeypatch.setenv("KV_ARENA_BLIND_BATTLES_PER_MINUTE", "1")
    first = play(request())
    assert len(first[-1].battle) == 32, first[-1].status
    again = play(request())  # a fresh cookie, another forged entry: the same visitor
    assert again[-1].status.startswith(NOT_ANSWERED) and "At most 1 battles a minute per visitor" in again[-1].status
    other = play(request("192.0.2.9"))  # another address: its own count
    assert len(other[-1].battle) == 32, other[-1].status
    with blind.battles.store().engine.connect() as c:  # the visitor is stored salted, never as an address
        visitors = c.execute(sa.text("SELECT visitor FROM battles")).scalars().all()
    assert len(set(visitors)) == 2 and all(len(v) == 64 and "203.0.113" not in v for v in visitors)


def test_votes_count_per_visitor_whatever_cookie_it_sends(app, monkeypatch):
    monkeypatch.setenv("KV_ARENA_BLIND_VOTES_PER_MINUTE", "2")
    db = battles.store()
    cookies = [secrets.token_urlsafe(18) for _ in range(4)]
    shown = [battle_row(db, cookie) for cookie in cookies]
    said = [tab.vote(battle_id, "A", service.Session(), request(cookie=cookie)).status
            for battle_id, cookie in zip(shown[:3], cookies)]
    assert ["Vote recorded" in s for s in said] == [True, True, False]
    assert "At most 2 votes a minute per visitor" in said[2] and "\n" not in said[2]
    # the cookie still owns its battle: another client at the same address cannot vote on it
    stolen = tab.vote(shown[3], "A", service.Session(), request("192.0.2.9"))
    assert "only on a battle you were shown" in stolen.status
    assert "Vote recorded" in tab.vote(shown[3], "B", service.Session(), request("192.0.2.9", cookies[3])).status


def test_nothing_before_the_vote_names_the_method_its_budget_or_the_side(app):
    progress = Recorded()
    outputs = play(request(), method="vl_cache", budget="0.3", progress=progress)
    shown = outputs[-1]
    assert len(shown.battle) == 32, shown.status
    said = progress.lines + [str(v) for o in outputs for v in o.changed().values() if v is not None and v is not shown.a
                             and v is not shown.b]
    names = [n for n in backends.available() if not backends.is_reference(n)]
    for line in said:
        for name in names:
            assert name not in line and backends.backend_class(name).title not in line, line
        assert "budget" not in line.lower() and "0.3" not in line, line
        assert "A was" not in line and "B was" not in line, line
    assert blind.NEUTRAL in progress.lines and not any("Prefilling" in line for line in progress.lines)
    reveal = tab.vote(shown.battle, "A", service.Session(), request(cookie=None)).status  # another cookie: refused
    assert "only on a battle you were shown" in reveal


def test_every_new_battle_comes_with_the_vote_control_empty(app):
    req = request()
    first = play(req)
    assert first[-1].choice is None  # set (emptied), not left as it was
    assert "Vote recorded" in tab.vote(first[-1].battle, "B", service.Session(), req).status
    follow = list(tab.blind({"text": service.scene_examples()[0].questions[1], "files": []}, MODEL, "random", "random",
                            first[-1].battle, service.Session(), req, Recorded()))
    assert follow[-1].status.startswith(NOT_ANSWERED)  # another session: not this one's to continue
    assert follow[-1].choice is None and follow[-1].a == "" and follow[-1].battle == first[-1].battle  # text, no answers
    assert tab.new_battle().choice is None


def test_infinipot_v_is_never_drawn_nor_offered(app):
    settings = service.Settings.make(model=MODEL)
    assert "infinipot_v" not in blind.runnable(MODEL, settings)
    assert "infinipot_v" not in dict(tab.method_choices()).values()
    assert not blind.may_draw(backends.backend_class("infinipot_v"))
    assert blind.may_draw(backends.backend_class("snapkv"))
    refused = play(request(), method="infinipot_v")
    assert "method must be one of" in refused[-1].status


def test_a_method_that_compressed_nothing_is_drawn_again_or_refused(app, monkeypatch):
    """Were a method to hold the whole cache on the input anyway, no "full against full" is recorded."""
    monkeypatch.setattr(battles, "runnable", lambda *a, **k: ["infinipot_v", "snapkv"])
    picks = iter(["infinipot_v"])
    real = battles._pick
    monkeypatch.setattr(battles, "_pick", lambda choice, drawn, what, shown, **kw: next(picks) if what == "method"
                        and choice in (None, blind.DRAW) else real(choice, drawn, what, shown, **kw))
    scene = service.scene_examples()[0]
    settings = service.Settings.make(model=MODEL, max_new_tokens=4)
    prepared = service.prepare(scene.questions[0], list(scene.files))
    shown = blind.start(service.Session(), settings, prepared, method=blind.DRAW, budget="0.2", client="carol")
    reveal = blind.vote(shown.id, "A", client="carol")
    assert reveal.method == "snapkv" and reveal.kv_fraction < 0.9  # InfiniPot-V held it all: drawn again
    with pytest.raises(UserError, match="InfiniPot-V held the whole cache on this input"):
        blind.start(service.Session(), settings, prepared, method="infinipot_v", budget="0.2", client="carol")
    assert [r.votes for r in blind.leaderboard()] == [1]


def profile(username: str) -> gr.OAuthProfile:
    return gr.OAuthProfile({"name": username.title(), "preferred_username": username,
                            "profile": f"https://huggingface.co/{username}", "picture": ""})


@pytest.mark.parametrize("space, setting, required", [(None, None, False), ("someone/kv-arena", None, True),
                                                      ("someone/kv-arena", "0", False), (None, "1", True)])
def test_sign_in_is_required_on_a_space_unless_turned_off(monkeypatch, space, setting, required):
    for name, value in (("SPACE_ID", space), ("KV_ARENA_BLIND_REQUIRE_LOGIN", setting)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert blind.require_login() is required


def test_where_sign_in_is_required_only_signed_in_votes_count(app, monkeypatch):
    monkeypatch.setenv("KV_ARENA_BLIND_REQUIRE_LOGIN", "1")
    db = battles.store()
    cookies = [secrets.token_urlsafe(18) for _ in range(3)]
    shown = [battle_row(db, cookie) for cookie in cookies]
    monkeypatch.setattr(tab, "login_available", lambda: True)  # as on a Space with OAuth: the button is there
    signed_out = tab.vote(shown[0], "A", service.Session(), request(cookie=cookies[0]), None)
    assert "Vote recorded" in signed_out.status and "not counted on the leaderboard" in signed_out.status
    assert "sign in with Hugging Face" in signed_out.status and signed_out.board == []
    signed_in = tab.vote(shown[1], "B", service.Session(), request(cookie=cookies[1]), profile("alice"))
    assert "Vote recorded" in signed_in.status and "not counted" not in signed_in.status
    assert [r.votes for r in blind.leaderboard()] == [1] and blind.signed_out_apart() == 1
    assert "1 vote from visitors not signed in" in tab.board_note()
    # one vote per account per battle (and per battle at all)
    again = tab.vote(shown[1], "A", service.Session(), request(cookie=cookies[1]), profile("alice"))
    assert "one vote per battle" in again.status
    with db.engine.connect() as c:  # the account is stored salted, never by name
        accounts = c.execute(sa.text("SELECT account FROM votes")).scalars().all()
    assert None in accounts and all(a is None or (len(a) == 64 and "alice" not in a) for a in accounts)
    monkeypatch.setenv("KV_ARENA_BLIND_REQUIRE_LOGIN", "0")  # not required: every vote counts, nothing apart
    assert [r.votes for r in blind.leaderboard()] == [2] and tab.board_note() == ""
    monkeypatch.setenv("KV_ARENA_BLIND_REQUIRE_LOGIN", "1")
    monkeypatch.setattr(tab, "login_available", lambda: False)  # off a Space: no button to point at (issue 68)
    off = tab.vote(shown[2], "A", service.Session(), request(cookie=cookies[2]), None)
    assert "not counted on the leaderboard" in off.status and "button" not in off.status, off.status


def test_an_account_votes_at_the_rate_of_one_visitor_from_any_address(app, monkeypatch):
    monkeypatch.setenv("KV_ARENA_BLIND_VOTES_PER_MINUTE", "1")
    db = battles.store()
    cookies = [secrets.token_urlsafe(18) for _ in range(2)]
    shown = [battle_row(db, cookie) for cookie in cookies]
    assert "Vote recorded" in tab.vote(shown[0], "A", service.Session(), request("192.0.2.1", cookies[0]),
                                       profile("bob")).status
    elsewhere = tab.vote(shown[1], "A", service.Session(), request("192.0.2.2", cookies[1]), profile("bob"))
    assert "At most 1 votes a minute" in elsewhere.status


def test_a_vote_with_nothing_picked_says_what_to_do(app):
    said = tab.vote("0" * 32, None, service.Session(), request()).status
    assert "Pick A is better, B is better or The same" in said and "None" not in said
