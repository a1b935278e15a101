"""The object loss of tiny-arena-vl v3's stage 2 (training/object_loss.py): every visual token's
target is the object its cell belongs to (motion only where the object moves), the heads it trains
stay outside the model, and a run with both auxiliary losses saves and resumes them."""

from __future__ import annotations

import json

import pytest
import torch

from kv_arena.tiny import drawn_scenes as scenes
from tests.support import training_module

objects = training_module("object_loss")
train = training_module("train_arena_v3")


@pytest.mark.parametrize("kind", ["colour", "images", "moving", "pair"])
def test_every_named_token_carries_its_objects_shape_and_colour(kind):
    it = scenes.item(11, kind, 2, 0.5)
    targets = objects.object_targets(it)
    assert all(len(t) == it.visual_tokens() for t in targets.values())
    assert set(torch.nonzero(targets["colour"]).flatten().tolist()) == set(it.informative)
    for q in it.turns:
        for word, part in zip(q.answer.split(), q.parts):
            if word in scenes.COLOURS:
                assert {int(targets["colour"][k]) for k in part} == {1 + list(scenes.COLOURS).index(word)}
            if word in scenes.SHAPES:
                assert {int(targets["shape"][k]) for k in part} == {1 + scenes.SHAPES.index(word)}
    moving = set(torch.nonzero(targets["motion"]).flatten().tolist())
    if kind == "moving":  # the moving object's tokens, every frame pair: what "Which shape moves?" names
        assert moving == set(it.question.tokens)
    else:
        assert not moving


def test_out_of_scope_pictures_have_no_targets():
    assert objects.object_targets(scenes.out_of_scope(3, 1, 0.5)) is None


def test_a_run_with_both_losses_saves_its_heads_outside_the_model_and_resumes(tmp_path):
    from safetensors.torch import load_file

    args = ["--eyes", "training/stage1", "--out", str(tmp_path), "--threads", "1", "--eval-every", "1",
            "--eval-items", "1", "--point-weight", "0.5", "--object-weight", "0.5", "--hop-from", "0", "--scale-from", "0.3",
            "--scale-until", "100000", "--tokens", "1200", "--max-batch", "3"]
    assert train.main(args + ["--stop-at", "1"]) == 0
    saved = torch.load(tmp_path / objects.HEADS_FILE)
    assert set(saved["heads"]) == {f"{h}.{p}" for h in ("shape", "colour", "motion") for p in ("weight", "bias")}
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert not any(k.startswith(("shape", "colour", "motion")) for k in weights)  # the app's model, nothing more
    assert train.main(args + ["--stop-at", "2"]) == 0
    curve = json.loads((tmp_path / "training_curve.json").read_text())
    assert [p["step"] for p in curve] == [1, 2]
    again = torch.load(tmp_path / objects.HEADS_FILE)
    assert not torch.equal(again["heads"]["shape.weight"], saved["heads"]["shape.weight"])  # trained on
