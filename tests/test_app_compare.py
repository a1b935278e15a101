"""The Compare tab's event functions called directly: the full cache then each method, the table,
the panels, a bad selection or no question, and the examples' previews."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tests.app_support import ask, config

from app import launch_options
from components import chat, compare, compare_table, example_posters
from components.settings import control_values, settings_from
from kv_arena import service
from kv_arena.errors import UserError


def test_compare_runs_full_then_each_method(media):
    session = service.Session()
    runs = list(compare.respond(ask("What is this?", media["image"]), ["streamingllm"], session, config(max_new_tokens=4)))
    first = runs[0].answers
    assert first[0].label == "Full cache" and first[1].label == "StreamingLLM" and first[2].visible is False
    last = runs[-1]
    boxes, table, status, memory, quality, gallery, scale = (last.answers, last.table, last.status, last.memory,
                                                             last.quality, last.gallery, last.at_scale)
    assert re.match(r"holds 0\.\d\dx the full KV\n\n1\. What is this\?\n→ ", boxes[1])
    assert [row[:2] for row in table] == [["Full cache", 1], ["StreamingLLM", 1]]
    assert re.fullmatch(r"\d+\.\d\dx", table[1][2])  # bytes: exact
    assert all(re.fullmatch(r"\d+\.\d\dx|≈|–", cell) for cell in (table[1][4], table[1][6]))
    assert table[1][9] == ""  # no right/wrong mark: the app did not draw this picture
    assert status.startswith("Done") and len(gallery) == 1 and gallery[0][1] is None  # the caption is drawn in
    assert {t.name.split(":")[0] for t in memory.data} == {"Full cache", "StreamingLLM"}
    held = float(boxes[1].split("holds ")[1].split("x")[0])
    point = next(t for t in quality.data if t.name == "StreamingLLM")  # quality against the measured fraction
    assert abs(point.x[0] - held) < 0.006 and f"{point.y[0]:.0%}" == table[1][8]
    assert [t.name for t in quality.data][0] == "Full cache" and tuple(quality.data[0].x) == (1.0,)
    assert scale.startswith("*Computed, not measured*") and "StreamingLLM" in scale
    again = list(compare.respond(ask("What is this?", media["image"]), ["streamingllm"], session, config(max_new_tokens=4)))
    assert again[-1].table[0][0] == "Full cache (cached)"  # the table's full-cache row


def test_compare_asks_a_follow_up_on_each_methods_own_cache(media):
    outputs = list(compare.respond(ask("What is this?", media["image"]), ["h2o", "snapkv"], service.Session(),
                                   config(max_new_tokens=3), follow_up="And the colours?"))
    boxes, table, quality = outputs[-1].answers, outputs[-1].table, outputs[-1].quality
    assert [row[:2] for row in table] == [["Full cache", 1], ["Full cache", 2], ["H2O (heavy hitters)", 1],
                                          ["H2O (heavy hitters)", 2], ["SnapKV", 1], ["SnapKV", 2]]
    assert "2. And the colours?\n→ " in boxes[2]
    point = next(t for t in quality.data if t.name == "SnapKV")  # one marker per turn
    assert len(point.x) == 2 and list(point.marker.symbol) == ["circle", "diamond"]


def test_the_offline_models_example_is_marked_right_or_wrong_and_methods_differ():
    """Done when: one example in Compare, four methods at 0.2, both turns marked, and at least two
    methods differ from the full cache on some turn."""
    first, then = compare.example_rows(True)[0]
    values = control_values(model=service.ARENA, budget=compare.DEFAULT_BUDGET)
    outputs = list(compare.respond(first, compare.DEFAULT_METHODS, service.Session(), settings_from(values),
                                   follow_up=then))
    boxes, table = outputs[-1].answers, outputs[-1].table
    assert len(table) == 2 * 5 and all(row[9] == "✓" or row[9].startswith("✗ (true: ") for row in table)
    assert [row[9] for row in table[:2]] == ["✓", "✓"]  # the full cache answers both right
    differ = {row[0] for row in table[2:] if row[8] != "100%"}
    assert len(differ) >= 2
    assert all("✓ right" in box or "✗ wrong" in box for box in boxes)


def test_question_before_or_with_the_media():
    first, then = compare.example_rows(True)[0]
    values = control_values(model=service.ARENA, budget=0.2, compress="before_question")
    outputs = list(compare.respond(first, ["snapkv"], service.Session(), settings_from(values)))
    table = outputs[-1].table
    assert table[0][9] == "✓" and table[1][3] > 0  # answered, its TTFT counts both prefills
    with pytest.raises(UserError, match="When the cache is compressed"):
        settings_from(control_values(model=service.ARENA, compress="sometimes"))


def test_new_scene_fills_both_questions_with_known_answers():
    scene = compare.new_scene("images")
    box, then, status = scene.textbox, scene.follow_up, scene.status
    assert box["text"] and then and len(box["files"]) >= 2 and "new images scene" in status
    refused = compare.new_scene("nonsense")
    assert refused.status.startswith(chat.NOT_ANSWERED) and set(refused.changed()) == {"status"}
    assert compare.new_scene("moving").textbox["files"][0].endswith(".avi")  # drawn frames, read back pixel for pixel


@pytest.mark.parametrize("methods", [[], ["streamingllm", "a", "b", "c", "d"]])
def test_compare_rejects_a_bad_selection(media, methods):
    outputs = list(compare.respond(ask("Hi", media["image"]), methods, service.Session(), config()))
    (refused,) = outputs
    status = refused.status
    assert set(refused.changed()) == {"status", "textbox"}  # the rest as it was
    assert status.startswith(chat.NOT_ANSWERED) and "Pick 1 to 4 methods" in status


def test_compare_keeps_at_most_four_ticked():
    kept, status = compare.limit_methods(["h2o", "snapkv", "zipvl", "mpic", "vl_cache"])
    assert kept == ["h2o", "snapkv", "zipvl", "mpic"] and "at most 4" in status and "VL-Cache" in status
    kept, status = compare.limit_methods(["h2o"])
    assert status == "" and not isinstance(kept, list)  # within the limit the boxes are left as ticked (gr.skip)


def test_a_refused_method_keeps_the_pictures_in_the_box():
    """VisionZip refused on a tower without a CLS token: the example's pictures stay in the box, so
    the next Compare without it still sends them."""
    first, then = compare.example_rows(True)[2]
    values = control_values(model=service.ARENA, budget=compare.DEFAULT_BUDGET)
    (refused,) = list(compare.respond(first, ["visionzip", "kivi"], service.Session(), settings_from(values),
                                      follow_up=then))
    assert refused.status.startswith(chat.NOT_ANSWERED) and "VisionZip" in refused.status
    assert refused.textbox["files"] == first["files"] and refused.textbox["text"] == first["text"]


def test_four_runs_of_one_example_give_the_same_speed_verdicts():
    """The same Compare example four times, each in a new session (the full cache run again): no
    speed ratio that one run shows is called ≈ or "too short" by another, or read otherwise."""
    first, then = compare.example_rows(True)[0]
    values = control_values(model=service.ARENA, budget=compare.DEFAULT_BUDGET)
    verdicts = []
    for _ in range(4):
        table = list(compare.respond(first, compare.DEFAULT_METHODS, service.Session(), settings_from(values),
                                     follow_up=then))[-1].table
        verdicts.append({(row[0], row[1]): (row[4], row[6]) for row in table[2:]})
    for cell in verdicts[0]:
        for column in (0, 1):
            seen = {v[cell][column] for v in verdicts}
            marks = {v for v in seen if not re.fullmatch(r"\d+\.\d\dx", v)}
            assert not marks or len(seen) == 1, (cell, seen)  # a mark in one run is that mark in every run
            numbers = [float(v[:-1]) for v in seen if v not in marks]
            assert not numbers or max(numbers) / min(numbers) < 1.5 and (min(numbers) > 1) == (max(numbers) > 1)


def test_a_compared_question_the_scene_cannot_answer_says_why_once_under_the_table():
    """The cell says "not marked" (the reason in it made each row about 400 px tall); why, once per
    turn under the table, and in each answer column."""
    scene = str(chat.ASSETS / "scene_colour.png")
    last = list(compare.respond(ask("What colour is the triangle?", scene), ["snapkv"], service.Session(),
                                config("full", model="tiny-arena-vl"), follow_up="How many shapes are there?"))[-1]
    right = [row[compare_table.COLUMNS.index("Right?")] for row in last.table]  # full cache's turns, then SnapKV's
    assert right[0] in ("✓", "✗ (true: red)") and right[1::2] == ["not marked", "not marked"]
    assert last.notes.startswith("*Not marked*, turn 2: the scene answers the colour of a shape")
    assert last.notes.endswith(".") and "\n" not in last.notes  # once, though two runs' rows say it
    assert "(not marked: the scene answers" in last.answers[1]
    marked = list(compare.respond(ask("What colour is the triangle?", scene), ["snapkv"], service.Session(),
                                  config("full", model="tiny-arena-vl")))[-1]
    assert marked.notes == ""  # every turn marked: nothing under the table


@pytest.mark.parametrize("text", ["", "   "])
def test_compare_refuses_media_without_a_first_question(text):
    """A picture and no question: refused in the status line, before any model work, the picture
    left in the box for the question (as the API's /compare says too: tests/test_app_client.py)."""
    first, then = compare.example_rows(True)[0]
    (refused,) = list(compare.respond({"text": text, "files": first["files"]}, ["snapkv"], service.Session(),
                                      config("full", model="tiny-arena-vl"), follow_up=then))
    assert set(refused.changed()) == {"status", "textbox"}  # the answers, table and panels as they were
    assert refused.status.startswith(chat.NOT_ANSWERED) and "The first question is empty" in refused.status
    assert refused.textbox == {"text": text, "files": first["files"]}


def test_the_tables_numbers_keep_whole_and_turn_has_room():
    """What the browser test (tests/test_app_layout.py) sees, in the CSS and widths it is given."""
    assert len(compare_table.WIDTHS) == len(compare_table.COLUMNS)
    assert float(compare_table.WIDTHS[compare_table.COLUMNS.index("Turn")].rstrip("%")) >= 7
    assert '[data-col="0"], [data-col="9"]' in compare_table.TABLE_CSS and "white-space: nowrap" in compare_table.TABLE_CSS
    assert compare_table.TABLE_CSS in launch_options()["css"]


def test_every_example_video_has_its_first_frame_as_a_still_preview():
    """Each example row with a video carries a preview: its first frame, drawn behind the video in
    the page's CSS (a browser that loads no video before it is played showed an empty box)."""
    videos = example_posters.videos_of(compare.example_rows(True) + compare.example_rows(False))
    assert {Path(v).name for v in videos} == {"scene_moving.mp4", "bouncing_ball.mp4"}
    css = launch_options()["css"]
    for video in videos:
        rule = example_posters.rule(video)
        assert rule in css and f'video[src$="/{Path(video).name}"]' in rule
        data = base64.b64decode(re.search(r'url\("data:image/jpeg;base64,([^"]+)"\)', rule).group(1))
        preview, first = Image.open(io.BytesIO(data)).convert("RGB"), service.first_frame(video)
        assert preview.size == first.size  # the frame itself, JPEG aside
        assert np.abs(np.asarray(preview, np.int16) - np.asarray(first, np.int16)).mean() < 8
