"""A history a client sent that is not the session's conversation (edited, shortened, sent from
another client or after the cache was freed): the conversation is rebuilt from it, its media
included, instead of a new one starting without them.

:func:`take_history` makes the session's chat the history's turns (each message decoded and checked
as a new one is, each answer as given, tokenised), held by no method yet; the turn's method then
re-reads it before answering, as a method switch re-reads (``turns._reread``), under the same limits
(:func:`.rereads.check_switch`: the model's context, the tokens re-read per minute). Nothing is fed
here; a refusal (a file this session may not use, a history over the limits) leaves the session as it
was.
"""

from __future__ import annotations

from ..runtime.vision_tokens import check_runs_on
from .current import current_app
from .inputs import MAX_FRAMES, Prepared, Settings, prepare
from .model_pool import Progress, get_model, silent
from .plan import plan_turn
from .rereads import TurnCost, check_switch, tokens_per_minute
from .zerogpu import on_gpu
from .sessions import Session
from .state import ChatState
from .uploads import check_uploads

SENT = "sent history"  # the cache key's method of a chat no method holds yet (never a Settings' own)


def take_history(session: Session, settings: Settings, turns: list[tuple[str, list[str], str]],
                 progress: Progress = silent) -> list[Prepared]:
    """The session's conversation becomes ``turns`` ((question, files, answer) each, as a chat shows
    them), for ``settings``' method to re-read before its next answer; returns their messages. A video
    is read at most MAX_FRAMES frames (one prompt's worth). Decoding stops at the first turn that takes
    the whole past the model's context: the refusal says so in one line."""
    plan = plan_turn(settings)
    loaded = get_model(settings.model, progress)
    check_runs_on(loaded.model, plan.backend)
    for _, files, _ in turns:
        check_uploads(session, files)
    adapter, frames = loaded.adapter, min(settings.num_frames, MAX_FRAMES)
    end = adapter.tokenizer.eos_token_id
    history, answers, costs = [], [], []
    for i, (question, files, answer) in enumerate(turns):
        progress(0.05 + 0.2 * i / len(turns), f"Reading the history sent, turn {i + 1} of {len(turns)}...")
        prepared = prepare(question, files, frames)
        prompt = adapter.encode_turn(prepared.message, 0, 0, None).input_ids.shape[1]
        ids = adapter.tokens(answer) + [end]  # the answer as given, closed as a finished answer is
        history.append(prepared)
        answers.append(ids)
        costs.append(TurnCost(prompt + len(ids)))
        if sum(c.tokens for c in costs) > loaded.max_context:
            break  # check_switch refuses it: no need to decode the rest
    per_minute = tokens_per_minute(on_gpu(loaded))
    current_app().rereads.charge_person(session.visitor_key, session.client, per_minute, lambda recent: check_switch(
        costs, recent, type(plan.backend), context=loaded.max_context, full_cache=plan.is_reference, sent=True,
        per_minute=per_minute), dry=True)  # charged by the turn that re-reads it (turns.chat_turn)
    session.chat = ChatState(None, (settings.model, SENT), history, answers, references=session.chat.references,
                             costs=costs)
    session.visuals = []
    session.transcript = [(question, len(files), answer) for question, files, answer in turns]
    return history
