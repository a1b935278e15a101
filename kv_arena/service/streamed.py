"""A chat message's media streamed into the cache a few frames at a time under a KV cap
(:func:`kv_arena.runtime.streaming.feed_streaming`), as the streaming-video papers do (InfiniPot-V:
Memory-Constrained KV Cache Compression for Streaming Video Understanding, arXiv 2506.15745):
progress by frames for the UI, and the bytes the cache held after each chunk for the memory panel.

The question arrives afterwards, on the capped cache: a streamed video is compressed before
anyone asks about it, whatever the "when the cache is compressed" control says. The full cache
streams without a cap (the reference: its line crosses the cap)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace

from kv_arena.backends.layout import PromptLayout, VisualSpan

from ..runtime.generate import Conversation
from ..runtime.inputs import Message
from ..runtime.streaming import DEFAULT_FRAMES_PER_CHUNK, bytes_per_token, feed_streaming
from .plan import Plan
from .view_types import Meters, ProgressNote, StreamView

FRAMES_PER_CHUNK = DEFAULT_FRAMES_PER_CHUNK


def stream_media(conv: Conversation, message: Message,
                 plan: Plan) -> Generator[ProgressNote, None, tuple[StreamView, list[int | None]]]:
    """Feed ``message``'s media (its text left for the question) chunk by chunk, yielding a
    :class:`ProgressNote` after each; returns the stream's view and the media item each fed part
    belongs to (None for text; :func:`joined_layout`)."""
    cap = plan.cap_bytes
    bounds = _media_bounds(message)
    frames, kv_bytes, peak_kv_bytes, parts = [], [], [], []
    tokens, seconds, overhead_s, done = 0, 0.0, 0.0, 0
    # each frame sized as in a one-prompt video of one chunk's frames, whatever the video's length (the
    # one-prompt rule, a video sharing one image's pixels, would shrink a 600-frame video's frames to a token)
    frame_pixels = conv.adapter.video_frame_pixels(FRAMES_PER_CHUNK)
    for progress in feed_streaming(conv, replace(message, text=""), FRAMES_PER_CHUNK, cap, frame_pixels):
        tokens += progress.tokens
        seconds += progress.chunk_s
        overhead_s += progress.overhead_s
        fed, done = done, progress.frames_done
        parts.append(next(i for i, end in enumerate(bounds) if fed < end) if done > fed else None)
        if done > fed:  # a chunk of media (the header and the text around them are not)
            frames.append(done)
            kv_bytes.append(progress.kv_bytes)
            peak_kv_bytes.append(progress.peak_kv_bytes)
            yield ProgressNote(done / progress.frames_total, f"Streaming frame {done} of {progress.frames_total}...")
    view = StreamView(frames, kv_bytes, peak_kv_bytes, sum(bounds[-1:]), plan.settings.cap_bytes, cap is not None, tokens,
                      seconds, overhead_s, full_kv_bytes=bytes_per_token(conv) * conv.seen)
    return view, parts


def _media_bounds(message: Message) -> list[int]:
    """Where each image and video ends, in frames fed (an image is one), in the order they stream."""
    ends, total = [], 0
    for size in [1] * len(message.images) + [len(v.frames) for v in message.videos]:
        total += size
        ends.append(total)
    return ends


def with_stream(metrics: Meters, stream: StreamView) -> Meters:
    """A turn's meters counting its streamed part: the question's prefill came after it."""
    return replace(metrics, prompt_tokens=metrics.prompt_tokens + stream.tokens,
                   prefill_s=metrics.prefill_s + stream.seconds, ttft_s=metrics.ttft_s + stream.seconds,
                   overhead_s=metrics.overhead_s + stream.overhead_s)


def joined_layout(parts: list[PromptLayout], owners: list[int | None]) -> PromptLayout:
    """A streamed turn's parts (``owners``: the media item of each, None for text) as the one
    layout its one-shot prompt has: each video's chunks joined into one span, so the kept-token
    overlay draws the video whole."""
    visuals: dict[int, VisualSpan] = {}
    for layout, owner in zip(parts, owners + [None] * (len(parts) - len(owners))):
        for v in layout.visuals:
            first = visuals.get(owner)
            if first is None or owner is None:
                visuals[owner if owner is not None else -len(visuals) - 1] = v
                continue
            grid = (first.grid[0] + v.grid[0],) + tuple(first.grid[1:]) if first.grid and v.grid else None
            visuals[owner] = VisualSpan(v.kind, (first.span[0], v.span[1]), first.token_spans + v.token_spans, grid)
    return PromptLayout(parts[0].start, parts[-1].end, parts[0].system, list(visuals.values()),
                        [t for p in parts for t in p.text])
