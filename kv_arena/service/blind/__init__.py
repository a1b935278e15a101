"""The "Can you tell?" tab's engine side: blind battles of the full cache against a method
(:mod:`.battles`), the votes database (:mod:`.store`, :mod:`.schema`, Alembic's ``migrations/``),
the leaderboard (:mod:`.board`) and its interval (:mod:`.wilson`, a pure function)."""

from .battles import (DRAW, LEVELS, NEUTRAL, battle_methods, expire_s, may_draw, open_votes, require_login, runnable, start,
                      vote, vote_right)
from .board import leaderboard, signed_out_apart
from .store import VoteHolder, VoteStore, VotesUnavailable, salted
from .views import CHOICES, Battle, BoardRow, Reveal
from .wilson import wilson

__all__ = ["CHOICES", "DRAW", "LEVELS", "NEUTRAL", "Battle", "BoardRow", "Reveal", "VoteHolder", "VoteStore",
           "VotesUnavailable", "battle_methods", "expire_s", "leaderboard", "may_draw", "open_votes", "require_login", "runnable", "salted",
           "signed_out_apart", "start", "vote", "vote_right", "wilson"]
