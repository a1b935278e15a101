"""The Compare tab's event functions called directly: the full cache then each method, the table,
the panels, and a bad selection."""

from __future__ import annotations

import re

import pytest
from tests.app_support import ask, config

from components import chat, compare
from engine import service


def test_compare_runs_full_then_each_method(media):
    session = service.Session()
    runs = list(compare.respond(ask("What is this?", media["image"]), ["streamingllm"], session, config(max_new_tokens=4)))
    *boxes, table, status, memory, speed, layers, quality, gallery, _ = runs[-1]
    assert boxes[0].label == "Full cache" and boxes[2].visible is False
    assert re.fullmatch(r"StreamingLLM · holds 0\.\d\dx the full KV", boxes[1].label)
    assert [row[0] for row in table] == ["Full cache", "StreamingLLM"]
    assert all(re.fullmatch(r"\d+\.\d\dx|~ same", cell) for cell in (table[1][2], table[1][4], table[1][6]))
    assert status.startswith("Done") and len(gallery) == 1 and gallery[0][1].startswith("StreamingLLM, ")
    assert {t.name for t in memory.data} == {"Full cache", "StreamingLLM"}
    held = float(boxes[1].label.split("holds ")[1].split("x")[0])
    point = next(t for t in quality.data if t.name == "StreamingLLM")  # quality against the measured fraction
    assert abs(point.x[0] - held) < 0.006 and f"{point.y[0]:.0%}" == table[1][7]
    assert [t.name for t in quality.data][0] == "Full cache" and tuple(quality.data[0].x) == (1.0,)
    again = list(compare.respond(ask("What is this?", media["image"]), ["streamingllm"], session, config(max_new_tokens=4)))
    assert again[-1][compare.SLOTS][0][-1].startswith("cached")  # the table's full-cache row


@pytest.mark.parametrize("methods", [[], ["streamingllm", "a", "b", "c", "d"]])
def test_compare_rejects_a_bad_selection(media, methods):
    outputs = list(compare.respond(ask("Hi", media["image"]), methods, service.Session(), config()))
    (*kept, status, memory, speed, layers, quality, gallery, box), = outputs
    assert status.startswith(chat.NOT_ANSWERED) and "Pick 1 to 4 methods" in status


def test_compare_keeps_at_most_four_ticked():
    kept, status = compare.limit_methods(["h2o", "snapkv", "zipvl", "mpic", "vl_cache"])
    assert kept == ["h2o", "snapkv", "zipvl", "mpic"] and "at most 4" in status and "VL-Cache" in status
    assert compare.limit_methods(["h2o"]) == (["h2o"], "")
