"""Which client a request comes from, so an upload is used by and served to its uploader only.

Gradio's upload and file requests do not carry the tab's session, and its file route serves any
upload to whoever holds the path (``allowed_paths``, ``blocked_paths`` and ``set_static_paths``
are per path, not per client). So :class:`ClientCookie`, an ASGI middleware, gives each client an
id in a cookie on its first response (a browser keeps it for its tabs; ``gradio_client`` keeps the
cookies of its first request and sends them with its uploads, events and downloads), notes each
upload under that id (:func:`install` hooks Gradio's set of uploaded paths) and answers 404 to a
file request for an upload the requesting client did not make. The ledger itself is
``engine.service.uploads``.
"""

from __future__ import annotations

import secrets
from contextvars import ContextVar
from http.cookies import SimpleCookie

import gradio as gr
from starlette.middleware import Middleware

from engine import service

COOKIE = "kv_arena_client"
FILE_ROUTE = "/file="
_CURRENT: ContextVar[str | None] = ContextVar("kv_arena_client", default=None)


def _sent_cookie(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"cookie":
            morsel = SimpleCookie(value.decode("latin-1")).get(COOKIE)
            if morsel is not None and morsel.value:
                return morsel.value
    return None


def _secure(scope) -> bool:
    forwarded = dict(scope.get("headers", [])).get(b"x-forwarded-proto", b"").decode("latin-1")
    return scope.get("scheme") == "https" or forwarded.split(",")[0].strip() == "https"


def _set_cookie(client: str, secure: bool) -> bytes:
    # inside a Space's iframe (another site) a cookie must be SameSite=None, Secure, Partitioned
    where = "SameSite=None; Secure; Partitioned" if secure else "SameSite=Lax"
    return f"{COOKIE}={client}; Path=/; HttpOnly; {where}".encode("latin-1")


class ClientCookie:
    """ASGI middleware: the client's id for this request (made on its first), and the file route
    closed to uploads of other clients."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = _sent_cookie(scope)
        client = sent or secrets.token_urlsafe(18)
        path = scope.get("path", "")
        if FILE_ROUTE in path and not service.may_read(path.split(FILE_ROUTE, 1)[1], client):
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"Not found."})
            return

        async def send_with_cookie(message) -> None:
            if message["type"] == "http.response.start" and not sent:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"set-cookie", _set_cookie(client, _secure(scope)))]}
            await send(message)

        token = _CURRENT.set(client)  # the upload route runs in this context: the ledger reads it
        try:
            await self.app(scope, receive, send_with_cookie)
        finally:
            _CURRENT.reset(token)


class UploadLedger(set):
    """Gradio's set of uploaded paths; each upload is also told to the service with the id of the
    client that sent it."""

    def update(self, *batches) -> None:
        for paths in batches:
            paths = list(paths)
            service.note_uploads(paths, _CURRENT.get())
            super().update(paths)


def install(demo: gr.Blocks) -> None:
    """Hook ``demo``'s uploads (call before launch; pass :data:`LAUNCH` to ``launch``)."""
    ledger = UploadLedger(demo.upload_file_set)
    demo.temp_file_sets = [ledger if s is demo.upload_file_set else s for s in demo.temp_file_sets]
    demo.upload_file_set = ledger


LAUNCH = {"app_kwargs": {"middleware": [Middleware(ClientCookie)]}}


def client_of(request: gr.Request | None) -> str | None:
    """The client id an event's request carries (None without the cookie or a request)."""
    try:
        cookies = request.cookies
        return cookies[COOKIE] if COOKIE in cookies else None
    except (AttributeError, KeyError, TypeError):
        return None
