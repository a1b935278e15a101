"""tiny-arena-vl v3's drawings (kv_arena/tiny/drawn_scenes.py) and its training script: seeded, drawn
off the token grid, every object's tokens named on the grid the image processor really makes,
answers in the vocabulary, and the training chat exactly the app's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import backends
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import DEFAULT_SYSTEM, Message
from kv_arena.runtime.models import MODELS
from kv_arena.tiny import drawn_scenes as scenes
from tests.support import training_module


@pytest.fixture(scope="module")
def v3():
    """A random-weight v3 model behind the app's own pieces (no trained weights needed)."""
    from kv_arena.runtime.attention import ATTENTION_NAME  # importing it registers the runtime's attention function
    from kv_arena.runtime.models import LoadedModel
    from kv_arena.runtime.vision_attention import VISION_ATTENTION_NAME

    model, adapter = training_module("checkpoints").build_v3(3)
    model.eval().set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": VISION_ATTENTION_NAME})
    return LoadedModel(MODELS["tiny-arena-vl"], model, adapter, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", scenes.QUESTION_TYPES)
def test_items_are_seeded_and_at_the_papers_sizes(v3, kind):
    it, again = scenes.item(5, kind, 3), scenes.item(5, kind, 3)
    assert it.turns == again.turns
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(it.images(), again.images()))
    chunk = v3.adapter.encode_turn(Message(it.question.text, **it.media()), 0, 0, DEFAULT_SYSTEM)
    visuals = chunk.layout.visuals
    assert sum(v.length for v in visuals) == it.visual_tokens()  # the processor keeps the drawn grid
    if not it.video:
        assert [tuple(v.grid[1:]) for v in visuals] == [(p.rows, p.cols) for p in it.pictures]
    text = chunk.input_ids.shape[1] - it.visual_tokens()
    assert text <= 30 and it.visual_tokens() >= 480  # SnapKV's 32-token window is under a fifth of it
    for q in it.turns:
        assert set(q.tokens) <= set(it.informative)
        assert v3.adapter.tokenizer.unk_token_id not in v3.adapter.tokens(q.text + " " + q.answer)
    asked = [set(q.tokens) for q in it.turns]
    if kind != "objects":
        assert all(not a & b for i, a in enumerate(asked) for b in asked[i + 1:])  # follow-ups: other objects


@pytest.mark.parametrize("kind", scenes.QUESTION_TYPES)
def test_every_question_indexes_the_grid_the_model_receives_at_every_scale(v3, kind):
    """At every picture size of the training curriculum (--scale-from up to full size), the processor
    keeps the drawn grid (no picture under its 64-token minimum, which it would enlarge), so the cells
    each question names are its object's cells in the grid the model receives."""
    train = training_module("train_arena_v3")
    args = train.parse_args([])
    for scale in sorted({train.scale_at(step, args) for step in range(0, args.scale_until + 1, 300)}):
        for seed in range(2):
            it = scenes.item(seed, kind, 2, scale)
            chunk = v3.adapter.encode_turn(Message(it.question.text, **it.media()), 0, 0, DEFAULT_SYSTEM)
            visuals = chunk.layout.visuals
            grids = [tuple(int(x) for x in v.grid[1:]) for v in visuals]
            drawn = [(p.rows, p.cols) for p in it.pictures]
            assert grids == (drawn[:1] * len(visuals) if it.video else drawn), (kind, scale, seed)
            assert sum(v.length for v in visuals) == it.visual_tokens()
            for q in it.turns:
                assert q.tokens and set(q.tokens) <= set(range(it.visual_tokens()))


def test_sizes_cover_the_range():
    sizes = {kind: [scenes.item(s, kind).visual_tokens() for s in range(12)] for kind in ("colour", "images", "moving")}
    assert min(sizes["colour"]) >= 480 and max(sizes["images"]) >= 1500 and max(sizes["moving"]) >= 2000
    frames = [len(scenes.item(s, "moving").pictures) for s in range(12)]
    assert min(frames) >= 16 and max(frames) <= 32


@pytest.mark.parametrize("kind", scenes.QUESTION_TYPES)
def test_every_object_is_a_cell_across_or_more(kind):
    """v3 reads objects a cell across (28 px at the processed size) and larger: smaller ones, which its
    frozen tower read at under 0.8, are not drawn (the fallback of docs/offline-model.md)."""
    for seed in range(6):
        it = scenes.item(seed, kind)
        sides = [t.size * p.rows for p in it.pictures for t in p.things]
        assert sides and min(sides) >= scenes.OBJECT_CELLS[0] - 1e-9 and max(sides) <= scenes.OBJECT_CELLS[1] + 1e-9
    assert scenes.OBJECT_CELLS[0] >= 1.0


def test_objects_are_listed_in_colour_order_and_pairs_name_two():
    for seed in range(10):
        it = scenes.item(seed, "objects")
        words = it.question.answer.split()
        colours = words[0::2]
        assert colours == [c for c in scenes.COLOURS if c in colours] and set(words[1::2]) <= set(scenes.SHAPES)
        assert len(words) == 2 * len({t.colour for p in it.pictures for t in p.things})
        pair = scenes.item(seed, "pair").question
        assert len(pair.answer.split()) == 2 and pair.text.startswith("What colours are the")


@pytest.mark.parametrize("seed, cols, rows, scale", [(0, 24, 20, 1.0), (1, 24, 20, 1.0), (2, 24, 20, 1.0),
                                                      (3, 24, 20, 1.0), (4, scenes.MIN_SIDE, scenes.MIN_SIDE, 0.5),
                                                      (5, scenes.MIN_SIDE, 9, 2.0)])
def test_every_drawn_pixel_lies_in_its_objects_tokens(seed, cols, rows, scale):
    """On a plain background, drawn at ``scale`` times the processed size and resized to it as a
    user's picture is (the smallest pictures too), a cell that differs from the background is one the
    item names as an object's, and objects sit off the token grid."""
    rng = np.random.default_rng(seed)
    render = {"scale": scale, "resize_to": (cols * scenes.CELL, rows * scenes.CELL)}
    picture = scenes.Picture(cols, rows, {"base": (30, 30, 30), "texture": "plain", "seed": 1, "strength": 10},
                             render=render)
    for shape, colour in scenes.kinds(rng, 5 if cols > scenes.MIN_SIDE else 3):
        thing = scenes.place(rng, picture, shape, colour)
        if thing is not None:
            picture.things.append(thing)
    pixels = np.asarray(scenes.draw(picture)).astype(int)
    named = {k for t in picture.things for k in picture.cells_of(t)}
    for r in range(picture.rows):
        for c in range(picture.cols):
            cell = pixels[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28]
            changed = (np.abs(cell - 30).max(-1) > 40).mean()
            if changed > 0.05:  # a strip of a pixel or two along an edge does not count
                assert r * picture.cols + c in named, (r, c, changed)
    offsets = [(t.x * picture.cols) % 1 for t in picture.things]
    assert any(0.1 < o < 0.9 for o in offsets)


def test_out_of_scope_pictures_are_answered_unknown():
    kinds = set()
    for seed in range(10):
        it = scenes.out_of_scope(seed, turns=2)
        assert [q.answer for q in it.turns] == [scenes.UNKNOWN] * 2 and not it.informative
        assert all(np.asarray(im).shape[2] == 3 for im in it.images())
        kinds.add(it.turns[0].text)
    assert len(kinds) > 1


def test_fresh_scenes_are_new_and_answered():
    a, b = scenes.fresh("colour", seed=1), scenes.fresh("colour", seed=2)
    assert a.turns != b.turns and len(a.turns) == 2 and a.question.answer in scenes.COLOURS


@pytest.mark.parametrize("kind", ["pair", "moving"])
def test_training_sees_exactly_the_apps_chat(v3, kind, monkeypatch):
    """Tokens and M-RoPE positions of a three-turn training chat are those a real Conversation
    feeds (whatever it answers); its pixels are the chunk's own (training calls encode_turn)."""
    train = training_module("train_arena_v3")
    it = scenes.item(3, kind, 3)
    chunks = []
    encode = v3.adapter.encode_turn
    monkeypatch.setattr(v3.adapter, "encode_turn", lambda *a, **k: chunks.append(encode(*a, **k)) or chunks[-1])
    conv = Conversation(v3, backends.make_backend("full"))
    said = [conv.ask(Message(q.text, **(it.media() if k == 0 else {})), ignore_eos=True,
                     max_new_tokens=len(v3.adapter.tokens(q.answer))).token_ids for k, q in enumerate(it.turns)]
    monkeypatch.undo()
    seq = train.encode(v3.adapter, it)
    ids = list(seq.ids)
    for turn, tokens in zip(seq.answers, said):
        for (at, _), token in zip(turn, tokens):
            ids[at + 1] = token  # the chat goes on from what the model said, as long as the answer
    fed, rope = [], []  # each turn's chunk, then the answer tokens its decode steps fed (all but the last)
    for chunk, tokens in zip(chunks, said):
        fed += chunk.input_ids[0].tolist() + tokens[:-1]
        rope += [chunk.rope_ids.expand(3, -1), torch.arange(chunk.next_position, chunk.next_position + len(tokens) - 1).expand(3, -1)]
    assert fed == ids[:len(fed)] and len(fed) == seq.answers[-1][-2][0] + 1
    assert torch.equal(torch.cat(rope, dim=1), seq.positions[:, :len(fed)])


def test_training_script_runs_saves_and_resumes(tmp_path, capsys):
    from kv_arena.tiny.arena_model import VERSION_KEY, bundled_version, load_arena_weights

    train = training_module("train_arena_v3")
    small = ["--out", str(tmp_path), "--tokens", "400", "--max-batch", "2", "--eval-every", "1", "--eval-items", "1",
             "--scale-from", "0.3", "--evict-from", "1", "--threads", "1"]
    assert train.main(small + ["--steps", "3", "--stop-at", "2"]) == 0  # the schedule of 3 steps, cut after 2
    assert train.main(small + ["--steps", "3"]) == 0  # resumes
    assert "resumed at step 2" in capsys.readouterr().out
    curve = json.loads((tmp_path / "training_curve.json").read_text())
    assert [p["step"] for p in curve] == [1, 2, 3]
    assert set(curve[-1]) >= {"loss", "colour", "objects_follow", "pair", "unknown"}
    assert json.loads((tmp_path / "config.json").read_text())[VERSION_KEY] == 3 == bundled_version(tmp_path)
    load_arena_weights(train.checkpoints.build_v3()[0], tmp_path)  # what a resumed run loads


def test_training_asks_the_types_begun_by_each_step():
    train = training_module("train_arena_v3")
    args = train.parse_args(["--types-from", "colour=0,shape=2,images=2,moving=5,pair=5,objects=9",
                             "--tokens", "300", "--max-batch", "3"])
    assert train.types_at(0, args.types_from) == ["colour"]
    assert train.types_at(2, args.types_from) == ["colour", "shape", "images"]
    assert train.types_at(9, args.types_from) == list(train.scenes.QUESTION_TYPES)
    adapter = train.setup(args)[1]
    assert {s.item.kind for s in train.draw(0, args, adapter)} <= {"colour", "unknown"}
    with pytest.raises(SystemExit):  # every type needs a first step, one of them 0
        train.parse_args(["--types-from", "colour=1,shape=2"])


def test_the_moving_object_moves_inside_every_tokens_two_frames_at_every_scale():
    """A video token spans frames 2g and 2g + 1: "Which shape moves?" is answerable only if the object
    moves inside each of those pairs (a path drawn straight across the frame did not fit 16-32 frames,
    and nearly every full-size video had it still)."""
    train = training_module("train_arena_v3")
    args = train.parse_args([])
    for scale in sorted({train.scale_at(step, args) for step in range(0, args.scale_until + 1, 300)}):
        for seed in range(12):
            it = scenes.item(seed, "moving", 1, scale)
            frames = it.pictures
            for g in range(len(frames) // 2):
                (a,), (b,) = ([t for t in frames[f].things if t.shape == it.question.answer] for f in (2 * g, 2 * g + 1))
                cells = np.hypot((a.x - b.x) * frames[0].cols, (a.y - b.y) * frames[0].rows)
                assert cells >= 0.6, (scale, seed, g)
                assert all(t.size / 2 - 1e-9 <= t.y <= 1 - t.size / 2 + 1e-9 for t in (a, b))
                still = [t for t in frames[2 * g].things if t != a]
                assert still == [t for t in frames[2 * g + 1].things if t != b]  # the others stay put


@pytest.mark.parametrize("kind", ["colour", "images", "pair", "objects"])
def test_each_answer_word_is_tied_to_the_core_of_its_object(kind):
    """``Question.parts``: per answer word, the cells whose centre lies in its object's box (a cell at the
    edge shows a corner, not the shape), never empty, always among the cells the question depends on."""
    for seed in range(6):
        it = scenes.item(seed, kind, 2)
        offsets = np.cumsum([0] + [p.token_count for p in it.pictures])
        boxes = {}
        for i, p in enumerate(it.pictures):
            for t in p.things:
                boxes[t.colour] = (i, p, t)
        for q in it.turns:
            assert len(q.parts) == len(q.answer.split())
            for word, part in zip(q.answer.split(), q.parts):
                assert part and set(part) <= set(q.tokens if kind != "objects" else it.informative)
                i, p, t = boxes[word] if word in boxes else next(b for b in boxes.values() if b[2].shape == word)
                cells = [k - offsets[i] for k in part]
                assert set(cells) <= set(p.cells_of(t))
                if len(cells) > 1:
                    assert all(abs((k % p.cols + 0.5) / p.cols - t.x) <= t.size / 2 * p.rows / p.cols + 1e-9 for k in cells)


def test_stage_one_continues_a_finished_run_and_stage_two_takes_its_tower(tmp_path, capsys):
    """Stage 1 goes on from a finished run's tower, heads, curve and step (--start-from, a new mix),
    and a resumed stage 2 run swaps its frozen tower for that one (--new-eyes), saved with the run."""
    from safetensors.torch import load_file

    eyes = training_module("train_arena_v3_eyes")
    train = training_module("train_arena_v3")
    small = ["--pictures", "1", "--cells", "8", "10", "--objects", "2", "3", "--eval-items", "3", "--threads", "1"]
    first, more = tmp_path / "eyes", tmp_path / "eyes-more"
    assert eyes.main(small + ["--out", str(first), "--steps", "1"]) == 0
    assert eyes.main(small + ["--out", str(more), "--start-from", str(first), "--steps", "2", "--video-share", "1"]) == 0
    assert "continuing" in capsys.readouterr().out
    assert [p["step"] for p in json.loads((more / "training_curve.json").read_text())] == [1, 2]
    tower, continued = eyes.load_eyes(first)[0], eyes.load_eyes(more)[0]
    assert any(not torch.equal(tower[k], continued[k]) for k in tower)  # it trained on

    run = tmp_path / "run"
    stage2 = ["--out", str(run), "--tokens", "300", "--max-batch", "2", "--eval-every", "9", "--eval-items", "1",
              "--threads", "1", "--eyes", str(first)]
    assert train.main(stage2 + ["--steps", "2", "--stop-at", "1"]) == 0
    assert train.main(stage2 + ["--steps", "2", "--new-eyes", str(more)]) == 0
    assert "replaces the run's from step 1" in capsys.readouterr().out
    saved = load_file(str(run / "model.safetensors"))
    visual = {k.split("visual.", 1)[1]: v for k, v in saved.items() if ".visual." in k or k.startswith("visual.")}
    assert visual and all(torch.equal(visual[k], continued[k]) for k in continued)  # frozen, so saved as given
