"""What the "Can you tell?" tab gets from the service: plain values only (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = ("A", "B", "same")


@dataclass(frozen=True)
class Battle:
    """Two answers to one turn, as A and B in a random order; nothing says which is which."""

    id: str
    turn: int
    a: str
    b: str
    hint: str = ""  # the offline model's line about media it was not made for


@dataclass(frozen=True)
class Reveal:
    """What a vote reveals: which answer was which, the method, its budget, the KV each held and
    the model's own time for each (first token and decode)."""

    battle: str
    choice: str
    verdict: str  # "full", "method" or "same"
    full_side: str
    method: str
    method_title: str
    budget: float
    full_kv_bytes: int
    method_kv_bytes: int
    kv_fraction: float
    full_s: float
    method_s: float
    turn: int
    truth: str | None = None
    full_right: bool | None = None
    method_right: bool | None = None
    right: bool | None = None  # the vote against the truth (None: no known scene)
    counted: bool = True  # on the leaderboard (False: cast signed out where sign-in is required)


@dataclass(frozen=True)
class BoardRow:
    """One leaderboard row: per model, method and budget level."""

    model: str
    method: str
    method_title: str
    budget: float
    votes: int
    cant_tell: float  # share of votes "same" or for the compressed answer
    low: float  # its 95% Wilson interval
    high: float
    kv_fraction: float  # mean KV the method really held, over the full cache's
    votes_right: float | None  # share of votes that agree with the truth (known scenes only)
    method_right: float | None  # share of its answers right (known scenes only)
