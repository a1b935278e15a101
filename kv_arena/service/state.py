"""What a session carries between GPU calls: a chat's cache and history (:class:`ChatState`) and the
full-cache references (:class:`ReferenceCache`). A GPU function takes them and hands back the new
ones; on ZeroGPU they cross processes pickled, without the model (see :mod:`.zerogpu`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kv_arena import backends

from ..mpic.linking import Linker
from ..runtime.generate import Conversation, ConversationState
from ..runtime.models import LoadedModel
from . import zerogpu
from .inputs import Prepared, Settings
from .rereads import TurnCost
from .store import media_store
from .view_types import LayerFigures, Meters
from .views import layer_figures, meters
from .zerogpu import relocate


@dataclass
class Reference:
    """The full cache's answer and meters for one input (a chat prefix or a comparison)."""

    text: str
    token_ids: list[int]
    metrics: Meters
    layers: LayerFigures


class ReferenceCache:
    """Full-cache runs keyed by (model, generation settings, messages so far), newest last.

    ``conv`` is the full-cache conversation at the state of ``conv_key`` (its
    :class:`ConversationState` while it crosses processes); a chat's next reference continues it,
    anything else replays the earlier messages on a fresh one.
    """

    size = 16

    def __init__(self) -> None:
        self.results: OrderedDict[tuple, Reference] = OrderedDict()
        self.conv: Conversation | ConversationState | None = None
        self.conv_key: tuple | None = None

    def __getstate__(self) -> dict:
        return dict(self.__dict__, conv=_portable(self.conv))

    def attach(self, loaded: LoadedModel) -> ReferenceCache:
        self.conv = _attach(self.conv, loaded, "")
        return self

    def get(self, loaded: LoadedModel, settings: Settings, history: list[Prepared]) -> tuple[Reference, bool]:
        """(reference, cached) for the last message of ``history``."""
        key = settings.generation + tuple(p.key for p in history)
        if key in self.results:
            self.results.move_to_end(key)
            return self.results[key], True
        generation = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                      "question_after": settings.question_after}
        resume, self.conv_key = self.conv_key, None  # None until this answer completes: a failure
        if self.conv is None or resume != key[:-1]:  # would leave the cache half-written
            self.conv = Conversation(loaded, backends.make_reference())
            for earlier in history[:-1]:
                self.conv.ask(earlier.message, **generation)
        update = self.conv.ask(history[-1].message, **generation)
        self.conv_key = key
        reference = Reference(update.text, update.token_ids, meters(update.metrics), layer_figures(self.conv))
        return self.store(key, reference), False

    def adopt(self, conv: Conversation | ConversationState | None, key: tuple) -> None:
        """A full-cache chat whose last answer is the reference for ``key``, taken over by another
        method: its conversation becomes the one the next reference continues (nothing recomputed)."""
        if key in self.results and conv is not None and self.conv_key != key:
            self.conv, self.conv_key = conv, key

    def store(self, key: tuple, reference: Reference) -> Reference:
        self.results[key] = reference
        while len(self.results) > self.size:
            self.results.popitem(last=False)
        return reference


def _portable(conv: Conversation | ConversationState | None) -> ConversationState | None:
    """What of ``conv`` pickles: its state without the model (weights never cross processes) or
    its linker; :func:`_attach` continues it in the process that takes it."""
    return conv.snapshot() if isinstance(conv, Conversation) else conv


def _attach(conv: Conversation | ConversationState | None, loaded: LoadedModel,
            session_id: str) -> Conversation | None:
    """``conv`` on ``loaded``, a linker to the session's media store given back if it had one."""
    if not isinstance(conv, ConversationState):
        return conv
    linker = Linker(media_store(), session_id) if conv.linked else None
    return Conversation.restore(conv, loaded, linker)


@dataclass
class ChatState:
    """What a chat carries from turn to turn (a :class:`~kv_arena.service.sessions.Session` holds one):
    the GPU function takes it and hands back the new one (it pickles without the model; see
    :mod:`kv_arena.service.zerogpu`)."""

    conv: Conversation | ConversationState | None = None  # the state while it crosses processes
    cache_key: tuple | None = None  # Settings.cache_key of the method that built ``conv``
    history: list[Prepared] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)  # the token ids of each answer, as given
    reused: list[set[int]] = field(default_factory=list)  # per layer: token indices whose KV came from the store
    references: ReferenceCache = field(default_factory=ReferenceCache)
    costs: list[TurnCost] = field(default_factory=list)  # per turn: what it fed (what a switch re-reads)

    def __getstate__(self) -> dict:
        return dict(self.__dict__, conv=_portable(self.conv))

    def continues(self, settings: Settings) -> bool:
        """Whether a message with these settings continues this chat's cache."""
        return self.conv is not None and self.cache_key == settings.cache_key

    def rereadable(self, settings: Settings) -> bool:
        """Whether another method (budget, knobs, cap) can take this conversation over by re-reading
        it: there is one, on the same model (the answers' token ids are that model's)."""
        return bool(self.history) and self.cache_key is not None and self.cache_key[0] == settings.model

    def rollback_point(self) -> ChatState:
        """This chat as it is, to go back to if a turn fails half-way: the conversation's cache
        and counters copied to the CPU (a GPU keeps one copy), the messages and the references
        shared (a turn replaces the list of messages, never edits it; a reference that failed
        half-way is recomputed)."""
        conv = None if self.conv is None else relocate(_portable(self.conv), "cpu")
        return ChatState(conv, self.cache_key, list(self.history), list(self.answers), [set(r) for r in self.reused],
                         self.references, list(self.costs))

    def rolled_back(self, device) -> ChatState:
        """This rollback point as the session's chat again, its cache on ``device``."""
        if self.conv is not None and str(device) != "cpu":
            self.conv = relocate(self.conv, device)
        return self

    def attach(self, loaded: LoadedModel, session_id: str) -> ChatState:
        self.conv = _attach(self.conv, loaded, session_id)
        self.references.attach(loaded)
        return self


def arrive(state, loaded: LoadedModel, session_id: str):
    """A state handed to a GPU function, on the model's device with its model attached."""
    state = relocate(state, loaded.device) if zerogpu.ZERO_GPU else state
    return state.attach(loaded, session_id) if isinstance(state, ChatState) else state.attach(loaded)


def depart(state):
    """A state a GPU function hands back: on the CPU on ZeroGPU (its GPU is gone after the call)."""
    return relocate(state, "cpu") if zerogpu.ZERO_GPU else state

