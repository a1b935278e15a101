"""MPIC in the app: its k for the model, storing uploads, what was reused, the media library and the
TTFT panel."""

from __future__ import annotations

import logging
from pathlib import Path

from PIL import Image

from ..mpic.linking import ingest
from ..mpic.ttft import measure_ttft
from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.models import LoadedModel
from .inputs import VIDEO_SUFFIXES, Prepared, Settings, request_seconds
from .model_pool import get_model
from .sessions import Session
from .state import ChatState
from .store import media_store
from .view_types import LibraryEntry, ReuseSummary, TtftView
from .zerogpu import gpu_function

log = logging.getLogger(__name__)


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
            failed.append(name)
    return f"could not store {', '.join(failed)}: recomputed" if failed else ""


def reuse_summary(state: ChatState, conv: Conversation, prompt_tokens: int, note: str) -> ReuseSummary:
    """This prompt's reused and recomputed token counts (mean over layers), each visual's fate, and
    the chat's reused tokens so far (per layer) for the overlay."""
    reused = conv.backend.report.reused or []
    if len(state.reused) != len(conv.cache.layers):
        state.reused = [set() for _ in conv.cache.layers]
    for layer, positions in zip(state.reused, reused):
        layer.update(int(p) for p in positions.flatten())
    count = round(sum(len(p) for p in reused) / len(reused)) if reused else 0
    note = "; ".join(n for n in (note, media_store().health_note()) if n)  # a shared store's fault, in one line
    return ReuseSummary(conv.backend.reuse_label, count, prompt_tokens - count,
                        list(conv.linker.status) if conv.linker else [], note)


def media_library(session: Session) -> list[LibraryEntry]:
    """The session's stored media, oldest first."""
    if session.media_model is None:
        return []
    return [LibraryEntry(row["key"], row["label"], row["kind"], row["model"], row["tokens"], row["bytes"],
                        row["in_memory"], row["on_disk"], row["on_server"]) for row in media_store().library(session.id)]


def mpic_ttft(session: Session) -> TtftView | None:
    """TTFT of the last MPIC turn's message, sent as a new prompt with the store as it is now,
    under full recompute, prefix caching and MPIC (its k): :func:`ttft_on_gpu`'s figures.
    None without such a turn or when its message has no media (nothing to reuse)."""
    if session.last_mpic is None:
        return None
    settings, prepared = session.last_mpic
    if not prepared.message.images and not prepared.message.videos:
        return None
    get_model(settings.model)
    return ttft_on_gpu(settings, prepared, session.id)


@gpu_function(duration=lambda settings, prepared, session_id: request_seconds(settings, prepared, runs=3))
def ttft_on_gpu(settings: Settings, prepared: Prepared, session_id: str) -> TtftView:
    """The bars in the panel's order (:data:`~kv_arena.mpic.ttft.PANEL_MODES`), the reference first."""
    loaded = get_model(settings.model)
    params = {k: v for k, v in settings.method_params(settings.method).items() if k != "mode"}
    figures = list(measure_ttft(loaded, media_store(), session_id, prepared.message, **params).values())
    media_store().flush()
    names = [f["label"][:1].upper() + f["label"][1:] for f in figures]  # "Full recompute", "MPIC-32"
    return TtftView({name: f["ttft_s"] for name, f in zip(names, figures)}, names[0], figures[0]["prompt_tokens"])
