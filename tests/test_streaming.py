"""Streaming prefill (kv_arena/runtime/streaming.py): a turn's media fed a few frames at a time gives
the one-shot prefill's cache and logits when nothing is evicted, and a capped method holds the
cache under its cap plus one chunk."""

from __future__ import annotations

import pytest
import torch
from tests.support import TINY_MODELS, make_image, make_video

# Qwen3-VL writes a timestamp between a video's frames: its video does not stream in parts yet
STREAMING_MODELS = [name for name in TINY_MODELS if name != "tiny-qwen3-vl"]

import backends
from kv_arena.errors import UserError
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.streaming import feed_streaming, synthetic_video


def one_shot_and_streamed(loaded, message: Message, frames_per_chunk: int):
    one = Conversation(loaded, backends.make_backend("full"))
    one.feed(message)
    streamed = Conversation(loaded, backends.make_backend("full"))
    progress = list(feed_streaming(streamed, message, frames_per_chunk=frames_per_chunk))
    return one, streamed, progress


def assert_same_cache(one: Conversation, streamed: Conversation) -> None:
    assert streamed.seen == one.seen and streamed.next_position == one.next_position
    for a, b in zip(one.cache.layers, streamed.cache.layers):
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(streamed.last_logits, one.last_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", STREAMING_MODELS)
def test_streamed_video_equals_one_shot_prefill(models, name):
    loaded = models(name)
    video = make_video(3, frames=6, size=112)  # Qwen-VL: 3 temporal groups; LLaVA: 6 images
    message = Message("What happens?", videos=[video], num_frames=6)
    one, streamed, progress = one_shot_and_streamed(loaded, message, frames_per_chunk=2)
    assert len(progress) >= 4 and progress[-1].frames_done == 6  # header, 3 chunks (or more), question text
    assert_same_cache(one, streamed)
    question = Message("Which colour?")
    assert streamed.ask(question, max_new_tokens=6, ignore_eos=True).token_ids == \
        one.ask(question, max_new_tokens=6, ignore_eos=True).token_ids


@pytest.mark.parametrize("name", STREAMING_MODELS)
def test_streamed_images_and_video_equal_one_shot_after_a_first_turn(models, name):
    loaded = models(name)
    first = Message("Hello.")
    message = Message("Compare.", images=[make_image(1, (112, 112)), make_image(2, (112, 84))],
                      videos=[make_video(4, frames=4, size=112)], num_frames=4)
    one = Conversation(loaded, backends.make_backend("full"))
    streamed = Conversation(loaded, backends.make_backend("full"))
    for conv in (one, streamed):
        conv.ask(first, max_new_tokens=3, ignore_eos=True)
    one.feed(message)
    list(feed_streaming(streamed, message, frames_per_chunk=2))
    assert_same_cache(one, streamed)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_chunks_carry_the_one_prompt_m_rope_positions_and_frame_spans(models, name):
    loaded = models(name)
    message = Message("What moves?", videos=[make_video(5, frames=8, size=112)], num_frames=8)
    one_shot = Conversation(loaded, backends.make_backend("full")).encode(message)
    streamed = Conversation(loaded, backends.make_backend("full"))
    chunks = []
    feed = streamed.prefill_chunk
    streamed.prefill_chunk = lambda chunk, cap_bytes=None: chunks.append(chunk) or feed(chunk, cap_bytes)
    list(feed_streaming(streamed, message, frames_per_chunk=2))
    assert len(chunks) == 6  # header, 4 temporal groups, text after the video
    assert torch.equal(torch.cat([c.input_ids for c in chunks], 1), one_shot.input_ids)
    rope = torch.cat([c.rope_ids.expand(3, -1) for c in chunks], 1)  # a text-only part has 1-D ids
    assert torch.equal(rope, one_shot.rope_ids)
    frames = [f for c in chunks for v in c.layout.videos for f in v.frames]
    assert frames == one_shot.layout.videos[0].frames


def test_the_full_cache_grows_with_the_video_and_a_cap_is_refused_to_a_method_that_cannot_stream(models):
    loaded = models("tiny-qwen2-vl")
    message = Message("", videos=[synthetic_video(8, size=56)], num_frames=8)
    conv = Conversation(loaded, backends.make_backend("full"))
    held = [p.kv_bytes for p in feed_streaming(conv, message, frames_per_chunk=2)]
    assert held == sorted(held) and held[-1] > held[1]
    with pytest.raises(UserError, match="cannot stream under a memory cap"):
        list(feed_streaming(Conversation(loaded, backends.make_backend("full")), message, cap_bytes=10_000))


def test_a_video_that_cannot_stream_is_refused(models):
    from kv_arena.errors import UserError

    conv = Conversation(models("tiny-qwen3-vl"), backends.make_backend("full"))
    with pytest.raises(UserError, match="cannot stream a video in parts"):
        list(feed_streaming(conv, Message("What happens?", videos=[make_video(3, frames=4, size=112)], num_frames=4)))


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava"])
def test_a_video_decoded_as_it_streams_equals_the_decoded_video(models, name, tmp_path):
    """A long video's frames are read from its file a chunk at a time (FramesOnDisk): the same
    frames and the same cache as the video decoded whole, and the stand-in pickles as a path."""
    import pickle

    import numpy as np

    from kv_arena.media import FramesOnDisk, load_video, write_avi

    path = tmp_path / "clip.avi"
    write_avi(path, make_video(5, frames=10, size=56).frames, fps=2)
    whole, lazy = load_video(str(path), 6), load_video(str(path), 6, lazy=True)
    assert isinstance(lazy.frames, FramesOnDisk) and lazy.frames.shape == whole.frames.shape
    assert np.array_equal(lazy.frames[1:4], whole.frames[1:4]) and np.array_equal(lazy.frames[-1], whole.frames[-1])
    assert np.array_equal(np.asarray(lazy.frames), whole.frames)
    assert np.array_equal(np.stack(list(pickle.loads(pickle.dumps(lazy.frames)))), whole.frames)
    loaded = models(name)
    caches = []
    for video in (whole, lazy):
        conv = Conversation(loaded, backends.make_backend("full"))
        list(feed_streaming(conv, Message("What happens?", videos=[video], num_frames=6), frames_per_chunk=2))
        caches.append(conv)
    assert_same_cache(*caches)
