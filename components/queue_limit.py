"""At most ``KV_ARENA_MAX_QUEUED_PER_VISITOR`` (4) events queued or running per visitor, so one
visitor cannot fill the queue (``KV_ARENA_QUEUE``, 32) and lock everyone else out with "Queue is
full": an event over its visitor's limit is refused at once (HTTP 429, one line), never queued.

A visitor is its address behind the trusted proxies (:mod:`kv_arena.service.visitors`): a fresh
cookie or a forged ``X-Forwarded-For`` entry is the same visitor. The limit keeps room in the
queue: it is at most a quarter of the queue's size, so the other visitors always have the rest.
Gradio's own queue says what each visitor has waiting or running (every event keeps the request
that started it), and the requests that passed this check but are not in the queue yet count too,
so a burst sent all at once is held to the same limit.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from kv_arena import service

from . import clients

LIMIT_ENV = "KV_ARENA_MAX_QUEUED_PER_VISITOR"
OLD_LIMIT_ENV = "KV_ARENA_MAX_QUEUED_PER_CLIENT"  # its name before visitors were addresses (still read)
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
    """Events one visitor may have queued or running at once (0: no limit), at most a share of the queue."""
    try:
        limit = max(0, int(os.environ.get(LIMIT_ENV, os.environ.get(OLD_LIMIT_ENV, DEFAULT_LIMIT))))
    except ValueError:
        limit = DEFAULT_LIMIT
    return min(limit, service.visitors.share(queue_size())) if limit else 0


def client_key(scope) -> str:
    """Who a request (its ASGI scope) comes from, as the limit counts: its visitor."""
    return service.visitor_from_scope(scope).key


def starts_event(scope) -> bool:
    """Whether the request queues an event (``/queue/join``, ``/call/<api>``)."""
    path = scope.get("path", "")
    return scope.get("method") == "POST" and bool(clients.JOIN.search(path) or clients.CALL_START.search(path))


def _queued(scope) -> Counter[str]:
    """Events queued or running now, per client, as Gradio's queue holds them."""
    app = scope.get("app")
    blocks = app.get_blocks() if app is not None and hasattr(app, "get_blocks") else None
    queue = getattr(blocks, "_queue", None)  # Gradio's queue: its events by id, each with its request
    events = list(getattr(queue, "event_ids_to_events", {}).values())
    return Counter(client_key(event.request.scope) for event in events if getattr(event, "request", None))


def refusal(limit: int) -> str:
    return (f"Too many events from your address: at most {limit} may wait or run at once "
            f"({LIMIT_ENV}); send the next when one has ended.")


class QueueLimit:
    """ASGI middleware: an event over its visitor's limit answers 429 with one line."""

    def __init__(self, app) -> None:
        self.app = app
        self.joining: Counter[str] = Counter()  # requests let through, their event not yet queued

    async def __call__(self, scope, receive, send) -> None:
        limit = max_queued()
        if scope["type"] != "http" or not limit or not starts_event(scope):
            await self.app(scope, receive, send)
            return
        key = client_key(scope)
        # no await between the count and the increment: one event loop, so a burst is counted whole
        if _queued(scope)[key] + self.joining[key] >= limit:
            body = json.dumps({"detail": refusal(limit)}).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.joining[key] += 1
        pending = True

        async def send_counted(message) -> None:
            nonlocal pending
            if message["type"] == "http.response.start" and pending:  # queued (or refused) by now
                pending = False
                self._joined(key)
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if pending:
                self._joined(key)

    def _joined(self, key: str) -> None:
        self.joining[key] -= 1
        if self.joining[key] <= 0:
            del self.joining[key]
