"""What the app asks of the runtime, in plain Python values: the UI (``components/``) never sees a
tensor and never imports torch.

* :class:`Session` is one browser tab: its conversation (the compressed cache carried from turn to
  turn), the media it uploaded, and its full-cache references. Nothing in it is shared.
* :func:`chat_turn` answers one message, yielding a view (answer so far, meters, per-layer figures,
  kept visual tokens at the end) after every token.
* :func:`compare` runs the full cache and up to four methods one after another on one input.
* The full-cache reference for a given input is computed once per session and reused; every view
  says whether its reference came from that cache (its timings are then from the earlier run).
* MPIC's media KV store (:func:`media_store`) is one per process, under ``KV_ARENA_KV_STORE``
  (default: ``kv-arena-mpic`` in the temp directory); each session's entries live in a namespace
  named by the server-side :attr:`Session.id` (never by anything a client sends), are stored when
  an MPIC turn adds media, listed by :func:`media_library` and dropped when the session closes or
  its model changes.

Models are shared between sessions (read-only weights); at most one hub model stays loaded.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import socket
import tempfile
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import backends

from .arena_model import arena_weights_present
from .bench import agreement
from .bench_mpic import measure_ttft
from .errors import UserError
from .generate import Conversation
from .inputs import Message
from .kv_store import KVStore
from .linking import Linker, ingest
from .media import Video, load_image, load_video
from .models import ARENA, DEFAULT_MODEL, MODELS, LoadedModel, load_model, model_spec
from .uploads import check_uploads, file_hash, forget_uploads, note_uploads, upload_dir  # noqa: F401 - the app's API
from .zerogpu import ZERO_GPU, gpu_function, relocate

log = logging.getLogger(__name__)
Progress = Callable[[float, str], None]
VIDEO_SUFFIXES = {".mp4", ".webm", ".mov", ".avi", ".mkv", ".m4v", ".mpg", ".mpeg"}
MAX_COMPARE = 4
HUB_DEFAULT = "Qwen/Qwen2-VL-2B-Instruct"

def _silent(fraction: float, text: str) -> None:
    pass


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

_MODELS: dict[str, LoadedModel] = {}
_MODEL_LOCK = threading.Lock()


def hub_reachable(timeout: float = 1.5) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def default_model() -> str:
    """``KV_ARENA_MODEL`` if set; a real hub model with a GPU and network; else the model trained here
    (it answers questions about its scenes), or a tiny random one if its weights are missing."""
    chosen = os.environ.get("KV_ARENA_MODEL")
    if chosen:
        return chosen
    if torch.cuda.is_available() and hub_reachable():
        return HUB_DEFAULT
    return ARENA if arena_weights_present() else DEFAULT_MODEL


def model_choices() -> list[tuple[str, str]]:
    """(label, name) for the model picker; hub models say that they download weights."""
    return [(f"{name} (download)" if spec.needs_download else name, name) for name, spec in MODELS.items()]


def has_random_weights(name: str) -> bool:
    return name in MODELS and model_spec(name).random_weights


def is_trained_here(name: str) -> bool:
    return name in MODELS and model_spec(name).source == "trained"


def model_description(name: str) -> str:
    return model_spec(name).description


def get_model(name: str, progress: Progress = _silent) -> LoadedModel:
    """Load (once) and return a model; one hub model at a time so a GPU holds one set of weights."""
    with _MODEL_LOCK:
        if name in _MODELS:
            return _MODELS[name]
        spec = model_spec(name)
        if not spec.small:  # free the previous large model before loading another
            for other in [n for n in _MODELS if not model_spec(n).small]:
                del _MODELS[other]
            free_memory()
        try:
            loaded = load_model(name, progress=progress)
            if not ZERO_GPU:  # on ZeroGPU the GPU exists only inside a GPU function: no forward here
                progress(0.95, "Warming up (so the first timings are not start-up costs)...")
                Conversation(loaded, backends.make_backend("full")).ask(Message("Hi"), max_new_tokens=2)
        except UserError:
            raise
        except torch.OutOfMemoryError:
            free_memory()
            raise UserError(f"Not enough memory to load {name}; pick a smaller model.") from None
        except Exception as exc:  # a broken download, a missing package: readable, never a traceback
            first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
            raise UserError(f"{name} failed to load: {exc.__class__.__name__}: {first_line}") from None
        _MODELS[name] = loaded
        return loaded


def image_tokens(name: str, side: int = 448) -> int:
    """Visual tokens the model makes of one ``side`` x ``side`` image (its processor's own resize)."""
    loaded = get_model(name)
    chunk = loaded.adapter.encode_turn(Message("", images=[Image.new("RGB", (side, side))]), 0, 0, None)
    return chunk.layout.visuals[0].length


def mpic_default_k(name: str, paper_k: int = 32) -> int:
    """MPIC-k's k for this model: the paper's 32 recomputed tokens per image (of 256 and more in
    its models), capped at a quarter of the model's tokens for a 448 px image, so a model with
    few tokens per image still reuses most of each stored image."""
    return max(1, min(paper_k, image_tokens(name) // 4))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Everything the controls decide. ``params`` holds every method's values, so a comparison
    runs each method as configured; use :meth:`make` to build it from a dict."""

    model: str = DEFAULT_MODEL
    method: str = "full"
    budget: float = 0.5
    max_new_tokens: int = 48
    num_frames: int = 8
    temperature: float = 0.0
    params: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()  # (method, ((name, value), ...))

    @classmethod
    def make(cls, params: dict[str, dict] | None = None, **fields) -> Settings:
        frozen = tuple((m, tuple(sorted(v.items()))) for m, v in sorted((params or {}).items()))
        return cls(params=frozen, **fields)

    def method_params(self, method: str) -> dict:
        return dict(dict(self.params).get(method, ()))

    def backend(self, method: str | None = None):
        """Build the chosen method (or another one, as configured); bad values -> UserError."""
        name = method or self.method
        try:
            cls = backends.backend_class(name)
            return backends.make_backend(name, budget=self.budget if cls.uses_budget else 1.0, **self.method_params(name))
        except ValueError as exc:
            raise UserError(str(exc)) from None

    @property
    def cache_key(self) -> tuple:
        """What built the chat's cache: a change here means the cache cannot be continued."""
        return self.model, self.method, self.budget, tuple(sorted(self.method_params(self.method).items()))

    @property
    def generation(self) -> tuple:
        """What else, besides the messages, decides the answer (part of a reference's key)."""
        return self.model, self.max_new_tokens, self.temperature


@dataclass
class Prepared:
    """One user message, decoded and checked before any model work."""

    message: Message
    key: str  # content hash: same text, same media bytes, same frame count -> same key
    files: list[str] = field(default_factory=list)


def prepare(text: str, files: list, num_frames: int = 8, progress: Progress = _silent) -> Prepared:
    """Decode the attached images and videos; any bad file raises a UserError naming it."""
    text = (text or "").strip()
    files = [str(f) for f in files or []]
    if not text and not files:
        raise UserError("The message is empty: type a question or attach an image or a video.")
    digest = hashlib.sha1(f"{text}\x00{num_frames}".encode())
    images, videos = [], []
    for i, path in enumerate(files):
        progress(0.05 + 0.2 * i / len(files), f"Reading {Path(path).name}...")
        if Path(path).suffix.lower() in VIDEO_SUFFIXES:
            videos.append(load_video(path, num_frames))
        else:  # anything else must be an image; load_image says so readably when it is not
            images.append(load_image(path))
        digest.update(file_hash(path).encode())
    message = Message(text, images=images, videos=videos, num_frames=num_frames)
    return Prepared(message, digest.hexdigest(), files)


def media_hint(model: str, messages: list[Prepared]) -> str:
    """A hint when a model that only answers about media gets a conversation without any."""
    if not is_trained_here(model) or any(p.message.images or p.message.videos for p in messages):
        return ""
    return (f"Hint: {model} only answers questions about its kind of scenes, a picture, several or a "
            "short video (see the Examples); without one its answer means nothing.")


# --------------------------------------------------------------------------------------------
# Per-session state
# --------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """The full cache's answer and meters for one input (a chat prefix or a comparison)."""

    text: str
    token_ids: list[int]
    metrics: dict
    layers: dict


class ReferenceCache:
    """Full-cache runs keyed by (model, generation settings, messages so far), newest last.

    ``conv`` is the full-cache conversation at the state of ``conv_key``; a chat's next reference
    continues it, anything else replays the earlier messages on a fresh one.
    """

    size = 16

    def __init__(self) -> None:
        self.results: OrderedDict[tuple, Reference] = OrderedDict()
        self.conv: Conversation | None = None
        self.conv_key: tuple | None = None

    def __getstate__(self) -> dict:
        return dict(self.__dict__, conv=_portable(self.conv))

    def attach(self, loaded: LoadedModel) -> ReferenceCache:
        _attach(self.conv, loaded, "")
        return self

    def get(self, loaded: LoadedModel, settings: Settings, history: list[Prepared]) -> tuple[Reference, bool]:
        """(reference, cached) for the last message of ``history``."""
        key = settings.generation + tuple(p.key for p in history)
        if key in self.results:
            self.results.move_to_end(key)
            return self.results[key], True
        generation = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature}
        resume, self.conv_key = self.conv_key, None  # None until this answer completes: a failure
        if self.conv is None or resume != key[:-1]:  # would leave the cache half-written
            self.conv = Conversation(loaded, backends.make_backend("full"))
            for earlier in history[:-1]:
                self.conv.ask(earlier.message, **generation)
        update = self.conv.ask(history[-1].message, **generation)
        self.conv_key = key
        reference = Reference(update.text, update.token_ids, update.metrics.to_dict(), layer_figures(self.conv))
        return self.store(key, reference), False

    def store(self, key: tuple, reference: Reference) -> Reference:
        self.results[key] = reference
        while len(self.results) > self.size:
            self.results.popitem(last=False)
        return reference


def _portable(conv: Conversation | None) -> Conversation | None:
    """A copy of ``conv`` that pickles without the model (weights never cross processes) and with
    its linker as a flag; :func:`_attach` puts them back in the process that continues it."""
    if conv is None or conv.loaded is None:
        return conv
    copy = Conversation.__new__(Conversation)
    copy.__dict__.update(conv.__dict__, loaded=None, adapter=None, _rotary_module=None, linker=conv.linker is not None)
    return copy


def _attach(conv: Conversation | None, loaded: LoadedModel, session_id: str) -> None:
    if conv is None or conv.loaded is not None:
        return
    linker = Linker(media_store(), session_id) if conv.linker else None
    conv.__dict__.update(loaded=loaded, adapter=loaded.adapter, _rotary_module=loaded.language_model().rotary_emb,
                         linker=linker, _sync=loaded.device.type == "cuda")


@dataclass
class ChatState:
    """What a chat carries from turn to turn: the GPU function takes it and hands back the new one
    (it pickles without the model; see :mod:`engine.zerogpu`)."""

    conv: Conversation | None = None
    cache_key: tuple | None = None  # Settings.cache_key of the method that built ``conv``
    history: list[Prepared] = field(default_factory=list)
    reused: list[set[int]] = field(default_factory=list)  # per layer: token indices whose KV came from the store
    references: ReferenceCache = field(default_factory=ReferenceCache)

    def __getstate__(self) -> dict:
        return dict(self.__dict__, conv=_portable(self.conv))

    def continues(self, settings: Settings) -> bool:
        """Whether a message with these settings continues this chat's cache."""
        return self.conv is not None and self.cache_key == settings.cache_key

    def attach(self, loaded: LoadedModel, session_id: str) -> ChatState:
        _attach(self.conv, loaded, session_id)
        self.references.attach(loaded)
        return self


def _arrive(state, loaded: LoadedModel, session_id: str):
    """A state handed to a GPU function, on the model's device with its model attached."""
    state = relocate(state, loaded.device) if ZERO_GPU else state
    return state.attach(loaded, session_id) if isinstance(state, ChatState) else state.attach(loaded)


def _depart(state):
    """A state a GPU function hands back: on the CPU on ZeroGPU (its GPU is gone after the call)."""
    return relocate(state, "cpu") if ZERO_GPU else state


# --------------------------------------------------------------------------------------------
# MPIC's media KV store
# --------------------------------------------------------------------------------------------

_STORE: KVStore | None = None
_STORE_LOCK = threading.Lock()


def media_store() -> KVStore:
    """The process's one media KV store: ``KV_ARENA_KV_STORE`` (a directory), or a temp one.
    ``KV_ARENA_KV_STORE_MB`` caps its disk use (memory: a quarter of that)."""
    global _STORE
    with _STORE_LOCK:
        if _STORE is None:
            root = os.environ.get("KV_ARENA_KV_STORE") or os.path.join(tempfile.gettempdir(), "kv-arena-mpic")
            disk = int(float(os.environ.get("KV_ARENA_KV_STORE_MB", "8192")) * 2**20)
            _STORE = KVStore(root, memory_bytes=disk // 4, disk_bytes=disk)
        return _STORE


def _after_fork() -> None:
    """A forked worker (ZeroGPU) opens the store anew: the parent's writer threads do not exist in
    it. What a worker stores reaches the app through the disk (GPU functions flush before they end)."""
    global _STORE, _STORE_LOCK, _MODEL_LOCK
    _STORE, _STORE_LOCK, _MODEL_LOCK = None, threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
_STOPPING: set[str] = set()  # ids of sessions whose answer should end (seen by in-process GPU work only)


class Session:
    """One browser tab. Starts empty (Gradio deep-copies it per session) and is freed on close."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex  # the media store's namespace: made here, never sent by a client
        self.media_model: str | None = None  # the model the session's stored media KV belongs to
        self.reused: list[set[int]] = []  # per layer: chat token indices whose KV came from the store
        self.last_mpic: tuple[Settings, Prepared] | None = None  # the last MPIC turn, for the TTFT panel
        self.conv: Conversation | None = None
        self.cache_key: tuple | None = None  # Settings.cache_key of the method that built ``conv``
        self.history: list[Prepared] = []
        self.references = ReferenceCache()
        self.visuals: list[dict] = []  # kept-token maps of the last answer, for the overlay
        self.uploads: set[str] = set()  # paths of the uploads it used (see check_uploads)
        self.stop_requested = False

    @property
    def stop_requested(self) -> bool:
        return self.id in _STOPPING

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        (_STOPPING.add if value else _STOPPING.discard)(self.id)

    def chat_state(self) -> ChatState:
        return ChatState(self.conv, self.cache_key, self.history, self.reused, self.references)

    def adopt(self, state: ChatState) -> None:
        """Keep what a GPU function handed back (the same objects when it ran in this process)."""
        self.conv, self.cache_key, self.history, self.reused = state.conv, state.cache_key, state.history, state.reused
        self.references = state.references

    def continues(self, settings: Settings) -> bool:
        """Whether a message with these settings continues this chat's cache."""
        return self.chat_state().continues(settings)

    def new_chat(self) -> None:
        self.conv, self.cache_key, self.history, self.visuals = None, None, [], []
        self.reused = []

    def use_model(self, model: str) -> None:
        """Another model: the stored media KV of the previous one is useless, so it goes."""
        if self.media_model not in (None, model):
            media_store().drop_session(self.id)
            self.last_mpic = None
        self.media_model = model

    def close(self) -> None:
        self.new_chat()
        self.references = ReferenceCache()
        if self.media_model is not None:
            media_store().drop_session(self.id)
        self.media_model, self.last_mpic = None, None
        forget_uploads(self)
        self.stop_requested = False
        free_memory()


def close_session(session: Session | None) -> None:
    if isinstance(session, Session):
        session.close()


_OPEN: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()


def track(session: Session, session_hash: str | None) -> None:
    """Remember which browser session owns ``session`` so closing the tab frees it at once."""
    if session_hash:
        _OPEN[session_hash] = session


def release(session_hash: str | None) -> None:
    session = _OPEN.pop(session_hash, None) if session_hash else None
    close_session(session)


# --------------------------------------------------------------------------------------------
# Figures the panels draw (plain lists and numpy arrays)
# --------------------------------------------------------------------------------------------


def layer_figures(conv: Conversation) -> dict:
    """Per layer: tokens held, bytes held, and the method's planned budgets if it reports them."""
    report = conv.backend.report
    return {"tokens": conv.cache.tokens_per_layer(), "bytes": [layer.nbytes() for layer in conv.cache.layers],
            "seen": conv.seen, "planned": [float(b) for b in report.get("layer_budgets", [])] or None}


def kept_visuals(conv: Conversation, history: list[Prepared], highlight: list | None = None,
                 meaning: str = "kept") -> list[dict]:
    """For each image and video of the chat, the share of KV heads keeping each visual token, per layer.

    Returns dicts with ``label``, ``kind``, ``meaning``, ``pictures`` (the image, or the frames a
    video's temporal tokens cover, as the model saw them) and ``keep`` of shape (layers, t, h, w).
    ``highlight`` (per layer, token indices) replaces the kept tokens, e.g. MPIC's reused ones.
    """
    held = np.zeros((len(conv.cache.layers), conv.seen), dtype=np.float32)
    # a method that keeps every token may name the ones to highlight instead (ZipVL: its 4-bit tokens)
    chosen = highlight if highlight is not None else conv.backend.report.get("overlay") or conv.cache.kept_positions()
    for i, positions in enumerate(chosen):
        if positions is None or positions.numel() == 0:
            continue
        positions = positions.long().clamp(0, conv.seen - 1).cpu()
        mask = torch.zeros(positions.shape[0], conv.seen).scatter_(1, positions, 1.0)
        held[i] = mask.mean(0).numpy()  # heads may keep different tokens: a share, not a yes/no
    out = []
    for turn, (prepared, layout) in enumerate(zip(history, conv.layouts), start=1):
        media = [("image", m) for m in prepared.message.images] + [("video", m) for m in prepared.message.videos]
        for n, ((kind, source), visual) in enumerate(zip(media, layout.visuals), start=1):
            if visual.grid is None or visual.length != int(np.prod(visual.grid)):
                continue  # tiled layouts (LLaVA-NeXT) have no single grid to draw on
            t, h, w = visual.grid
            keep = held[:, visual.span[0]:visual.span[1]].reshape(-1, t, h, w)
            label = f"{kind} {n}" + (f", turn {turn}" if len(history) > 1 else "")  # short: a one-line caption
            out.append({"label": label, "kind": kind, "keep": keep, "meaning": meaning,
                        "pictures": _pictures(source, t, conv.adapter.image_processor)})
    return out


def _pictures(source: Image.Image | Video, t: int, image_processor) -> list[np.ndarray]:
    """What the model saw: center-cropped for CLIP-style processors; one frame per temporal token."""
    frames = [np.asarray(source)] if isinstance(source, Image.Image) else \
        [source.frames[i] for i in (np.arange(t) * len(source.frames)) // t]
    if getattr(image_processor, "do_center_crop", False):
        frames = [_center_square(f) for f in frames]
    return frames


def _center_square(frame: np.ndarray) -> np.ndarray:
    h, w = frame.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return frame[top:top + side, left:left + side]


# --------------------------------------------------------------------------------------------
# A chat turn and a comparison
# --------------------------------------------------------------------------------------------


def _reference_view(reference: Reference | None, cached: bool) -> dict | None:
    if reference is None:
        return None
    return {"text": reference.text, "metrics": reference.metrics, "layers": reference.layers, "cached": cached}


class CacheLost(UserError):
    """The GPU work failed mid-forward: the chat's cache is half-written, so it goes."""


def _guarded(run: Iterator[dict], chat: bool) -> Iterator[dict]:
    """Out-of-memory and unexpected failures become a UserError (inside the GPU function, so what
    crosses back from a ZeroGPU worker is a plain message). A failure mid-forward leaves a cache
    half-written, so a chat's cache is dropped (:class:`CacheLost`; the history on screen stays)."""
    after = " This chat's cache was freed; your next message starts a new conversation." if chat else ""
    lost = CacheLost if chat else UserError
    try:
        yield from run
    except UserError:
        raise
    except torch.OutOfMemoryError:
        free_memory()
        raise lost("Out of GPU memory: use fewer images or frames, a lower budget or fewer new tokens." + after) from None
    except Exception as exc:
        log.exception("unexpected failure")  # the traceback for the log, a sentence for the user
        raise lost(f"The model failed on this input ({exc.__class__.__name__}: {str(exc)[:200]}).{after}") from None


def _relay(session: Session, views: Iterator[dict], progress: Progress) -> Iterator[dict]:
    """A GPU function's yields, in the caller: progress goes to ``progress``, views go on."""
    try:
        for view in views:
            if "progress" in view:
                progress(*view["progress"])
            else:
                yield view
    except CacheLost:
        session.new_chat()
        raise


def request_seconds(settings: Settings, prepared: Prepared, runs: int = 1) -> float:
    """How long the GPU may take for ``runs`` answers to this message: a start, each image or
    video frame encoded, each new token (generous for a 2B model on a ZeroGPU slice)."""
    message = prepared.message
    media = len(message.images) + sum(len(getattr(v, "frames", ())) or message.num_frames for v in message.videos)
    return 15 + runs * (3 + 1.5 * media + 0.25 * settings.max_new_tokens)


def _chat_seconds(state: ChatState, settings: Settings, prepared: Prepared, session_id: str) -> float:
    answers = 1 if settings.method == "full" else 2  # the method's and the full cache's reference
    replay = len(state.history) if not state.references.results else 0  # a reference may replay the chat
    return request_seconds(settings, prepared, answers + (settings.method == "mpic")) + 5 * replay


def chat_turn(session: Session, settings: Settings, prepared: Prepared, progress: Progress = _silent) -> Iterator[dict]:
    """Answer one message, yielding a view after every token: ``text``, ``done``, ``new_chat``,
    ``method`` (its title), ``metrics`` (Metrics.to_dict()), ``layers`` (:func:`layer_figures`),
    ``reference`` (the full cache's text, metrics, layers and ``cached``; None for the full cache
    itself), and once done ``agreement`` with the reference and ``visuals`` (:func:`kept_visuals`).

    The model loads here, in the app's process (on ZeroGPU: on the CPU, moved to the GPU inside
    each GPU call); the turn itself runs in :func:`chat_on_gpu`, which hands back the new state."""
    settings.backend()  # bad parameters fail before any model work
    get_model(settings.model, progress)
    session.use_model(settings.model)
    session.stop_requested = False
    for view in _relay(session, chat_on_gpu(session.chat_state(), settings, prepared, session.id), progress):
        if view["done"]:
            session.adopt(view.pop("state"))
            session.visuals = view["visuals"]
            if settings.method == "mpic":
                session.last_mpic = (settings, prepared)
        yield view


@gpu_function(duration=_chat_seconds)
def chat_on_gpu(state: ChatState, settings: Settings, prepared: Prepared, session_id: str) -> Iterator[dict]:
    """One chat turn as a pure function: yields ``{"progress": (fraction, text)}`` and views; the
    last view holds ``state``, the chat after this turn (the same object when run in-process)."""
    yield from _guarded(_turn(state, settings, prepared, session_id), chat=True)


def _turn(state: ChatState, settings: Settings, prepared: Prepared, session_id: str) -> Iterator[dict]:
    backend = settings.backend()
    loaded = get_model(settings.model)  # loaded by the caller; a worker forked before that loads it again
    state = _arrive(state, loaded, session_id)
    mpic = settings.method == "mpic"
    note = ""
    if mpic:
        yield {"progress": (0.3, "Storing the KV of the media...")}
        note = store_media(session_id, loaded, prepared)
    new_chat = not state.continues(settings)
    if new_chat:  # the cache was built by another method or model: it cannot be continued
        linker = Linker(media_store(), session_id) if mpic else None  # without it MPIC is the full cache
        state = ChatState(Conversation(loaded, backend, linker=linker), settings.cache_key, references=state.references)
    history = state.history + [prepared]
    reference, cached = None, False
    if settings.method != "full":
        yield {"progress": (0.4, "Full-cache reference for this input...")}
        reference, cached = state.references.get(loaded, settings, history)
    conv = state.conv
    yield {"progress": (0.7, f"Prefilling with {conv.backend.title}...")}
    if mpic:
        conv.backend.report = {}  # a prompt without stored media must not show the last one's reuse
    for update in conv.stream(prepared.message, max_new_tokens=settings.max_new_tokens,
                              temperature=settings.temperature, should_stop=lambda: session_id in _STOPPING):
        view = {"text": update.text, "done": update.done, "new_chat": new_chat, "metrics": update.metrics.to_dict(),
                "method": conv.backend.title, "reference": _reference_view(reference, cached),
                "layers": layer_figures(conv), "agreement": None, "visuals": None, "mpic": None}
        if update.done:
            state.history = history
            if reference is not None:
                view["agreement"] = agreement(update.token_ids, reference.token_ids)
            elif session_id not in _STOPPING:  # a full-cache answer is itself the reference
                key = settings.generation + tuple(p.key for p in history)
                state.references.store(key, Reference(update.text, update.token_ids, view["metrics"], view["layers"]))
            if mpic:
                view["mpic"] = _reuse_summary(state, conv, update.metrics.prompt_tokens, note)
                highlight = [torch.tensor(sorted(p), dtype=torch.long)[None] for p in state.reused]
                view["visuals"] = kept_visuals(conv, history, highlight, "reused")
                media_store().flush()  # what this call stored reaches the app's process through the disk
            else:
                view["visuals"] = kept_visuals(conv, history)
            view["state"] = _depart(state)
        yield view


# --------------------------------------------------------------------------------------------
# MPIC: storing uploads, what was reused, the media library and the TTFT panel
# --------------------------------------------------------------------------------------------


def _media_names(prepared: Prepared) -> list[str]:
    """File names in the message's media order (its images, then its videos)."""
    names = [Path(f).name for f in prepared.files]
    videos = [Path(f).suffix.lower() in VIDEO_SUFFIXES for f in prepared.files]
    return [n for n, v in zip(names, videos) if not v] + [n for n, v in zip(names, videos) if v]


def store_media(session_id: str, loaded: LoadedModel, prepared: Prepared) -> str:
    """Store the KV of each image and video of the message for this session (a lookup when it
    already is). A failure costs no answer: that media is recomputed; returns what to tell the user."""
    store, message, failed = media_store(), prepared.message, []
    media = [(m, False) for m in message.images] + [(v, True) for v in message.videos]
    for (item, is_video), name in zip(media, _media_names(prepared)):
        try:
            ingest(loaded, store, session_id, item, video=is_video, num_frames=message.num_frames, label=name)
        except Exception as exc:  # noqa: BLE001 - the turn goes on without this entry
            log.warning("could not store %s: %s", name, exc)
            failed.append(f"{name} ({exc.__class__.__name__})")
    return f"could not store {', '.join(failed)}: recomputed" if failed else ""


def _reuse_summary(state: ChatState, conv: Conversation, prompt_tokens: int, note: str) -> dict:
    """This prompt's reused and recomputed token counts (mean over layers), each visual's fate, and
    the chat's reused tokens so far (per layer) for the overlay."""
    reused = conv.backend.report.get("reused") or []
    if len(state.reused) != len(conv.cache.layers):
        state.reused = [set() for _ in conv.cache.layers]
    for layer, positions in zip(state.reused, reused):
        layer.update(int(p) for p in positions.flatten())
    count = round(sum(len(p) for p in reused) / len(reused)) if reused else 0
    mode = conv.backend.mode
    name = {"mpic": f"MPIC-{conv.backend.k}", "prefix": "prefix caching", "full_reuse": "full reuse",
            "cacheblend": f"CacheBlend-{conv.backend.recompute_ratio:.0%}", "recompute": "full recompute"}[mode]
    return {"mode": name, "reused": count, "recomputed": prompt_tokens - count,
            "visuals": list(conv.linker.status) if conv.linker else [], "note": note}


def media_library(session: Session) -> list[dict]:
    """The session's stored media: label, kind, model, tokens, bytes, in_memory, on_disk."""
    return media_store().library(session.id) if session.media_model is not None else []


def mpic_ttft(session: Session) -> dict | None:
    """TTFT of the last MPIC turn's message, sent as a new prompt with the store as it is now,
    under full recompute, prefix caching and MPIC (its k): ``{"ttft_s": {mode: s}, "k", "tokens"}``.
    None without such a turn or when its message has no media (nothing to reuse)."""
    if session.last_mpic is None:
        return None
    settings, prepared = session.last_mpic
    if not prepared.message.images and not prepared.message.videos:
        return None
    get_model(settings.model)
    return ttft_on_gpu(settings, prepared, session.id)


@gpu_function(duration=lambda settings, prepared, session_id: request_seconds(settings, prepared, runs=3))
def ttft_on_gpu(settings: Settings, prepared: Prepared, session_id: str) -> dict:
    loaded = get_model(settings.model)
    params = {k: v for k, v in settings.method_params("mpic").items() if k != "mode"}
    figures = measure_ttft(loaded, media_store(), session_id, prepared.message, ("recompute", "prefix", "mpic"),
                           **params)
    media_store().flush()
    return {"ttft_s": {mode: f["ttft_s"] for mode, f in figures.items()}, "k": params.get("k", 32),
            "tokens": figures["mpic"]["prompt_tokens"]}


def compare(session: Session, settings: Settings, methods: list[str], prepared: Prepared,
            progress: Progress = _silent) -> Iterator[dict]:
    """The full cache, then each method, one after another (never interleaved: honest timings)."""
    methods = [m for m in dict.fromkeys(methods or []) if m != "full"]
    if not 1 <= len(methods) <= MAX_COMPARE:
        raise UserError(f"Pick 1 to {MAX_COMPARE} methods to compare with the full cache (got {len(methods)}).")
    for method in methods:  # bad parameters fail before any model work
        settings.backend(method)
    return _compare(session, settings, methods, prepared, progress)


def _compare(session: Session, settings: Settings, methods: list[str], prepared: Prepared,
             progress: Progress) -> Iterator[dict]:
    get_model(settings.model, progress)
    session.use_model(settings.model)
    session.stop_requested = False
    views = compare_on_gpu(session.references, settings, methods, prepared, session.id)
    for view in _relay(session, views, progress):
        if view["done"]:
            session.references = view.pop("references")
        yield view


def _compare_seconds(references: ReferenceCache, settings: Settings, methods: list[str], prepared: Prepared,
                     session_id: str) -> float:
    return request_seconds(settings, prepared, runs=1 + len(methods) + ("mpic" in methods))


@gpu_function(duration=_compare_seconds)
def compare_on_gpu(references: ReferenceCache, settings: Settings, methods: list[str], prepared: Prepared,
                   session_id: str) -> Iterator[dict]:
    """A comparison as a pure function: yields progress and views; the last view holds
    ``references``, the session's full-cache references with this input's added."""
    yield from _guarded(_compare_runs(references, settings, methods, prepared, session_id), chat=False)


def _compare_runs(references: ReferenceCache, settings: Settings, methods: list[str], prepared: Prepared,
                  session_id: str) -> Iterator[dict]:
    built = [settings.backend(m) for m in methods]
    loaded = get_model(settings.model)
    references = _arrive(references, loaded, session_id)
    if "mpic" in methods:
        yield {"progress": (0.2, "Storing the KV of the media...")}
        store_media(session_id, loaded, prepared)
        media_store().flush()
    yield {"progress": (0.3, "Full cache...")}
    reference, cached = references.get(loaded, settings, [prepared])
    runs = [{"name": "full", "method": "Full cache", "text": reference.text, "metrics": reference.metrics,
             "layers": reference.layers, "agreement": 1.0, "cached": cached, "done": True, "visuals": None}]
    yield {"runs": runs, "done": False}
    for i, backend in enumerate(built):
        yield {"progress": (0.4 + 0.6 * i / len(built), f"{backend.title}...")}
        linker = Linker(media_store(), session_id) if backend.name == "mpic" else None
        conv = Conversation(loaded, backend, linker=linker)
        run = {"name": backend.name, "method": backend.title, "cached": False, "visuals": None, "agreement": None}
        runs.append(run)
        for update in conv.stream(prepared.message, max_new_tokens=settings.max_new_tokens,
                                  temperature=settings.temperature, should_stop=lambda: session_id in _STOPPING):
            run.update(text=update.text, metrics=update.metrics.to_dict(), layers=layer_figures(conv), done=update.done)
            if update.done:
                run["agreement"] = agreement(update.token_ids, reference.token_ids)
                run["visuals"] = kept_visuals(conv, [prepared])
            yield {"runs": runs, "done": False}
        if session_id in _STOPPING:
            break
    yield {"runs": runs, "done": True, "references": _depart(references)}
