"""Blind battles: the full cache and one method answer the same turn (a Compare of the two, so
both run on the same input, one after the other), shown as A and B in a random order; a vote
reveals which was which. A follow-up continues both conversations: the conversation so far is run
again with the new question, the method answering it from the cache it compressed (the full
cache's earlier turns come from the session's reference cache).

The rules (one vote per battle, a vote only from the client shown the battle, an expiry, and
rates per visitor, never per cookie: a script minting a cookie per battle is still one visitor,
``service.visitors``) are checked against the database, so they hold across replicas; each
refusal is one line. Nothing sent before the vote names the method, its budget or the side (the
progress is one neutral line), and a battle only draws methods that compress its input: one built
around a streamed video's cap (InfiniPot-V) holds a picture whole, and battles do not stream.

Where sign-in is required (:func:`require_login`: on a Space by default), a vote keeps the Hugging
Face account that cast it; the leaderboard counts those only, and the signed-out votes apart.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import uuid
from dataclasses import dataclass, field, replace

from kv_arena import backends

from ...errors import UserError
from ...runtime.vision_tokens import check_runs_on
from ..current import current_app
from ..inputs import Prepared, Settings
from ..methods import HOLDS_ALL, stacks_of, title_of
from ..model_pool import Progress, get_model, silent
from ..plan import plan_turn
from ..scenes import media_hint
from ..sessions import Session
from ..turns import compare
from .schema import battles as battle_table, votes as vote_table
from .store import VotesUnavailable, VoteStore, now
from .views import CHOICES, Battle, Reveal

LEVELS = (0.1, 0.2, 0.3, 0.5)  # the budgets a battle draws from (the leaderboard's levels)
THREADS_PER_SESSION = 8  # blind conversations a session may continue (the newest)


def expire_s() -> float:
    """A battle takes votes and follow-ups this long after it was shown (``KV_ARENA_BLIND_EXPIRE_S``)."""
    return float(os.environ.get("KV_ARENA_BLIND_EXPIRE_S", 3600))


def battles_per_minute() -> int:
    return int(os.environ.get("KV_ARENA_BLIND_BATTLES_PER_MINUTE", 10))


def votes_per_minute() -> int:
    return int(os.environ.get("KV_ARENA_BLIND_VOTES_PER_MINUTE", 20))


def require_login() -> bool:
    """Whether only signed-in visitors' votes count on the leaderboard (``KV_ARENA_BLIND_REQUIRE_LOGIN``;
    default on where ``SPACE_ID`` is set, i.e. on a Hugging Face Space, whose OAuth signs them in)."""
    given = os.environ.get("KV_ARENA_BLIND_REQUIRE_LOGIN", "").strip().lower()
    if given in ("1", "true", "yes", "on"):
        return True
    if given in ("0", "false", "no", "off"):
        return False
    return bool(os.environ.get("SPACE_ID"))


NEUTRAL = "Answering… (two answers, one after the other)"  # the only progress line before the vote


def store() -> VoteStore:
    """This application's votes store (opened on first use with ``KV_ARENA_DB_URL``)."""
    return current_app().votes.get()


def open_votes(url: str | None = None) -> VoteStore:
    """Open (or reopen on ``url``) the votes store now, migrating it: ``app.py`` at start, so bad
    settings are one line before anything is served (the operator's: where the database is)."""
    try:
        return current_app().votes.open(url)
    except VotesUnavailable as exc:
        raise VotesUnavailable(exc.detail) from None


@dataclass
class Thread:
    """A blind conversation this session may continue: its turns, method and budget, last battle."""

    turns: list[Prepared]
    method: str
    budget: float
    settings: Settings
    last: str = ""
    ids: list[str] = field(default_factory=list)


def _who(client: str | None, session: Session) -> str:
    """The id a battle's rows are owned by: the client's cookie id, or without one its session."""
    return client or f"session:{session.id}"


def _visitor(visitor: str | None, session: Session | None, who: str) -> str:
    """What the rates count by: the visitor's key (its address, ``service.visitors``), else the
    session's visitor, else (a direct call with neither) the row owner itself."""
    return visitor or (session.visitor_key if session is not None else who)


def _check_rate(db: VoteStore, column, key: str, limit: int, what: str) -> None:
    if limit > 0 and db.recent(column, key, 60) >= limit:
        raise UserError(f"At most {limit} {what} a minute per visitor: wait a moment and try again.")


def may_draw(cls) -> bool:
    """Whether a battle may draw the method: budgeted, not the full cache, and not built around a
    streamed video's cap (``cap_replaces_budget``: InfiniPot-V compresses video frames as they
    stream, and holds a picture whole, 1.00x; battles do not stream), so no battle is full
    against full."""
    return cls.uses_budget and not cls.is_reference and not cls.cap_replaces_budget


def drawable() -> list[str]:
    """The methods a battle may draw (:func:`may_draw`), then SnapKV on each quantised store (FP8,
    INT4: a store alone takes no budget, so it is met here through the stack, which does)."""
    return backends.names_where(may_draw) + [s for s in stacks_of() if may_draw(backends.backend_class(s))]


def battle_methods() -> list[tuple[str, str]]:
    """(name, title) of each method a battle may draw, whatever the model (:func:`runnable` narrows)."""
    return [(name, title_of(name)) for name in drawable()]


def runnable(model: str, settings: Settings, progress: Progress = silent) -> list[str]:
    """The methods a battle may draw (:func:`may_draw`) that run on ``model`` (a method needing a
    CLS token, say, does not)."""
    loaded = get_model(model, progress)
    names = []
    for name in drawable():
        try:
            check_runs_on(loaded.model, plan_turn(settings, name, streamed=False).backend)
        except UserError:
            continue
        names.append(name)
    return names


DRAW = "any"  # a method drawn at random: "random" names Random eviction, a method like any other


def _pick(choice, drawn: list, what: str, shown, draw: str = DRAW) -> object:
    """``choice`` if among ``drawn`` (or drawn at random for None, "" or ``draw``), else one line."""
    if choice in (None, "", draw):
        return secrets.choice(drawn)
    if choice not in drawn:
        raise UserError(f"The {what} must be one of {', '.join(map(shown, drawn))}, or {draw} to draw one; "
                        f"got {str(choice)[:40]!r}.")
    return choice


def _budget(value) -> float | None:
    if value in (None, "", "random"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"The budget must be one of {', '.join(map(str, LEVELS))} or random; got {str(value)[:40]!r}.") from None
    return next((level for level in LEVELS if abs(level - number) < 1e-9), number)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _answer_s(metrics) -> float:
    return metrics.ttft_s + metrics.decode_s


def start(session: Session, settings: Settings, prepared: Prepared, method=None, budget=None,
          client: str | None = None, follow: str = "", progress: Progress = silent,
          visitor: str | None = None) -> Battle:
    """A new battle (``follow`` empty) or the next turn of the one ``follow`` names: both answers
    run, the battle is written, and the answers come back as A and B in a random order. ``visitor``
    (``Visitor.key``) is what the rate counts by; ``client`` (the cookie) owns the battle."""
    db = store()
    raw = _who(client, session)
    who, visits = db.client(raw), db.client(_visitor(visitor, session, raw))
    _check_rate(db, battle_table.c.visitor, visits, battles_per_minute(), "battles")
    drawn: list[str] = []
    if follow:
        thread = _thread_to_continue(session, db, follow, who, prepared)
        turns = thread.turns + [prepared]
    else:
        if not (prepared.message.images or prepared.message.videos):
            raise UserError("Ask about a picture or a video: attach one (or click an example).")
        chosen = _budget(budget)
        level = _pick(chosen, list(LEVELS), "budget", str, draw="random")
        base = replace(settings, budget=level)
        drawn = runnable(settings.model, base, progress)
        picked = _pick(method, drawn, "method", str)
        drawn = [n for n in drawn if n != picked] if method in (None, "", DRAW) else []
        thread = Thread([], picked, level, replace(base, method=picked))
        turns = [prepared]
    thread, full, own = _answers(session, thread, turns, drawn, progress)
    full_side = secrets.choice("AB")
    a, b = (full.text, own.text) if full_side == "A" else (own.text, full.text)
    battle_id = uuid.uuid4().hex
    db.add_battle({
        "id": battle_id, "thread": thread.ids[0] if thread.ids else battle_id, "turn": len(turns),
        "model": settings.model, "method": thread.method, "budget": thread.budget,
        "kv_fraction": own.metrics.kv_bytes_prefill / max(1, full.metrics.kv_bytes_prefill),
        "full_kv_bytes": full.metrics.kv_bytes_prefill, "method_kv_bytes": own.metrics.kv_bytes_prefill,
        "full_s": _answer_s(full.metrics), "method_s": _answer_s(own.metrics), "full_side": full_side,
        "hash_a": _digest(a), "hash_b": _digest(b), "truth": own.truth, "full_right": full.right,
        "method_right": own.right, "client": who, "visitor": visits})
    _remember(session, replace(thread, turns=turns, last=battle_id, ids=thread.ids + [battle_id]))
    return Battle(battle_id, len(turns), a, b, media_hint(settings.model, turns[:1]))


def neutral(progress: Progress) -> Progress:
    """``progress`` saying only :data:`NEUTRAL`: the run's own lines name the method ("Prefilling
    with VL-Cache...") and its steps tell one method from another (MPIC's "Storing the KV...")."""
    return lambda fraction, text: progress(0.3, NEUTRAL)


def _answers(session: Session, thread: Thread, turns: list[Prepared], drawn: list[str],
             progress: Progress) -> tuple[Thread, object, object]:
    """The full cache's answer and the method's to the last turn. A method that compressed nothing
    on this input (held the whole cache) makes no battle: another is drawn from ``drawn`` (a
    random draw), else it is refused in one line."""
    while True:
        progress(0.3, NEUTRAL)
        views = list(compare(session, thread.settings, [thread.method], turns, neutral(progress)))
        if not views or not views[-1].done or len(views[-1].runs[-1].turns) < len(turns):
            raise UserError("The battle was stopped before both answers were complete; nothing was recorded.")
        full, own = views[-1].runs[0].turns[-1], views[-1].runs[-1].turns[-1]
        if own.metrics.kv_bytes_prefill < HOLDS_ALL * full.metrics.kv_bytes_prefill:
            return thread, full, own
        if not drawn:
            title = title_of(thread.method)
            raise UserError(f"{title} held the whole cache on this input (it compressed nothing), so there is "
                            "nothing to tell apart: pick another method; nothing was recorded.")
        method = secrets.choice(drawn)
        drawn = [n for n in drawn if n != method]
        thread = replace(thread, method=method, settings=replace(thread.settings, method=method))


def _thread_to_continue(session: Session, db: VoteStore, follow: str, who: str, prepared: Prepared) -> Thread:
    """The blind conversation a follow-up continues: this session's, its last turn voted, not expired."""
    threads = getattr(session, "blind", {})
    thread = next((t for t in threads.values() if t.last == follow), None)
    if thread is None:
        raise UserError("No battle to continue by that id in this session: leave the battle empty for a new one "
                        "(a follow-up continues the last turn of a battle this session played).")
    row = db.battle(follow)
    if row is None or row["client"] != who:
        raise UserError("That battle is not this client's; start a new one.")
    _check_fresh(row)
    if db.vote_of(follow) is None:
        raise UserError("Vote on this battle's answers first; then ask a follow-up.")
    if prepared.message.images or prepared.message.videos:
        raise UserError("A follow-up is text only: it asks about the same picture or video (start a new battle for "
                        "another).")
    return thread


def _remember(session: Session, thread: Thread) -> None:
    threads = session.blind
    threads[thread.ids[0]] = thread
    while len(threads) > THREADS_PER_SESSION:
        threads.pop(next(iter(threads)))


def _check_fresh(row: dict) -> None:
    if (now() - row["created_at"]).total_seconds() > expire_s():
        minutes = expire_s() / 60
        raise UserError(f"This battle expired (votes and follow-ups are taken for {minutes:g} minutes): start a new one.")


def checked_choice(choice) -> str:
    """"A", "B" or "same" (any case), else one line."""
    if choice is None or (isinstance(choice, str) and not choice.strip()):
        raise UserError("Pick A is better, B is better or The same, then vote.")
    canonical = {c.lower(): c for c in CHOICES}.get(str(choice).strip().lower()) if isinstance(choice, str) else None
    if canonical is None:
        raise UserError(f'The vote must be "A", "B" or "same"; got {str(choice)[:40]!r}.')
    return canonical


def vote(battle_id, choice, client: str | None, session: Session | None = None, visitor: str | None = None,
         account: str | None = None) -> Reveal:
    """Record ``choice`` on the battle and reveal it; refused in one line: another client's or an
    unknown battle, one expired or already voted, a visitor (or an account) voting too fast.
    ``account``: the Hugging Face username signed in (None: signed out), stored salted; where
    sign-in is required only such votes count on the leaderboard (the others are kept apart)."""
    if battle_id is None or (isinstance(battle_id, str) and not battle_id.strip()):
        raise UserError("Ask a question first (with a picture or a video): then vote on its two answers.")
    choice = checked_choice(choice)
    if not isinstance(battle_id, str) or not re.fullmatch(r"[0-9a-f]{32}", battle_id.strip()):
        raise UserError("Name a battle by the id /blind returned (32 hex digits).")
    battle_id = battle_id.strip()
    db = store()
    raw = client or (f"session:{session.id}" if session is not None else "")
    who, visits = db.client(raw), db.client(_visitor(visitor, session, raw))
    signed = db.client(f"account:{account}") if account else None
    _check_rate(db, vote_table.c.visitor, visits, votes_per_minute(), "votes")
    if signed is not None:  # one account from many addresses is still one voter
        _check_rate(db, vote_table.c.account, signed, votes_per_minute(), "votes")
    row = db.battle(battle_id)
    if row is None or row["client"] != who:  # the same line either way: ids of others' battles tell nothing
        raise UserError("You can vote only on a battle you were shown (this client, this battle id).")
    _check_fresh(row)
    verdict = "same" if choice == "same" else "full" if choice == row["full_side"] else "method"
    right = vote_right(verdict, row["full_right"], row["method_right"])
    if not db.add_vote({"battle_id": battle_id, "choice": choice, "verdict": verdict, "right": right, "client": who,
                        "visitor": visits, "account": signed}):
        raise UserError("This battle already has its vote: one vote per battle.")
    return Reveal(battle_id, choice, verdict, row["full_side"], row["method"], title_of(row["method"]),
                  row["budget"], row["full_kv_bytes"], row["method_kv_bytes"], row["kv_fraction"], row["full_s"],
                  row["method_s"], row["turn"], row["truth"], row["full_right"], row["method_right"], right,
                  counted=signed is not None or not require_login())


def vote_right(verdict: str, full_right: bool | None, method_right: bool | None) -> bool | None:
    """Whether a vote agrees with the truth: "same" when both answers are equally right, else the
    right one preferred; None where the scene is not known."""
    if full_right is None or method_right is None:
        return None
    if full_right == method_right:
        return verdict == "same"
    return verdict == ("full" if full_right else "method")


__all__ = ["LEVELS", "NEUTRAL", "Thread", "VotesUnavailable", "battle_methods", "checked_choice", "expire_s",
           "may_draw", "neutral", "open_votes", "require_login", "runnable", "start", "store", "vote", "vote_right"]
