"""The engine serves the generation of tiny-arena-vl its weights' config.json names: the bundle is
v3; a v3 folder (random weights, saved as a run saves them) in KV_ARENA_TINY_DIR loads as v3 and
chats, "New scene" draws v3's kinds with the answers the scene's objects give, the marks know v3's
questions, the benches report v3; a v2 folder is still served as v2 (its scenes, its 8 frames, no
examples until drawn); an unknown generation is refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import backends
from kv_arena import service
from kv_arena.bench import cli
from kv_arena.errors import UserError
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import DEFAULT_SYSTEM, Message
from kv_arena.runtime.models import ARENA, describe, load_model, model_config
from kv_arena.service import AppState, scenes
from kv_arena.service.scene_truth import SceneObject, judge
from kv_arena.tiny import arena_model, arena_scenes, arena_v3_model, drawn_scenes, generations

V2, V3 = arena_scenes.QUESTION_TYPES, drawn_scenes.QUESTION_TYPES


@pytest.fixture(scope="module")
def v3_folder(tmp_path_factory):
    """Random v3 weights and their config.json, written as a training run writes them (and the bundle
    holds them: training/checkpoints.py's ``save``)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("v3")
    model = arena_model.build_arena_model(5, arena_v3_model.arena_config())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / arena_model.WEIGHTS))
    model.config.to_json_file(str(folder / "config.json"))
    return folder


@pytest.fixture(scope="module")
def v2_folder(tmp_path_factory):
    """Random v2 weights and their config.json (arena_version 2), as training/train_arena.py writes them."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("v2")
    model = arena_model.build_arena_model(5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / arena_model.WEIGHTS))
    model.config.to_json_file(str(folder / "config.json"))
    return folder


@pytest.fixture
def serves_v3(v3_folder, monkeypatch, tmp_path):
    """The app's offline model is the v3 folder; the test's own application state and upload folder."""
    monkeypatch.setenv("KV_ARENA_TINY_DIR", str(v3_folder))
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    with service.using_app(AppState()):
        yield v3_folder


def test_a_v3_folder_loads_as_v3_and_chats(serves_v3):
    loaded = load_model(ARENA, device="cpu")
    config = loaded.model.config
    assert config.arena_version == 3 and generations.of().number == 3
    assert config.vision_config.depth == 4 == model_config(ARENA).vision_config.depth  # v3's tower, not v2's
    adapter = loaded.adapter
    assert adapter.tokenizer.get_vocab() == arena_v3_model.tokenizer().get_vocab()
    assert {"picture", "unknown", "colours"} <= set(adapter.tokenizer.get_vocab())
    assert adapter.image_processor.size == arena_v3_model.image_processor().size  # up to 48x48 tokens, not 16x16
    it = drawn_scenes.fresh("pair", seed=1)
    chunk = adapter.encode_turn(Message(it.question.text, **it.media()), 0, 0, DEFAULT_SYSTEM)
    assert sum(v.length for v in chunk.layout.visuals) == it.visual_tokens()  # the drawn grid, as in training
    text = Conversation(loaded, backends.make_backend("snapkv", budget=0.5)).ask(
        Message(it.question.text, **it.media()), max_new_tokens=3).text
    assert isinstance(text, str) and set(text.split()) <= set(adapter.tokenizer.get_vocab())
    assert "(generation 3)" in describe(ARENA) and "'unknown'" in service.model_description(ARENA)


def test_new_scene_draws_v3_kinds_with_the_answers_their_objects_give(serves_v3):
    assert service.scene_types() == V3
    for kind in ("objects", "pair", "moving"):
        scene = service.draw_scene(kind, seed=3)
        assert scene.types == V3 and len(scene.answers) == 2
        assert judge(scene.objects, scene.video, scene.questions[0], scene.types) == (scene.answers[0], "")
        media = scenes.media_digest(scene.files)
        assert scenes.judged(media, scene.questions[1]) == (scene.answers[1], "")
    assert scene.video and sum(o.moves for o in scene.objects) == 1
    hint = service.media_hint(ARENA, [service.prepare("What is in the picture?", [])])
    assert "only answers questions about its kind of scenes" in hint and len(hint) < 200  # the card is linked, not repeated


def test_v3_takes_every_frame_of_its_videos_where_other_models_keep_eight(serves_v3):
    """v3's moving object moves inside each video token's two frames: the app feeds the trained model
    every frame of a drawn video by default (the settings, the API, Compare's and the blind test's
    settings alike); hub and random models keep 8 frames, and so their memory."""
    import numpy as np

    from components import api_docs, settings

    frames = service.default_frames(ARENA)
    assert frames == drawn_scenes.SIZES["moving"][1][1] == 32 == generations.of().video_frames
    hub, random_model = "Qwen/Qwen2-VL-2B-Instruct", "tiny-qwen2.5-vl"
    assert service.default_frames(hub) == service.default_frames(random_model) == service.DEFAULT_FRAMES == 8
    for seed in (3, 4):  # "New scene" -> the message the app prepares with the default: every frame, in order
        scene = service.draw_scene("moving", seed=seed)
        video = service.prepare(scene.questions[0], list(scene.files), frames).message.videos[0]
        drawn = drawn_scenes.fresh("moving", turns=2, seed=seed).frames()
        assert 16 <= len(drawn) <= 32 and np.array_equal(np.asarray(video.frames), drawn)
    # the controls, as Chat, Compare (the column's controls by name) and the blind test (the model alone) read them
    assert settings.settings_from(settings.control_values(model=ARENA)).num_frames == 32
    assert settings.settings_from_named({"model": ARENA}).num_frames == 32  # /blind
    assert settings.settings_from_named({"model": ARENA, "num_frames": None}).num_frames == 32  # the API's null
    assert settings.settings_from_named({"model": hub}).num_frames == 8
    assert settings.settings_from_named({"model": ARENA, "num_frames": 12}).num_frames == 12
    assert "tiny-arena-vl: 32" in api_docs.control_lines()["num_frames"]
    # picking a model moves the frames to its default unless the user set them
    assert settings.frames_for_model(ARENA, hub, 8) == 32 and settings.frames_for_model(hub, ARENA, 32.0) == 8
    assert settings.frames_for_model(hub, ARENA, 20) is settings.KEEP
    assert settings.frames_for_model(ARENA, random_model, 12) is settings.KEEP
    assert settings.on_model(ARENA, random_model, 8).num_frames == 32
    assert settings.on_model(random_model, ARENA, 32).num_frames == 8


def test_the_page_starts_on_its_models_frames(serves_v3, monkeypatch):
    import gradio as gr

    from components import settings

    for model, frames in ((ARENA, 32), ("tiny-qwen2.5-vl", 8)):
        monkeypatch.setenv("KV_ARENA_MODEL", model)
        with gr.Blocks():
            panel = settings.build_settings()
        assert panel.model.value == model and panel.num_frames.value == frames


def test_v3_examples_are_drawn_and_never_overwrite_v2s(serves_v3):
    from components import chat

    files = [f for _, names in service.arena_examples() for f in names]
    assert len(service.arena_examples()) == len(V3) == len(service.scene_examples())
    assert all((scenes.ASSETS / f).is_file() for f in files)  # drawn by assets/make_examples.py
    v2_files = {f for _, names in arena_scenes.examples().values() for f in names}
    assert not v2_files & set(files)
    assert len(chat.examples(ARENA)) == len(V3) + 1  # and the long video, streamed under a cap
    assert Path(service.long_example().path).name not in files and not v2_files & {"scene_long.mp4"}


def test_judge_marks_v3s_lists_and_pairs_and_says_why_not_otherwise():
    one = (SceneObject("ring", "blue"), SceneObject("square", "red"), SceneObject("cross", "orange"))
    assert judge(one, False, "What is in the picture?", V3) == ("red square blue ring orange cross", "")
    assert judge(one, False, "what's in this image", V3) == ("red square blue ring orange cross", "")
    assert judge(one, False, "What colours are the ring and the square?", V3) == ("blue red", "")  # as asked
    assert judge(one, False, "What colours are the square and the ring?", V3) == ("red blue", "")
    assert judge(one, False, "What colours are the ring and the circle?", V3) == (None, "this scene has no circle")
    assert judge(one, False, "What colour is the cross?", V3) == ("orange", "")
    two = one + (SceneObject("circle", "green", image=1),)
    truth, why = judge(two, False, "What is in the picture?", V3)
    assert truth is None and "one still picture" in why
    truth, why = judge(one, False, "How many shapes are there?", V3)
    assert truth is None and "what is in the picture" in why and "colours of two shapes" in why
    # v2 asks none of them: its reasons are as before
    truth, why = judge(one, False, "What is in the picture?", V2)
    assert truth is None and why == ("the scene answers the colour of a shape, the shape of a colour, or which "
                                     "shape moves, one object at a time")
    assert judge(one, False, "What colours are the ring and the square?", V2)[0] is None


def test_the_benches_report_the_served_generation(serves_v3, tmp_path):
    out = tmp_path / "acc"
    assert cli.main(["--mode", "accuracy", "--model", ARENA, "--methods", "full", "--per-type", "1",
                     "--types", "objects", "--no-probe", "--no-figure", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "acc.json").read_text())
    assert report["generation"] == 3 and set(report["points"]) == {"objects"}


def test_an_unknown_generation_is_refused_clearly(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({arena_model.VERSION_KEY: 7}))
    monkeypatch.setenv("KV_ARENA_TINY_DIR", str(tmp_path))
    with pytest.raises(UserError, match="generation 7; this app serves generations 2, 3"):
        load_model(ARENA, device="cpu")
    with pytest.raises(UserError, match="generation 7"):
        service.scene_types()
    assert "generation 7" in describe(ARENA)  # the model card says why instead of failing


def test_the_bundle_is_served_as_v3(monkeypatch):
    monkeypatch.delenv("KV_ARENA_TINY_DIR", raising=False)
    assert generations.of() is generations.GENERATIONS[3] and service.scene_types() == V3
    assert generations.of().config().to_dict() == arena_v3_model.arena_config().to_dict()
    assert service.default_frames(ARENA) == generations.of().video_frames == 32
    assert "(generation 3)" in describe(ARENA)


def test_a_v2_folder_is_still_served_as_v2(v2_folder, monkeypatch, tmp_path):
    """The previous generation, from a run's folder: v2's model, scenes, frames and words; its
    examples (assets/arena_*, no longer shipped) are skipped until drawn, so none are offered."""
    from components import chat

    monkeypatch.setenv("KV_ARENA_TINY_DIR", str(v2_folder))
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    with service.using_app(AppState()):
        assert generations.of() is generations.GENERATIONS[2] and service.scene_types() == V2
        loaded = load_model(ARENA, device="cpu")
        assert loaded.model.config.arena_version == 2 and loaded.model.config.vision_config.depth == 1
        assert loaded.adapter.tokenizer.get_vocab() == arena_model.tokenizer().get_vocab()
        it = arena_scenes.fresh("colour", seed=1)
        text = Conversation(loaded, backends.make_backend("snapkv", budget=0.5)).ask(
            Message(it.question.text, **it.media()), max_new_tokens=2).text
        assert set(text.split()) <= set(loaded.adapter.tokenizer.get_vocab())
        assert "(generation 2)" in describe(ARENA)
        # its videos have 4 to 8 frames: 8 feeds each whole
        longest = max(len(arena_scenes.fresh("moving", seed=s).frames()) for s in range(40))
        assert service.default_frames(ARENA) == generations.of().video_frames == longest == 8
        assert service.scene_examples() == () and chat.examples(ARENA) == []
        scene = service.draw_scene("shape", seed=2)
        assert scene.types == V2 and judge(scene.objects, scene.video, scene.questions[0], V2) == (scene.answers[0], "")


def test_missing_weights_name_their_generations_training(tmp_path):
    import importlib.util

    from kv_arena.tiny.arena_model import TRAINED_BY, VERSION_KEY, load_arena_weights

    assert set(TRAINED_BY) == set(generations.GENERATIONS)
    assert all(importlib.util.find_spec(module) for module in TRAINED_BY.values())  # named, never imported
    model = arena_model.build_arena_model(0, arena_v3_model.arena_config())
    for version, says, not_said in ((None, "python -m training.train_arena", "train_arena_v3"),
                                    (3, "python -m training.train_arena_v3", "train_arena or"),
                                    (7, "python -m training.train_arena or python -m training.train_arena_v3", "")):
        folder = tmp_path / str(version)
        folder.mkdir()
        if version is not None:
            (folder / "config.json").write_text(json.dumps({VERSION_KEY: version}))
        with pytest.raises(UserError, match="model.safetensors is missing; train it with") as refused:
            load_arena_weights(model, folder)
        assert str(refused.value).endswith(says) and (not not_said or not_said not in str(refused.value))
