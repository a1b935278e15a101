"""What the facade hands the UI, by name: frozen dataclasses of plain numbers, strings, lists and
numpy arrays. No tensor and no torch import here, so ``components/`` (and the tests) read these
fields without the runtime; the service builds them (:mod:`.turns`, :mod:`.views`, :mod:`.mpic`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Meters:
    """One answer's measured figures, none estimated (the runtime's ``Metrics`` as plain values)."""

    prompt_tokens: int = 0
    visual_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # request -> first token: media encoding, prefill, the method's own work
    prefill_s: float = 0.0
    overhead_s: float = 0.0  # inside the method's hooks during the prefill
    decode_s: float = 0.0
    decode_overhead_s: float = 0.0
    decode_tok_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # each decode step's latency
    kv_bytes_prefill: int = 0  # held after the prompt (and its compression)
    kv_bytes: int = 0  # held now
    kv_trace: list[int] = field(default_factory=list)  # held after the prompt, then after every step
    tokens_held: list[int] = field(default_factory=list)  # per layer, now
    peak_memory_bytes: int | None = None  # CUDA only


@dataclass(frozen=True)
class LayerFigures:
    """Per layer: tokens and bytes held, and the method's planned budgets where it reports them."""

    tokens: list[int]
    nbytes: list[int]
    seen: int  # tokens fed so far (the uncompressed history's length)
    planned: list[float] | None = None


@dataclass(frozen=True)
class KeptVisual:
    """One image or video of a chat, with the share of KV heads keeping each of its visual tokens."""

    label: str  # "image 1", "video 2, turn 3"
    kind: str  # "image" or "video"
    meaning: str  # what a clear cell means: "kept", MPIC's "reused", ZipVL's high-precision...
    pictures: list[np.ndarray]  # what the model saw: the image, or one frame per temporal token
    keep: np.ndarray  # (layers, t, h, w) shares in [0, 1]
    tokens: int = 0  # its visual tokens in the prompt
    frames: int = 0  # the frames they stand for (a picture: 1)


@dataclass(frozen=True)
class StreamView:
    """How a message's media streamed in under a KV cap, chunk by chunk."""

    frames: list[int]  # frames fed after each chunk of media
    kv_bytes: list[int]  # held after each chunk, once the method evicted
    peak_kv_bytes: list[int]  # held while each chunk went in
    frames_total: int
    cap_bytes: int | None  # the cap set (the full cache streams without holding it)
    capped: bool  # whether the method held the cap
    tokens: int = 0
    seconds: float = 0.0
    overhead_s: float = 0.0
    full_kv_bytes: int = 0  # computed: what a full cache would hold after these media (bytes per token x tokens)


@dataclass(frozen=True)
class ReferenceView:
    """The full cache's answer to the same input, for comparison (``cached``: from an earlier run)."""

    text: str
    metrics: Meters
    layers: LayerFigures
    cached: bool


@dataclass(frozen=True)
class ReuseSummary:
    """What MPIC reused from the media store for one prompt (token counts: mean over layers)."""

    mode: str  # "MPIC-32", "prefix caching", "CacheBlend-15%"...
    reused: int
    recomputed: int
    visuals: list[str]  # each image's and video's fate: "linked", "recomputed (not stored)"...
    note: str = ""  # media that could not be stored, or the shared store's fault: said to the user


@dataclass(frozen=True)
class SwitchNote:
    """A conversation re-read by another method (its settings changed): what the re-read cost."""

    method: str  # the new method's title
    turns: int
    tokens: int  # prompt and answer tokens fed again
    seconds: float


@dataclass(frozen=True)
class ChatView:
    """A chat answer so far, after one token (``done``: the last one)."""

    text: str
    done: bool
    new_chat: bool  # the message started a new conversation
    method: str  # its title
    metrics: Meters
    layers: LayerFigures
    reference: ReferenceView | None = None  # None for the full cache itself
    stream: StreamView | None = None  # when the media streamed in under a cap
    agreement: float | None = None  # once done: answer tokens equal to the reference's
    visuals: list[KeptVisual] | None = None  # once done
    mpic: ReuseSummary | None = None  # once done, for MPIC
    question: str = ""
    truth: str | None = None  # the scene's true answer, when the app drew the scene
    right: bool | None = None
    unmarked: str = ""  # why a question about a scene the app drew is not marked ("": marked, or no scene)
    switch: SwitchNote | None = None  # the conversation so far was re-read by this method first
    is_reference: bool = False  # the method is the full cache itself: its figures are the reference
    context_tokens: int = 0  # tokens of the whole conversation the cache stood for after this prompt
    note: str = ""  # the method's own line on this prompt (EVS: no video, so it held the whole cache)


@dataclass(frozen=True)
class CompareTurn:
    """One method's answer to one turn of a comparison (``metrics`` None until its first token)."""

    question: str
    text: str = ""
    metrics: Meters | None = None
    layers: LayerFigures | None = None  # once done
    agreement: float | None = None  # answer tokens equal to the full cache's, once done
    loyal: bool | None = None  # once done: the answer is the full cache's, whole (what loyalty counts)
    cached: bool = False  # the full cache's, from an earlier run on this input
    truth: str | None = None
    right: bool | None = None
    unmarked: str = ""  # why a question about a scene the app drew is not marked
    done: bool = False
    note: str = ""  # the method's own line on this turn's prompt (EVS: no video, so it held the whole cache)


@dataclass(frozen=True)
class CompareRun:
    """One method through the whole conversation (the full cache's run first)."""

    name: str
    method: str  # its title
    turns: tuple[CompareTurn, ...] = ()
    visuals: list[KeptVisual] | None = None  # once done
    done: bool = False


@dataclass(frozen=True)
class CompareView:
    """A comparison so far: the full cache's run first, then each method's."""

    runs: tuple[CompareRun, ...]
    done: bool


@dataclass(frozen=True)
class LibraryEntry:
    """One entry of a session's MPIC media library."""

    key: str  # content hash
    label: str  # the upload's file name
    kind: str | None
    model: str
    tokens: int | None
    nbytes: int
    in_memory: bool
    on_disk: bool
    on_server: bool = False  # on the shared Valkey/Redis server (KV_ARENA_KV_STORE_URL)


@dataclass(frozen=True)
class TtftView:
    """TTFT of one prompt with its media stored, per bar of the panel ("Full recompute",
    "Prefix caching", "MPIC-32"), in the panel's order."""

    ttft_s: dict[str, float]
    reference: str  # the bar the others are divided by
    tokens: int  # the prompt's tokens


@dataclass(frozen=True)
class ProgressNote:
    """What a GPU function yields between views: how far it is, in words."""

    fraction: float
    text: str
