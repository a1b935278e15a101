"""The offline model's scenes with their true answers (examples and "New scene"), the marks, the
uncompressed AVI a drawn video is written as, agreement over answer tokens only, and the speed
computed at real scale."""

from __future__ import annotations

import numpy as np
import pytest

from kv_arena.errors import UserError
from kv_arena.media import decoded_pixels, load_video, write_avi
from kv_arena.runtime.generate import agreement
from kv_arena.service import at_scale, scenes
from kv_arena.service.inputs import prepare


def test_examples_have_a_follow_up_about_another_object_and_known_answers():
    for scene in scenes.examples():
        assert len(scene.questions) == len(scene.answers) == 2 and scene.questions[0] != scene.questions[1]
        media = prepare(scene.questions[0], list(scene.files)).media  # as the app keys a message's media
        assert scenes.true_answer(media, scene.questions[1].upper()) == scene.answers[1]  # normalised match
        assert scenes.true_answer(media, "What is the meaning of this?") is None
    assert scenes.true_answer("", "What colour is the circle?") is None  # no media, no scene


def test_every_question_about_a_scenes_objects_is_marked_and_another_says_why_not():
    """The scene knows every object: the colour of any shape, the shape of any colour, which moves,
    in any of its images; a question its objects cannot answer gets a short reason, not a mark."""
    by_kind = {scene.kind: prepare(scene.questions[0], list(scene.files)).media for scene in scenes.examples()}
    colour = by_kind["colour"]  # a yellow cross, a purple circle, a red triangle, an orange square
    assert scenes.judged(colour, "What colour is the triangle?") == ("red", "")
    assert scenes.judged(colour, "what COLOR is the Triangle") == ("red", "")
    assert scenes.judged(colour, "Which shape is red?") == ("triangle", "")
    assert scenes.judged(colour, "What colour is the ring?") == (None, "this scene has no ring")
    assert scenes.judged(colour, "Which shape is green?") == (None, "nothing in this scene is green")
    assert scenes.judged(colour, "Which shape moves?") == (None, "nothing moves in a still picture")
    truth, why = scenes.judged(colour, "How many shapes are there?")
    assert truth is None and "colour of a shape" in why
    assert scenes.judged(by_kind["images"], "What colour is the circle?") == ("blue", "")  # the second of four images
    assert scenes.judged(by_kind["images"], "Which shape is orange?") == ("ring", "")  # the fourth
    assert scenes.judged(by_kind["moving"], "What colour is the square?") == ("orange", "")
    assert scenes.judged(by_kind["moving"], "What colour is the shape that moves?") == ("orange", "")
    assert scenes.judged("", "What colour is the circle?") == (None, "")  # no scene: no mark, nothing to say
    drawn = scenes.draw_scene("moving", seed=7)
    media = scenes.media_digest(drawn.files)
    assert scenes.judged(media, "Which shape moves?") == (drawn.answers[0], "")


def test_a_new_scene_is_drawn_with_its_answers():
    scene = scenes.draw_scene("colour", seed=5)
    assert scenes.scene_of(scenes.media_digest(scene.files)) == scene
    assert scenes.is_right(f" {scene.answers[0].upper()}.", scene.answers[0]) is True
    assert scenes.is_right("nothing", scene.answers[0]) is False and scenes.is_right("x", None) is None
    with pytest.raises(UserError, match="scene type"):
        scenes.draw_scene("weather")


def test_a_drawn_video_reads_back_pixel_for_pixel(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, size=(4, 28, 42, 3), dtype=np.uint8)
    write_avi(tmp_path / "v.avi", frames, fps=2)
    video = load_video(str(tmp_path / "v.avi"), num_frames=4)
    assert np.array_equal(video.frames, frames) and video.timestamps == [0.0, 0.5, 1.0, 1.5]


def test_a_video_with_fewer_frames_than_asked_comes_back_whole(tmp_path):
    """Every frame once, in order (none repeated, none padded), decoded at once or as read; the
    decoded-pixels budget counts the frames there are. Fewer asked: evenly spaced, as before."""
    frames = np.random.default_rng(1).integers(0, 256, size=(6, 28, 42, 3), dtype=np.uint8)
    path = str(tmp_path / "v.avi")
    write_avi(path, frames, fps=2)
    for asked, lazy in ((6, False), (32, False), (40, True)):
        video = load_video(path, num_frames=asked, lazy=lazy)
        assert len(video.frames) == 6 and np.array_equal(np.asarray(video.frames), frames)
        assert video.timestamps == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
        assert decoded_pixels(path, True, asked)[0] == 6 * 28 * 42
    fewer = load_video(path, num_frames=3)
    assert np.array_equal(fewer.frames, frames[[0, 2, 5]]) and fewer.timestamps == [0.0, 1.0, 2.5]


def test_agreement_leaves_the_end_of_turn_out():
    eos = {9}
    assert agreement([5, 9], [6, 9], eos) == 0.0  # two different one-word answers do not half agree
    assert agreement([5, 9], [5, 9], eos) == 1.0 and agreement([5, 9], [6, 9]) == 0.5


def test_speed_at_scale_reads_weights_and_cache_per_step():
    arch = next(a for a in at_scale.architectures() if a.name == "Qwen/Qwen2.5-VL-7B-Instruct")
    assert 7e9 < arch.decoder_params < 8.5e9  # a 7B model's language part
    short, long = at_scale.speed(arch, 0.2, 1_000), at_scale.speed(arch, 0.2, 32_768)
    assert short.step_method_s < short.step_full_s and long.ttft_s > 30 * short.ttft_s
    saved = long.step_full_s - long.step_method_s
    assert saved == pytest.approx(0.8 * long.kv_full_bytes / at_scale.A100.bandwidth)
