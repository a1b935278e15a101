"""Each MCP tool call on a session of its own, closed when it ends.

Gradio's MCP bridge sends every tool call to the app through one ``gradio_client`` of its own (one
cookie, one session hash), and its transport is stateless (no MCP session id), so nothing tells
one MCP caller from another. Sharing the bridge's session would let caller B's empty history reset
caller A's conversation, and the full-cache figures "(cached)" from A's question tell B what A
asked. So a call that comes through the bridge (its ``x-gradio-user: mcp`` header, which the bridge
sets on every call) gets a fresh session: no conversation or cache outlives it (docs/mcp.md).

The bridge re-sends each call from 127.0.0.1 with the caller's headers, so the app would see every
MCP caller as one visitor (or, with 0 trusted hops, as whatever ``X-Forwarded-For`` it forged). So
the caller's visitor is written into its MCP request (:func:`vouched_scope`), in a header only this
process can write (``visitors.vouch``), which the bridge passes on with the rest: the call counts
as its caller, by the same rule as any request. ``queue_limit`` counts a tool call from its MCP
request (:func:`tool_calls`) and refuses it in the MCP answer itself (:func:`refused`), so the
caller reads one line, not the bridge's HTTP error naming the app's internal URL.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable

from kv_arena import service
from kv_arena.service import visitors

BRIDGE_HEADER, BRIDGE_USER = "x-gradio-user", "mcp"  # what Gradio's MCP bridge sends with every call
MCP_ROUTE = re.compile(r"/gradio_api/mcp(?:/.*)?$")  # every MCP transport's routes
STREAMABLE = re.compile(r"/gradio_api/mcp(?:/http)?/?$")  # POST: a JSON-RPC message, its answer in the reply
COUNTED_HEADER = "x-kv-arena-counted"  # on a tool call the queue limit has counted from its MCP request


def _without(headers: list, name: str) -> list:
    return [(k, v) for k, v in headers if k.lower() != name.encode()]


def vouched_scope(scope: dict) -> dict:
    """An MCP request's scope with its caller's visitor written in (``visitors.VOUCH_HEADER``; one a
    client wrote goes), for the bridge to pass on; any other request's as it is."""
    if not MCP_ROUTE.search(scope.get("path", "")):
        return scope
    caller = visitors.from_scope({**scope, "headers": _without(scope.get("headers", []), visitors.VOUCH_HEADER)})
    headers = [*_without(scope.get("headers", []), visitors.VOUCH_HEADER),
               (visitors.VOUCH_HEADER.encode(), visitors.vouch(caller.address).encode("latin-1"))]
    return {**scope, "headers": headers}


def tool_calls(scope: dict, body: bytes) -> list:
    """The JSON-RPC ids of the ``tools/call`` requests an MCP POST carries on the streamable
    transport (whose reply carries their answers); none for any other request."""
    if scope.get("method") != "POST" or not STREAMABLE.search(scope.get("path", "")):
        return []
    try:
        sent = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []
    messages = sent if isinstance(sent, list) else [sent]
    return [m.get("id") for m in messages if isinstance(m, dict) and m.get("method") == "tools/call"]


def counted_scope(scope: dict) -> dict:
    """The scope of a tool call the queue limit counted, marked so for the event the bridge queues."""
    headers = [*_without(scope.get("headers", []), COUNTED_HEADER),
               (COUNTED_HEADER.encode(), visitors.vouch("counted").encode("latin-1"))]
    return {**scope, "headers": headers}


def counted(scope) -> bool:
    """Whether an event's request is a tool call the queue limit already counted (:func:`counted_scope`)."""
    values = [v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == COUNTED_HEADER.encode()]
    return visitors.vouched(values) == "counted"


def refused(ids: list, line: str) -> bytes:
    """The MCP answer that refuses these tool calls with ``line`` (a tool's error result each)."""
    answers = [{"jsonrpc": "2.0", "id": i, "result": {"content": [{"type": "text", "text": line}], "isError": True}}
               for i in ids]
    return json.dumps(answers[0] if len(answers) == 1 else answers).encode()


def from_mcp(request) -> bool:
    """Whether an event's ``gr.Request`` came through Gradio's MCP bridge."""
    try:
        return request.headers.get(BRIDGE_HEADER) == BRIDGE_USER
    except AttributeError:
        return False


def own_session(event: Callable) -> Callable:
    """``event`` (a generator taking ``session`` and ``request``) on a fresh session, closed after
    it, when called through MCP; as it is otherwise (a browser tab or an API client keeps its own)."""
    signature = inspect.signature(event)

    @functools.wraps(event)
    def per_call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if not from_mcp(bound.arguments.get("request")):
            yield from event(*args, **kwargs)
            return
        session = bound.arguments["session"] = service.Session()
        try:
            yield from event(*bound.args, **bound.kwargs)
        finally:
            service.close_session(session)
    return per_call
