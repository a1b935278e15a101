"""Caps on uploads no event has used yet, per visitor and for the whole server, in bytes and in files.

Gradio writes an upload to disk before any event names it, and the app keeps it until a session
uses it or :func:`~kv_arena.service.sessions.idle_seconds` passes (a browser uploads a file when
it is attached, before the message is sent). Without a cap one visitor could fill the disk in
seconds, or its folder with thousands of tiny files. So an upload that would take a visitor's
unused uploads over ``KV_ARENA_MAX_UNUSED_UPLOAD_MB`` (default 256, one maximum-size video and then
some) or ``KV_ARENA_MAX_UNUSED_UPLOAD_FILES`` (64), or every visitor's together over
``KV_ARENA_MAX_UNUSED_UPLOADS_MB`` (2048) or ``KV_ARENA_MAX_UNUSED_UPLOADS_FILES`` (1024), is refused
whole, in one line (HTTP 413), and nothing already uploaded is touched: evicting the oldest would let
one visitor delete another's attachment before it is sent.

A visitor is an address (:mod:`.visitors`): fresh cookies do not make a script more visitors. A
visitor's caps are at most a quarter of the totals, so the totals always keep room for the others.
Uploads a session has used no longer count; neither do the app's own files."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .visitors import share

MB = 2**20


class Counted(Protocol):
    """What this module reads of an upload's record (``uploads._Upload``)."""

    size: int

    def awaited(self) -> bool: ...

    def awaited_by(self, visitor: str) -> bool: ...


def _number(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


def total_cap() -> int:
    """Bytes of unused uploads every visitor together may keep (``KV_ARENA_MAX_UNUSED_UPLOADS_MB``)."""
    return int(_number("KV_ARENA_MAX_UNUSED_UPLOADS_MB", 2048) * MB)


def per_visitor_cap() -> int:
    """Bytes of unused uploads one visitor may keep (``KV_ARENA_MAX_UNUSED_UPLOAD_MB``, at most a share of the total)."""
    return min(int(_number("KV_ARENA_MAX_UNUSED_UPLOAD_MB", 256) * MB), share(total_cap()))


def total_files() -> int:
    """Unused uploads every visitor together may keep (``KV_ARENA_MAX_UNUSED_UPLOADS_FILES``)."""
    return int(_number("KV_ARENA_MAX_UNUSED_UPLOADS_FILES", 1024))


def per_visitor_files() -> int:
    """Unused uploads one visitor may keep (``KV_ARENA_MAX_UNUSED_UPLOAD_FILES``, at most a share of the total)."""
    return min(int(_number("KV_ARENA_MAX_UNUSED_UPLOAD_FILES", 64)), share(total_files()))


@dataclass(frozen=True)
class Unused:
    """Unused uploads: one visitor's and everyone's, in bytes and in files."""

    mine: int = 0
    mine_files: int = 0
    everyone: int = 0
    everyone_files: int = 0

    def plus(self, size: int, files: int) -> Unused:
        return Unused(self.mine + size, self.mine_files + files, self.everyone + size, self.everyone_files + files)


def unused(records: Iterable[Counted], visitor: str) -> Unused:
    """What ``visitor`` and everyone hold in uploads no session has used yet."""
    records = list(records)
    mine = [r for r in records if r.awaited_by(visitor)]
    waiting = [r for r in records if r.awaited()]
    return Unused(sum(r.size for r in mine), len(mine), sum(r.size for r in waiting), len(waiting))


def refusal(before: Unused, after: Unused) -> str | None:
    """The line that refuses an upload taking unused uploads from ``before`` to ``after`` over a
    cap; None when it fits (one that adds nothing always does)."""
    if after.mine > max(before.mine, per_visitor_cap()):
        return (f"Upload refused: your files not yet sent in a message would hold {after.mine / MB:.0f} MB, over "
                f"the {per_visitor_cap() / MB:.0f} MB allowed; send them in a message first (unused uploads are "
                "deleted after the idle time).")
    if after.mine_files > max(before.mine_files, per_visitor_files()):
        return (f"Upload refused: you have {after.mine_files:,} files not yet sent in a message, over the "
                f"{per_visitor_files():,} allowed; send them in a message first.")
    if after.everyone > max(before.everyone, total_cap()) \
            or after.everyone_files > max(before.everyone_files, total_files()):
        return ("Upload refused: this server holds all the files not yet sent in a message it keeps "
                f"({total_cap() / MB:.0f} MB, {total_files():,} files); try again in a few minutes.")
    return None


def room_refusal(now: Unused, declared: int) -> str | None:
    """The same line before the request is read, when its declared size alone cannot fit (a little
    over the files' sizes: the form's own bytes); at least one file."""
    slack = 64 * 1024
    return refusal(now, now.plus(max(0, declared - slack), 1))
