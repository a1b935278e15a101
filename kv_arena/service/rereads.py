"""What a method switch may cost. A conversation another method takes over is re-read by it
(``turns._reread``): every turn's media and text again, then the answers as given. Unbounded, that
let one visitor spend a minute of CPU per six-byte message: six turns streamed from a 1000-frame
video under a cap re-read 192,162 tokens (5.9x the model's context) at every flip of the method.

So a switch is held to three rules, checked before any model work (:func:`check_switch`):
- it re-reads each turn as that turn was fed: a turn streamed under a cap is streamed again under a
  cap (the new one, else its own), never prefilled whole (:func:`reread_cap`);
- all it re-reads together stays within the model's context (what one prompt could hold);
- a person re-reads at most KV_ARENA_REREAD_TOKENS_PER_MINUTE tokens (default: 32,768) in any
  minute, whatever session brings the conversation (a switch, or a history sent to a fresh session:
  :mod:`.resent`), so flipping the method on every message, or sending a long history from a new
  session each time, is refused in one line saying how long to wait. A person is a client cookie
  behind an address (the clients without one are one person), so one person's re-reads are not
  another's; the people behind one address (:mod:`.visitors`: fresh cookies are the same address)
  re-read at most :data:`PER_ADDRESS` times that together. A re-read is charged when it is allowed,
  before any model work, so a burst of them is counted whole.
The chat line of a switch says what it cost (tokens and seconds, ``SwitchNote``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_arena import backends

from ..errors import UserError

# tokens a visitor may re-read a minute; unset: by where the model runs (tokens_per_minute)
REREAD_TOKENS_PER_MINUTE = int(os.environ["KV_ARENA_REREAD_TOKENS_PER_MINUTE"]) \
    if os.environ.get("KV_ARENA_REREAD_TOKENS_PER_MINUTE") else None
ON_GPU, ON_CPU = 32_768, 8_192  # the defaults: a CPU re-reads 27,000 tokens of the offline model in about 2 minutes
WINDOW_S = 60.0
PER_ADDRESS = 2  # the people behind one address re-read at most this many persons' tokens a minute together


def tokens_per_minute(on_gpu: bool) -> int:
    """Tokens one visitor may re-read a minute (``KV_ARENA_REREAD_TOKENS_PER_MINUTE``, else 32,768
    where the model runs on a GPU and 8,192 on a CPU: a minute of the one heavy slot, or less)."""
    if REREAD_TOKENS_PER_MINUTE is not None:
        return REREAD_TOKENS_PER_MINUTE
    return ON_GPU if on_gpu else ON_CPU


@dataclass(frozen=True)
class TurnCost:
    """What one turn of a chat fed the model: prompt tokens (its streamed media included) and answer
    tokens, and the KV cap its media streamed under (None: one prompt)."""

    tokens: int
    cap_bytes: int | None = None


def reread_cap(turn: TurnCost, plan_cap: int | None, streams: bool) -> int | None:
    """The cap a turn is re-read under: the new settings' cap where they set one, else the turn's own
    when it was streamed (and the new method can hold one; the full cache streams without a cap)."""
    if plan_cap is not None:
        return plan_cap
    return turn.cap_bytes if streams else None


def check_switch(costs: list[TurnCost], rereads: list[tuple[float, int]], method: type | str, *,
                 context: int, full_cache: bool, now: float | None = None, sent: bool = False,
                 per_minute: int | None = None) -> int:
    """The tokens a switch to ``method`` would re-read; a UserError (one line, nothing changed) when
    it may not: a streamed turn and a method that cannot stream under a cap, more tokens than the
    model's ``context``, or more than ``per_minute`` (default: :func:`tokens_per_minute` on a CPU) with
    the re-reads of the last minute (``rereads``: (time, tokens) of the visitor's earlier re-reads).
    ``sent``: the conversation is a history a client sent, re-read in place of the session's (said
    so); it must fit the minute's tokens whole. A switch of the session's own conversation may
    exceed them when it is the visitor's only re-read of the minute (a long chat can still change
    method, once a minute)."""
    cls = backends.backend_class(method) if isinstance(method, str) else method
    tokens = sum(c.tokens for c in costs)
    keep = "Send a shorter history, or [] to start a new chat." if sent else "Keep the method you had, or start a new chat."
    doing = f"Re-reading the history sent with {cls.title}" if sent else f"Switching to {cls.title}"
    if any(c.cap_bytes is not None for c in costs) and not (full_cache or cls.streams_under_cap):
        raise UserError(f"{cls.title} cannot re-read this conversation: a video in it was streamed under a memory "
                        f"cap, and {cls.title} cannot hold one. {keep}")
    if tokens > context:
        raise UserError(f"{doing} would re-read {tokens:,} tokens, more than the model's context "
                        f"({context:,}). {keep}")
    now = time.monotonic() if now is None else now
    recent = sum(n for at, n in rereads if now - at < WINDOW_S)
    limit = tokens_per_minute(False) if per_minute is None else per_minute
    if sent and tokens > limit:
        raise UserError(f"{doing} would re-read {tokens:,} tokens, more than a visitor may re-read in a minute on "
                        f"this server ({limit:,}, KV_ARENA_REREAD_TOKENS_PER_MINUTE). Send a shorter history, or "
                        "keep your session and send [] to start a new chat.")
    if recent and recent + tokens > limit:
        wait = WINDOW_S - (now - min(at for at, _ in rereads if now - at < WINDOW_S))
        raise UserError(f"You re-read {recent:,} tokens in the last minute; {doing[0].lower() + doing[1:]} would "
                        f"re-read {tokens:,} more (the limit is {limit:,} a minute, "
                        f"KV_ARENA_REREAD_TOKENS_PER_MINUTE). Wait {max(1, round(wait))} s, or "
                        f"{'send [] to start a new chat' if sent else 'keep the method'}.")
    return tokens


def person_of(visitor: str, client: str | None) -> str:
    """The key a person's re-reads are counted by: their client cookie behind their address."""
    return f"{visitor}|{client or 'no cookie'}"


def _within_address(recent: list, tokens: int, limit: int, now: float) -> None:
    """Refuses (one line) a re-read that takes the address's last minute over ``limit``; its first
    re-read of the minute always passes (as a person's own switch does)."""
    done = sum(r.tokens for r in recent)
    if done and done + tokens > limit:
        wait = WINDOW_S - (now - min(r.at for r in recent))
        raise UserError(f"The people behind your address re-read {done:,} tokens in the last minute; this would "
                        f"re-read {tokens:,} more (the limit for one address is {limit:,} a minute, {PER_ADDRESS} x "
                        f"KV_ARENA_REREAD_TOKENS_PER_MINUTE). Wait {max(1, round(wait))} s, or keep the method.")


@dataclass
class Reread:
    """One re-read charged to a visitor: its tokens, and when it ended (when it began, until then)."""

    tokens: int
    at: float


class RereadBook:
    """Each visitor's re-reads of the last minute, under one lock. A re-read's minute runs from its
    end: a history that takes longer than a minute to re-read (a slow CPU) still holds its visitor
    back for a minute after it, so the next one waits and another visitor's turn comes first."""

    def __init__(self) -> None:
        self.recent: dict[str, list[Reread]] = {}
        self.lock = threading.Lock()

    def after_fork(self) -> None:
        self.lock = threading.Lock()

    def charge(self, visitor: str, check: Callable[[list[tuple[float, int]]], int], now: float | None = None,
               dry: bool = False, person: str | None = None, address_limit: int | None = None) -> Reread:
        """``check`` (given the re-reads of the last minute of ``person``, default ``visitor``, as
        (time, tokens)) says how many tokens a re-read costs, or refuses it; what it allows is charged
        at once (``dry``: only checked, for a history taken now, charged by the turn that re-reads it).
        ``address_limit``: the tokens everyone behind ``visitor`` may re-read in a minute together.
        Call :meth:`ended` with what it returns once the re-read is done."""
        now = time.monotonic() if now is None else now
        key = person or visitor
        with self.lock:  # checked and charged together: a burst of requests is counted whole
            for gone in [v for v, rs in self.recent.items() if all(now - r.at >= WINDOW_S for r in rs)]:
                del self.recent[gone]  # people idle for a minute are forgotten
            recent = [r for r in self.recent.get(key, []) if now - r.at < WINDOW_S]
            charged = Reread(check([(r.at, r.tokens) for r in recent]), now)
            if address_limit is not None:
                _within_address(self._address_recent(visitor, now), charged.tokens, address_limit, now)
            if not dry:
                self.recent[key] = recent + [charged]
            return charged

    def charge_person(self, visitor: str, client: str | None, per_minute: int,
                      check: Callable[[list[tuple[float, int]]], int], dry: bool = False) -> Reread:
        """:meth:`charge` to the person ``client`` behind ``visitor`` (:func:`person_of`), everyone
        behind the address together held to :data:`PER_ADDRESS` x ``per_minute``."""
        return self.charge(visitor, check, dry=dry, person=person_of(visitor, client),
                           address_limit=PER_ADDRESS * per_minute)

    def _address_recent(self, visitor: str, now: float) -> list[Reread]:
        return [r for k, rs in self.recent.items() if k == visitor or k.startswith(visitor + "|")
                for r in rs if now - r.at < WINDOW_S]

    def ended(self, reread: Reread, now: float | None = None) -> None:
        """The re-read is done (or failed): its minute starts now."""
        with self.lock:
            reread.at = time.monotonic() if now is None else now
