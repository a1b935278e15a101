"""Figures the panels draw, as the typed views of :mod:`.view_types`: an answer's meters, the
cache per layer and the visual tokens each method kept."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from ..media import Video
from ..runtime.generate import Conversation, Metrics
from .inputs import Prepared
from .view_types import KeptVisual, LayerFigures, Meters


def meters(metrics: Metrics) -> Meters:
    """The runtime's meters as the UI reads them."""
    return Meters(**metrics.to_dict())


MAX_DRAWN_FRAMES = 16  # a longer video's overlay draws this many of its temporal tokens, evenly spaced


def layer_figures(conv: Conversation) -> LayerFigures:
    """Per layer: tokens held, bytes held, and the method's planned budgets if it reports them."""
    report = conv.backend.report
    return LayerFigures(conv.cache.tokens_per_layer(), [layer.nbytes() for layer in conv.cache.layers], conv.seen,
                        [float(b) for b in report.layer_budgets or []] or None)


def kept_visuals(conv: Conversation, history: list[Prepared], highlight: list | None = None,
                 meaning: str | None = None) -> list[KeptVisual]:
    """For each image and video of the chat, the share of KV heads keeping each visual token, per
    layer (``keep``), drawn on what the model saw (``pictures``: the image, or the frames a video's
    temporal tokens cover). ``highlight`` (per layer, token indices) replaces the kept tokens, e.g. MPIC's reused ones.
    """
    meaning = meaning or conv.backend.overlay_meaning
    held = np.zeros((len(conv.cache.layers), conv.seen), dtype=np.float32)
    # a method that keeps every token may name the ones to highlight instead (ZipVL: its 4-bit tokens)
    chosen = highlight if highlight is not None else conv.backend.report.overlay or conv.cache.kept_positions()
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
            tokens = np.concatenate([held[:, a:b] for a, b in visual.token_spans], axis=1)  # frames without their timestamps
            keep = tokens.reshape(-1, t, h, w)
            drawn = np.arange(t) if t <= MAX_DRAWN_FRAMES else np.arange(MAX_DRAWN_FRAMES) * t // MAX_DRAWN_FRAMES
            label = f"{kind} {n}" + (f", turn {turn}" if len(history) > 1 else "")  # short: a one-line caption
            label += f", {len(drawn)} of {t} frames drawn" if len(drawn) < t else ""
            out.append(KeptVisual(label, kind, meaning, _pictures(source, drawn, t, conv.adapter.image_processor),
                                  keep[:, drawn], visual.length, 1 if kind == "image" else len(source.frames)))
    return out


def _pictures(source: Image.Image | Video, drawn: np.ndarray, t: int, image_processor) -> list[np.ndarray]:
    """What the model saw: center-cropped for CLIP-style processors; a frame per temporal token
    ``drawn`` of the ``t``."""
    frames = [np.asarray(source)] if isinstance(source, Image.Image) else \
        [source.frames[i] for i in (drawn * len(source.frames)) // t]
    if getattr(image_processor, "do_center_crop", False):
        frames = [_center_square(f) for f in frames]
    return frames


def _center_square(frame: np.ndarray) -> np.ndarray:
    h, w = frame.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return frame[top:top + side, left:left + side]

