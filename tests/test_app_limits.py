"""What one visitor may make the server do (issue 46): no text past its limits reaches the tokenizer,
no request body past its limit is read whole, and a method switch re-reads a bounded conversation:
each streamed turn under a cap, never past the model's context, at most so many tokens a minute."""

from __future__ import annotations

import time

import httpx
import pytest
from tests.app_support import ask, launched_app, turn
from tests.support import make_video

from components import chat, request_size
from kv_arena import service
from kv_arena.errors import UserError
from kv_arena.media import write_avi
from kv_arena.service import inputs, rereads, streamed
from kv_arena.service.rereads import TurnCost, check_switch

CAP_MB = 80 * 2048 / 2**20  # 80 tokens of tiny-qwen2-vl


@pytest.fixture(scope="module")
def url():
    with launched_app() as (_, address):
        yield address


# --- text and request size ---------------------------------------------------------------------
@pytest.mark.parametrize("text, says", [("a" * (inputs.MAX_TEXT_CHARS + 1), "characters"),
                                        ("\U0001F600" * (inputs.MAX_TEXT_BYTES // 4 + 1), "bytes of UTF-8")])
def test_text_over_its_limits_is_refused_in_one_line_before_any_tokenising(text, says, monkeypatch):
    def no_tokenising(*args, **kwargs):
        raise AssertionError("the text reached the tokenizer")

    monkeypatch.setattr(service, "chat_turn", no_tokenising)
    session = service.Session()
    outputs, error = turn(session, ask(text))
    assert error is not None and "The message is too long" in error and says in error and "\n" not in error
    with pytest.raises(UserError, match="too long"):  # a history sent back with such a message, and a follow-up
        chat.checked_history([{"role": "user", "content": text}])
    with pytest.raises(UserError, match="too long"):
        service.prepare(text, [])


def test_text_at_its_limits_passes():
    assert service.checked_text("a" * inputs.MAX_TEXT_CHARS)
    assert service.checked_text("\U0001F600" * (inputs.MAX_TEXT_BYTES // 4))  # 4 bytes each


def test_a_request_body_over_the_limit_is_refused_before_it_is_read(url):
    """A body whose Content-Length is over the limit is answered 413 at once; a chunked one as soon as
    its bytes pass the limit; either way in one line, and the server goes on serving."""
    big = b"x" * (request_size.MAX_REQUEST_BYTES + 1)
    start = time.perf_counter()
    declared = httpx.post(f"{url}gradio_api/queue/join", content=big, timeout=30,
                          headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "KV_ARENA_MAX_REQUEST_BYTES" in declared.json()["detail"]

    def chunks():
        for _ in range(request_size.MAX_REQUEST_BYTES // 2**16 + 2):
            yield b"y" * 2**16

    chunked = httpx.post(f"{url}gradio_api/queue/join", content=chunks(), timeout=30)
    assert chunked.status_code == 413 and "\n" not in chunked.json()["detail"]
    assert time.perf_counter() - start < 10
    assert httpx.get(f"{url}gradio_api/info", timeout=30).status_code == 200


# --- method switches ---------------------------------------------------------------------------
def test_a_switch_is_refused_past_the_context_and_past_the_minutes_budget():
    three = [TurnCost(900), TurnCost(900), TurnCost(900)]
    assert check_switch(three, [], "snapkv", context=4096, full_cache=False) == 2700
    with pytest.raises(UserError, match=r"would re-read 2,700 tokens, more than the model's context \(2,048\)"):
        check_switch(three, [], "snapkv", context=2048, full_cache=False)
    now = 1000.0
    with pytest.raises(UserError, match=r"re-read 32,000 tokens in the last minute.*Wait 50 s"):
        check_switch(three, [(now - 10, 32_000)], "snapkv", context=40_000, full_cache=False, now=now)
    assert check_switch(three, [(now - 61, 32_000)], "snapkv", context=40_000, full_cache=False, now=now) == 2700
    streamed_turn = [TurnCost(900, cap_bytes=2**20)]
    with pytest.raises(UserError, match=r"H2O \(heavy hitters\) cannot re-read this conversation: a video in it was streamed"):
        check_switch(streamed_turn, [], "h2o", context=4096, full_cache=False)
    assert check_switch(streamed_turn, [], "full", context=4096, full_cache=True) == 900


@pytest.fixture
def video(tmp_path, monkeypatch):
    monkeypatch.setattr(streamed, "FRAMES_PER_CHUNK", 2)
    path = tmp_path / "eight.avi"
    write_avi(path, make_video(3, frames=8, size=112).frames, fps=2)
    return str(path)


def test_a_streamed_turn_is_re_read_under_its_own_cap_and_what_it_cost_is_said(video):
    """Streamed under a cap by StreamingLLM, then switched to SnapKV with the cap off: SnapKV re-reads
    the video streamed under the turn's own cap (the same tokens the turn fed, its cache under the
    cap), not prefilled whole; H2O, which cannot hold a cap, is refused in one line."""
    session = service.Session()
    first, error = turn(session, ask("What happens?", video), method="streamingllm", num_frames=8,
                        stream_cap_mb=CAP_MB, max_new_tokens=4)
    assert error is None
    (cost,) = session.chat.costs
    assert cost.cap_bytes == round(CAP_MB * 2**20) and cost.tokens > 80
    history = first[-1].chatbot
    refused, error = turn(session, ask("And then?"), history, method="h2o", num_frames=8, max_new_tokens=4)
    assert error is not None and "cannot re-read this conversation" in error and "\n" not in error
    assert len(session.history) == 1
    switched, error = turn(session, ask("And then?"), history, method="snapkv", num_frames=8, max_new_tokens=4)
    assert error is None
    line = next(m["content"] for m in switched[-1].chatbot if (m.get("metadata") or {}).get("title") == chat.SWITCHED)
    assert f"({cost.tokens} tokens," in line
    assert session.chat.costs[0] == cost and len(session.chat.costs) == 2
    assert session.conv.cache.nbytes() <= 2 * CAP_MB * 2**20  # under the cap plus the follow-up, never the whole video


def test_flipping_the_method_on_every_message_is_refused_within_the_minute(monkeypatch, media):
    monkeypatch.setattr(rereads, "REREAD_TOKENS_PER_MINUTE", 1)  # one switch a minute, whatever its size
    session = service.Session()
    first, error = turn(session, ask("What is this?", media["image"]), method="snapkv")
    assert error is None
    second, error = turn(session, ask("And this?"), first[-1].chatbot, method="streamingllm")
    assert error is None
    third, error = turn(session, ask("And now?"), second[-1].chatbot, method="h2o")
    assert error is not None and "in the last minute" in error and "Wait" in error
    assert len(session.history) == 2  # nothing lost: the conversation as it was
    monkeypatch.setattr(rereads, "WINDOW_S", 0.0)  # the minute has passed
    fourth, error = turn(session, ask("And now?"), second[-1].chatbot, method="h2o")
    assert error is None
