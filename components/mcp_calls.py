"""Each MCP tool call on a session of its own, closed when it ends.

Gradio's MCP bridge sends every tool call to the app through one ``gradio_client`` of its own (one
cookie, one session hash), and its transport is stateless (no MCP session id), so nothing tells
one MCP caller from another. Sharing the bridge's session would let caller B's empty history reset
caller A's conversation, and the full-cache figures "(cached)" from A's question tell B what A
asked. So a call that comes through the bridge (its ``x-gradio-user: mcp`` header, which the bridge
sets on every call) gets a fresh session: no conversation or cache outlives it (docs/mcp.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from kv_arena import service

BRIDGE_HEADER, BRIDGE_USER = "x-gradio-user", "mcp"  # what Gradio's MCP bridge sends with every call


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
