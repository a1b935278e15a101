"""Qwen2-VL / Qwen2.5-VL rotary positions (kv_arena/runtime/mrope_positions.py): the authors' rule
against an oracle written token by token, transformers' own ``get_rope_index`` where the two rules
agree, a video asked about in the message that sends it, and tiny-arena-vl kept on the rule it was
trained with. Qwen3-VL and LLaVA are checked as they are."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from packaging.version import Version
from tests.support import make_image, make_video

import backends
from kv_arena.errors import UserError
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import DEFAULT_SYSTEM, Message
from kv_arena.runtime.mrope_positions import (FRAME_EXTENT, IMAGE, LARGEST_POSITION, RULE_KEY, TEXT, VIDEO,
                                              mrope_positions, rule_of)
from kv_arena.tiny import arena_model


def oracle(pieces, start=0):
    """The authors' rule, one token at a time. ``pieces``: ("text", n) or (kind, (t, h, w), step).
    Text counts on from the position after everything before it; a block's token at step i, row r,
    column c sits at (base + floor(i * step), base + r, base + c), base being that next position."""
    rows, after = [], start  # after: the position after the largest one so far
    for piece in pieces:
        if piece[0] == "text":
            for _ in range(piece[1]):
                rows.append((after, after, after))
                after += 1
            continue
        _, (t, h, w), step = piece
        base = after
        for i in range(t):
            for r in range(h):
                for c in range(w):
                    rows.append((base + int(i * step), base + r, base + c))
        after = max(max(row) for row in rows) + 1
    return torch.tensor(rows, dtype=torch.long).T, after


def types_and_grids(pieces):
    types, grids, steps = [], {"image": [], "video": []}, []
    for piece in pieces:
        if piece[0] == "text":
            types += [TEXT] * piece[1]
            continue
        kind, grid, step = piece
        types += [IMAGE if kind == "image" else VIDEO] * (grid[0] * grid[1] * grid[2])
        grids[kind].append(grid)
        if kind == "video":
            steps.append(step)
    return types, grids["image"], grids["video"], steps


SQUARE, PORTRAIT, LANDSCAPE = (1, 4, 4), (1, 6, 3), (1, 2, 5)
CASES = {
    "square image": [("text", 3), ("image", SQUARE, 1), ("text", 4)],
    "portrait image": [("text", 2), ("image", PORTRAIT, 1), ("text", 2)],
    "landscape image": [("text", 2), ("image", LANDSCAPE, 1), ("text", 3)],
    "video longer than its frame": [("text", 3), ("video", (9, 2, 3), 1), ("text", 5)],  # T > rows, cols
    "video shorter than its frame": [("text", 3), ("video", (2, 5, 4), 1), ("text", 5)],  # T < rows, cols
    "portrait video in seconds": [("text", 1), ("video", (4, 6, 2), 12.5), ("text", 2)],  # Qwen2.5-VL: 0.5 s x 25/s
    "slow landscape video": [("text", 1), ("video", (3, 2, 7), 4.0), ("text", 2)],
    "images and videos in one message": [("text", 2), ("image", PORTRAIT, 1), ("text", 2), ("video", (6, 2, 2), 1),
                                         ("text", 2), ("image", LANDSCAPE, 1), ("text", 1), ("video", (2, 3, 3), 2.5),
                                         ("text", 3)],
    "media last": [("text", 2), ("video", (5, 2, 2), 1)],
}


@pytest.mark.parametrize("start", [0, 37])  # a first turn, and a later one going on from the one before
@pytest.mark.parametrize("case", CASES)
def test_positions_follow_the_authors_rule(case, start):
    types, images, videos, steps = types_and_grids(CASES[case])
    positions, after = mrope_positions(types, images, videos, steps, start)
    expected, expected_after = oracle(CASES[case], start)
    assert torch.equal(positions, expected) and after == expected_after
    assert after == int(positions.max()) + 1  # the next chunk and the first decode step go on from here


def test_the_text_after_a_long_video_follows_its_last_time_id_not_its_frame():
    types, images, videos, steps = types_and_grids(CASES["video longer than its frame"])
    ours, _ = mrope_positions(types, images, videos, steps)
    extent, _ = mrope_positions(types, images, videos, steps, rule=FRAME_EXTENT)
    video_end = 3 + 9 * 6
    assert int(ours[0, video_end]) == int(ours[:, :video_end].max()) + 1 == 3 + 8 + 1
    assert int(extent[0, video_end]) == 3 + 3  # start + the frame's larger side, among the video's time ids
    assert torch.equal(ours[:, :video_end], extent[:, :video_end])  # the video itself is placed alike


def test_a_run_that_does_not_match_its_grid_is_refused():
    with pytest.raises(ValueError, match="does not match"):
        mrope_positions([TEXT] + [IMAGE] * 5, [(1, 2, 2)])
    with pytest.raises(ValueError, match="does not match"):
        mrope_positions([VIDEO] * 4)
    with pytest.raises(ValueError, match="unknown rule"):
        mrope_positions([TEXT], rule="middle")


def agrees_with_authors(pieces) -> bool:
    """Whether transformers 5.3-5.24's rule gives the authors' positions: every video's last time id
    stays under its frame's larger side."""
    return all(int((p[1][0] - 1) * p[2]) < max(p[1][1:]) for p in pieces if p[0] == "video")


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
@pytest.mark.parametrize("case", CASES)
def test_transformers_gives_the_same_positions_where_the_rules_agree(models, name, case):
    pieces = CASES[case]
    if name == "tiny-qwen2-vl":  # Qwen2-VL's time ids are the temporal steps themselves
        pieces = [(p[0], p[1], 1) if p[0] == "video" else p for p in pieces]
    model = models(name).model
    merge = model.config.vision_config.spatial_merge_size
    types, images, videos, steps = types_and_grids(pieces)
    per_second = getattr(model.config.vision_config, "tokens_per_second", 1)
    kwargs = {"image_grid_thw": torch.tensor([(t, h * merge, w * merge) for t, h, w in images]) if images else None,
              "video_grid_thw": torch.tensor([(t, h * merge, w * merge) for t, h, w in videos]) if videos else None}
    if name == "tiny-qwen2.5-vl" and videos:
        kwargs["second_per_grid_ts"] = torch.tensor([s / per_second for s in steps])
    ids = torch.zeros(1, len(types), dtype=torch.long)
    theirs, _ = model.model.get_rope_index(ids, torch.tensor([types]), **kwargs)
    ours, _ = mrope_positions(types, images, videos, steps)
    if agrees_with_authors(pieces):  # images only, or videos short for their frame: one rule
        assert torch.equal(theirs[:, 0], ours)
    if Version("5.3") <= Version(transformers.__version__) < Version("5.25"):  # the releases that place it so
        assert torch.equal(theirs[:, 0], mrope_positions(types, images, videos, steps, rule=FRAME_EXTENT)[0])


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_a_48_frame_video_and_its_question_in_one_message(models, name):
    """The issue's case: the question's first token (the vision end marker) right after the video's
    largest position, the chunk's next position right after its last token, a later turn and the
    decode steps going on from there."""
    loaded = models(name)
    adapter = loaded.adapter
    chunk = adapter.encode_turn(Message("What moves in the video?", videos=[make_video(0, frames=48, size=112)],
                                        num_frames=48), 0, 0, DEFAULT_SYSTEM)
    ids, rope = chunk.input_ids[0], chunk.rope_ids
    video = (ids == adapter.config.video_token_id).nonzero()[:, 0]
    after = int(video[-1]) + 1
    assert int(rope[0, video].max() - rope[0, video].min()) >= 23  # 24 temporal steps: past the frame's side
    assert rope[:, after].tolist() == [int(rope[:, video].max()) + 1] * 3
    assert torch.equal(rope[:, after:], rope[0, after] + torch.arange(len(ids) - after).expand(3, -1))  # text counts on
    assert chunk.next_position == int(rope[0, -1]) + 1 == int(rope.max()) + 1
    conv = Conversation(loaded, backends.make_backend("full"))
    conv.ask(Message("What moves in the video?", videos=[make_video(0, frames=48, size=112)], num_frames=48),
             max_new_tokens=3, ignore_eos=True)
    assert conv.next_position == chunk.next_position + 2  # decoded one by one (the last one waits, pending)
    later = conv.encode(Message("And then?"))
    assert int(later.rope_ids[0, 0]) == conv.next_position


def test_tiny_arena_vl_keeps_the_rule_it_was_trained_with(models, tmp_path):
    """Its config.json records the rule (transformers 5.3-5.24's, which it was trained on) and the
    engine places its video prompts by it; a folder that names an unknown rule is refused."""
    shipped = json.loads((arena_model.ASSET_DIR / "config.json").read_text())
    assert shipped[RULE_KEY] == FRAME_EXTENT == arena_model.TRAINED_ROPE_RULE and RULE_KEY == arena_model.ROPE_RULE_KEY
    arena = models("tiny-arena-vl")
    assert rule_of(arena.model.config) == FRAME_EXTENT
    assert rule_of(models("tiny-qwen2.5-vl").model.config) == LARGEST_POSITION  # the same architecture, built here
    adapter = arena.adapter
    chunk = adapter.encode_turn(Message("Which shape moves?", videos=[make_video(0, frames=32, size=112)],
                                        num_frames=32), 0, 0, DEFAULT_SYSTEM)
    video = (chunk.input_ids[0] == adapter.config.video_token_id).nonzero()[:, 0]
    grid = chunk.layout.videos[0].grid
    assert int(chunk.rope_ids[0, int(video[-1]) + 1]) == int(chunk.rope_ids[1, video[0]]) + max(grid[1:])
    assert chunk.next_position == int(chunk.rope_ids.max()) + 1
    if Version("5.3") <= Version(transformers.__version__) < Version("5.25"):  # the positions it was trained on
        grids = {k: v for k, v in chunk.model_kwargs.items() if k in ("video_grid_thw", "second_per_grid_ts")}
        theirs, _ = arena.model.model.get_rope_index(chunk.input_ids, adapter.token_types(chunk.input_ids), **grids)
        assert torch.equal(theirs[:, 0], chunk.rope_ids)
    (tmp_path / "config.json").write_text(json.dumps({arena_model.VERSION_KEY: 3, RULE_KEY: "middle"}))
    with pytest.raises(UserError, match="rope_text_after_media 'middle'"):
        rule_of(SimpleNamespace(**{RULE_KEY: arena_model.trained_rope_rule(tmp_path)}))


def test_qwen3_vl_places_each_frame_after_the_last(models):
    """Qwen3-VL (left to transformers): each frame a block of one step between its timestamp and
    markers, so the authors' rule over per-frame grids gives the model's positions."""
    loaded = models("tiny-qwen3-vl")
    adapter = loaded.adapter
    chunk = adapter.encode_turn(Message("What moves?", images=[make_image(1, (112, 84))],
                                        videos=[make_video(2, frames=8, size=112)], num_frames=8), 0, 5, DEFAULT_SYSTEM)
    merge = loaded.model.config.vision_config.spatial_merge_size
    images = [(t, h // merge, w // merge) for t, h, w in chunk.model_kwargs["image_grid_thw"].tolist()]
    frames = [(1, h // merge, w // merge) for t, h, w in chunk.model_kwargs["video_grid_thw"].tolist() for _ in range(t)]
    ours, after = mrope_positions(adapter.token_types(chunk.input_ids)[0].tolist(), images, frames, start=5)
    assert torch.equal(chunk.rope_ids, ours) and chunk.next_position == after


def test_llava_positions_are_one_dimensional(models):
    loaded = models("tiny-llava")
    chunk = loaded.adapter.encode_turn(Message("What is it?", images=[make_image(1, (112, 112))],
                                               videos=[make_video(2, frames=2, size=112)], num_frames=2), 0, 9, None)
    q = chunk.input_ids.shape[1]
    assert torch.equal(chunk.rope_ids, torch.arange(9, 9 + q)[None]) and chunk.next_position == 9 + q
