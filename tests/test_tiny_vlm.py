"""The bundled, trained tiny-arena-vl model: loads offline, answers known boards right, and the
accuracy benchmark runs end to end (on very few questions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import backends
from engine import bench
from engine.generate import Conversation
from engine.inputs import Message
from engine.models import MODELS, load_model
from engine.scenes import COLOURS, EXTRA_TYPES, GRID, colour_question, count_question, held_out, item, sample

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@pytest.fixture(scope="module")
def arena():
    return load_model("tiny-arena-vl", device="cpu")


def ask(loaded, image, question: str, question_after: bool = True) -> str:
    conv = Conversation(loaded, backends.make_backend("full"))
    if question_after:
        conv.feed(Message("", images=[image]))
        return conv.ask(Message(question), max_new_tokens=8).text.strip()
    return conv.ask(Message(question, images=[image]), max_new_tokens=8).text.strip()


def _training_module():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "training" / "train_tiny_vlm.py"
    spec = importlib.util.spec_from_file_location("train_tiny_vlm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scenes_are_seeded_and_answers_follow_the_board():
    a, qa = sample(123)
    b, qb = sample(123)
    assert a.colours == b.colours and qa == qb
    assert sum(int(count_question(a, c).answer) for c in COLOURS) == GRID * GRID
    q = colour_question(a, 1, 2)
    assert q.text == "Colour of cell F?" and q.answer == a.colours[1][2] and q.cells == ((1, 2),)
    assert a.image().size == (84, 84) and a.image(scale=4).size == (336, 336)
    assert a.image().tobytes() == b.image().tobytes()


def test_extra_question_types_have_consistent_answers():
    several = item(5, "which_image")
    counts = [len(s.cells_of(several.question.text.split()[-2])) for s in several.scenes]
    assert 2 <= len(counts) <= 3 and counts.index(max(counts)) + 1 == int(several.question.answer)
    assert counts.count(max(counts)) == 1 and len(several.media()["images"]) == len(counts)
    video = item(7, "direction")
    frames = video.frames.astype(int)
    red = [(f[..., 0] > 200) & (f[..., 1] < 80) for f in frames]  # the square's pixels, frame by frame
    ys, xs = zip(*[(m.nonzero()[0].mean(), m.nonzero()[1].mean()) for m in red])
    moved = {"left": xs[0] - xs[-1], "right": xs[-1] - xs[0], "up": ys[0] - ys[-1], "down": ys[-1] - ys[0]}
    assert max(moved, key=moved.get) == video.question.answer
    assert video.media()["videos"][0].frames.shape[0] == 8
    assert {it.question.kind for kind in EXTRA_TYPES for it in held_out(kind, 2)} == set(EXTRA_TYPES)


def test_bundled_model_is_registered_and_shipped():
    assert (ASSETS / "tiny-arena-vl" / "model.safetensors").stat().st_size < 10_000_000
    spec = MODELS["tiny-arena-vl"]
    assert not spec.needs_download and "How many" in spec.description


def test_known_answers_on_held_out_boards(arena):
    """A handful of held-out boards: counts and colours of named cells, both prompt orders."""
    items = held_out("count", 5) + held_out("colour", 5)
    got = [ask(arena, it.scenes[0].image(), it.question.text) for it in items]
    want = [it.question.answer for it in items]
    assert sum(g == w for g, w in zip(got, want)) >= 9, list(zip(got, want))
    first = items[0]
    assert ask(arena, first.scenes[0].image(), first.question.text, question_after=False) == first.question.answer


def test_example_boards_get_right_answers(arena):
    """The app's example boards (drawn 4x larger) are scaled back to 9 tokens and answered right."""
    from PIL import Image

    scene, _ = sample(11)
    image = Image.open(ASSETS / "board_1.png").convert("RGB")
    assert ask(arena, image, "How many cells are blue?") == count_question(scene, "blue").answer
    assert ask(arena, image, "Colour of cell C?") == scene.colours[0][2]


def test_accuracy_bench_smoke(tmp_path, capsys):
    out = tmp_path / "acc"
    code = bench.main(["--mode", "accuracy", "--methods", "full,streamingllm", "--budgets", "0.5,1.0",
                       "--per-type", "2", "--out", str(out)])
    assert code == 0
    report = json.loads((tmp_path / "acc.json").read_text())
    assert set(report["accuracy"]) == {"count", "colour"}
    assert set(report["accuracy"]["count"]["streamingllm"]) == {"0.5", "1.0"}
    assert set(report["accuracy"]["count"]["full"]) == {"1.0"}  # no budget: runs once
    assert set(report["probe"]["colour"]) == {"drop one unrelated cell", "drop a random 75% of cells",
                                              "drop exactly the needed cells"}
    assert (tmp_path / "acc.html").exists()
    assert "streamingllm" in capsys.readouterr().out


def test_answers_are_matched_on_their_first_word():
    from engine.bench_accuracy import is_right

    assert is_right("Blue.", "blue") and is_right("2 (the second)", "2") and is_right(" left", "left")
    assert not is_right("", "red") and not is_right("The red one", "red") and not is_right("12", "1")


def test_probe_drops_exactly_the_named_cells(arena):
    from engine.bench_accuracy import _dropper

    conv = Conversation(arena, backends.make_backend("full"))
    conv.feed(Message("", images=[sample(3)[0].image()]))
    start = conv.layouts[-1].visuals[0].span[0]
    before = conv.cache.layers[0].positions[0].tolist()
    _dropper([(0, 0), (2, 1)])(conv.cache, conv.layouts[-1])
    for layer in conv.cache.layers:
        assert layer.positions[0].tolist() == [p for p in before if p not in (start, start + 7)]


def test_accuracy_bench_rejects_bad_input(capsys):
    assert bench.main(["--mode", "accuracy", "--budgets", "0,2"]) == 2
    assert bench.main(["--mode", "accuracy", "--types", "weather"]) == 2
    assert "error" in capsys.readouterr().err


def test_offline_default_is_the_trained_model_and_the_app_examples_are_answered(monkeypatch):
    """With no GPU and no KV_ARENA_MODEL the app starts on tiny-arena-vl, says what it can answer,
    and its clickable board examples get right answers through the chat event."""
    import torch

    from components import chat, settings
    from engine import service

    monkeypatch.delenv("KV_ARENA_MODEL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert service.default_model() == "tiny-arena-vl"
    card = settings.model_card("tiny-arena-vl")
    assert "Colour of cell" in card and "random weights" not in card
    config = settings.settings_from(settings.control_values(method="full", max_new_tokens=8))
    session = service.Session()
    for (message,) in chat.examples()[:2]:
        text, files = message["text"], message["files"]
        scene = sample({"board_1.png": 11, "board_2.png": 12}[Path(files[0]).name])[0]
        want = (count_question(scene, text.split()[-1].rstrip("?")).answer if text.startswith("How many")
                else scene.colours[0][2])
        *_, last = chat.respond(message, [], session, config)
        assert last[0][-1]["content"].strip() == want, (text, last[0][-1]["content"])


def test_training_script_runs_saves_and_resumes(tmp_path, capsys):
    """A few steps of the real training script: weights and curve written, a longer schedule resumes."""
    from engine.arena_model import load_arena_weights

    train = _training_module()
    small = ["--out", str(tmp_path), "--batch", "4", "--colour-first-steps", "1", "--eval-every", "1",
             "--eval-items", "2"]
    assert train.main(small + ["--stages", "2:0.5"]) == 0
    assert [p["step"] for p in json.loads((tmp_path / "training_curve.json").read_text())] == [1, 2]
    assert train.main(small + ["--stages", "2:0.5,3:1.0:1.0"]) == 0  # the last step trains with evictions
    curve = json.loads((tmp_path / "training_curve.json").read_text())
    assert [p["step"] for p in curve] == [1, 2, 3]
    assert set(curve[-1]) >= {"count", "colour", "count_drop1", "colour_drop1", "loss"}
    assert "resumed at step 2" in capsys.readouterr().out
    model = train.build_arena_model()
    load_arena_weights(model, tmp_path)  # what the app loads
    assert train.kinds_for(5, train.parse_args(small + ["--stages", "9:1.0"])) == ["count"] * 4
    assert train.parse_stages("10:0.5,20:0.9:0.25") == [(10, 0.5, 0.0), (20, 0.9, 0.25)]
    for bad in ("10:0.5,5:0.5", "10:0.5:2", "10"):
        with pytest.raises(SystemExit):
            train.parse_stages(bad)


def test_training_evictions_are_the_probes_cache_edit(arena):
    """Training hides keys with an attention mask; the probe removes them from the cache after the
    board was prefilled. Both must give the same answers, and hidden_keys never hides what the
    answer depends on nor the first token."""
    import numpy as np
    import torch

    from engine.arena_model import load_arena_weights
    from engine.bench_accuracy import _dropper, answer, is_right

    train = _training_module()
    model = train.build_arena_model()
    load_arena_weights(model, ASSETS / "tiny-arena-vl")
    model.set_attn_implementation("sdpa")
    model.eval()
    batcher = train.Batcher(model, arena.adapter)
    items = held_out("count", 12)
    pairs = [(it.scenes[0], it.question) for it in items]
    hidden = train.one_unrelated_cell(batcher, pairs, np.random.default_rng(0))
    with torch.no_grad():
        _, hits = train.forward_loss(model, batcher, pairs, hidden=hidden)
    start = batcher.prefix_ids.shape[1]
    for it, keys, hit in zip(items, hidden, hits.tolist()):
        cells = [divmod(k - start, GRID) for k in keys]
        assert not set(cells) & set(it.question.cells)
        got = answer(arena, backends.make_backend("full"), it, _dropper(cells))
        assert is_right(got, it.question.answer) == hit, (it.question, cells, got)
    drawn = train.hidden_keys(batcher, pairs, np.random.default_rng(1), share=1.0)
    for (_, question), keys in zip(pairs, drawn):
        visual = [divmod(k - start, GRID) for k in keys if k >= start]
        assert 0 not in keys and not set(visual) & set(question.cells)
        assert 1 <= len(visual) <= 2 if len(question.cells) < GRID * GRID else not visual
