"""The leaderboard: per model, method and budget level, the votes, the share "can't tell" (same,
or the compressed answer preferred) with its 95% Wilson interval, and where the scene is known the
share of votes that agree with the truth and of the method's answers that were right. Where
sign-in is required (``battles.require_login``), only signed-in accounts' votes count; the others
are kept, their number shown apart (:func:`signed_out_apart`)."""

from __future__ import annotations

from ..methods import title_of
from .battles import require_login, store
from .views import BoardRow
from .wilson import wilson


def leaderboard() -> list[BoardRow]:
    rows = []
    for t in store().tallies(signed_in_only=require_login()):
        low, high = wilson(t.cant_tell, t.votes)
        # title_of: a method a later version dropped is named as stored; its votes still count
        rows.append(BoardRow(t.model, t.method, title_of(t.method), t.budget, t.votes, t.cant_tell / t.votes, low, high,
                             t.kv_fraction, t.votes_right / t.votes_known if t.votes_known else None,
                             t.method_right / t.votes_known if t.votes_known else None))
    return rows


def signed_out_apart() -> int:
    """Votes kept but not counted on the board: cast signed out where sign-in is required (0 otherwise)."""
    return store().signed_out_votes() if require_login() else 0
