"""The bundled, trained tiny-arena-vl model (generation 3): loads offline and answers held-out items
of every type right, says "unknown" to pictures outside its scenes, and answers its examples; v2's
scenes, tokenizer and training still match the app's prompts; the accuracy benchmark runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import backends
from kv_arena.bench import cli
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.models import ARENA, MODELS, describe, load_model
from tests.support import training_module

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@pytest.fixture(scope="module")
def arena():
    return load_model("tiny-arena-vl", device="cpu")


def test_bundled_model_is_registered_and_shipped():
    assert (ASSETS / "tiny-arena-vl" / "model.safetensors").stat().st_size < 20_000_000
    spec = MODELS["tiny-arena-vl"]
    assert not spec.needs_download and "(generation 3)" in describe(spec.name)
    assert "Which shape moves?" in describe(spec.name) and "'unknown'" in describe(spec.name)  # what v3 reads


def test_answers_are_judged_whole():
    from kv_arena.bench.accuracy import judge

    assert judge("Blue.", "blue").right and judge(" red  Star!", "red star").right
    assert not judge("", "red").right and not judge("The red one", "red").right and not judge("12", "1").right
    run_on = judge("blue triangle triangle", "blue triangle")
    assert not run_on.right and run_on.ran_on  # an answer that runs on past its end is wrong, and counted
    assert not judge("red", "red star").ran_on


def test_wilson_interval():
    from kv_arena.bench.accuracy import wilson

    lo, hi = wilson(190, 200)
    assert 0.90 < lo < 0.95 < hi < 0.98
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0


def test_accuracy_bench_rejects_bad_input(capsys):
    assert cli.main(["--mode", "accuracy", "--budgets", "0,2"]) == 2
    assert cli.main(["--mode", "accuracy", "--types", "weather"]) == 2
    assert "error" in capsys.readouterr().err


ITEMS = [(kind, seed) for kind in ("colour", "shape", "images", "moving") for seed in range(8)]


@pytest.fixture(scope="module")
def random_arena():
    """A random-weight tiny-arena-vl behind the app's own pieces (no bundle needed)."""
    import torch

    from kv_arena.runtime.attention import ATTENTION_NAME  # importing it registers the runtime's attention function
    from kv_arena.runtime.inputs import QwenVLAdapter
    from kv_arena.runtime.models import LoadedModel
    from kv_arena.tiny.arena_model import arena_image_processor, build_arena_model, tokenizer

    model = build_arena_model(3).eval()
    model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
    adapter = QwenVLAdapter(model, tokenizer(), arena_image_processor())
    return LoadedModel(MODELS["tiny-arena-vl"], model, adapter, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind,seed", ITEMS)
def test_scenes_are_seeded_mostly_background_and_name_their_tokens(kind, seed):
    import numpy as np

    from kv_arena.tiny.arena_scenes import BIG, SMALL, cell_pixels, item

    it, again = item(seed, kind, 3), item(seed, kind, 3)
    assert it.turns == again.turns and (it.frames() == again.frames()).all()
    side = BIG if kind in ("colour", "shape") else SMALL
    count = len(it.pictures) // 2 if it.video else len(it.pictures)
    assert it.visual_tokens() == count * side * side
    assert (count == 1) if kind in ("colour", "shape") else (2 <= count <= 4 if kind == "images" else len(it.pictures) in (4, 6, 8))
    assert len(it.informative) <= 0.25 * it.visual_tokens()  # at least 75% background
    frames = it.frames()
    pairs = [(frames[2 * g], frames[2 * g + 1]) for g in range(count)] if it.video else [(f, f) for f in frames]
    plain = cell_pixels(it.pictures[0].background, None)
    for k in range(it.visual_tokens()):  # a token is an object's exactly when its cell is not background
        g, (r, c) = k // (side * side), divmod(k % (side * side), side)
        cells = [f[r * 28:(r + 1) * 28, c * 28:(c + 1) * 28] for f in pairs[g]]
        assert all(np.array_equal(x, plain) for x in cells) == (k not in it.informative)
    asked = [set(q.tokens) for q in it.turns]
    assert len(it.turns) == 3 and all(a <= set(it.informative) for a in asked)
    assert all(not a & b for i, a in enumerate(asked) for b in asked[i + 1:])  # follow-ups: other objects
    if kind == "moving":
        mover = {it.pictures[f].things and next(t for t in it.pictures[f].things.values()
                                                  if t.shape == it.question.answer) for f in range(len(frames))}
        cells = [next(cell for cell, t in p.things.items() if t.shape == it.question.answer) for p in it.pictures]
        assert len(mover) == 1 and len(set(cells)) == len(cells)  # one object, a new cell every frame


def test_prompt_is_mostly_visual_and_every_answer_is_one_token(random_arena):
    from kv_arena.runtime.inputs import DEFAULT_SYSTEM
    from kv_arena.tiny.arena_scenes import COLOURS, SHAPES, held_out

    adapter = random_arena.adapter
    assert all(len(adapter.tokens(word)) == 1 for word in list(COLOURS) + list(SHAPES))
    assert len(adapter.tokens(DEFAULT_SYSTEM)) <= 8
    for it in held_out("colour", 3) + held_out("shape", 3):
        chunk = adapter.encode_turn(Message(it.question.text, **it.media()), 0, 0, DEFAULT_SYSTEM)
        visual = sum(v.length for v in chunk.layout.visuals)
        assert visual == 100 and visual / chunk.input_ids.shape[1] >= 0.8


@pytest.mark.parametrize("kind", ["colour", "images", "moving"])
def test_training_sees_exactly_the_apps_chat(random_arena, kind, monkeypatch):
    """Tokens, M-RoPE positions and visual tokens of a three-turn training chat are those of a real
    Conversation (whatever it answers), and an eviction in training (an attention mask) gives the
    logits that removing the same tokens from the cache gives."""
    import numpy as np
    import torch

    from kv_arena.bench.accuracy import drop_visual
    from kv_arena.runtime.attention import ATTENTION_NAME
    from kv_arena.tiny.arena_scenes import item

    train = training_module("train_arena")
    batcher = train.Batcher(random_arena.model, random_arena.adapter)
    it = item(11, kind, 3)
    batcher.check(it)
    chunks = []
    encode = random_arena.adapter.encode_turn
    monkeypatch.setattr(random_arena.adapter, "encode_turn", lambda *a, **k: chunks.append(encode(*a, **k)) or chunks[-1])
    conv = Conversation(random_arena, backends.make_backend("full"))
    said = [conv.ask(Message(q.text, **(it.media() if k == 0 else {})), max_new_tokens=1).token_ids[0]
            for k, q in enumerate(it.turns)]
    seq = batcher.encode(it)
    ids, positions = list(seq.ids), batcher.positions(seq)
    for turn, token in zip(seq.answers, said):
        ids[turn[0][0] + 1] = token  # the chat goes on from what the model said
    fed = [i for c in chunks for i in c.input_ids[0].tolist()]
    assert fed == ids[:len(fed)] and len(fed) == seq.answers[-1][0][0] + 1
    rope = torch.cat([c.rope_ids.expand(3, -1) for c in chunks], dim=1)  # text-only chunks: one row for all three
    assert torch.equal(rope, positions[:, :len(fed)])

    hidden = [int(k) for k in np.random.default_rng(0).choice(it.visual_tokens(), 40, replace=False)
              if k not in it.question.tokens]
    seq.item = it
    seq.hidden = [seq.visual_at[k] for k in hidden]
    random_arena.model.set_attn_implementation("sdpa")  # as the training script runs it
    with torch.no_grad():
        logits = train.forward(random_arena.model, batcher, [seq])[2][0]  # predicts the first answer
    random_arena.model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
    conv = Conversation(random_arena, backends.make_backend("full"))
    conv.feed(Message("", **it.media()))
    drop_visual(conv, hidden)
    conv.ask(Message(it.question.text), max_new_tokens=1)
    assert torch.allclose(logits, conv.last_logits, atol=1e-4)


def test_training_script_runs_saves_and_resumes(tmp_path, capsys):
    from kv_arena.tiny.arena_model import VERSION_KEY, build_arena_model, load_arena_weights

    train = training_module("train_arena")
    small = ["--out", str(tmp_path), "--batch", "4", "--eval-every", "1", "--eval-items", "2", "--reveal", "1,1,2",
             "--evict-from", "1", "--completion-until", "1"]
    assert train.main(small + ["--steps", "3", "--stop-at", "2"]) == 0  # the schedule of 3 steps, cut after 2
    assert train.main(small + ["--steps", "3"]) == 0  # resumes
    assert "resumed at step 2" in capsys.readouterr().out
    curve = json.loads((tmp_path / "training_curve.json").read_text())
    assert [p["step"] for p in curve] == [1, 2, 3]
    assert set(curve[-1]) >= {"loss", "colour", "colour_follow", "images_objects_only", "moving_no_needed",
                              "shape_random75"}
    assert json.loads((tmp_path / "config.json").read_text())[VERSION_KEY] == 2
    load_arena_weights(build_arena_model(), tmp_path)  # what the app loads
    assert train.reveal(0, (10, 20, 40)) == (1.0, 1.0) and train.reveal(15, (10, 20, 40)) == (0.5, 1.0)
    assert train.reveal(30, (10, 20, 40)) == (0.0, 0.5) and train.reveal(50, (10, 20, 40)) == (0.0, 0.0)


def test_accuracy_bench_refuses_probes_a_models_processor_cannot_take(tmp_path, capsys):
    """v3's pictures are larger than a random tiny Qwen2.5-VL's processor keeps (it scales them down),
    so the probes, which remove tokens by the scene's numbering, are refused before anything runs."""
    run = ["--mode", "accuracy", "--model", "tiny-qwen2.5-vl", "--methods", "full", "--per-type", "1",
           "--types", "colour", "--no-figure", "--out", str(tmp_path / "acc")]
    assert cli.main(run) == 2
    err = capsys.readouterr().err
    assert "reads a colour scene as 240 visual tokens where the scene has 728" in err and "--no-probe" in err
    assert cli.main(run + ["--no-probe"]) == 0


@pytest.fixture
def serves_v2_scenes(tmp_path, monkeypatch):
    """The bench asks the served generation's questions: v2's, whose pictures a random tiny
    Qwen2.5-VL reads on the scenes' own grid (v3's larger ones its processor scales down)."""
    folder = tmp_path / "v2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"arena_version": 2}))
    monkeypatch.setenv("KV_ARENA_TINY_DIR", str(folder))


def test_accuracy_bench_smoke(tmp_path, capsys, serves_v2_scenes):
    """Runs end to end on a random model: every point keeps its knob and realised KV fraction."""
    out = tmp_path / "acc"
    code = cli.main(["--mode", "accuracy", "--model", "tiny-qwen2.5-vl", "--methods", "full,snapkv,mpic",
                       "--budgets", "0.5,1.0", "--per-type", "1", "--types", "colour,moving", "--out", str(out)])
    assert code == 0
    report = json.loads((tmp_path / "acc.json").read_text())
    assert set(report["points"]) == {"colour", "moving"}
    snap = report["points"]["colour"]["snapkv"]
    assert [(p["knob"], p["value"]) for p in snap] == [("budget", 0.5), ("budget", 1.0)]
    assert 0 < snap[0]["realised"] < 0.75 and snap[1]["realised"] == 1.0
    assert report["points"]["colour"]["full"][0]["realised"] == 1.0
    assert [p["knob"] for p in report["points"]["moving"]["mpic"]] == [None]  # no knob: runs once
    assert set(snap[0]) >= {"with", "before", "follow", "with_ran_on", "n"}
    assert set(report["probe"]["moving"]) == {"keep only the object tokens", "drop exactly the needed tokens",
                                              "drop a random 75% of visual tokens"}
    assert (tmp_path / "acc.html").exists()
    assert "snapkv" in capsys.readouterr().out
    # the README's tables again from the JSON, nothing run
    assert cli.main(["--mode", "accuracy", "--from-json", str(tmp_path / "acc.json"), "--no-figure"]) == 0
    printed = capsys.readouterr().out
    assert f"| snapkv | budget 0.5 | {snap[0]['realised']:.2f} |" in printed and "| mpic | - |" in printed
    assert "before the question" in printed
    assert cli.main(["--mode", "accuracy", "--from-json", str(tmp_path / "missing.json")]) == 2
    # --add asks the same items of another method only: the full cache's row is the earlier run's
    assert cli.main(["--mode", "accuracy", "--add", str(tmp_path / "acc.json"), "--methods", "h2o",
                     "--budgets", "0.5", "--no-figure"]) == 0
    printed = capsys.readouterr().out
    asked = [line.split()[1] for line in printed.splitlines() if line.startswith(("colour ", "moving "))]
    assert asked == ["h2o", "h2o"]  # what it ran, a line each: not the full cache
    added = json.loads((tmp_path / "acc.json").read_text())
    assert added["points"]["colour"]["full"] == report["points"]["colour"]["full"]
    assert added["points"]["colour"]["h2o"][0]["realised"] < 0.75 and "snapkv" in added["points"]["colour"]


def test_the_bundle_is_v3(arena):
    from kv_arena.tiny import arena_v3_model, generations

    assert generations.of().number == 3 and arena.model.config.arena_version == 3
    assert arena.model.config.vision_config.depth == 4
    shipped = json.loads((ASSETS / "tiny-arena-vl" / "config.json").read_text())
    made = json.loads(arena_v3_model.arena_config().to_json_string())  # the config the engine builds in code
    assert {k: v for k, v in shipped.items() if k != "transformers_version"} == {
        k: v for k, v in made.items() if k != "transformers_version"}


def test_known_answers_first_and_follow_up(arena):
    """A handful of held-out two-turn chats of every v3 type, full cache, as a user asks them
    (kv_arena.bench.accuracy.chat: the app's Conversation, whole answers), and pictures outside its
    scenes answered "unknown", both turns."""
    from kv_arena.bench.accuracy import chat
    from kv_arena.tiny.drawn_scenes import QUESTION_TYPES, UNKNOWN, held_out

    for kind in QUESTION_TYPES:
        right = [[v.right for v in chat(arena, backends.make_backend("full"), it)[0]] for it in held_out(kind, 5, turns=2)]
        assert sum(r[0] for r in right) >= 4 and sum(r[1] for r in right) >= 4, (kind, right)
    for it in held_out("unknown", 3, turns=2):
        assert [q.answer for q in it.turns] == [UNKNOWN] * 2
        assert all(v.right for v in chat(arena, backends.make_backend("full"), it)[0]), it.question.text


def test_examples_are_answered(arena):
    """The app's clickable examples (service.arena_examples(), files drawn by assets/make_examples.py
    and read back as the app reads them), both turns, and the service marks them with those answers."""
    from kv_arena import service
    from kv_arena.service import scenes
    from kv_arena.tiny.drawn_scenes import examples

    drawn = examples()
    assert [files for _, files in service.arena_examples()] == [files for _, files in drawn.values()]
    assert [(s.questions, s.answers) for s in scenes.examples()] == [
        (tuple(q.text for q in it.turns), tuple(q.answer for q in it.turns)) for it, _ in drawn.values()]
    for it, files in drawn.values():
        message = service.prepare(it.question.text, [str(ASSETS / f) for f in files], service.default_frames(ARENA)).message
        conv = Conversation(arena, backends.make_backend("full"))
        said = [conv.ask(message if k == 0 else Message(q.text), max_new_tokens=12).text.strip()
                for k, q in enumerate(it.turns)]
        assert said == [q.answer for q in it.turns], (files, said)


def test_is_the_offline_default_and_says_what_it_answers(monkeypatch):
    import torch

    from components import about, settings
    from kv_arena import service

    monkeypatch.delenv("KV_ARENA_MODEL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert service.default_model() == "tiny-arena-vl"
    assert "Which shape moves?" in settings.model_card("tiny-arena-vl") and "Which shape moves?" in about.PANELS
