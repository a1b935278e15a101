"""What a method switch may cost. A conversation another method takes over is re-read by it
(``turns._reread``): every turn's media and text again, then the answers as given. Unbounded, that
let one visitor spend a minute of CPU per six-byte message: six turns streamed from a 1000-frame
video under a cap re-read 192,162 tokens (5.9x the model's context) at every flip of the method.

So a switch is held to three rules, checked before any model work (:func:`check_switch`):
- it re-reads each turn as that turn was fed: a turn streamed under a cap is streamed again under a
  cap (the new one, else its own), never prefilled whole (:func:`reread_cap`);
- all it re-reads together stays within the model's context (what one prompt could hold);
- a chat re-reads at most KV_ARENA_REREAD_TOKENS_PER_MINUTE tokens (default: 32,768) in any minute,
  so flipping the method on every message is refused until the minute has passed.
The chat line of a switch says what it cost (tokens and seconds, ``SwitchNote``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kv_arena import backends

from ..errors import UserError

REREAD_TOKENS_PER_MINUTE = int(os.environ.get("KV_ARENA_REREAD_TOKENS_PER_MINUTE", 32_768))
WINDOW_S = 60.0


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
                 context: int, full_cache: bool, now: float | None = None, sent: bool = False) -> int:
    """The tokens a switch to ``method`` would re-read; a UserError (one line, nothing changed) when
    it may not: a streamed turn and a method that cannot stream under a cap, more tokens than the
    model's ``context``, or more than REREAD_TOKENS_PER_MINUTE with the re-reads of the last
    minute (``rereads``: (time, tokens) of this chat's earlier switches). ``sent``: the conversation is a
    history a client sent, re-read in place of the session's (said so)."""
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
    if recent and recent + tokens > REREAD_TOKENS_PER_MINUTE:
        wait = WINDOW_S - (now - min(at for at, _ in rereads if now - at < WINDOW_S))
        raise UserError(f"This chat re-read {recent:,} tokens in the last minute; {doing[0].lower() + doing[1:]} would "
                        f"re-read {tokens:,} more (the limit is {REREAD_TOKENS_PER_MINUTE:,} a minute, "
                        f"KV_ARENA_REREAD_TOKENS_PER_MINUTE). Wait {max(1, round(wait))} s, or "
                        f"{'send [] to start a new chat' if sent else 'keep the method'}.")
    return tokens


def recent_rereads(rereads: list[tuple[float, int]], tokens: int, now: float | None = None) -> list[tuple[float, int]]:
    """This chat's re-reads of the last minute, with one of ``tokens`` now."""
    now = time.monotonic() if now is None else now
    return [(at, n) for at, n in rereads if now - at < WINDOW_S] + [(now, tokens)]
