"""A history that is not the session's conversation (edited, or sent to another session) is re-read,
its picture and its answers as sent, instead of a new conversation starting without the picture;
what cannot be re-read (a file it may not use, past the limits) is refused in one line."""

from __future__ import annotations

import re

from tests.app_support import ask, config, turn

from components import chat, checked_controls
from components.history import NEW_CONVERSATION, REREAD, transcript, with_own_files
from kv_arena import service
from kv_arena.service import rereads

SCENE = str(chat.ASSETS / "scene_colour.png")  # a circle (purple) and a cross (yellow), among others
ARENA = dict(model="tiny-arena-vl", method="full")


def titles(history: list) -> list:
    return [(m.get("metadata") or {}).get("title") for m in history]


def first_chat(session: service.Session) -> list:
    outputs, error = turn(session, ask("What colour is the circle?", SCENE), **ARENA)
    assert error is None and "**right**" in outputs[-1].status
    return outputs[-1].chatbot


def test_an_edited_history_is_re_read_with_its_picture():
    session = service.Session()
    history = first_chat(session)
    edited = history[:-1] + [history[-1] | {"content": "A circle, I think."}]
    outputs, error = turn(session, ask("What colour is the cross?"), edited, **ARENA)
    assert error is None
    shown = outputs[-1].chatbot
    assert shown[: len(edited)] == edited and NEW_CONVERSATION not in titles(shown) and titles(shown).count(REREAD) == 1
    assert re.search(r"re-read its 1 turn above, files and answers as sent \(\d+ tokens", shown[len(edited)]["content"])
    assert shown[-1]["content"] == "yellow" and "**right**" in outputs[-1].status  # the picture is in its memory
    assert len(session.history) == 2 and session.transcript == transcript(shown)
    assert session.transcript[0][2] == "A circle, I think."  # the answer as sent
    third, error = turn(session, ask("What colour is the circle?"), shown, **ARENA)  # continued, not re-read again
    assert error is None and titles(third[-1].chatbot).count(REREAD) == 1 and "**right**" in third[-1].status
    assert len(session.history) == 3


def test_a_history_sent_to_another_session_is_re_read_by_its_method():
    history = first_chat(service.Session())
    other = service.Session()  # a new client, or the cache freed
    outputs, error = turn(other, ask("What colour is the cross?"), history, model="tiny-arena-vl", method="h2o",
                          budget=0.9)
    assert error is None and outputs[-1].chatbot[-1]["content"] == "yellow" and "**right**" in outputs[-1].status
    said = outputs[-1].chatbot[len(history)]["content"]
    assert titles(outputs[-1].chatbot).count(REREAD) == 1 and "H2O (heavy hitters) at a budget of 0.90 re-read" in said
    assert len(other.history) == 2


def test_a_history_naming_a_file_it_may_not_use_is_refused_in_one_line(media):
    session = service.Session()  # holds no copy of a file gradio_client downloaded for another session
    returned = {"type": "file", "file": {"path": "/home/someone/downloads/x.png"}, checked_controls.RETURNED: True}
    theirs = [{"role": "user", "content": [returned, {"type": "text", "text": "What is it?"}]},
              {"role": "assistant", "content": "A cross."}]
    outputs, error = turn(session, ask("What colour is it?"), theirs, **ARENA)
    assert error is not None and "holds no copy of" in error and "\n" not in error
    assert outputs[-1].chatbot == with_own_files(theirs, session) and outputs[-1].textbox == ask("What colour is it?")
    assert session.history == []  # nothing read
    outside = [{"role": "user", "content": [{"path": str(media["image"])}, "What is it?"]},
               {"role": "assistant", "content": "A cross."}]
    outputs = list(chat.respond(ask("And its colour?"), outside, session, config(**ARENA), sent_by_client=True))
    assert "was not uploaded to this app" in outputs[-1].status and session.history == []
    first_chat(session)  # and the session goes on


def test_a_history_past_the_limits_is_refused_in_one_line(monkeypatch):
    session = service.Session()
    history = first_chat(session)
    words = " ".join(["blue"] * 4000)  # 4,000 tokens, under the limits of one message's text
    long = history + [{"role": r, "content": words if r == "assistant" else "More?"} for _ in range(9)
                      for r in ("user", "assistant")]  # 36,000 tokens: more than the model's context (32,768)
    _, error = turn(session, ask("What colour is the cross?"), long, **ARENA)
    assert error is not None and re.search(r"Re-reading the history sent with .* more than the model's context", error)
    assert len(session.history) == 1  # the conversation as it was
    cost = sum(c.tokens for c in session.chat.costs)  # what re-reading the first turn costs, about
    monkeypatch.setattr(rereads, "REREAD_TOKENS_PER_MINUTE", int(1.5 * cost))  # one re-read a minute
    edited = history[:-1] + [history[-1] | {"content": "Blue."}]
    _, error = turn(session, ask("What colour is the cross?"), edited, **ARENA)
    assert error is None
    _, error = turn(session, ask("What colour is the cross?"), history, **ARENA)
    assert error is not None and "in the last minute" in error and "send [] to start a new chat" in error


def test_a_history_costs_its_visitor_whatever_session_brings_it(monkeypatch):
    """Issue 56: a long history sent to a fresh session each time is one visitor's re-reads; over its
    tokens a minute the answer is one line saying how long to wait. Another visitor is not held up."""
    first = service.Session()
    history = first_chat(first)
    cost = sum(c.tokens for c in first.chat.costs)
    monkeypatch.setattr(rereads, "REREAD_TOKENS_PER_MINUTE", int(1.5 * cost))  # one re-read a minute
    sessions = [service.Session() for _ in range(3)]
    for s in sessions:
        s.visitor = "visitor:203.0.113.5"
    _, error = turn(sessions[0], ask("What colour is the cross?"), history, **ARENA)
    assert error is None
    _, error = turn(sessions[1], ask("What colour is the cross?"), history, **ARENA)
    assert error is not None and "\n" not in error and re.search(r"in the last minute.*Wait \d+ s", error)
    other = service.Session()
    other.visitor = "visitor:198.51.100.9"
    _, error = turn(other, ask("What colour is the cross?"), history, **ARENA)
    assert error is None


def test_a_sent_history_over_a_minute_of_re_reading_is_refused_at_once(monkeypatch):
    """A history sent to a fresh session must fit a visitor's minute whole (a switch of the session's
    own conversation may not, once a minute): one long history cannot hold the one heavy slot for
    minutes while other visitors wait."""
    first = service.Session()
    history = first_chat(first)
    monkeypatch.setattr(rereads, "REREAD_TOKENS_PER_MINUTE", sum(c.tokens for c in first.chat.costs) // 2)
    other = service.Session()
    _, error = turn(other, ask("What colour is the cross?"), history, **ARENA)
    assert error is not None and "more than a visitor may re-read in a minute" in error and "\n" not in error
    assert other.history == []
    monkeypatch.setattr(rereads, "REREAD_TOKENS_PER_MINUTE", None)
    assert rereads.tokens_per_minute(False) == 8_192 and rereads.tokens_per_minute(True) == 32_768
