"""One address holds a bounded number of sessions (issue 68): past ``KV_ARENA_MAX_SESSIONS_PER_VISITOR``
a new session frees that visitor's session idle longest (one without a heartbeat open first, never
one answering, never another visitor's), and a session whose client never opened a heartbeat is
kept only ``KV_ARENA_SESSION_NO_HEARTBEAT_S`` idle. The memory this bounds: ``python -m
tools.one_visitor --parts sessions`` (docs/app.md)."""

from __future__ import annotations

import time

from kv_arena import service
from kv_arena.service import AppState, sessions

ADDRESS = "visitor:203.0.113.5"


def test_a_visitor_holds_at_most_its_cap_of_sessions_the_oldest_idle_freed_first(monkeypatch):
    monkeypatch.setenv("KV_ARENA_MAX_SESSIONS_PER_VISITOR", "3")
    with service.using_app(AppState()):
        tabs = [service.Session() for _ in range(8)]  # held here, as Gradio holds them
        other = service.Session()
        service.track(other, "other-0", None, "visitor:198.51.100.1")
        with sessions.active("tab-1", heartbeat=True):  # tab 1 keeps a heartbeat open
            for i, tab in enumerate(tabs[:6]):
                service.track(tab, f"tab-{i}", f"cookie-{i}", ADDRESS)  # a fresh cookie each: the same address
                assert len(sessions.held_by(ADDRESS)) <= 3
            assert sorted(sessions.held_by(ADDRESS)) == ["tab-1", "tab-4", "tab-5"]  # the beating one kept
        with sessions.active("tab-4"):  # tab 4 answering: never freed
            for i, tab in enumerate(tabs[6:], start=6):
                service.track(tab, f"tab-{i}", None, ADDRESS)
            assert "tab-4" in sessions.held_by(ADDRESS) and len(sessions.held_by(ADDRESS)) == 3
        assert sessions.held_by("visitor:198.51.100.1") == ["other-0"]  # another visitor's untouched
        assert tabs[0].chat.conv is None and not tabs[0].transcript  # a freed session holds nothing


def test_a_session_that_never_heard_a_heartbeat_is_kept_briefly(monkeypatch):
    monkeypatch.setenv("KV_ARENA_SESSION_IDLE_S", "600")
    monkeypatch.setenv("KV_ARENA_SESSION_NO_HEARTBEAT_S", "0.2")
    with service.using_app(AppState()):
        raw, tab = service.Session(), service.Session()
        service.track(raw, "raw", None, ADDRESS)
        service.track(tab, "tab", None, ADDRESS)
        with sessions.active("tab", heartbeat=True):
            pass  # a tab that opened its heartbeat once (and dropped it for a moment)
        time.sleep(0.4)
        sessions.expire_idle()  # (the sweeper may have been first)
        assert service.open_session("raw") is None and service.open_session("tab") is tab
    assert sessions.unheard_idle_seconds() == 0.2


def test_a_tab_whose_heartbeat_opened_before_its_first_event_keeps_the_long_idle_time(monkeypatch):
    monkeypatch.setenv("KV_ARENA_SESSION_IDLE_S", "600")
    monkeypatch.setenv("KV_ARENA_SESSION_NO_HEARTBEAT_S", "0.2")
    with service.using_app(AppState()):
        tab = service.Session()
        with sessions.active("early", heartbeat=True):  # the page loads: its heartbeat first
            sessions.expire_idle()  # the sweeper runs before the tab's first event
            service.track(tab, "early", None, ADDRESS)
        time.sleep(0.4)  # the heartbeat dropped for a moment (a phone asleep)
        sessions.expire_idle()
        assert service.open_session("early") is tab
