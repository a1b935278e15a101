"""One visitor cannot fill the queue (security audit, item 5; issues 56 and 68): a raw script that
joins 40 chat events at once, each under its own session hash and with a fresh cookie, gets its
address's waiting room (``KV_ARENA_MAX_QUEUED_PER_ADDRESS``, 8) and a one-line 429 for the rest, and
a normal user is served at once instead of meeting "Queue is full"; one person (one cookie) has at
most ``KV_ARENA_MAX_QUEUED_PER_VISITOR`` (4). A visitor is its address behind the trusted proxies
(``KV_ARENA_TRUSTED_PROXY_HOPS``), never its cookie, and with 0 hops the server itself ignores
``X-Forwarded-For``. Ten people behind one address, asking at once, wait their turn. On 127.0.0.1
(and 127.0.0.2, another address of this host) only, in bounded loops.

``python -m pytest tests/test_app_queue_limit.py -s`` prints how long the normal user waited."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gradio_client import Client

from components.queue_limit import DEFAULT_LIMIT, LIMIT_ENV, address_room
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


def flood(demo, url: str, count: int, headers=None) -> list[httpx.Response]:
    """``count`` chat events joined at once by one script, each under a session hash and a cookie of
    its own; every event is a long answer, so the queue stays full while they are sent. ``headers``:
    one dict for all, or a function of the event's number."""
    body = {"data": chat_data({"text": "Tell me a long story.", "files": []}, max_new_tokens=200),
            "fn_index": fn_index(demo, "chat"), "event_data": None, "trigger_id": None}

    def join(i):
        minted = {"cookie": f"kv_arena_client={uuid.uuid4().hex}"}  # a new cookie: still the same visitor
        sent = headers(i) if callable(headers) else (headers or {})
        return httpx.post(f"{url}gradio_api/queue/join", timeout=30, headers=sent | minted,
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


def test_one_visitor_cannot_fill_the_queue_and_a_normal_user_is_served_promptly(server, monkeypatch):
    """Behind a proxy (one trusted hop), the flood's every event forges its own first entry and mints
    a cookie; the normal user comes from another address."""
    demo, url = server
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "1")
    user = Client(url, verbose=False, headers={"x-forwarded-for": "198.51.100.77"})  # it keeps its cookie
    answers = flood(demo, url, FLOOD, lambda i: {"x-forwarded-for": f"192.0.2.{i}, 203.0.113.5"})
    seconds, full = served(url, user)
    codes = [a.status_code for a in answers]
    figure = (f"flood of {FLOOD}: {codes.count(200)} queued, {codes.count(429)} refused (429), "
              f"{codes.count(503)} 'Queue is full' (503); the normal user was answered after {seconds:.1f} s, "
              f"told 'Queue is full' {full} times")
    print(figure)
    assert full == 0 and seconds < 150, figure  # served, never "Queue is full" (its time: printed with -s)
    assert codes.count(200) <= address_room() + 2 and set(codes) <= {200, 429}, figure  # +2: events done meanwhile
    refused = next(a for a in answers if a.status_code == 429).json()["detail"]
    assert f"at most {address_room()} may wait or run at once for the people behind one address" in refused
    assert "\n" not in refused


def other_address() -> httpx.Client:
    """A client connecting from 127.0.0.2: another address of this host, so another visitor at 0 hops."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=150)


def call_chat(http: httpx.Client, url: str, headers: dict | None = None, text: str = "Hi") -> tuple[int, str]:
    """``/call/chat`` asked and read to its end: (the status of the call, its last message line)."""
    values = chat_data({"text": text, "files": []}, max_new_tokens=4)
    values = [values[0], values[1], *values[3:]]  # /call/chat's values: no session (the API skips it)
    started = http.post(f"{url}gradio_api/call/chat", json={"data": values}, headers=headers or {})
    if started.status_code != 200:
        return started.status_code, started.text
    with http.stream("GET", f"{url}gradio_api/call/chat/{started.json()['event_id']}", headers=headers or {}) as s:
        lines = [line for line in s.iter_lines() if line.startswith(("event:", "data:"))]
    return 200, "\n".join(lines[-2:])


def test_with_zero_hops_the_server_ignores_forwarded_for_too(server, monkeypatch):
    """Uvicorn would take a client's ``X-Forwarded-For`` for its peer on 127.0.0.1: with 0 hops it does
    not, so 40 events from loopback each forging the header are one address's few, and a victim at
    another address is answered."""
    demo, url = server
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "0")
    assert clients_env() == ""  # the server was launched trusting no proxy
    answers = flood(demo, url, FLOOD, lambda i: {"x-forwarded-for": f"198.51.100.{i}"})
    with other_address() as victim:
        status, last = call_chat(victim, url)
    codes = [a.status_code for a in answers]
    assert codes.count(200) <= address_room() + 2 and set(codes) <= {200, 429}, codes
    assert status == 200 and last.startswith("event: complete"), last


def clients_env() -> str | None:
    import os

    return os.environ.get("FORWARDED_ALLOW_IPS")


def test_one_person_has_at_most_the_per_visitor_limit(server, monkeypatch):
    """Six events at once under one cookie (each on a session of its own): four wait or run, two are refused."""
    demo, url = server
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "1")
    cookie = f"kv_arena_client={uuid.uuid4().hex}"
    body = {"data": chat_data({"text": "Tell me a long story.", "files": []}, max_new_tokens=200),
            "fn_index": fn_index(demo, "chat"), "event_data": None, "trigger_id": None}

    def join(i):
        return httpx.post(f"{url}gradio_api/queue/join", timeout=30, json=body | {"session_hash": uuid.uuid4().hex[:11]},
                          headers={"x-forwarded-for": "203.0.113.44", "cookie": cookie})

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(join, range(6)))
    codes = [a.status_code for a in answers]
    assert DEFAULT_LIMIT - 2 <= codes.count(200) <= DEFAULT_LIMIT and codes.count(429) >= 2, codes
    refused = next(a for a in answers if a.status_code == 429).json()["detail"]
    assert f"Too many events from you: at most {DEFAULT_LIMIT}" in refused
    served(url, Client(url, verbose=False, headers={"x-forwarded-for": "198.51.100.78"}))  # the queue drained


def test_ten_people_behind_one_address_wait_their_turn(server, monkeypatch):
    """A classroom behind one address: ten browsers (a cookie each) ask at once, once. All but two
    (the address's waiting room is 8) are answered, none told "Queue is full"."""
    demo, url = server
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "1")

    def person(i):
        with httpx.Client(timeout=150) as http:
            return call_chat(http, url, {"x-forwarded-for": "203.0.113.60", "cookie": f"kv_arena_client=pupil{i}"})

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(person, range(10)))
    answered = [r for r in results if r[0] == 200 and r[1].startswith("event: complete")]
    assert len(answered) >= 10 - 2, results
    assert all(code in (200, 429) for code, _ in results), results


def scope(forwarded: str, cookie: str) -> dict:
    return {"type": "http", "client": ("127.0.0.1", 5000),
            "headers": [(b"x-forwarded-for", forwarded.encode()), (b"cookie", f"kv_arena_client={cookie}".encode())]}


def test_the_queue_counts_by_visitor_not_by_cookie_or_forged_entries(monkeypatch):
    """Behind one trusted proxy its own entry (the rightmost) is the visitor, whatever the client wrote
    to its left and whatever cookie it mints; without a trusted proxy the peer is."""
    from components.queue_limit import client_key

    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "1")
    keys = {client_key(scope(f"198.51.100.{i}, 203.0.113.5", uuid.uuid4().hex)) for i in range(6)}
    assert keys == {"visitor:203.0.113.5"}
    assert client_key(scope("203.0.113.5, 198.51.100.9", "c")) == "visitor:198.51.100.9"
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "0")
    assert {client_key(scope(f"198.51.100.{i}", uuid.uuid4().hex)) for i in range(6)} == {"visitor:127.0.0.1"}


def test_the_limit_keeps_room_in_the_queue(monkeypatch):
    from components import queue_limit

    monkeypatch.setenv(LIMIT_ENV, "50")
    monkeypatch.setenv("KV_ARENA_QUEUE", "32")
    assert queue_limit.max_queued() == 8  # a quarter of the queue, never all of it
    monkeypatch.delenv(LIMIT_ENV)
    monkeypatch.setenv("KV_ARENA_MAX_QUEUED_PER_CLIENT", "3")  # the old name is still read
    assert queue_limit.max_queued() == 3


def test_events_spread_over_the_slash_64s_of_one_allocation_are_one_address(server, monkeypatch):
    """48 long events from 12 IPv6 /64s of one /56 (what one customer is given): one address's room."""
    demo, url = server
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "1")
    answers = flood(demo, url, 48, lambda i: {"x-forwarded-for": f"2001:db8:aa:{i % 12:x}::{i + 1:x}"})
    user = Client(url, verbose=False, headers={"x-forwarded-for": "2001:db8:bb::1"})  # another customer
    seconds, full = served(url, user)
    codes = [a.status_code for a in answers]
    assert full == 0 and codes.count(200) <= address_room() + 2 and set(codes) <= {200, 429}, codes


def test_a_client_without_cookie_or_session_hash_is_one_person(server, monkeypatch):
    """``/call/chat`` from a script that keeps no cookie: Gradio draws each event's session hash, so
    the script is one person of its address, held to the per-person limit."""
    demo, url = server
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("KV_ARENA_TRUSTED_PROXY_HOPS", "1")
    values = chat_data({"text": "Tell me a long story.", "files": []}, max_new_tokens=200)
    values = [values[0], values[1], *values[3:]]

    def start(i):
        return httpx.post(f"{url}gradio_api/call/chat", json={"data": values}, timeout=30,
                          headers={"x-forwarded-for": "203.0.113.91"})

    with ThreadPoolExecutor(8) as pool:
        codes = [a.status_code for a in pool.map(start, range(8))]
    assert codes.count(200) <= DEFAULT_LIMIT + 1 and codes.count(429) >= 3, codes
    served(url, Client(url, verbose=False, headers={"x-forwarded-for": "198.51.100.79"}))  # the queue drained
