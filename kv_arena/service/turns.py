"""A chat turn and a comparison: each loads the model in the app's process, then runs as a GPU
function (:mod:`.zerogpu`) that takes the session's state and hands the new one back."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace

import torch

from kv_arena import backends

from ..errors import UserError
from ..mpic.linking import Linker
from ..runtime.generate import Conversation, agreement, loyal
from ..runtime.inputs import Message
from ..runtime.vision_tokens import check_runs_on
from .current import current_app
from .inputs import MAX_FRAMES, Prepared, Settings, request_seconds
from .model_pool import Progress, free_memory, get_model, silent
from .mpic import reuse_summary, store_media
from .plan import Plan, plan_turn
from .rereads import TurnCost, check_switch, reread_cap, tokens_per_minute
from .sessions import Session, stopping
from .state import ChatState, Reference, ReferenceCache, arrive, depart
from .scenes import is_right, judged
from .store import media_store
from .streamed import joined_layout, stream_media, with_stream
from .view_types import ChatView, CompareRun, CompareTurn, CompareView, ProgressNote, ReferenceView, SwitchNote
from .views import kept_visuals, layer_figures, meters
from .zerogpu import gpu_function, on_gpu

log = logging.getLogger(__name__)
MAX_COMPARE = 4
CACHE_FREED = "This chat's cache was freed; your next message starts a new conversation."
ROLLED_BACK = "The conversation is as it was before this message."


def _reference_view(reference: Reference | None, cached: bool) -> ReferenceView | None:
    if reference is None:
        return None
    return ReferenceView(reference.text, reference.metrics, reference.layers, cached)


@dataclass(frozen=True)
class Handoff:
    """A GPU function's last yield: its last view and the state it hands back to the session."""

    view: ChatView | CompareView
    state: ChatState | ReferenceCache


class CacheLost(UserError):
    """The GPU ran out of memory mid-turn: the chat's cache goes (a copy would need that memory again)."""


def _guarded(run: Iterator, chat: bool) -> Iterator:
    """Out-of-memory and unexpected failures become a UserError of one line (inside the GPU
    function, so what crosses back from a ZeroGPU worker is a plain message). Out of memory, a
    chat's cache is dropped (:class:`CacheLost`); any other failure mid-turn is rolled back by
    :func:`chat_turn` (the conversation as it was before the message)."""
    try:
        yield from run
    except UserError:
        raise
    except torch.OutOfMemoryError:
        free_memory()
        lost, after = (CacheLost, f" {CACHE_FREED}") if chat else (UserError, "")
        raise lost("Out of GPU memory: use fewer images or frames, a lower budget or fewer new tokens." + after) from None
    except Exception as exc:
        # one line in the log (a failure on a visitor's input is no bug of the server's), one for the user
        log.warning("the model failed on this input: %s: %s", exc.__class__.__name__, _one_line(exc))
        after = f" {ROLLED_BACK}" if chat else ""
        raise UserError(f"The model failed on this input ({exc.__class__.__name__}: {_one_line(exc)}).{after}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:200]


def _relay(session: Session, views: Iterator,
           progress: Progress) -> Iterator[ProgressNote | ChatView | CompareView | Handoff]:
    """A GPU function's yields, in the caller: progress goes to ``progress`` and on (so a caller
    can stop between the chunks of a long prefill), views go on."""
    try:
        for view in views:
            if isinstance(view, ProgressNote):
                progress(view.fraction, view.text)
            yield view
    except CacheLost:
        session.new_chat()
        raise


def _chat_seconds(state: ChatState, plan: Plan, prepared: Prepared, session_id: str) -> float:
    answers = 1 if plan.is_reference else 2  # the method's and the full cache's reference
    replay = len(state.history) if not state.references.results else 0  # a reference may replay the chat
    reread = len(state.history) if not state.continues(plan.settings) and state.rereadable(plan.settings) else 0
    return request_seconds(plan.settings, prepared, answers + plan.reuses_media) + 5 * (replay + reread)


def chat_turn(session: Session, settings: Settings, prepared: Prepared, progress: Progress = silent,
              shown: list[tuple[str, int, str]] | None = None) -> Iterator[ChatView | ProgressNote]:
    """Answer one message, yielding a :class:`ChatView` after every token: the answer so far, its
    meters and per-layer figures, the full cache's reference (None for the full cache itself), and
    once done the agreement with the reference (answer tokens, end-of-turn left out), the kept
    visual tokens, and the true answer and right/wrong when the scene is one the app drew
    (:mod:`.scenes`; None otherwise).

    ``shown`` is the transcript of the chat the message was sent after (``Session.transcript``'s
    form): when it is not the session's conversation, that conversation ends and a new one starts,
    so what a caller sees and what the model remembers agree (None: continue it).

    The model loads here, in the app's process (on ZeroGPU: on the CPU, moved to the GPU inside
    each GPU call); the turn itself runs in :func:`chat_on_gpu`, which hands back the new state.

    Between the chunks of a streamed prefill it yields a :class:`ProgressNote`: a caller that stops
    iterating there (a client gone) stops the prefill. A turn that fails (a UserError, the model's
    failure said in one line) leaves the conversation as it was before the message; out of
    memory, its cache is freed instead."""
    plan = plan_turn(settings)  # bad parameters, or a cap the method cannot hold, fail before any model work
    check_runs_on(get_model(settings.model, progress).model, plan.backend)  # before any GPU call
    if shown is not None and shown != session.transcript:
        session.new_chat()
    chat = session.chat
    reread = None
    if not chat.continues(settings) and chat.rereadable(settings):  # a switch: what it re-reads is bounded
        context = get_model(settings.model).max_context
        per_minute = tokens_per_minute(on_gpu(get_model(settings.model)))
        reread = current_app().rereads.charge_person(session.visitor_key, session.client, per_minute, lambda recent:
                                                     check_switch(chat.costs, recent, type(plan.backend), context=context,
                                                                  full_cache=plan.is_reference, per_minute=per_minute))
    session.use_model(settings.model)
    session.stop_requested = False
    before = session.chat.rollback_point()
    try:
        yield from _answer(session, plan, prepared, progress)
    except CacheLost:
        raise  # out of memory: the cache went (_relay)
    except UserError:
        session.chat = before.rolled_back(get_model(settings.model).device)
        raise
    finally:
        if reread is not None:  # its visitor's minute runs from here
            current_app().rereads.ended(reread)


def _answer(session: Session, plan: Plan, prepared: Prepared,
            progress: Progress) -> Iterator[ChatView | ProgressNote]:
    """:func:`chat_turn`'s GPU call and what it hands back to the session."""
    for view in _relay(session, chat_on_gpu(session.chat, plan, prepared, session.id), progress):
        if isinstance(view, Handoff):
            session.chat = view.state  # the same object when the GPU function ran in this process
            view = view.view
            session.visuals = view.visuals
            earlier = [] if view.new_chat else session.transcript
            session.transcript = earlier + [(prepared.message.text, len(prepared.files), view.text)]
            if plan.reuses_media:
                session.last_mpic = (plan.settings, prepared)
        yield view


@gpu_function(duration=_chat_seconds)
def chat_on_gpu(state: ChatState, plan: Plan, prepared: Prepared,
                session_id: str) -> Iterator[ProgressNote | ChatView | Handoff]:
    """One chat turn as a pure function: yields progress and views; the last is a :class:`Handoff`
    with the chat after this turn (the same object when run in-process)."""
    yield from _guarded(_turn(state, plan, prepared, session_id), chat=True)


def _turn(state: ChatState, plan: Plan, prepared: Prepared,
          session_id: str) -> Iterator[ProgressNote | ChatView | Handoff]:
    settings = plan.settings
    loaded = get_model(settings.model)  # loaded by the caller; a worker forked before that loads it again
    state = arrive(state, loaded, session_id)
    reuses = plan.reuses_media
    note = ""
    if reuses:
        yield ProgressNote(0.3, "Storing the KV of the media...")
        note = store_media(session_id, loaded, prepared)
    new_chat, switch = not state.continues(settings), None
    if new_chat:  # the cache was built by another method or model: it cannot be continued
        linker = Linker(media_store(), session_id) if reuses else None  # without it MPIC is the full cache
        fresh = ChatState(Conversation(loaded, plan.backend, linker=linker), settings.cache_key,
                          references=state.references)
        if state.rereadable(settings):  # the same conversation, now held by this method
            switch = yield from _reread(state, fresh.conv, plan, session_id)
            if state.conv is not None and state.conv.backend.is_reference:  # the full cache's chat: the reference from here on
                state.references.adopt(state.conv, settings.generation + tuple(p.key for p in state.history))
            fresh.history, fresh.answers, fresh.costs, new_chat = state.history, state.answers, state.costs, False
        state = fresh
    history = state.history + [prepared]
    reference, cached = None, False
    if not plan.is_reference and not _beyond_one_prompt(history):
        yield ProgressNote(0.4, "Full-cache reference for this input...")
        reference, cached = state.references.get(loaded, settings, history)
    conv = state.conv
    yield ProgressNote(0.7, f"Prefilling with {conv.backend.title}...")
    if reuses:
        conv.backend.reset_report()  # a prompt without stored media must not show the last one's reuse
    media = next((p.media for p in reversed(history) if p.media), "")  # the scene the chat is about
    message, stream, parts, first_part = prepared.message, None, [], len(conv.layouts)
    if settings.streamed and (message.images or message.videos):
        try:
            stream, parts = yield from stream_media(conv, message, plan)
        except UserError as exc:  # refused mid-stream (a cap too small, past the context): the cache holds a part
            raise UserError(f"{exc} {ROLLED_BACK}") from None
        message = Message(message.text, media_first=message.media_first)  # the question, on the capped cache
    before = conv.seen  # what the conversation fed before this prompt (a streamed media's chunks included)
    for update in conv.stream(message, **plan.generation, should_stop=lambda: stopping(session_id)):
        metrics = meters(update.metrics)
        view = ChatView(update.text, update.done, new_chat, conv.backend.title,
                        with_stream(metrics, stream) if stream else metrics, layer_figures(conv),
                        _reference_view(reference, cached), stream, switch=switch,
                        is_reference=conv.backend.is_reference, context_tokens=before + update.metrics.prompt_tokens,
                        note=conv.backend.report.note or "")
        if not update.done:
            yield view
            continue
        if stream:
            _one_layout(conv, first_part, parts)
        state.history, state.answers = history, state.answers + [update.token_ids]
        fed = update.metrics.prompt_tokens + len(update.token_ids) + (stream.tokens if stream else 0)
        state.costs = state.costs + [TurnCost(fed, settings.cap_bytes if stream else None)]
        view = marked(view, media, prepared.message.text)
        if reference is not None:
            view = replace(view, agreement=agreement(update.token_ids, reference.token_ids, loaded.adapter.eos_ids))
        elif not stopping(session_id):  # a full-cache answer is itself the reference
            key = settings.generation + tuple(p.key for p in history)
            state.references.store(key, Reference(update.text, update.token_ids, view.metrics, view.layers))
        if reuses:
            reuse = reuse_summary(state, conv, update.metrics.prompt_tokens, note)  # adds to state.reused
            highlight = [torch.tensor(sorted(p), dtype=torch.long)[None] for p in state.reused]
            view = replace(view, mpic=reuse, visuals=kept_visuals(conv, history, highlight, "reused"))
            media_store().flush()  # what this call stored reaches the app's process through the disk
        else:
            view = replace(view, visuals=kept_visuals(conv, history))
        yield Handoff(view, depart(state))


def _reread(state: ChatState, conv: Conversation, plan: Plan,
            session_id: str) -> Generator[ProgressNote, None, SwitchNote]:
    """The conversation so far fed to ``conv``, the new method's: each turn's media and text under
    the new settings (streamed under the cap when there is one), then its answer as it was given
    (``Conversation.replay``); returns what that cost."""
    start, tokens, turns = time.perf_counter(), 0, len(state.history)
    costs = state.costs if len(state.costs) == turns else [TurnCost(0)] * turns
    for i, (prepared, answer, cost) in enumerate(zip(state.history, state.answers, costs)):
        yield ProgressNote(0.3 + 0.1 * i / turns, f"{conv.backend.title} re-reads turn {i + 1} of {turns}...")
        if plan.reuses_media:
            store_media(session_id, conv.loaded, prepared)
        message, first_part, parts = prepared.message, len(conv.layouts), None
        # a turn streamed under a cap is streamed again (under the new cap, else its own), never prefilled whole
        if (plan.streamed or cost.cap_bytes is not None) and (message.images or message.videos):
            cap = reread_cap(cost, plan.cap_bytes, plan.backend.streams_under_cap and not plan.is_reference)
            stream, parts = yield from stream_media(conv, message, replace(plan, cap_bytes=cap))
            tokens += stream.tokens
            message = Message(message.text, media_first=message.media_first)
        metrics = conv.replay(message, answer, question_after=plan.settings.question_after)
        tokens += metrics.prompt_tokens + metrics.new_tokens
        if parts is not None:
            _one_layout(conv, first_part, parts)
    return SwitchNote(conv.backend.title, turns, tokens, time.perf_counter() - start)


def _one_layout(conv: Conversation, first_part: int, parts: list[int | None]) -> None:
    """A streamed turn's parts as one layout, as a one-shot prompt has (the overlay pairs layouts
    with messages)."""
    conv.layouts[first_part:] = [joined_layout(conv.layouts[first_part:], parts)]


def _beyond_one_prompt(history: list[Prepared]) -> bool:
    """A chat with a video longer than one prompt may hold: no full-cache reference (it would
    prefill the whole video at once, which streaming under a cap is there to avoid)."""
    return any(len(v.frames) > MAX_FRAMES for p in history for v in p.message.videos)


def compare(session: Session, settings: Settings, methods: list[str], turns: Prepared | list[Prepared],
            progress: Progress = silent) -> Iterator[CompareView]:
    """The full cache, then each method, one after another (never interleaved: honest timings),
    each through the whole conversation ``turns`` (the first question with its media, then any
    follow-ups) on its own compressed cache."""
    methods = [methods] if isinstance(methods, str) else methods  # one name sent through the API
    turns = [turns] if isinstance(turns, Prepared) else list(turns)
    methods = [m for m in dict.fromkeys(methods or []) if not backends.is_reference(m)]
    if not 1 <= len(methods) <= MAX_COMPARE:
        raise UserError(f"Pick 1 to {MAX_COMPARE} methods to compare with the full cache (got {len(methods)}).")
    if not turns:
        raise UserError("The message is empty: type a question or attach an image or a video.")
    plans = [plan_turn(settings, m, streamed=False) for m in methods]  # bad parameters fail before any model work
    return _compare(session, settings, plans, turns, progress)


def _compare(session: Session, settings: Settings, plans: list[Plan], turns: list[Prepared],
             progress: Progress) -> Iterator[CompareView]:
    loaded = get_model(settings.model, progress)
    for plan in plans:  # a method this model's vision tower cannot serve: before any GPU call
        check_runs_on(loaded.model, plan.backend)
    session.use_model(settings.model)
    session.stop_requested = False
    views = compare_on_gpu(session.chat.references, settings, plans, turns, session.id)
    for view in _relay(session, views, progress):
        if isinstance(view, ProgressNote):
            continue
        if isinstance(view, Handoff):
            session.chat.references = view.state
            view = view.view
        yield view


def _compare_seconds(references: ReferenceCache, settings: Settings, plans: list[Plan], turns: list[Prepared],
                     session_id: str) -> float:
    runs = (1 + len(plans) + any(p.reuses_media for p in plans)) * len(turns)
    return request_seconds(settings, turns[0], runs=runs)


@gpu_function(duration=_compare_seconds)
def compare_on_gpu(references: ReferenceCache, settings: Settings, plans: list[Plan], turns: list[Prepared],
                   session_id: str) -> Iterator[ProgressNote | CompareView | Handoff]:
    """A comparison as a pure function: yields progress and views; the last is a :class:`Handoff`
    with the session's full-cache references, this conversation's added."""
    yield from _guarded(_compare_runs(references, settings, plans, turns, session_id), chat=False)


def marked(turn: ChatView | CompareTurn, media: str, question: str) -> ChatView | CompareTurn:
    """A turn's answer with its true answer and right/wrong where the scene is known (else None),
    or why a question about a known scene is not marked."""
    truth, unmarked = judged(media, question)
    return replace(turn, question=question, truth=truth, right=is_right(turn.text, truth), unmarked=unmarked)


def _compare_runs(references: ReferenceCache, settings: Settings, plans: list[Plan], turns: list[Prepared],
                  session_id: str) -> Iterator[ProgressNote | CompareView | Handoff]:
    """Views of the runs so far (the full cache first), each answer marked right or wrong where the
    scene is known and its agreement with the full cache's (end-of-turn left out)."""
    loaded = get_model(settings.model)
    references = arrive(references, loaded, session_id)
    eos = loaded.adapter.eos_ids
    media = next((t.media for t in turns if t.media), "")
    if any(p.reuses_media for p in plans):
        yield ProgressNote(0.2, "Storing the KV of the media...")
        store_media(session_id, loaded, turns[0])
        media_store().flush()
    answers, full = [], []
    for i, prepared in enumerate(turns):
        yield ProgressNote(0.3, f"Full cache, turn {i + 1}...")
        reference, cached = references.get(loaded, settings, turns[:i + 1])
        answers.append(reference)
        full.append(marked(CompareTurn(prepared.message.text, reference.text, reference.metrics, reference.layers,
                                       1.0, True, cached, done=True), media, prepared.message.text))
    reference_method = backends.backend_class(backends.reference_name())
    runs = [CompareRun(reference_method.name, reference_method.title, tuple(full), done=True)]
    yield CompareView(tuple(runs), False)
    for i, plan in enumerate(plans):
        yield ProgressNote(0.4 + 0.6 * i / len(plans), f"{plan.backend.title}...")
        linker = Linker(media_store(), session_id) if plan.reuses_media else None
        conv = Conversation(loaded, plan.backend, linker=linker)
        answered: list[CompareTurn] = []
        runs.append(CompareRun(plan.backend.name, plan.backend.title))
        for prepared, reference in zip(turns, answers):
            answered.append(CompareTurn(prepared.message.text))
            for update in conv.stream(prepared.message, **plan.generation, should_stop=lambda: stopping(session_id)):
                turn = replace(answered[-1], text=update.text, metrics=meters(update.metrics), done=update.done)
                if update.done:  # the per-layer figures once per answer: they walk every layer
                    turn = replace(marked(turn, media, prepared.message.text), layers=layer_figures(conv),
                                   agreement=agreement(update.token_ids, reference.token_ids, eos),
                                   loyal=loyal(update.text, reference.text), note=conv.backend.report.note or "")
                answered[-1] = turn
                runs[-1] = replace(runs[-1], turns=tuple(answered))
                yield CompareView(tuple(runs), False)
            if stopping(session_id):
                break
        runs[-1] = replace(runs[-1], turns=tuple(answered), visuals=kept_visuals(conv, turns[:len(answered)]),
                           done=True)
        yield CompareView(tuple(runs), False)
        if stopping(session_id):
            break
    yield Handoff(CompareView(tuple(runs), True), depart(references))
