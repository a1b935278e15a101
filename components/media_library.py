"""MPIC's panels under the chat: the session's media library (what the media KV store holds for
this tab) and the TTFT of the last MPIC message under prefix caching vs MPIC.

Both refresh after each chat turn (:func:`refresh`); the TTFT is measured only after an MPIC turn,
so other methods pay nothing for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import gradio as gr

from kv_arena import service
from kv_arena.errors import UserError

from . import plots
from .outputs import KEEP, Outputs

log = logging.getLogger(__name__)
COLUMNS = ["media", "kind", "tokens", "stored (MB)", "in memory", "on disk", "on server", "model"]


def library_rows(session: service.Session) -> list[list]:
    """The session's stored media as table rows, oldest first."""
    return [[row.label or row.key[:12], row.kind, row.tokens, round(row.nbytes / 2**20, 2),
             "yes" if row.in_memory else "no", "yes" if row.on_disk else "no", "yes" if row.on_server else "no", row.model]
            for row in service.media_library(session)]


@dataclass(frozen=True)
class MediaPanels:
    """The two panels, named as :class:`PanelOutputs` names their values."""

    library: gr.Dataframe
    ttft: gr.Plot


@dataclass(frozen=True)
class PanelOutputs(Outputs):
    library: Any = KEEP  # table rows
    ttft: Any = KEEP  # the TTFT figure


def refresh(session: service.Session, measure: bool = True) -> PanelOutputs:
    """The library's rows and the TTFT figure; ``measure``: time the last MPIC message again (after its turn)."""
    ttft = None
    if measure:
        try:
            ttft = service.mpic_ttft(session)
        except UserError as exc:
            gr.Warning(str(exc))
        except Exception:  # a side panel must never break the chat
            log.exception("TTFT panel failed")
    return PanelOutputs(library_rows(session), plots.ttft_figure(ttft))


def after_turn(session: service.Session, method: str) -> PanelOutputs:
    """The chat event's follow-up: the library always, the TTFT panel only after a turn of a
    method that reuses stored media (MPIC)."""
    if not service.reuses_media(method):
        return PanelOutputs(library=library_rows(session))
    return refresh(session)


def build_media_panels() -> MediaPanels:
    with gr.Accordion("MPIC: media library and time to first token", open=False):
        gr.Markdown("With **MPIC**, every image or video you send is stored once (its KV cache, in memory and "
                    "on disk, for this tab only) and linked into later prompts at any position. The TTFT panel "
                    "re-times your last MPIC message with prefix caching and MPIC (full recompute in grey).")
        table = gr.Dataframe(headers=COLUMNS, value=[], label="Media library (this session)", interactive=False,
                             elem_id="media-library")
        plot = gr.Plot(label="TTFT: prefix caching vs MPIC", elem_id="mpic-ttft")
    return MediaPanels(table, plot)
