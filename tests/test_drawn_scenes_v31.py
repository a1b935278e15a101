"""tiny-arena-vl v3.1's new data (issue #57): drawing variations, photo-like pictures, long videos, and
chats asked "before the question"; v3's own items unchanged."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import backends
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import DEFAULT_SYSTEM, Message
from kv_arena.tiny import drawn_scenes as scenes
from kv_arena.tiny import long_videos, photo_like, scene_variations
from tests.support import training_module
from tests.test_drawn_scenes import v3  # noqa: F401  (the fixture)


def _digest(it) -> str:
    h = hashlib.sha1()
    for im in it.images():
        h.update(np.asarray(im).tobytes())
    h.update(repr([(q.text, q.answer, q.tokens, q.parts) for q in it.turns]).encode())
    return h.hexdigest()


def test_v3_items_are_unchanged_by_the_variations():
    """The variations are opt-in: a v3 object (no angle, stroke 1, no outline, no shade) is drawn by
    v3's own calls, and an item drawn twice is the same; the varied item of a seed is another scene."""
    t = scenes.Thing("cross", "red", 0.5, 0.5, 0.2)
    assert (t.angle, t.stroke, t.outline, t.rgb) == (0.0, 1.0, None, None)
    for kind in scenes.QUESTION_TYPES:
        it = scenes.held_out(kind, 1, turns=2)[0]
        assert _digest(it) == _digest(scenes.held_out(kind, 1, turns=2)[0])
        assert all(p.angle == 0 and p.stroke == 1 and p.outline is None and p.rgb is None
                   for pic in it.pictures for p in pic.things)
        assert _digest(scene_variations.varied_item(10_000_000, kind, 2)) != _digest(it)


def test_the_variations_are_drawn():
    things = [t for s in range(40) for kind in ("colour", "pair", "images", "moving")
              for p in scene_variations.varied_item(s, kind, 2).pictures[:1] for t in p.things]
    angles = [abs(t.angle) for t in things if t.angle]
    assert angles and np.mean([10 <= a <= 20 for a in angles]) > 0.6  # a fifth further round, at any angle
    assert any(t.stroke > 1.2 for t in things) and any(t.outline for t in things)
    assert any(t.rgb == (255, 165, 0) and t.colour == "orange" for t in things)  # web orange is orange
    ones = [scene_variations.varied_item(s, "colour", 2) for s in range(30)]
    one = [it for it in ones if len(it.pictures[0].things) == 1]
    assert one, "some scenes hold one object"
    for it in one:  # its follow-up asks the other property of the same object
        (t,) = it.pictures[0].things
        assert [q.answer for q in it.turns] == [t.colour, t.shape]


@pytest.mark.parametrize("seed", range(4))
def test_every_varied_pixel_lies_in_its_objects_tokens(seed):
    """Turned, thick and outlined objects stay inside the cells their questions name."""
    rng = np.random.default_rng(seed)
    cols = rows = 20
    picture = scenes.Picture(cols, rows, {"base": (30, 30, 30), "texture": "plain", "seed": 1, "strength": 10},
                             render={"scale": 1.5, "resize_to": (cols * scenes.CELL, rows * scenes.CELL)})
    vary = scene_variations.Variations(turn=1.0, stroke=1.0, outline=0.5, shade=0.5)
    for shape, colour in scenes.kinds(rng, 5):
        thing = scenes.place(rng, picture, shape, colour)
        if thing is not None:
            thing = vary.thing(rng, thing)
            if thing.outline == (0, 0, 0):
                thing = scene_variations.dataclasses.replace(thing, outline=(255, 255, 255))
            picture.things.append(thing)
    pixels = np.asarray(scenes.draw(picture)).astype(int)
    named = {k for t in picture.things for k in picture.cells_of(t)}
    for r in range(rows):
        for c in range(cols):
            cell = pixels[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28]
            if (np.abs(cell - 30).max(-1) > 40).mean() > 0.05:
                assert r * cols + c in named, (r, c)


def test_photo_like_pictures_are_answered_unknown():
    kinds = set()
    for seed in range(8):
        it = photo_like.photo_item(seed, turns=2)
        assert it.kind == "unknown" and [q.answer for q in it.turns] == [scenes.UNKNOWN] * 2 and not it.informative
        images = it.images()
        assert all(np.asarray(im).shape == (p.rows * scenes.CELL, p.cols * scenes.CELL, 3)
                   for im, p in zip(images, it.pictures))
        assert np.asarray(images[0]).std() > 5  # not a blank picture
        kinds |= {p.background["kind"] for p in it.pictures}
    assert len(kinds) >= 3


def test_big_subject_photos_change_only_the_kind_of_picture():
    """subject_share draws on a stream of its own: without it the held-out photos are what they were;
    with it the same pictures (seed, size, saving) show one big subject instead."""
    # the first held-out photo chat as every v3.1 evaluation before step 8,500 drew it
    assert _digest(photo_like.held_out_photos(1)[0]) == "5fa331355144165875a1f87b41653c0bf2a047de"
    for seed in range(6):
        plain, subject = photo_like.photo_item(seed, 2), photo_like.photo_item(seed, 2, subject_share=1.0)
        assert all(p.background["kind"] in photo_like.KINDS for p in plain.pictures)
        assert all(p.background["kind"] == photo_like.SUBJECT for p in subject.pictures)
        assert [(p.cols, p.rows, p.background["photo"], p.render) for p in plain.pictures] == \
            [(p.cols, p.rows, p.background["photo"], p.render) for p in subject.pictures]
        assert [q.text for q in plain.turns] == [q.text for q in subject.turns]
        big = np.asarray(subject.images()[0], np.float32)
        assert big.std() > 10  # a subject against its background, not a flat picture


@pytest.mark.parametrize("kind", long_videos.LONG_TYPES)
def test_long_videos_keep_their_grid_and_name_their_tokens(v3, kind):  # noqa: F811
    for seed in range(2):
        it = long_videos.long_item(seed, kind, 2)
        assert it.video and len(it.pictures) >= long_videos.LONG_SIZES[1][0] and it.fps == long_videos.LONG_FPS
        chunk = v3.adapter.encode_turn(Message(it.question.text, **it.media()), 0, 0, DEFAULT_SYSTEM)
        assert sum(v.length for v in chunk.layout.visuals) == it.visual_tokens()  # the processor keeps the grid
        for q in it.turns:
            assert q.tokens and set(q.tokens) <= set(it.informative)
    for seed in range(4):  # the asked object is in view for a short stretch of whole video tokens
        it = long_videos.long_item(seed, "glimpse", 1)
        seen = [k for k, p in enumerate(it.pictures) if any(it.question.text.endswith(f" {t.shape}?") for t in p.things)]
        assert 6 <= len(seen) <= 16 and seen == list(range(seen[0], seen[-1] + 1)) and seen[0] % 2 == 0


@pytest.mark.parametrize("kind", long_videos.LONG_TYPES)
def test_a_long_video_over_minutes_is_the_same_scene_further_apart_in_time(v3, kind):  # noqa: F811
    """Spread over 10 minutes (as the app samples such a video) a long video keeps its frames and
    questions; only its times change, and with them the time ids, about ten times further apart."""
    fast, slow = long_videos.long_item(5, kind, 2), long_videos.long_item(5, kind, 2, minutes=10)
    assert np.array_equal(fast.frames(), slow.frames()) and [q.answer for q in fast.turns] == [q.answer for q in slow.turns]
    assert slow.fps == pytest.approx(len(slow.pictures) / 600)
    ids = [v3.adapter.encode_turn(Message(it.question.text, **it.media()), 0, 0, DEFAULT_SYSTEM).rope_ids[0].max()
           for it in (fast, slow)]
    assert ids[1] > 5 * ids[0]
    with pytest.raises(ValueError, match="positive"):
        long_videos.long_item(5, kind, minutes=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_long_video_demo_is_sampled_back_to_the_drawn_frames(tmp_path, seed):
    """tools.long_video --question glimpse: a 5-minute video at 1 fps whose drawn frames the app's
    sampling (kv_arena.media.load_video, asked for as many) gives back one for one."""
    from kv_arena.media import load_video
    from tools.long_video import draw_video

    question, answer, written, asked = draw_video(tmp_path / "v.avi", 5, 1, seed, "glimpse")
    item = long_videos.held_out_long("glimpse", seed + 1, turns=1, minutes=5)[seed]
    assert (question, answer, written, asked) == (item.question.text, item.question.answer, 300, len(item.pictures))
    clip = load_video(str(tmp_path / "v.avi"), asked)
    assert np.abs(clip.frames.astype(int) - item.frames().astype(int)).max() <= 2  # uncompressed, each a drawn frame
    assert clip.sample_fps == pytest.approx(item.fps, rel=0.1)


def test_the_long_video_demo_writes_each_drawn_frame_where_the_app_samples_it():
    """Over every length the demo draws (40 to 72 frames) and writes (1 to 10 minutes at 1 or 2 fps): the frames
    the app samples (kv_arena.media.sampled_frames) show the drawn frames in order, one each."""
    from kv_arena.media import sampled_frames
    from tools.long_video import held_frames

    lo, hi = long_videos.LONG_SIZES[1]
    for minutes in range(1, 11):
        for fps in (1, 2):
            count = minutes * 60 * fps
            for drawn in range(lo, min(hi, count) + 1):  # fewer frames than drawn: the tool refuses
                shown = held_frames(count, drawn)
                assert shown[sampled_frames(count, drawn)].tolist() == list(range(drawn)), (minutes, fps, drawn)
                assert shown.tolist() == sorted(shown.tolist())  # in order, each held once in one stretch


def test_the_probe_reads_long_videos_over_any_minutes(capsys):
    probe = training_module("probe_v31")
    assert probe.main(["assets/tiny-arena-vl", "--over", "1,5", "--long-items", "1", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == ["minutes", "1", "5"]
    assert all(r.count(" / ") == len(long_videos.LONG_TYPES) for r in rows[1:])


def test_the_long_video_demo_refuses_bad_counts_in_one_line(capsys):
    from tools.long_video import main

    assert main(["--videos", "0"]) == 2 and main(["--minutes", "0"]) == 2
    assert capsys.readouterr().err.count("error:") == 2


@pytest.mark.parametrize("kind", ["moving", "colour"])
def test_a_chat_asked_apart_is_what_a_conversation_feeds_before_the_question(v3, kind, monkeypatch):  # noqa: F811
    """The media prefilled in a part of their own, then the question (Conversation.feed, then ask):
    the training chat's tokens and positions are those fed; for a video its question sits after the
    video's last time id, not where the one-turn chat puts it."""
    train = training_module("train_arena_v3")
    it = scenes.item(3, kind, 2)
    chunks = []
    encode = v3.adapter.encode_turn
    monkeypatch.setattr(v3.adapter, "encode_turn", lambda *a, **k: chunks.append(encode(*a, **k)) or chunks[-1])
    conv = Conversation(v3, backends.make_backend("full"))
    conv.feed(Message("", **it.media()))
    said = [conv.ask(Message(q.text), ignore_eos=True, max_new_tokens=len(v3.adapter.tokens(q.answer))).token_ids
            for q in it.turns]
    monkeypatch.undo()
    seq = train.encode(v3.adapter, it, apart=True)
    assert chunks[0].layout.visuals and not chunks[1].layout.visuals  # the media in a part of their own
    ids = list(seq.ids)
    for turn, tokens in zip(seq.answers, said):
        for (at, _), token in zip(turn, tokens):
            ids[at + 1] = token
    fed, rope = chunks[0].input_ids[0].tolist(), [chunks[0].rope_ids]
    for chunk, tokens in zip(chunks[1:], said):
        fed += chunk.input_ids[0].tolist() + tokens[:-1]
        rope += [chunk.rope_ids.expand(3, -1), torch.arange(chunk.next_position, chunk.next_position + len(tokens) - 1).expand(3, -1)]
    assert fed == ids[:len(fed)]
    assert torch.equal(torch.cat(rope, dim=1), seq.positions[:, :len(fed)])
    together = train.encode(v3.adapter, it)
    assert together.ids == seq.ids
    assert torch.equal(together.positions, seq.positions) != it.video  # only a video's question moves


def test_v31_starts_from_the_bundle_and_resumes(tmp_path, capsys):
    import json

    v31 = training_module("train_arena_v31")
    small = ["--out", str(tmp_path), "--tokens", "300", "--max-batch", "2", "--eval-items", "1", "--long-eval-items", "1",
             "--threads", "1", "--workers", "1", "--eval-every", "1", "--steps", "6253"]
    assert v31.main(small + ["--stop-at", "6251"]) == 0
    assert "starts from" in capsys.readouterr().out
    assert v31.main(small) == 0
    assert "resumed at step 6251" in capsys.readouterr().out
    curve = json.loads((tmp_path / "training_curve.json").read_text())
    assert [p["step"] for p in curve] == [6250, 6251, 6252, 6253] and curve[0]["loss"] is None
    assert set(curve[-1]) >= {"colour", "colour_follow", "moving_needed_only", "before_moving", "varied_shape",
                              "photo", "unknown", "glimpse", "long_moving", "glimpse_10min", "long_moving_10min"}
    args = v31.parse_args([])
    assert (curve[-1]["long_share"], curve[-1]["slow_share"]) == (args.long_share, args.slow_share)
    assert curve[-1]["subject_share"] == args.subject_share == 0.0 and "photo_subject" in curve[-1]
    assert curve[-1]["steps"] == 6253 and curve[-1]["slow_minutes"] == [5.0, 10.0]
    assert v31.lr_from(6250, args) < v31.lr_from(6250 + args.warmup, args) <= args.lr == 2e-4


def test_stage_one_draws_the_variations_only_when_asked():
    """Stage 1's pictures and clips: v3's drawings without --varied-share (its runs replay), v3.1's
    variations with it."""
    eyes = training_module("train_arena_v3_eyes")
    adapter = training_module("checkpoints").build_v3(0)[1]
    processor = eyes.arena_v3_model.image_processor()
    plain = eyes.parse_args(["--pictures", "6", "--video-share", "0.5"])
    varied = eyes.parse_args(["--pictures", "6", "--video-share", "0.5", "--varied-share", "1"])
    things = lambda samples: [t for s in samples for t, _, _ in s.objects]  # noqa: E731
    assert all(t.angle == 0 and t.stroke == 1 and t.outline is None and t.rgb is None
               for step in range(3) for t in things(eyes.draw_step(step, plain, adapter, processor)))
    drawn = [t for step in range(3) for t in things(eyes.draw_step(step, varied, adapter, processor))]
    assert any(t.angle for t in drawn) and any(t.stroke > 1 for t in drawn) and any(t.rgb for t in drawn)


def test_v31_goes_on_with_a_tower_continued_on_the_variations(tmp_path, capsys):
    """Stage 1 continued with --varied-share evaluates the varied pictures and clips too; the v3.1
    run resumed with --new-eyes goes on with that tower, saved with it, and its curve names the
    tower, so the first evaluations of the new tower are not held against the old one's best."""
    import json

    from safetensors.torch import load_file

    eyes = training_module("train_arena_v3_eyes")
    v31 = training_module("train_arena_v31")
    small = ["--pictures", "1", "--cells", "8", "10", "--objects", "2", "3", "--eval-items", "5", "--threads", "1"]
    more = tmp_path / "v31-eyes"
    assert eyes.main(small + ["--out", str(more), "--start-from", "training/stage1", "--steps", "8001",
                              "--varied-share", "1"]) == 0
    assert {"varied_shape", "varied_clips_motion"} <= set(json.loads((more / "training_curve.json").read_text())[-1])
    run = tmp_path / "run"
    stage2 = ["--out", str(run), "--tokens", "300", "--max-batch", "2", "--eval-items", "1", "--long-eval-items", "1",
              "--threads", "1", "--workers", "1", "--eval-every", "9", "--steps", "6252", "--no-eval-first"]
    assert v31.main(stage2 + ["--stop-at", "6251"]) == 0
    assert v31.main(stage2 + ["--new-eyes", str(more)]) == 0
    assert "replaces the run's from step 6251" in capsys.readouterr().out
    curve = json.loads((run / "training_curve.json").read_text())
    assert [(p["step"], p["tower"]) for p in curve] == [(6251, "stage1"), (6252, "v31-eyes")]
    saved = load_file(str(run / "model.safetensors"))
    visual = {k.split("visual.", 1)[1]: v for k, v in saved.items() if k.startswith(("visual.", "model.visual."))}
    continued = eyes.load_eyes(more)[0]
    assert visual and all(torch.equal(visual[k], continued[k]) for k in continued)

    args = v31.parse_args([])
    best = {"colour": 1.0}
    old = [{"step": s, "lr_factor": 1.0, "tower": "stage1", **best} for s in (1, 2)]
    low = {"colour": 0.5}
    new = old + [{"step": 3, "lr_factor": 1.0, "tower": "v31-eyes", **low}]
    assert v31.watch(new, low, 4, args, 1.0, "v31-eyes") == 1.0  # the old tower's best is not the bar
    assert v31.watch(old + [{"step": 3, "lr_factor": 1.0, "tower": "stage1", **low}], low, 4, args, 1.0) == 0.5


def test_the_v31_probe_counts_right_answers_by_variation(capsys):
    """probe_v31 on the bundle: every varied type's first questions, right/asked by the variations
    their objects carry (each chat under "plain" or its variations); a run is needed."""
    probe = training_module("probe_v31")
    for it in scene_variations.held_out_varied("shape", 8, turns=1):
        tags = probe.tags_of(it)
        assert tags and tags <= set(probe.TAGS) and ("plain" not in tags or tags == {"plain"})
    assert probe.main(["assets/tiny-arena-vl", "--items", "3", "--threads", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert [line.split(" (")[0] for line in lines] == list(scenes.QUESTION_TYPES)
    assert all(f"/{3})" in line.split(":")[0] for line in lines)
    with pytest.raises(SystemExit):
        probe.main(["--items", "3"])


def test_the_v31_bar_prints_the_model_cards_tables(capsys):
    """probe_v31 --bar: a row per type (first / follow-up, only its objects, before the question,
    varied), "unknown" and photo-like rows, the long videos at 1 frame a second and over 5 and 10
    minutes, and the bar's line; the exit code says whether the bar is met."""
    probe = training_module("probe_v31")
    code = probe.main(["assets/tiny-arena-vl", "--bar", "--items", "1", "--long-items", "1", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [line.split(" | ")[0].lstrip("| ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["type", *scenes.QUESTION_TYPES, "unknown (out-of-scope pictures)", "unknown (photo-like pictures)",
                    "unknown (photo-like, one big subject)",
                    "long video, asked after it (first / follow-up)", *long_videos.LONG_TYPES]
    last = out.strip().splitlines()[-1]
    assert last.startswith("v3's bar: ") and code == (1 if "under" in last else 0)


def test_the_v31_bar_holds_v3s_bar_and_bars_before_the_question_and_photos_but_shows_varied():
    v31 = training_module("train_arena_v31")
    acc = {k: 1.0 for t in scenes.QUESTION_TYPES for k in (t, t + "_follow", "before_" + t, "varied_" + t)}
    acc |= {"unknown": 0.99, "photo": 0.95, "varied_pair": 0.85}
    assert v31.bar_line(acc) == "v3's bar: held; v3.1's (0.9): met; varied drawings (shown): lowest varied_pair 0.85"
    acc |= {"unknown": 0.97, "before_moving": 0.85, "photo": 0.8}
    assert v31.bar_line(acc).startswith("v3's bar: under: unknown 0.97; v3.1's (0.9): under: before_moving 0.85, photo 0.80;")
