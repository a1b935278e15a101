"""Files an event's messages hand a client, noted as that client's before it can ask for them.

Gradio copies every file an output names (the chat's pictures, an overlay, a drawn scene) into its
cache, in a folder named by the file's hash, and the client fetches that copy by its path. The app
serves a file under Gradio's folder only to a client this process has a record for
(``service.may_read``), so each such copy is noted as the receiving client's here, as its message
goes out (:class:`ServedFiles`, fed by ``clients.ClientCookie`` for the routes that stream an
event's messages). A client without a cookie keeps none: what it was sent it cannot fetch back."""

from __future__ import annotations

import json

from kv_arena import service


def file_paths(value) -> list[str]:
    """Every ``path`` of a file (a dict with a ``path`` and Gradio's file marker or a ``url``) in a
    message's JSON value."""
    found, stack = [], [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            path = node.get("path")
            if isinstance(path, str) and ("url" in node or "meta" in node):
                found.append(path)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


class ServedFiles:
    """One response's stream of server-sent events, read as it goes out: the files each message
    names are noted as ``client``'s (a message split across body chunks is read whole)."""

    def __init__(self, client: str) -> None:
        self.client = client
        self.pending = b""
        self.noted: set[str] = set()  # a streamed answer names the same pictures in every message

    def read(self, chunk: bytes) -> None:
        self.pending += chunk
        *messages, self.pending = self.pending.split(b"\n\n")
        for message in messages:
            for line in message.split(b"\n"):
                if line.startswith(b"data:"):
                    self._note(line[5:])

    def _note(self, data: bytes) -> None:
        try:
            value = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return
        paths = [path for path in file_paths(value) if path not in self.noted]
        if paths:
            service.note_served(paths, self.client)
            self.noted.update(paths)
