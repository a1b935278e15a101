"""Events queued or running are held per person and per address, so no one fills the queue
(``KV_ARENA_QUEUE``, 32) and locks everyone else out with "Queue is full":

- a person (a client cookie; without one, a tab's session hash, and a client sending neither is one
  person) may have at most ``KV_ARENA_MAX_QUEUED_PER_VISITOR`` (4) events waiting or running;
- the people behind one address (a visitor, :mod:`kv_arena.service.visitors`: a fresh cookie or a
  forged ``X-Forwarded-For`` entry is the same address) together at most
  ``KV_ARENA_MAX_QUEUED_PER_ADDRESS`` (8): the address's waiting room.

Both are at most a quarter of the queue, so the other addresses always have the rest. An event
within both waits its turn in Gradio's queue (a position and an estimate, as any other); one past
either is refused at once (HTTP 429, one line), never queued. So a classroom behind one address is
served in turn up to its waiting room, and a script minting a cookie per event gets that room and
no more. Gradio's own queue says what each person and address has waiting or running (every event
keeps the request that started it), and the requests that passed this check but are not in the
queue yet count too, so a burst sent all at once is held to the same limits.

An MCP tool call counts as its caller's (``mcp_calls``): from its MCP request to its answer, and is
refused in that answer (one line, as the tool's error); the event the bridge queues for it is not
counted again.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from kv_arena import service

from . import clients, mcp_calls

LIMIT_ENV = "KV_ARENA_MAX_QUEUED_PER_VISITOR"
OLD_LIMIT_ENV = "KV_ARENA_MAX_QUEUED_PER_CLIENT"  # its name before visitors were addresses (still read)
ROOM_ENV = "KV_ARENA_MAX_QUEUED_PER_ADDRESS"
QUEUE_ENV = "KV_ARENA_QUEUE"
DEFAULT_LIMIT = 4
DEFAULT_QUEUE = 32


def queue_size() -> int:
    """The queue's size (``KV_ARENA_QUEUE``), as ``app.build_demo`` gives it to Gradio."""
    try:
        return max(1, int(os.environ.get(QUEUE_ENV, DEFAULT_QUEUE)))
    except ValueError:
        return DEFAULT_QUEUE


def max_queued() -> int:
    """Events one person may have queued or running at once (0: no limit), at most a share of the queue."""
    try:
        limit = max(0, int(os.environ.get(LIMIT_ENV, os.environ.get(OLD_LIMIT_ENV, DEFAULT_LIMIT))))
    except ValueError:
        limit = DEFAULT_LIMIT
    return min(limit, service.visitors.share(queue_size())) if limit else 0


def address_room() -> int:
    """Events the people behind one address may have queued or running together (its waiting room):
    ``KV_ARENA_MAX_QUEUED_PER_ADDRESS``, default and at most a share of the queue, at least :func:`max_queued`."""
    share = service.visitors.share(queue_size())
    try:
        room = int(os.environ.get(ROOM_ENV, share))
    except ValueError:
        room = share
    return max(max_queued(), min(room, share))


def client_key(scope) -> str:
    """The address a request (its ASGI scope) comes from, as the waiting room counts: its visitor."""
    return service.visitor_from_scope(scope).key


def person_key(scope, session_hash: str | None = None) -> str:
    """Who a request comes from inside its address, as the per-person limit counts: its client
    cookie, else the session hash it queues under; one sending neither is one person of its address."""
    cookie = clients.cookie_of(scope)
    who = f"client:{cookie}" if cookie else f"session:{session_hash}" if session_hash else "no cookie"
    return f"{client_key(scope)}|{who}"


def starts_event(scope) -> bool:
    """Whether the request queues an event (``/queue/join``, ``/call/<api>``)."""
    path = scope.get("path", "")
    return scope.get("method") == "POST" and bool(clients.JOIN.search(path) or clients.CALL_START.search(path))


def _queued(scope) -> Counter[str]:
    """Events queued or running now, per address and per person, as Gradio's queue holds them."""
    app = scope.get("app")
    blocks = app.get_blocks() if app is not None and hasattr(app, "get_blocks") else None
    queue = getattr(blocks, "_queue", None)  # Gradio's queue: its events by id, each with its request
    counts: Counter[str] = Counter()
    for event in list(getattr(queue, "event_ids_to_events", {}).values()):
        request = getattr(event, "request", None)
        if request is None or mcp_calls.counted(request.scope):
            continue
        counts[client_key(request.scope)] += 1
        # an event started by /call/<api> has a session hash Gradio drew, not one its client sent
        called = clients.CALL_START.search(request.scope.get("path", ""))
        counts[person_key(request.scope, None if called else getattr(event, "session_hash", None))] += 1
    return counts


def refusal(limit: int) -> str:
    return (f"Too many events from you: at most {limit} may wait or run at once "
            f"({LIMIT_ENV}); send the next when one has ended.")


def room_refusal(room: int) -> str:
    return (f"Too many events from your address: at most {room} may wait or run at once for the people behind "
            f"one address ({ROOM_ENV}); try again when one has ended.")


def _session_hash(body: bytes) -> str | None:
    try:
        found = json.loads(body).get("session_hash")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        return None
    return found if isinstance(found, str) else None


class QueueLimit:
    """ASGI middleware: an event over its visitor's limit answers 429 with one line."""

    def __init__(self, app) -> None:
        self.app = app
        self.joining: Counter[str] = Counter()  # requests let through, their event not yet queued

    async def __call__(self, scope, receive, send) -> None:
        limit = max_queued()
        if scope["type"] != "http" or not limit or mcp_calls.counted(scope):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        calls: list = []  # an MCP request's tool calls: counted from here, refused in its answer
        session_hash = None
        if scope.get("method") == "POST" and (mcp_calls.STREAMABLE.search(path) or clients.JOIN.search(path)):
            pending = await clients.whole_body(receive)  # an MCP request: one small JSON message
            body = b"".join(m.get("body", b"") for m in pending)
            calls = mcp_calls.tool_calls(scope, body)
            session_hash = _session_hash(body) if clients.JOIN.search(path) else None
            receive = clients.replaying(pending, receive)
        if not calls and not starts_event(scope):
            await self.app(scope, receive, send)
            return
        keys = (client_key(scope), person_key(scope, session_hash))
        # no await between the count and the increment: one event loop, so a burst is counted whole
        queued = _queued(scope)
        line = (refusal(limit) if queued[keys[1]] + self.joining[keys[1]] >= limit
                else room_refusal(address_room()) if queued[keys[0]] + self.joining[keys[0]] >= address_room()
                else None)
        if line and calls:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": mcp_calls.refused(calls, line)})
            return
        if line:
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
            await send({"type": "http.response.body", "body": json.dumps({"detail": line}).encode()})
            return
        self.joining.update(keys)
        if calls:  # counted until its answer has been sent, the bridge's event included
            try:
                await self.app(mcp_calls.counted_scope(scope), receive, send)
            finally:
                self._joined(keys)
            return
        pending_count = True

        async def send_counted(message) -> None:
            nonlocal pending_count
            if message["type"] == "http.response.start" and pending_count:  # queued (or refused) by now
                pending_count = False
                self._joined(keys)
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if pending_count:
                self._joined(keys)

    def _joined(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            self.joining[key] -= 1
            if self.joining[key] <= 0:
                del self.joining[key]
