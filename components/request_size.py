"""A bound on what one HTTP request may make the server read: :class:`RequestSizeLimit`, an ASGI
middleware outside every other, answers 413 to a request body over MAX_REQUEST_BYTES before it is
read whole (one 60 MB message once took 7 GB of memory and three minutes of the queue, refused only
after tokenising). File uploads are left to Gradio's own ``max_file_size``; an event's inputs (the
message, a history, the settings) are JSON of a few kilobytes, and each text in them is held to
``KV_ARENA_MAX_TEXT_CHARS`` / ``KV_ARENA_MAX_TEXT_BYTES`` by the app itself."""

from __future__ import annotations

import json
import os

UPLOAD_ROUTE = "/upload"
MAX_REQUEST_BYTES = int(os.environ.get("KV_ARENA_MAX_REQUEST_BYTES", 4 * 2**20))


def too_large_line(size: int | None) -> str:
    said = f"{size:,} bytes" if size is not None else "more"
    return (f"The request is too large ({said}; the limit is {MAX_REQUEST_BYTES:,} bytes, "
            "KV_ARENA_MAX_REQUEST_BYTES): send shorter text; files go through the upload.")


def declared_length(scope) -> int | None:
    """A request's Content-Length, or None where it sends none (or one that is no number)."""
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send, size: int | None) -> None:
    body = json.dumps({"detail": too_large_line(size), "error": too_large_line(size)}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestSizeLimit:
    """Refuses (413, one line) a request body over MAX_REQUEST_BYTES: at once when its
    Content-Length says so, else as soon as the bytes read pass the limit (a chunked body is held
    until then, at most the limit, and passed on whole)."""

    def __init__(self, app, limit: int | None = None) -> None:
        self.app = app
        self.limit = MAX_REQUEST_BYTES if limit is None else limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH") \
                or scope.get("path", "").endswith(UPLOAD_ROUTE):
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.limit:
            await _refuse(send, declared)
            return
        held, size = [], 0
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await _refuse(send, None)
                return
            if not message.get("more_body"):
                break

        async def replay():
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)
