"""Streaming prefill: a user turn's media fed a few frames at a time, under a memory cap.

A long video never enters the model whole. Its frames are turned into pixels, encoded by the
vision tower and prefilled in chunks of whole temporal groups (Qwen-VL's vision attention never
crosses a group, so each group's features are those of a one-shot prompt); LLaVA-style models see
frames as images, one chunk of frames at a time. Every chunk carries the rotary positions it has
in the one prompt the turn would be (M-RoPE time, row and column; 1-D otherwise), computed from
token ids alone, so with nothing evicted streaming equals a one-shot prefill.

After each chunk a method that ``streams_under_cap`` brings the cache back under ``cap_bytes``
(through ``AttentionCall.cap_bytes``), so the cache holds at most the cap plus one chunk; without
a cap (the full cache's reference) it grows with the video.

The turn is fed up to the question, as :meth:`Conversation.feed` does: the question then arrives
with :meth:`Conversation.stream` on top of the capped cache (a streamed video is compressed before
anyone asks about it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from PIL import Image

from kv_arena.backends.base import CapTooSmall
from kv_arena.backends.layout import PromptLayout, VisualSpan

from ..errors import UserError
from ..media import Video, load_image, load_video
from .generate import Conversation
from .inputs import Chunk, Message

DEFAULT_FRAMES_PER_CHUNK = 8


@dataclass
class StreamProgress:
    """The state after one chunk of a streamed turn, all measured."""

    frames_done: int  # video frames fed so far (images count as one frame each)
    frames_total: int
    kv_bytes: int  # held after this chunk, once the method evicted
    peak_kv_bytes: int  # most held while this chunk went in (it lands whole before the method evicts)
    cap_bytes: int | None
    chunk_s: float  # this chunk: pixels, vision tower, prefill, eviction
    overhead_s: float  # of which inside the method's hooks
    tokens: int  # tokens this chunk fed


def bytes_per_token(conv: Conversation) -> int:
    """Bytes one token's keys and values take in a full cache of this model (all layers)."""
    cfg = conv.loaded.text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * conv.loaded.num_layers * cfg.num_key_value_heads * head_dim * torch.finfo(conv.loaded.dtype).bits // 8


def video_chunks(conv: Conversation, video: Video, frames_per_chunk: int,
                 frame_max_pixels: int | None = None) -> Iterator[tuple[int, Chunk]]:
    """(frames in the chunk, chunk) for one video placed after what ``conv`` has fed, built lazily:
    pixels exist for one chunk at a time."""
    adapter = conv.adapter
    if adapter.video_chunking is None:
        raise UserError(f"{conv.loaded.spec.name} cannot stream a video in parts yet (its video prompt puts a "
                        "timestamp between frames); send the video without a memory cap.")
    if adapter.video_chunking == "groups":  # native video (Qwen-VL): temporal groups, M-RoPE
        yield from _grouped_video_chunks(conv, video, frames_per_chunk, frame_max_pixels)
        return
    for first in range(0, len(video.frames), frames_per_chunk):  # frames as images (LLaVA-style)
        frames = video.frames[first:first + frames_per_chunk]
        chunk = adapter.encode_turn(Message(images=[Image.fromarray(f) for f in frames], media_first=False),
                                    conv.seen, conv.next_position, None, (), open_turn=False, close_turn=False)
        spans = [v.span for v in chunk.layout.visuals]
        first_grid = chunk.layout.visuals[0].grid
        grid = (len(spans),) + tuple(first_grid[1:]) if first_grid else None
        video_span = VisualSpan("video", (spans[0][0], spans[-1][1]), spans, grid)
        yield len(frames), replace(chunk, layout=replace(chunk.layout, visuals=[video_span]))


def _grouped_video_chunks(conv: Conversation, video: Video, frames_per_chunk: int,
                          frame_max_pixels: int | None) -> Iterator[tuple[int, Chunk]]:
    adapter, cfg = conv.adapter, conv.adapter.config
    ip = adapter.image_processor
    tp, merge, patch = ip.temporal_patch_size, ip.merge_size, ip.patch_size
    count, height, width = video.frames.shape[:3]
    groups = math.ceil(count / tp)
    size = adapter.video_frame_size(groups * tp, height, width, frame_max_pixels)
    grid = (groups, size[0] // patch, size[1] // patch)
    per_group = (grid[1] // merge) * (grid[2] // merge)
    ids = [cfg.vision_start_token_id] + [cfg.video_token_id] * (groups * per_group) + [cfg.vision_end_token_id]
    # positions of the whole video from its token ids and grid, as in one prompt, sliced per chunk;
    # one text token after it tells where the prompt's text goes on (the model's rule,
    # kv_arena/runtime/mrope_positions.py: after the video's largest position, or for tiny-arena-vl
    # at its frame's extent)
    grid_inputs = {k: [v] for k, v in adapter.video_grid_inputs(video, grid).items()}
    rope_ids, _ = adapter.positions(torch.tensor([ids + [cfg.vision_end_token_id]]), None, grid_inputs, conv.next_position)
    rope_ids, next_position = rope_ids[:, :-1], int(rope_ids[0, -1])
    ids = torch.tensor([ids])
    step = max(1, frames_per_chunk // tp)  # whole temporal groups per chunk
    start = conv.seen
    for g0 in range(0, groups, step):
        g1 = min(groups, g0 + step)
        lo, hi = (0 if g0 == 0 else 1 + g0 * per_group), 1 + g1 * per_group + (1 if g1 == groups else 0)
        first_token = start + 1 + g0 * per_group
        frames = [(first_token + i * per_group, first_token + (i + 1) * per_group) for i in range(g1 - g0)]
        text = ([(start, start + 1)] if g0 == 0 else []) + ([(frames[-1][1], frames[-1][1] + 1)] if g1 == groups else [])
        layout = PromptLayout(start + lo, start + hi, None,
                              [VisualSpan("video", (frames[0][0], frames[-1][1]), frames,
                                          (g1 - g0, grid[1] // merge, grid[2] // merge))], text)
        patches, _ = adapter.patchify_video(video.frames[g0 * tp:g1 * tp], size=size)
        kwargs = {"pixel_values_videos": patches, "video_grid_thw": torch.tensor([[g1 - g0, grid[1], grid[2]]])}
        chunk = Chunk(ids[:, lo:hi], rope_ids[:, lo:hi], layout, kwargs,
                      next_position if g1 == groups else int(rope_ids[:, :hi].max()) + 1)
        yield min(count, g1 * tp) - min(count, g0 * tp), chunk


def feed_streaming(conv: Conversation, message: Message, frames_per_chunk: int = DEFAULT_FRAMES_PER_CHUNK,
                   cap_bytes: int | None = None, frame_max_pixels: int | None = None) -> Iterator[StreamProgress]:
    """Feed a user turn's text and media up to the question in chunks, yielding after each; the
    turn stays open for the question (``conv.stream(Message(question))``).

    ``cap_bytes``: the bytes the cache may hold after each chunk (the method must stream under a
    cap); ``frame_max_pixels``: a fixed pixel budget per video frame (default: the one-shot
    prompt's, where a video shares one image's budget, which shrinks frames as videos grow)."""
    if cap_bytes is not None and not conv.backend.streams_under_cap:
        raise UserError(f"{conv.backend.title} cannot stream under a memory cap; pick a method that can "
                        "(InfiniPot-V, StreamingLLM, SnapKV) or the full cache without a cap.")
    if conv.linker is not None:
        raise UserError("MPIC links stored media whole; it does not stream a video in chunks.")
    images = [load_image(i) for i in message.images]
    videos = [load_video(v, message.num_frames) for v in message.videos]
    has_media = bool(images or videos)
    total = len(images) + sum(len(v.frames) for v in videos)
    done, highest = 0, conv.next_position - 1
    conv.backend.reset_report()

    def feed(chunk: Chunk, frames: int) -> StreamProgress | None:
        nonlocal done, highest
        if chunk.input_ids.shape[1] == 0:
            return None
        needed = chunk.next_position + 1
        if needed > conv.loaded.max_context:
            raise UserError(f"The video reaches rotary position {needed}, past the model's context of "
                            f"{conv.loaded.max_context}. Use fewer frames.")
        t0 = time.perf_counter()
        conv.cache.peak_bytes = conv.cache.nbytes()
        try:
            overhead = conv.prefill_chunk(chunk, cap_bytes)
        except CapTooSmall as exc:
            raise UserError(str(exc)) from None
        done += frames
        conv.turn_open = True
        highest = max(highest, int(chunk.rope_ids.max()))
        held = conv.cache.nbytes()  # a one-token part goes in as a decode step, which the peak meter skips
        return StreamProgress(done, total, held, max(held, conv.cache.peak_bytes), cap_bytes,
                              time.perf_counter() - t0, overhead, chunk.input_ids.shape[1])

    # the parts of the one prompt: header (and text before the media), each image, each video's
    # chunks, then the text after the media, each tokenised as the one-shot prompt tokenises it
    head = conv.encode(Message(text="" if message.media_first else message.text, media_first=False))
    progress = feed(head, 0)
    if progress:
        yield progress
    for image in images:
        chunk = conv.adapter.encode_turn(Message(images=[image], media_first=False), conv.seen, conv.next_position,
                                         None, (), open_turn=False, close_turn=False)
        yield feed(chunk, 1)
    for video in videos:
        for frames, chunk in video_chunks(conv, video, frames_per_chunk, frame_max_pixels):
            yield feed(chunk, frames)
    if message.media_first:
        tail = Message(text=("\n" if has_media else "") + message.text, media_first=False)
        progress = feed(conv.encode(tail), 0)
        if progress:
            yield progress
    conv.next_position = highest + 1  # the next turn goes on after the turn's highest id, as after a one-shot prompt


def synthetic_video(frames: int, size: int = 112, seed: int = 0, fps: float = 1.0) -> Video:
    """A seeded video of drifting noise (neighbouring frames alike, as in real footage)."""
    rng = np.random.RandomState(seed)
    base = rng.rand(size, size, 3)
    data = np.empty((frames, size, size, 3), dtype=np.uint8)
    for i in range(frames):
        drift = np.roll(base, shift=i % size, axis=1)
        data[i] = ((0.8 * drift + 0.2 * rng.rand(size, size, 3)) * 255).astype(np.uint8)
    return Video(frames=data, timestamps=[i / fps for i in range(frames)], fps=fps)
