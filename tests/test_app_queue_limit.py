"""One visitor cannot fill the queue (security audit, item 5): a raw script that joins 40 chat
events at once, each under its own session hash, gets its client's few (``KV_ARENA_MAX_QUEUED_PER_CLIENT``,
4) and a one-line 429 for the rest, and a normal user is served at once instead of meeting "Queue is
full". A client is its cookie, else its forwarded address. On 127.0.0.1 only, in bounded loops.

``python -m pytest tests/test_app_queue_limit.py -s`` prints how long the normal user waited."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gradio_client import Client

from components.queue_limit import DEFAULT_LIMIT, LIMIT_ENV
from tests.test_app_client import controls
from tests.app_support import launched_app
from tests.test_app_hostile import chat_data, fn_index

FLOOD = 40  # more than the queue holds (KV_ARENA_QUEUE, 32)


@pytest.fixture(scope="module")
def server():
    with launched_app() as (demo, url):
        yield demo, url
        # the floods' last events end before the server does (the chat runs one event at a time, in order)
        served(url, Client(url, verbose=False))


def flood(demo, url: str, count: int, headers: dict | None = None) -> list[httpx.Response]:
    """``count`` chat events joined at once by one script that keeps no cookie, each under a session
    hash of its own; every event is a long answer, so the queue stays full while they are sent."""
    body = {"data": chat_data({"text": "Tell me a long story.", "files": []}, max_new_tokens=200),
            "fn_index": fn_index(demo, "chat"), "event_data": None, "trigger_id": None}

    def join(_):
        return httpx.post(f"{url}gradio_api/queue/join", timeout=30, headers=headers,
                          json=body | {"session_hash": uuid.uuid4().hex[:11]})

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(join, range(count)))


def served(url: str, client: Client, deadline_s: float = 150) -> tuple[float, int]:
    """How long a normal user's question takes to be answered, trying again every second while the
    queue is full (as a person would), and how many times it was told "Queue is full"."""
    start, full = time.monotonic(), 0
    while time.monotonic() - start < deadline_s:
        try:
            client.predict(message={"text": "Hi", "files": []}, history=[], **controls(), api_name="/chat")
            return time.monotonic() - start, full
        except Exception as exc:  # gradio_client's QueueError
            if "Queue is full" not in str(exc):
                raise
            full += 1
            time.sleep(1)
    return time.monotonic() - start, full


def test_one_client_cannot_fill_the_queue_and_a_normal_user_is_served_promptly(server, monkeypatch):
    demo, url = server
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    user = Client(url, verbose=False)  # a browser's or gradio_client's user: it has its cookie
    answers = flood(demo, url, FLOOD)
    seconds, full = served(url, user)
    codes = [a.status_code for a in answers]
    figure = (f"flood of {FLOOD}: {codes.count(200)} queued, {codes.count(429)} refused (429), "
              f"{codes.count(503)} 'Queue is full' (503); the normal user was answered after {seconds:.1f} s, "
              f"told 'Queue is full' {full} times")
    print(figure)
    assert full == 0 and seconds < 30, figure
    assert codes.count(200) <= DEFAULT_LIMIT + 2 and set(codes) <= {200, 429}, figure  # +2: events done meanwhile
    refused = next(a for a in answers if a.status_code == 429).json()["detail"]
    assert f"at most {DEFAULT_LIMIT} may wait or run at once" in refused and "\n" not in refused


def test_without_a_cookie_the_forwarded_address_is_the_client(server, monkeypatch):
    demo, url = server
    monkeypatch.setenv(LIMIT_ENV, "2")
    first = flood(demo, url, 6, headers={"x-forwarded-for": "203.0.113.7, 10.0.0.1"})  # as a Space's proxy sets it
    second = flood(demo, url, 2, headers={"x-forwarded-for": "198.51.100.9, 10.0.0.1"})
    assert [a.status_code for a in first].count(429) >= 3, [a.text for a in first]
    assert [a.status_code for a in second] == [200, 200], [a.text for a in second]
    assert "at most 2 may wait" in json.loads(next(a.text for a in first if a.status_code == 429))["detail"]
