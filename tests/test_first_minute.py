"""What a visitor meets in the first minute, called directly (the layout itself is
tests/test_app_layout.py's, in a browser): a long video to try, marked like every example; one short
line when an upload is not the offline model's kind; a Compare method that compressed nothing says
so, and random eviction that ties the full cache says why; figures as a non-expert reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.app_support import ask

from components import about, chat, compare
from components.settings import settings_from_named
from kv_arena import service
from kv_arena.media import load_video

ASSETS = Path(__file__).resolve().parents[1] / "assets"
ARENA = service.ARENA


def arena_settings(**controls) -> service.Settings:
    return settings_from_named({"model": ARENA, "max_new_tokens": 4, **controls})


def test_an_example_video_lasts_a_minute_and_is_sent_under_a_cap_with_every_frame():
    long = service.long_example()
    video = load_video(long.path, num_frames=long.frames)
    assert long.seconds >= 60 and len(video.frames) == long.frames  # every drawn frame, one for one
    assert video.fps * long.seconds == pytest.approx(long.frames)
    assert long.question in [row[0]["text"] for row in chat.examples(ARENA)]
    assert chat.example_settings(ask(long.question, long.path)) == (long.stream_cap_mb, long.frames)
    short = chat.examples(ARENA)[0][0]
    assert chat.example_settings(short) == (0, service.default_frames(ARENA))
    assert "Which shape" not in chat.examples_label(None) and "68 s video streams under a 1 MB KV cap" in \
        chat.examples_label(ARENA)
    # the model card asks about shapes the model knows (it asked about a "star")
    assert "star" not in service.model_description(ARENA)


def test_the_long_example_streams_under_its_cap_and_is_marked():
    long = service.long_example()
    outputs = list(chat.respond(ask(long.question, long.path), [], service.Session(),
                                arena_settings(method="full", stream_cap_mb=long.stream_cap_mb, num_frames=long.frames)))
    status = outputs[-1].status
    assert f"streamed {long.frames} frames" in status and "✓ **right**" in status  # the full cache reads it


def test_an_upload_the_model_does_not_read_gets_one_short_line():
    outputs = list(chat.respond(ask("What is in the picture?", str(ASSETS / "street.png")), [], service.Session(),
                                arena_settings(method="snapkv")))
    status = outputs[-1].status
    assert len(status) <= 600, status  # 1,351 characters, the model card again, before
    assert "does not look like one" in status and "[What it reads](#model-about)" in status
    assert status.count("unknown") <= 1


def test_compare_says_a_method_compressed_nothing_and_why_random_answered_as_the_full_cache():
    scene = service.scene_examples()[0]
    outputs = list(compare.respond(ask(scene.questions[0], *scene.files), ["infinipot_v", "random"], service.Session(),
                                   arena_settings(budget=0.2), follow_up=scene.questions[1]))
    full, infinipot, random = outputs[-1].answers[:3]
    assert infinipot.startswith("holds 1.00x the full KV\nInfiniPot-V compresses video frames only")
    assert "held the whole cache" in infinipot
    if "loyalty 2/2" in random:  # where it answered as the full cache, why: said under its loyalty
        assert compare.RANDOM_SAME in random
    else:
        assert compare.RANDOM_SAME not in random


def test_a_method_that_held_everything_without_a_word_is_said_to_have_compressed_nothing():
    turn = service.CompareTurn(question="q", text="a", metrics=service.Meters(kv_bytes_prefill=100), done=True)
    full = service.CompareRun("full", "Full cache", (turn,))
    quiet = service.CompareRun("h2o", "H2O", (turn,))
    assert "It compressed nothing on this input" in compare.held_line(quiet, full)


def test_about_names_every_method_that_acts_before_the_model():
    for name in ("VisionZip", "Downsample", "EVS"):
        assert name in about.INTRO.split("### When do the methods differ?")[0]


def test_a_long_video_drawn_like_the_scenes_is_said_to_be_the_models_kind(tmp_path):
    """A long video a visitor brings, drawn as tools.long_video draws the model's own held-out ones,
    streamed from disk: its first frame is judged, not "this does not look like one"."""
    from kv_arena.media import write_avi
    from kv_arena.tiny.long_videos import held_out_long

    item = held_out_long("long_moving", 1)[0]
    path = tmp_path / "long.avi"
    write_avi(path, item.frames(), fps=1)
    frames = len(item.pictures)
    outputs = list(chat.respond(ask(item.turns[0].text, str(path)), [], service.Session(),
                                arena_settings(method="snapkv", stream_cap_mb=1, num_frames=frames)))
    status = outputs[-1].status
    assert f"streamed {frames} frames" in status and "drawn like" in status and "does not look like" not in status
