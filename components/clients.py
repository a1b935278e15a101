"""Which client a request comes from, so an upload is used by and served to its uploader only.

Gradio's upload and file requests do not carry the tab's session, and its file route serves any
upload to whoever holds the path (``allowed_paths``, ``blocked_paths`` and ``set_static_paths``
are per path, not per client). So :class:`ClientCookie`, an ASGI middleware, gives each client an
id in a cookie on its first response (a browser keeps it for its tabs; ``gradio_client`` keeps the
cookies of its first request and sends them with its uploads, events and downloads), notes each
upload under that id (from the upload route's answer: the server paths of the files it received,
before the client sees them) and answers 404 to a file request for an upload the requesting client
did not make. The ledger itself is ``engine.service.uploads``.
"""

from __future__ import annotations

import json
import secrets
from http.cookies import SimpleCookie

import gradio as gr
from starlette.middleware import Middleware

from engine import service

COOKIE = "kv_arena_client"
FILE_ROUTE = "/file="
UPLOAD_ROUTE = "/upload"  # POST: the files' bytes in, their server paths out (a JSON list)


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


def _uploaded(body: bytes) -> list[str]:
    """The server paths an upload request's answer names (none if it is not a list of paths)."""
    try:
        paths = json.loads(body)
    except ValueError:
        return []
    return [p for p in paths if isinstance(p, str)] if isinstance(paths, list) else []


class ClientCookie:
    """ASGI middleware: the client's id for this request (made on its first), each upload noted
    under it, and the file route closed to uploads of other clients."""

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

        upload = scope.get("method") == "POST" and path.endswith(UPLOAD_ROUTE)
        status, body = 0, b""

        async def send_with_cookie(message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
                if not sent:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"set-cookie", _set_cookie(client, _secure(scope)))]}
            elif message["type"] == "http.response.body" and upload and status == 200:
                body += message.get("body", b"")
                if not message.get("more_body"):  # noted before the client can name the paths
                    service.note_uploads(_uploaded(body), client)
            await send(message)

        await self.app(scope, receive, send_with_cookie)


LAUNCH = {"app_kwargs": {"middleware": [Middleware(ClientCookie)]}}  # pass to ``launch`` (app.launch_options)


def client_of(request: gr.Request | None) -> str | None:
    """The client id an event's request carries (None without the cookie or a request)."""
    try:
        cookies = request.cookies
        return cookies[COOKIE] if COOKIE in cookies else None
    except (AttributeError, KeyError, TypeError):
        return None
