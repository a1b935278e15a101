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

The per-visitor caps are a person's: one client cookie (the clients without one at an address are
one person), so one person's files are never counted against another behind the same address. The
people behind one address (:mod:`.visitors`: fresh cookies do not make a script more addresses)
share ``KV_ARENA_MAX_UNUSED_UPLOAD_MB_PER_ADDRESS`` and ``KV_ARENA_MAX_UNUSED_UPLOAD_FILES_PER_ADDRESS``
(default and at most a quarter of the totals, so the totals always keep room for the others; a
person's caps are at most the address's). Uploads a session has used no longer count; neither do
the app's own files."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .env import env_number
from .visitors import share

MB = 2**20


class Counted(Protocol):
    """What this module reads of an upload's record (``uploads._Upload``)."""

    size: int

    def awaited(self) -> bool: ...

    def awaited_by(self, visitor: str) -> bool: ...

    def awaited_from(self, visitor: str, client: str | None) -> bool: ...


def total_cap() -> int:
    """Bytes of unused uploads every visitor together may keep (``KV_ARENA_MAX_UNUSED_UPLOADS_MB``)."""
    return int(env_number("KV_ARENA_MAX_UNUSED_UPLOADS_MB", 2048) * MB)


def address_cap() -> int:
    """Bytes of unused uploads the people behind one address may keep together
    (``KV_ARENA_MAX_UNUSED_UPLOAD_MB_PER_ADDRESS``, default and at most a share of the total)."""
    return min(int(env_number("KV_ARENA_MAX_UNUSED_UPLOAD_MB_PER_ADDRESS", share(total_cap()) / MB) * MB),
               share(total_cap()))


def per_visitor_cap() -> int:
    """Bytes of unused uploads one person may keep (``KV_ARENA_MAX_UNUSED_UPLOAD_MB``, at most the address's)."""
    return min(int(env_number("KV_ARENA_MAX_UNUSED_UPLOAD_MB", 256) * MB), address_cap())


def total_files() -> int:
    """Unused uploads every visitor together may keep (``KV_ARENA_MAX_UNUSED_UPLOADS_FILES``)."""
    return int(env_number("KV_ARENA_MAX_UNUSED_UPLOADS_FILES", 1024))


def address_files() -> int:
    """Unused uploads the people behind one address may keep together
    (``KV_ARENA_MAX_UNUSED_UPLOAD_FILES_PER_ADDRESS``, default and at most a share of the total)."""
    return min(int(env_number("KV_ARENA_MAX_UNUSED_UPLOAD_FILES_PER_ADDRESS", share(total_files()))),
               share(total_files()))


def per_visitor_files() -> int:
    """Unused uploads one person may keep (``KV_ARENA_MAX_UNUSED_UPLOAD_FILES``, at most the address's)."""
    return min(int(env_number("KV_ARENA_MAX_UNUSED_UPLOAD_FILES", 64)), address_files())


@dataclass(frozen=True)
class Unused:
    """Unused uploads: one person's, their address's and everyone's, in bytes and in files."""

    mine: int = 0
    mine_files: int = 0
    everyone: int = 0
    everyone_files: int = 0
    here: int = 0
    here_files: int = 0

    def plus(self, size: int, files: int) -> Unused:
        return Unused(self.mine + size, self.mine_files + files, self.everyone + size, self.everyone_files + files,
                      self.here + size, self.here_files + files)


def unused(records: Iterable[Counted], visitor: str, client: str | None = None) -> Unused:
    """What the person ``client`` (None: the clients without a cookie) behind ``visitor``, that
    address, and everyone hold in uploads no session has used yet."""
    records = list(records)
    mine = [r for r in records if r.awaited_from(visitor, client)]
    here = [r for r in records if r.awaited_by(visitor)]
    waiting = [r for r in records if r.awaited()]
    return Unused(sum(r.size for r in mine), len(mine), sum(r.size for r in waiting), len(waiting),
                  sum(r.size for r in here), len(here))


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
    if after.here > max(before.here, address_cap()) or after.here_files > max(before.here_files, address_files()):
        return ("Upload refused: the people behind your address hold files not yet sent in a message over "
                f"the {address_cap() / MB:.0f} MB allowed for one address ({address_files():,} files); "
                "send yours in a message first, or try again in a few minutes.")
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
