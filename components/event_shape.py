"""Whether an event's request names an event this app has, with enough values for it, checked
before Gradio queues it: Gradio fails on an unknown endpoint or index, and on too few values (a
``/call/chat`` with ``"data": []``), with a traceback in the server log and no word to the client.
Here such a request gets one line (404 or 422) and never reaches the queue.

So does a body Python's JSON reader cannot take or the app could not answer: nested deeper than
:data:`MAX_DEPTH` (Gradio would fail with a RecursionError: 400, :func:`too_deep`), a string holding
a lone surrogate in a setting (``"\\ud800"``: not text, it cannot be written back; a message's text is
refused by its event, in the chat), or a value that is not text
where the event takes a textbox's (Gradio would turn ``-1``, ``NaN``, ``[]`` or ``true`` into the
text "-1", "nan", "[]", "True").
"""

from __future__ import annotations

import json
import re

import gradio as gr

CALL = re.compile(r"/call/([^/]+)/?$")  # POST /call/<api>: the named endpoint's values, in order
JOIN = re.compile(r"/queue/join/?$")  # POST /queue/join: an event by index, all its inputs' values
MAX_DEPTH = 64  # JSON nesting a request may have (an event's values need under a dozen)
SURROGATE = re.compile("[\ud800-\udfff]")


def too_deep(body: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether a JSON body nests arrays and objects deeper than ``limit`` (counted without parsing:
    a parser is what a deep body breaks)."""
    if body.count(b"[") + body.count(b"{") <= limit:  # too few brackets to nest that deep (at C speed)
        return False
    depth, in_string, escaped = 0, False, False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)


def _endpoints(fns: dict) -> str:
    names = sorted(f"/{fn.api_name}" for fn in fns.values()
                   if fn.api_name and getattr(fn, "api_visibility", "public") == "public")
    return ", ".join(names) or "none"


def _values_refusal(name: str, blocks: list, data: list) -> str | None:
    """A value that is not text where a textbox takes it, or any string that is not valid Unicode."""
    settings = [value for block, value in zip(blocks, data)
                if not isinstance(block, (gr.MultimodalTextbox, gr.Chatbot))]  # a message's text: the event says why
    if any(SURROGATE.search(text) for text in _strings(settings)):
        return f"{name}: a value holds a lone surrogate (such as \\ud800), which is not text; send valid Unicode."
    for i, (block, value) in enumerate(zip(blocks, data)):
        if isinstance(block, gr.Textbox) and value is not None and not isinstance(value, str):
            label = getattr(block, "label", None) or f"value {i + 1}"
            return f"{name}: {label[:60]} takes text; got {json.dumps(value)[:30]}."
    return None


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
            return 404, f"This app has no endpoint /{call.group(1)[:60]}: its endpoints are {_endpoints(fns)}."
        wanted = [block for block in fn.inputs if not getattr(block, "skip_api", False)]
        enough = len(sent["data"]) in (len(wanted), len(fn.inputs)) or len(sent["data"]) > len(fn.inputs)
        name = f"/{fn.api_name}"
        given = wanted if len(sent["data"]) == len(wanted) else fn.inputs
    else:
        if not isinstance(sent.get("fn_index"), int):
            return None
        fn = fns.get(sent["fn_index"])
        if fn is None:
            return 404, f"This app has no event {str(sent.get('fn_index'))[:20]}."
        wanted = given = fn.inputs
        enough = len(sent["data"]) >= len(wanted)
        name = f"Event {sent['fn_index']}"
    if enough:
        refused = _values_refusal(name, list(given), sent["data"])
        return (422, refused) if refused else None
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
