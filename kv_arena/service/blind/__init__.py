"""The "Can you tell?" tab's engine side: blind battles of the full cache against a method
(:mod:`.battles`), the votes database (:mod:`.store`, :mod:`.schema`, Alembic's ``migrations/``),
the leaderboard (:mod:`.board`) and its interval (:mod:`.wilson`, a pure function)."""

from .battles import LEVELS, expire_s, open_votes, runnable, start, vote, vote_right
from .board import leaderboard
from .store import VoteHolder, VoteStore, VotesUnavailable, salted
from .views import CHOICES, Battle, BoardRow, Reveal
from .wilson import wilson

__all__ = ["CHOICES", "LEVELS", "Battle", "BoardRow", "Reveal", "VoteHolder", "VoteStore", "VotesUnavailable",
           "expire_s", "leaderboard", "open_votes", "runnable", "salted", "start", "vote", "vote_right", "wilson"]
