"""Whether an event's request names an event this app has, with enough values for it, checked
before Gradio queues it: Gradio fails on an unknown endpoint or index, and on too few values (a
``/call/chat`` with ``"data": []``), with a traceback in the server log and no word to the client.
Here such a request gets one line (404 or 422) and never reaches the queue.
"""

from __future__ import annotations

import json
import re

CALL = re.compile(r"/call/([^/]+)/?$")  # POST /call/<api>: the named endpoint's values, in order
JOIN = re.compile(r"/queue/join/?$")  # POST /queue/join: an event by index, all its inputs' values


def _fns(scope) -> dict:
    app = scope.get("app")
    blocks = app.get_blocks() if app is not None and hasattr(app, "get_blocks") else None
    return getattr(blocks, "fns", {}) or {}


def refusal(scope, body: bytes) -> tuple[int, str] | None:
    """(HTTP status, one line) for an event request that names no event of this app or sends it
    too few values; None for any other request (Gradio's own checks answer a malformed body)."""
    path = scope.get("path", "")
    call, join = CALL.search(path), JOIN.search(path)
    if scope.get("method") != "POST" or not (call or join):
        return None
    try:
        sent = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(sent, dict) or not isinstance(sent.get("data"), list):
        return None
    fns = _fns(scope)
    if call:
        fn = next((fn for fn in fns.values() if fn.api_name == call.group(1)), None)
        if fn is None:
            return 404, f"This app has no endpoint /{call.group(1)[:60]}: its endpoints are /chat and /compare."
        wanted = [block for block in fn.inputs if not getattr(block, "skip_api", False)]
        enough = len(sent["data"]) in (len(wanted), len(fn.inputs)) or len(sent["data"]) > len(fn.inputs)
        name = f"/{fn.api_name}"
    else:
        if not isinstance(sent.get("fn_index"), int):
            return None
        fn = fns.get(sent["fn_index"])
        if fn is None:
            return 404, f"This app has no event {str(sent.get('fn_index'))[:20]}."
        wanted = fn.inputs
        enough = len(sent["data"]) >= len(wanted)
        name = f"Event {sent['fn_index']}"
    if enough:
        return None
    return 422, (f"{name} takes {len(wanted)} values in \"data\" (its parameters, in the order the API page "
                 f"lists them); {len(sent['data'])} were sent.")


def posted_around_the_queue(scope, body: bytes) -> bool:
    """Whether a POST to ``/run/<name>`` asks for anything but one of Gradio's own unqueued events
    (an example's click loads its values that way, ``queue=False``): every event of the app goes
    through the queue, and Gradio answers an unknown one with a 500 and a traceback."""
    try:
        sent = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return True
    index = sent.get("fn_index") if isinstance(sent, dict) else None
    fn = _fns(scope).get(index) if isinstance(index, int) else None
    return fn is None or getattr(fn, "queue", True) is not False
