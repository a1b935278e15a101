"""Caps on uploads no event has used yet, per client and for the whole server.

Gradio writes an upload to disk before any event names it, and the app keeps it until a session
uses it or :func:`~kv_arena.service.sessions.idle_seconds` passes (a browser uploads a file when
it is attached, before the message is sent). Without a cap one client could fill the disk in
seconds. So an upload that would take a client's unused uploads over
``KV_ARENA_MAX_UNUSED_UPLOAD_MB`` (default 256, one maximum-size video and then some), or every
client's together over ``KV_ARENA_MAX_UNUSED_UPLOADS_MB`` (default 2048), is refused whole, in one
line (HTTP 413), and nothing already uploaded is touched: evicting the oldest would let one client
delete another's attachment before it is sent. Clients that keep no cookie count as one client.
Uploads a session has used no longer count; neither do the app's own files."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol

MB = 2**20


class Counted(Protocol):
    """What this module reads of an upload's record (``uploads._Upload``)."""

    size: int

    def awaited(self) -> bool: ...

    def awaits(self, client: str | None) -> bool: ...


def per_client_cap() -> int:
    """Bytes of unused uploads one client may keep (``KV_ARENA_MAX_UNUSED_UPLOAD_MB``)."""
    return int(float(os.environ.get("KV_ARENA_MAX_UNUSED_UPLOAD_MB", 256)) * MB)


def total_cap() -> int:
    """Bytes of unused uploads every client together may keep (``KV_ARENA_MAX_UNUSED_UPLOADS_MB``)."""
    return int(float(os.environ.get("KV_ARENA_MAX_UNUSED_UPLOADS_MB", 2048)) * MB)


def unused_bytes(records: Iterable[Counted], client: str | None) -> tuple[int, int]:
    """(this client's unused uploads, everyone's) in bytes; ``client`` None: the clients without a cookie."""
    records = list(records)
    return (sum(r.size for r in records if r.awaits(client)), sum(r.size for r in records if r.awaited()))


def refusal(before: tuple[int, int], after: tuple[int, int]) -> str | None:
    """The line that refuses an upload taking unused uploads from ``before`` to ``after`` (bytes:
    the client's, everyone's) over a cap; None when it fits (one that adds nothing always does)."""
    (mine, everyone), (mine_after, everyone_after) = before, after
    if mine_after > max(mine, per_client_cap()):
        return (f"Upload refused: your files not yet sent in a message would hold {mine_after / MB:.0f} MB, over "
                f"the {per_client_cap() / MB:.0f} MB allowed; send them in a message first (unused uploads are "
                "deleted after the idle time).")
    if everyone_after > max(everyone, total_cap()):
        return (f"Upload refused: this server holds {total_cap() / MB:.0f} MB of files not yet sent in a "
                "message, all it keeps; try again in a few minutes.")
    return None


def room_refusal(unused: tuple[int, int], declared: int) -> str | None:
    """The same line before the request is read, when its declared size alone cannot fit (a little
    over the files' sizes: the form's own bytes)."""
    slack = 64 * 1024
    mine, everyone = unused
    return refusal(unused, (mine + max(0, declared - slack), everyone + max(0, declared - slack)))
