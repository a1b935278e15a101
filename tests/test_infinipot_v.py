"""InfiniPot-V (backends/infinipot_v.py): TaR and VaN against plain reference computations, the
selection they make, and the memory cap it holds while a video streams in."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import backends
from backends.base import KVLayer
from backends.infinipot_v import room_target, select_entries, tar_scores, tar_share, van_scores
from backends.layout import PromptLayout, VisualSpan
from kv_arena.errors import UserError
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.streaming import bytes_per_token, feed_streaming, synthetic_video
from tests.support import attention_call, make_image


def test_tar_is_minus_the_mean_cosine_to_the_recent_frames_at_the_same_place():
    g = torch.Generator().manual_seed(0)
    heads, frames, places, dim = 2, 5, 3, 4
    keys = torch.randn(heads, frames, places, dim, generator=g)
    recent = 2  # the last two frames are the reference
    flat = keys.reshape(heads, frames * places, dim)
    place = torch.arange(places).repeat(frames).expand(heads, -1)
    past = (torch.arange(frames * places) < (frames - recent) * places).expand(heads, -1)
    got = tar_scores(flat, place, past, keys[:, -recent:])
    for h in range(heads):
        for f in range(frames):
            for s in range(places):
                i = f * places + s
                if f >= frames - recent:
                    assert got[h, i] == float("-inf")
                    continue
                sims = [F.cosine_similarity(keys[h, f, s], keys[h, r, s], dim=0) for r in range(frames - recent, frames)]
                assert got[h, i].item() == pytest.approx(-sum(sims).item() / recent, abs=1e-6)


def test_van_is_the_value_norm():
    values = torch.tensor([[[3.0, 4.0], [1.0, 0.0]], [[0.0, -2.0], [1.0, 1.0]]])
    expected = [5.0, 1.0, 2.0, math.sqrt(2)]  # sqrt(3^2 + 4^2), ..., per head and entry
    assert van_scores(values).flatten().tolist() == pytest.approx(expected)


def test_selection_keeps_text_recent_frames_best_tar_then_largest_van():
    # one head, 10 entries: 2 text, 6 past video, 2 recent video
    video = torch.tensor([[False, True, True, True, True, True, True, True, True, False]])
    recent = torch.zeros_like(video)
    recent[0, 7:9] = True
    tar = torch.full((1, 10), float("-inf"))
    tar[0, 1:7] = torch.tensor([0.1, 0.9, 0.2, 0.3, 0.8, 0.0])
    van = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 0.5, 3.0, 0.0, 0.0, 0.0]])
    kept = select_entries(tar, van, video, recent, keep_video=6, tar_count=4).tolist()[0]
    # text 0 and 9; recent 7, 8; TaR's best two past 2 (0.9) and 5 (0.8); VaN's best two of the rest 1 (5.0), 3 (4.0)
    assert kept == [0, 1, 2, 3, 5, 7, 8, 9]


def test_tar_takes_its_share_of_the_video_kept_rounded_as_the_authors_code():
    # the authors' code: VaN gets round((1 - tar_ratio) x kept), TaR the rest
    assert [tar_share(k, 0.5) for k in (4, 5, 7, 8)] == [2, 3, 3, 4]
    assert tar_share(10, 0.0) == 0 and tar_share(10, 1.0) == 10 and tar_share(10, 0.3) == 3


def test_room_is_made_before_a_chunk_that_would_pass_the_cap_in_whole_chunks():
    assert room_target(held=141, incoming=32, threshold=174, target=130) is None  # 173 fits: nothing yet
    assert room_target(held=173, incoming=32, threshold=174, target=130) == 142  # one chunk's room: 174 after it
    assert room_target(held=300, incoming=10, threshold=300, target=225) == 230  # 7 chunks fit in 300 - 225
    assert room_target(held=300, incoming=100, threshold=300, target=225) == 200  # a chunk larger than |M| - |C|
    assert room_target(held=300, incoming=100, threshold=300, target=225, kept=250) is None  # cannot fit anyway
    assert room_target(held=300, incoming=10, threshold=300, target=225, kept=260) == 260  # 4 chunks, the text stays


def test_tar_ratio_is_a_share_of_the_video_kept_not_of_the_text_too():
    """4 text tokens, then 8 frames of 2 places; a budget of 12 of 20 keeps the text and 8 video
    entries: TaR picks half of those 8 (the newest frame, then 2 past tokens at the changing place),
    VaN the other 4 (the static place, whose values are larger). A share of all 12 would give TaR 6."""
    text, frames, places, dim = 4, 8, 2, 4
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 1, text + frames * places, dim, generator=g)
    values = torch.ones_like(keys)
    for f in range(frames):
        keys[0, 0, text + f * places] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # place 0 never changes
        values[0, 0, text + f * places] *= 10  # and has the largest value norms
    layer = KVLayer()
    layer.append(keys, values, torch.arange(text + frames * places))
    spans = [(text + f * places, text + (f + 1) * places) for f in range(frames)]
    layout = PromptLayout(0, text + frames * places,
                          visuals=[VisualSpan("video", (text, text + frames * places), spans, (frames, 1, 2))])
    backend = backends.make_backend("infinipot_v", budget=0.6, tar_ratio=0.5, recent_ratio=0.0)

    class Cache:
        layers = [layer]

    tokens = text + frames * places
    backend.after_forward(Cache(), attention_call("prefill", tokens, tokens, layout=layout))
    kept = layer.positions[0].tolist()
    newest = spans[-1]
    past = [p for p in kept if text <= p < newest[0]]
    assert kept[:text] == list(range(text)) and set(range(*newest)) <= set(kept) and len(kept) == 12
    assert sum((p - text) % places == 1 for p in past) == 2  # TaR: 4 of the 8 video kept, 2 of them the newest frame
    assert sum((p - text) % places == 0 for p in past) == 4  # VaN: the other 4


def test_a_static_place_is_dropped_and_a_changing_one_kept():
    backend = backends.make_backend("infinipot_v", budget=0.5, tar_ratio=1.0, recent_ratio=0.25)
    frames, places, dim = 8, 2, 4
    keys = torch.zeros(1, 1, frames * places, dim)
    g = torch.Generator().manual_seed(1)
    for f in range(frames):
        keys[0, 0, f * places] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # place 0 never changes
        keys[0, 0, f * places + 1] = torch.randn(dim, generator=g)  # place 1 changes every frame
    layer = KVLayer()
    layer.append(keys, torch.ones_like(keys), torch.arange(frames * places))
    spans = [(f * places, (f + 1) * places) for f in range(frames)]
    layout = PromptLayout(0, frames * places, visuals=[VisualSpan("video", (0, frames * places), spans, (frames, 1, 2))])
    call = attention_call("prefill", frames * places, frames * places, layout=layout)

    class Cache:
        layers = [layer]

    backend.after_forward(Cache(), call)
    kept = layer.positions[0].tolist()
    assert len(kept) == frames * places // 2
    assert set(range(12, 16)) <= set(kept)  # the two newest frames, whole
    past = [p for p in kept if p < 12]
    assert all(p % places == 1 for p in past)  # only the changing place survives in the past


@pytest.mark.parametrize("method", ["infinipot_v", "streamingllm", "snapkv"])
def test_a_capped_stream_holds_the_cap_plus_one_chunk(models, method):
    loaded = models("tiny-qwen2-vl")
    message = Message("", videos=[synthetic_video(24, size=112)], num_frames=24)  # 12 groups of 16 tokens
    full = Conversation(loaded, backends.make_backend("full"))
    full_held = [p.kv_bytes for p in feed_streaming(full, message, frames_per_chunk=2)]
    cap = full_held[-1] // 2  # the header (46 tokens) and about 70 video tokens
    conv = Conversation(loaded, backends.make_backend(method))
    progress = list(feed_streaming(conv, message, frames_per_chunk=2, cap_bytes=cap))
    per_token = bytes_per_token(conv)
    for p in progress:
        assert p.kv_bytes <= cap + per_token * loaded.num_layers  # rounding: one entry per layer
        assert p.peak_kv_bytes <= cap + p.tokens * per_token + per_token * loaded.num_layers
    assert max(p.peak_kv_bytes for p in progress) < full_held[-1]
    assert conv.ask(Message("What?"), max_new_tokens=3, ignore_eos=True).metrics.new_tokens == 3


def test_a_stream_under_a_cap_ends_at_the_cap_as_the_authors_schedule_and_the_question_is_appended(models):
    """The authors' code (block_size B, compress_frame_num C) compresses after every block but the
    last and answers on the cache that block left: the system prompt and exactly B frames' tokens.
    Here: 12 temporal groups of 16 tokens in chunks of 2 groups (32 tokens; the first also carries
    the vision start, the last the vision end), under a cap of H + 1 + 8 x 16 + 1 entries per layer
    (H the header's tokens), as the authors' B = 8 groups with C = 6 (their blocks after the first
    are 2 groups). The cache holds H, H + 33, H + 65, H + 97, H + 129 after the first chunks (no
    compression), then exactly the cap after each of the last two: before each, a compression made
    one chunk's room (|M| - |C| = 44 entries at the default 0.75 holds one chunk, not two), keeping
    6 groups' worth of video (97 entries, then 96 before the chunk that brings the vision end), as
    the authors' code keeps C = 6 before each block; never more than the cap while a chunk went in; the one-token line after the video is appended (cap + 1). The question then goes in
    whole at budget 0.5 (the rule without a cap would have cut the layer to half the tokens seen);
    a later turn with video but no cap is held under the stream's cap."""
    loaded = models("tiny-qwen2-vl")
    message = Message("", videos=[synthetic_video(24, size=112)], num_frames=24)
    per_token = bytes_per_token(Conversation(loaded, backends.make_backend("full")))
    conv = Conversation(loaded, backends.make_backend("infinipot_v", budget=0.5))
    header = conv.encode(Message("", media_first=False)).input_ids.shape[1]
    cap = header + 1 + 8 * 16 + 1
    progress = list(feed_streaming(conv, message, frames_per_chunk=4, cap_bytes=cap * per_token))
    assert [p.kv_bytes // per_token for p in progress] == \
        [header, header + 33, header + 65, header + 97, header + 129, cap, cap, cap + 1]
    assert all(p.peak_kv_bytes <= cap * per_token for p in progress[:-1])
    video = conv.layouts[1].videos[0].span[0], conv.layouts[6].videos[0].span[1]
    for kept in conv.cache.kept_positions():
        in_video = (kept >= video[0]) & (kept < video[1])
        assert in_video.sum(dim=1).tolist() == [8 * 16] * kept.shape[0]  # B = 8 groups' tokens, every head
    before = [k.clone() for k in conv.cache.kept_positions()]
    seen = conv.seen
    conv.ask(Message("What moves?"), max_new_tokens=2, ignore_eos=True)
    assert conv.cache.tokens_per_layer() == [cap + 1 + conv.seen - seen] * loaded.num_layers
    for old, new in zip(before, conv.cache.kept_positions()):
        assert torch.equal(new[:, :old.shape[1]], old)  # nothing held before the question was evicted
    # a later turn that brings video without a cap is held under the stream's: down to |C| = 0.75 of it
    conv.ask(Message("And here?", videos=[synthetic_video(8, size=112, seed=3)], num_frames=8), max_new_tokens=1)
    assert conv.cache.tokens_per_layer() == [int(0.75 * cap)] * loaded.num_layers


def test_a_cap_below_the_prompts_text_is_refused_naming_the_smallest_it_can_hold(models):
    """InfiniPot-V compresses video tokens only: a cap the system prompt alone passes is refused in
    one line that names the smallest cap and the one from which video is kept, and a cap of the
    prompt's text holds."""
    loaded = models("tiny-qwen2-vl")
    message = Message("", videos=[synthetic_video(8, size=112)], num_frames=8)
    full = Conversation(loaded, backends.make_backend("full"))
    header = next(feed_streaming(full, message, frames_per_chunk=2)).kv_bytes  # the system prompt, before the video
    room = math.ceil(header / 1024 / 0.75 * 10) / 10  # KiB, rounded up: compressions go down to 0.75 of the cap
    with pytest.raises(UserError, match=r"^InfiniPot-V cannot hold the cache under a cap of 40\.0 KiB: it never "
                                        r"evicts the system prompt, text, images and earlier answers \(all but video frames\) "
                                        rf"\({header / 1024:.1f} KiB here\), the "
                                        rf"smallest cap it can hold; it keeps video tokens from {room:.1f} KiB\.$") as refused:
        list(feed_streaming(Conversation(loaded, backends.make_backend("infinipot_v")), message, 2, 40 * 1024))
    assert "\n" not in str(refused.value)
    text = header + 3 * bytes_per_token(full)  # and the video's start and end markers, and the line after it
    progress = list(feed_streaming(Conversation(loaded, backends.make_backend("infinipot_v")), message, 2, text))
    assert all(p.kv_bytes <= text for p in progress)


def test_the_refusal_counts_images_too_and_says_so(models):
    """What InfiniPot-V never evicts is every entry but video frames: an image streamed before the
    video is part of the figure the refusal names, and of the words."""
    loaded = models("tiny-qwen2-vl")
    message = Message("", images=[make_image(1, (112, 112))], videos=[synthetic_video(4, size=112)], num_frames=4)
    full = Conversation(loaded, backends.make_backend("full"))
    header, with_image = [p.kv_bytes for p in feed_streaming(full, message, frames_per_chunk=2)][:2]
    assert with_image > header
    with pytest.raises(UserError, match=r"it never evicts the system prompt, text, images and earlier answers "
                                        rf"\(all but video frames\) \({math.ceil(with_image / 1024 * 10) / 10:.1f} KiB here\)"):
        list(feed_streaming(Conversation(loaded, backends.make_backend("infinipot_v")), message, 2, header))


def test_one_prompt_at_a_budget_compresses_only_the_video(models):
    loaded = models("tiny-qwen2.5-vl")
    message = Message("What moves?", videos=[synthetic_video(8, size=112)], num_frames=8)
    conv = Conversation(loaded, backends.make_backend("infinipot_v", budget=0.7))
    conv.ask(message, max_new_tokens=1)
    video = conv.layouts[0].videos[0]
    assert conv.cache.tokens_per_layer() == [math.ceil(0.7 * conv.seen)] * loaded.num_layers
    for kept in conv.cache.kept_positions():
        outside = ~((kept >= video.span[0]) & (kept < video.span[1]))
        assert int(outside[0].sum()) == conv.seen - video.length  # every text token stays
