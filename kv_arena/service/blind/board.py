"""The leaderboard: per model, method and budget level, the votes, the share "can't tell" (same,
or the compressed answer preferred) with its 95% Wilson interval, and where the scene is known the
share of votes that agree with the truth and of the method's answers that were right."""

from __future__ import annotations

from kv_arena import backends

from .battles import store
from .views import BoardRow
from .wilson import wilson


def _title(method: str) -> str:
    try:
        return backends.backend_class(method).title
    except ValueError:  # a method a later version dropped: its votes still count
        return method


def leaderboard() -> list[BoardRow]:
    rows = []
    for t in store().tallies():
        low, high = wilson(t.cant_tell, t.votes)
        rows.append(BoardRow(t.model, t.method, _title(t.method), t.budget, t.votes, t.cant_tell / t.votes, low, high,
                             t.kv_fraction, t.votes_right / t.votes_known if t.votes_known else None,
                             t.method_right / t.votes_known if t.votes_known else None))
    return rows
