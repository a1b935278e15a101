"""Which client a request comes from, so an upload is used by and served to its uploader only.

Gradio's upload and file requests do not carry the tab's session, and its file route serves any
upload to whoever holds the path (``allowed_paths``, ``blocked_paths`` and ``set_static_paths``
are per path, not per client). So :class:`ClientCookie`, an ASGI middleware, gives each client an
id in a cookie on its first response (a browser keeps it for its tabs; ``gradio_client`` keeps the
cookies of its first request and sends them with its uploads, events and downloads), notes each
upload under that id (from the upload route's answer: the server paths of the files it received,
before the client sees them) and answers 404 to a file request for an upload the requesting client
did not make. The ledger itself is ``kv_arena.service.uploads``.

A file request is recognised by what it names, not by its route's spelling: every path a request
could stand for (each tail of its URL path after a ``/`` or ``=``, percent-decoded until it stops
changing, and each query value) is resolved as Gradio's file routes resolve it, so ``/file=``,
``/file/``, encoded forms and any later alias meet the same check. The middleware also answers 404
to a request for the messages of an event or session this server never had (``/call/<api>/<id>``,
``/queue/data``: Gradio would log a traceback), takes Gradio's file marker off any file an event
names outside the upload folder, a URL included (the app then refuses it in one line, where Gradio
would download the URL or fail with a traceback), answers an event that names no event of the app
or sends too few values, or one posted around the queue (``/run``), in one line (``event_shape``),
keeps a session awake while its heartbeat stream is open (``service.active``), and refuses an upload
over the caps on unused uploads (per visitor: ``kv_arena.service.visitors``) with 413 and one line
(``kv_arena.service.upload_caps``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
from collections import OrderedDict
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, unquote

import gradio as gr
from starlette.middleware import Middleware

from kv_arena import service

from . import event_shape, mcp_calls
from .request_size import RequestSizeLimit, declared_length
from .served_files import ServedFiles

COOKIE = "kv_arena_client"
UPLOAD_ROUTE = "/upload"  # POST: the files' bytes in, their server paths out (a JSON list)
CALL_START = re.compile(r"/call(?:/v2)?/[^/]+/?$")  # POST: an event started, its id in the answer
CALL_RESULT = re.compile(r"/call(?:/v2)?/[^/]+/([^/]+)/?$")  # GET: that event's messages
HEARTBEAT = re.compile(r"/heartbeat/([^/]+)/?$")
JOIN = re.compile(r"/queue/join/?$")  # POST: an event queued for the body's session_hash
QUEUE_DATA = re.compile(r"/queue/data/?$")  # GET ?session_hash=...: that session's messages
# POST: an event around the queue (api_open=False: none is allowed); /api/<name> is Gradio's older name for it
RUN = re.compile(r"/(?:run|api)/[^/]+/?$")
ALLOWED_IPS_ENV = "FORWARDED_ALLOW_IPS"  # uvicorn's: the peers whose X-Forwarded-For it believes
REMEMBERED = 10_000  # started events (and sessions) whose messages may still be fetched


def _decodings(text: str) -> set[str]:
    """``text`` and its percent-decodings, until one stops changing (a few rounds at most)."""
    out = {text}
    for _ in range(4):
        text = unquote(text)
        if text in out:
            break
        out.add(text)
    return out


def named_paths(scope) -> set[str]:
    """Every file path a request could name: each tail of its path after a ``/`` or ``=`` (as an
    absolute and as a relative path), and each query value, in every decoding."""
    raw = scope.get("raw_path") or b""
    spellings = {scope.get("path", "")} | ({raw.decode("latin-1")} if raw else set())
    values = [v for _, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)]
    out = set()
    for text in {d for spelling in spellings | set(values) for d in _decodings(spelling)}:
        out.add(text)
        for i, char in enumerate(text):
            if char in "/=":
                out.update((text[i + 1:], text[i:]) if char == "/" else (text[i + 1:],))
    return {p for p in out if p and p != "/"}


def _readable(scope, client: str | None) -> bool:
    return all(service.may_read(path, client) for path in named_paths(scope))


class _Known:
    """Ids this server handed out or was sent with a queued event (the newest :data:`REMEMBERED`),
    so messages are asked for a known one only: Gradio answers an unknown one with a traceback."""

    def __init__(self, field: str) -> None:
        self.field = field  # the JSON field that names the id in the body it is noted from
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, body: bytes) -> None:
        try:
            found = json.loads(body).get(self.field)
        except (ValueError, AttributeError, UnicodeDecodeError):
            return
        if isinstance(found, str):
            with self._lock:
                self._ids[found] = None
                while len(self._ids) > REMEMBERED:
                    self._ids.popitem(last=False)

    def known(self, event_id: str) -> bool:
        with self._lock:
            return event_id in self._ids

    def done(self, event_id: str) -> None:
        """Its messages were delivered (Gradio keeps them no longer)."""
        with self._lock:
            self._ids.pop(event_id, None)


EVENTS = _Known("event_id")  # from the answer to POST /call/<api>
SESSIONS = _Known("session_hash")  # from the body of POST /queue/join


def cookie_of(scope) -> str | None:
    """The client id a request (its ASGI scope) carries in its cookie, if any."""
    return _sent_cookie(scope)


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


def _json(scope) -> bool:
    """Whether a request says its body is JSON (every event's and MCP's; an upload's is a form)."""
    kind = dict(scope.get("headers", [])).get(b"content-type", b"").split(b";")[0].strip().lower()
    return kind in (b"application/json", b"") or kind.endswith(b"+json")


def _uploaded(body: bytes) -> list[str]:
    """The server paths an upload request's answer names (none if it is not a list of paths)."""
    try:
        paths = json.loads(body)
    except ValueError:
        return []
    return [p for p in paths if isinstance(p, str)] if isinstance(paths, list) else []


def _outside_files_unmarked(body: bytes) -> bytes | None:
    """An event's body with Gradio's file marker (``meta``) taken off every file it names outside
    the upload folder, a URL included: Gradio would refuse such a file with a traceback before any
    event runs (and download a URL first: the server never fetches a client's URL); unmarked, the
    event receives it and the app refuses it in one line. None: nothing to change."""
    try:
        sent = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    changed = False

    def visit(node) -> None:
        nonlocal changed
        if isinstance(node, list):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            path, meta = node.get("path"), node.get("meta")
            if (isinstance(meta, dict) and meta.get("_type") == "gradio.FileData" and isinstance(path, str)
                    and not service.in_upload_dir(path)):
                del node["meta"]
                changed = True
            for value in node.values():
                visit(value)

    visit(sent.get("data") if isinstance(sent, dict) else None)
    return json.dumps(sent).encode() if changed else None


async def whole_body(receive) -> list[dict]:
    """Every message of a request's body, read now (Gradio reads an event's body whole anyway)."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body"):
            return messages


def _with_length(scope, size: int) -> dict:
    headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(size).encode())]}


async def _not_found(send) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"Not found."})


async def _refuse(send, status: int, line: str) -> None:
    """One line, as Gradio words its own refusals (``{"detail": ...}``)."""
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"detail": line}).encode()})


async def _too_large(send, line: str, headers: list) -> None:
    """An upload refused by a cap on unused uploads: 413 and its one line (the browser shows it)."""
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), *headers]})
    await send({"type": "http.response.body", "body": line.encode()})


def replaying(pending: list[dict], receive):
    """A ``receive`` that gives the messages already read (``pending``) first, then the request's own."""
    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed


async def _drain(receive) -> None:
    """Read a refused request's body to its end, writing nothing (a client still sending it would
    otherwise see the connection close instead of the answer)."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return


def _unknown_event(scope) -> bool:
    """Whether the request asks for the messages of an event, or a session, this server never had."""
    if scope.get("method") not in ("GET", "HEAD"):
        return False
    path = scope.get("path", "")
    found = CALL_RESULT.search(path)
    if found:
        return not EVENTS.known(found.group(1))
    if QUEUE_DATA.search(path):
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        return not SESSIONS.known(query.get("session_hash", ""))
    return False


class ClientCookie:
    """ASGI middleware: the client's id for this request (made on its first), each upload noted
    under it, every file route closed to the private files of other clients, results asked for
    unknown events refused, and a session kept awake while its heartbeat is open."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = mcp_calls.vouched_scope(scope)  # an MCP call: its caller's visitor, for the bridge to pass on
        sent = _sent_cookie(scope)
        client = sent or secrets.token_urlsafe(18)
        path = scope.get("path", "")
        if not _readable(scope, sent) or _unknown_event(scope):
            await _not_found(send)
            return
        if scope.get("method") == "POST" and _json(scope) and not path.endswith(UPLOAD_ROUTE):  # read whole (at most the request size limit)
            pending = await whole_body(receive)
            body = b"".join(m.get("body", b"") for m in pending if m["type"] == "http.request")
            if event_shape.too_deep(body):  # Gradio: a 500 and a RecursionError's traceback
                await _refuse(send, 400, f"The request's JSON nests deeper than {event_shape.MAX_DEPTH} levels; "
                                         "an event's values need far fewer.")
                return
            if RUN.search(path) and event_shape.posted_around_the_queue(scope, body):  # Gradio: a 500 for an unknown name
                await _refuse(send, 404, "Every event goes through the queue: use /gradio_api/call/<api> or gradio_client.")
                return

            receive = replaying(pending, receive)
        beating = HEARTBEAT.search(path)
        with service.active(beating.group(1), heartbeat=True) if beating else contextlib.nullcontext():
            await self._serve(scope, receive, send, sent, client)

    async def _serve(self, scope, receive, send, sent: str | None, client: str) -> None:
        path = scope.get("path", "")
        upload = scope.get("method") == "POST" and path.endswith(UPLOAD_ROUTE)
        started = scope.get("method") == "POST" and CALL_START.search(path) is not None
        result = CALL_RESULT.search(path) if scope.get("method") == "GET" else None
        joining = scope.get("method") == "POST" and JOIN.search(path) is not None
        status, body, sent_body = 0, b"", b""
        pending: list[dict] = []
        cookie = [] if sent else [(b"set-cookie", _set_cookie(client, _secure(scope)))]
        visitor = service.visitor_from_scope(scope, sent).key  # whom the caps count it against
        refused = service.upload_room(sent, declared_length(scope) or 0, visitor) if upload else None
        if refused:  # over a cap on unused uploads: refused before Gradio writes anything
            await _drain(receive)
            await _too_large(send, refused, cookie)
            return
        held: dict | None = None  # an upload's answer, until its files are noted (or refused)
        if joining or started:  # an event's inputs: read whole, files outside the upload folder unmarked
            pending = await whole_body(receive)
            sent_body = b"".join(m.get("body", b"") for m in pending if m["type"] == "http.request")
            unmarked = _outside_files_unmarked(sent_body)
            if unmarked is not None:
                pending, sent_body = [{"type": "http.request", "body": unmarked, "more_body": False}], unmarked
                scope = _with_length(scope, len(unmarked))
            refused = event_shape.refusal(scope, sent_body)  # no such event, or too few values for it
            if refused:
                await _refuse(send, *refused)
                return

        async def receive_noted():
            return pending.pop(0) if pending else await receive()

        # the files an event's messages name become this client's (one without a cookie keeps none)
        streams = scope.get("method") == "GET" and (result or QUEUE_DATA.search(path))
        served = ServedFiles(sent) if sent and streams else None

        async def send_with_cookie(message) -> None:
            nonlocal status, body, held
            if message["type"] == "http.response.start":
                status = message["status"]
                if joining and status == 200:  # noted before the client can ask for its messages
                    SESSIONS.note(sent_body)
                message = {**message, "headers": [*message.get("headers", []), *cookie]}
                if upload and status == 200:
                    held = message
                    return
            elif message["type"] == "http.response.body" and upload and status == 200:
                body += message.get("body", b"")
                if message.get("more_body"):
                    return
                # noted before the client can name the paths, under the cookie the client sent: one that
                # sent none keeps none (raw HTTP), so its upload belongs to no client (usable once, by
                # the first session naming it)
                refused = service.note_uploads(_uploaded(body), sent, visitor)
                if refused:  # over a cap: the files just written are gone, the client told why
                    await _too_large(send, refused, cookie)
                    return
                await send(held)
                message = {**message, "body": body}
            elif message["type"] == "http.response.body" and started and status == 200:
                body += message.get("body", b"")
                if not message.get("more_body"):  # the event's id, before the client can ask for it
                    EVENTS.note(body)
            elif message["type"] == "http.response.body" and result and not message.get("more_body"):
                EVENTS.done(result.group(1))
            if served is not None and message["type"] == "http.response.body":
                served.read(message.get("body", b""))  # the files it names: this client's, before it asks
            await send(message)

        await self.app(scope, receive_noted, send_with_cookie)


OPERATOR_ALLOWED_IPS = os.environ.get(ALLOWED_IPS_ENV)  # what the operator set, before server_proxies


def server_proxies() -> None:
    """The proxies uvicorn (Gradio's server) believes about a request's peer and scheme, from the
    trusted hops (``KV_ARENA_TRUSTED_PROXY_HOPS``): none at 0 hops, else the operator's
    ``FORWARDED_ALLOW_IPS`` (uvicorn's default: 127.0.0.1 and ::1). Uvicorn reads its environment
    variable when Gradio starts it (Gradio takes no option for it); its default would let a client on
    127.0.0.1 name any peer in ``X-Forwarded-For`` where 0 hops means the header is ignored."""
    if service.trusted_hops() == 0:
        os.environ[ALLOWED_IPS_ENV] = ""
    elif OPERATOR_ALLOWED_IPS is None:
        os.environ.pop(ALLOWED_IPS_ENV, None)
    else:
        os.environ[ALLOWED_IPS_ENV] = OPERATOR_ALLOWED_IPS


def launch_kwargs(*inner) -> dict:
    """What ``launch`` takes for this middleware and the ``inner`` ones (ASGI middleware classes,
    run after it, e.g. ``queue_limit.QueueLimit``; app.launch_options): new dicts each call, since
    Gradio writes its MCP server's lifespan into the ``app_kwargs`` it is given, and a later launch
    handed the same dict would run that lifespan again (and fail to start). Sets the server's trusted
    proxies too (:func:`server_proxies`)."""
    server_proxies()
    return {"app_kwargs": {"middleware": [Middleware(RequestSizeLimit), Middleware(ClientCookie),
                                          *(Middleware(m) for m in inner)]}}


def client_of(request: gr.Request | None) -> str | None:
    """The client id an event's request carries (None without the cookie or a request)."""
    try:
        cookies = request.cookies
        return cookies[COOKIE] if COOKIE in cookies else None
    except (AttributeError, KeyError, TypeError):
        return None


def visitor_of(request: gr.Request | None) -> service.Visitor:
    """The visitor an event's request comes from (:mod:`kv_arena.service.visitors`): its address
    behind the trusted proxies, its cookie as a sub-key. Without a request: an unknown visitor."""
    scope = getattr(getattr(request, "request", None), "scope", None)
    if isinstance(scope, dict):  # every header line, as the middleware read them
        return service.visitor_from_scope(scope, client_of(request))
    headers = getattr(request, "headers", None)
    peer = getattr(getattr(request, "client", None), "host", None)
    return service.visitor_from_request(headers, peer, client_of(request))


def track(session: service.Session, request: gr.Request | None) -> None:
    """``service.track`` with what an event's request says: its tab, its client and its visitor."""
    service.track(session, getattr(request, "session_hash", None), client_of(request),
                  visitor_of(request).key if request is not None else None)
