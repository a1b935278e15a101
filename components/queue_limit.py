"""At most ``KV_ARENA_MAX_QUEUED_PER_CLIENT`` (4) events queued or running per client, so one
visitor cannot fill the queue (``KV_ARENA_QUEUE``, 32) and lock everyone else out with "Queue is
full": an event over its client's limit is refused at once (HTTP 429, one line), never queued.

A client is its cookie id (``clients.COOKIE``: a browser with all its tabs, one ``gradio_client``),
or, for a request without one (a raw script), its address: the first hop of ``X-Forwarded-For``
(what a Space's proxy sets), else the peer's. Gradio's own queue says what each client has waiting
or running (every event keeps the request that started it), and the requests that passed this
check but are not in the queue yet count too, so a burst sent all at once is held to the same limit.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from http.cookies import SimpleCookie

from . import clients

LIMIT_ENV = "KV_ARENA_MAX_QUEUED_PER_CLIENT"
DEFAULT_LIMIT = 4


def max_queued() -> int:
    """Events one client may have queued or running at once (0: no limit)."""
    try:
        return max(0, int(os.environ.get(LIMIT_ENV, DEFAULT_LIMIT)))
    except ValueError:
        return DEFAULT_LIMIT


def client_key(scope) -> str:
    """Who a request (its ASGI scope) comes from: its cookie id, else its forwarded or peer address."""
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}
    morsel = SimpleCookie(headers.get("cookie", "")).get(clients.COOKIE)
    if morsel is not None and morsel.value:
        return "cookie:" + morsel.value
    forwarded = headers.get("x-forwarded-for", "").split(",")[0].strip()
    if forwarded:
        return "address:" + forwarded
    peer = scope.get("client")
    return "address:" + (peer[0] if peer else "unknown")


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
    return (f"Too many events from this client: at most {limit} may wait or run at once "
            f"({LIMIT_ENV}); send the next when one has ended.")


class QueueLimit:
    """ASGI middleware: an event over its client's limit answers 429 with one line."""

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
