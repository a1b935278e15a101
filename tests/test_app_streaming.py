"""A video streamed into the chat under a memory cap, through the chat's event functions: the answer
arrives, the memory panel has one point per chunk under the cap (plus one chunk), follow-ups go on
on the capped cache, the full cache streamed without a cap answers as the one-prompt turn does, and
a method that cannot hold a cap is refused in one line."""

from __future__ import annotations

import re

import gradio as gr
import pytest
from tests.app_support import MODEL, ask, config, turn
from tests.support import make_video

from components import chat_status, plots, settings
from kv_arena import service
from kv_arena.errors import UserError
from kv_arena.media import write_avi
from kv_arena.service import streamed

CHUNK_FRAMES = 2  # one temporal group of tiny-qwen2-vl: 16 visual tokens
CAP_BYTES = 80 * 2048  # 80 tokens of tiny-qwen2-vl (2 KiB each, all layers)


@pytest.fixture
def video(tmp_path, monkeypatch):
    monkeypatch.setattr(streamed, "FRAMES_PER_CHUNK", CHUNK_FRAMES)
    path = tmp_path / "eight.avi"
    write_avi(path, make_video(3, frames=8, size=112).frames, fps=2)
    return str(path)


def chunk_trace(memory) -> tuple[list[float], float | None]:
    """The memory panel's bytes after each chunk, and its cap line, back in bytes."""
    scale, = [s for s, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "bytes"))
              if f"({unit})" in memory.layout.yaxis.title.text]
    chunks = [t for t in memory.data if t.name.endswith("after each chunk of frames")]
    cap = [t for t in memory.data if t.name.startswith("cap ")]
    return [y * scale for y in chunks[0].y], (cap[0].y[0] * scale if cap else None)


def streamed_turn(session, path, method, cap_mb, history=(), **kw):
    return turn(session, ask("What happens?", path) if path else ask("And then?"), history, method=method,
                num_frames=8, stream_cap_mb=cap_mb, max_new_tokens=6, **kw)


def test_a_video_streams_under_a_cap_and_follow_ups_go_on(video):
    full_session, capped_session = service.Session(), service.Session()
    full, error = streamed_turn(full_session, video, "full", CAP_BYTES / 2**20)
    assert error is None
    rising, _ = chunk_trace(full[-1].memory)
    assert len(rising) == 4 and rising == sorted(set(rising))  # 8 frames, 2 a chunk: the full cache only grows
    one_chunk = max(b - a for a, b in zip(rising, rising[1:]))

    outputs, error = streamed_turn(capped_session, video, "infinipot_v", CAP_BYTES / 2**20)
    assert error is None and outputs[-1].chatbot[-1]["content"] not in ("", "…")
    held, cap = chunk_trace(outputs[-1].memory)
    assert cap == CAP_BYTES and len(held) == 4  # one point per chunk of frames
    assert all(b <= CAP_BYTES + one_chunk for b in held) and max(held) < max(rising)
    status = outputs[-1].status
    assert re.search(r"streamed 8 frames in 4 chunks under a cap of 160\.0 KiB \(at most [\d.]+ KiB", status)
    peak = float(re.search(r"at most ([\d.]+) KiB", status).group(1)) * 2**10
    assert peak <= CAP_BYTES + one_chunk
    (visual,) = capped_session.visuals  # the overlay draws the video whole: its 4 temporal groups, joined from the chunks
    assert visual.label == "video 1" and visual.keep.shape[1] == 4

    history = outputs[-1].chatbot
    follow, error = streamed_turn(capped_session, None, "infinipot_v", CAP_BYTES / 2**20, history)
    assert error is None and follow[-1].chatbot[: len(history)] == history
    assert not any(m.get("metadata") for m in follow[-1].chatbot) and len(capped_session.history) == 2


def test_the_full_cache_streamed_answers_as_one_prompt_does(video):
    one_prompt, _ = streamed_turn(service.Session(), video, "full", 0)
    streamed_, _ = streamed_turn(service.Session(), video, "full", 1.0)
    assert streamed_[-1].chatbot[-1]["content"] == one_prompt[-1].chatbot[-1]["content"]
    assert "streamed 8 frames in 4 chunks without a cap" in streamed_[-1].status
    assert not any(t.name.endswith("after each chunk of frames") for t in one_prompt[-1].memory.data)


def test_a_method_that_cannot_hold_a_cap_is_refused_in_one_line(video):
    outputs, error = streamed_turn(service.Session(), video, "h2o", 1.0)
    assert error is not None and "H2O" in error and "cannot stream a video under a memory cap" in error
    assert "\n" not in error and outputs[-1].chatbot == []  # the chat as it was


def test_a_cap_below_what_infinipot_v_never_evicts_is_refused_in_one_line_and_rolled_back(video):
    session = service.Session()
    outputs, error = streamed_turn(session, video, "infinipot_v", 40 / 1024)
    assert error is not None and "\n" not in error and outputs[-1].chatbot == []
    assert re.search(r"InfiniPot-V cannot hold the cache under a cap of 40\.0 KiB: .* the smallest cap it can hold; "
                     r"it keeps video tokens from [\d.]+ KiB\. The conversation is as it was before this message", error)
    assert session.conv is None  # the half-streamed cache went: the conversation is as before (none)


def test_the_frame_limit_rises_with_a_cap():
    with pytest.raises(UserError, match="Video frames must lie between 1 and 32"):
        settings.settings_from(settings.control_values(model=MODEL, num_frames=600))
    assert config(num_frames=600, stream_cap_mb=2).num_frames == 600
    with pytest.raises(UserError, match="Video frames must lie between 1 and 1024"):
        config(num_frames=2000, stream_cap_mb=2)
    with pytest.raises(UserError, match=r"The memory cap \(MB\) must lie between 0 and 65536; got -1"):
        config(stream_cap_mb=-1)
    raised, lowered = settings.on_stream_cap(2, 8), settings.on_stream_cap(0, 600)
    assert raised.maximum == 1024 and "Up to 1,024 while streaming" in raised.info
    assert lowered.maximum == 32 and lowered.value == 32
    with gr.Blocks():
        panel = settings.build_settings()
    assert "stream_cap_mb" in panel.named and "InfiniPot-V" in panel.stream_cap.info


def test_the_memory_figure_draws_chunks_before_the_answer_and_the_cap():
    stream = service.StreamView(frames=[2, 4, 6], kv_bytes=[1, 2, 1.5], peak_kv_bytes=[2, 3, 3], frames_total=6,
                                cap_bytes=2, capped=True)
    run = plots.Drawn("InfiniPot-V", service.Meters(kv_trace=[3, 4]), stream=stream)
    figure = plots.memory_figure([run])
    chunks, cap = figure.data[1], figure.data[2]
    assert list(chunks.x) == [-3, -2, -1] and list(cap.x) == [-3, 1] and list(cap.y) == [2, 2]
    assert chat_status.stream_line(stream).startswith("streamed 6 frames in 3 chunks under")
    assert chat_status.stream_line(stream, 64).startswith("streamed 6 frames in 3 chunks (all the media have: the slider "
                                                   "asked for 64) under")


def test_a_video_over_one_prompts_frames_is_decoded_as_it_streams_and_drawn_in_part(tmp_path, monkeypatch):
    from kv_arena.media import FramesOnDisk

    monkeypatch.setattr(streamed, "FRAMES_PER_CHUNK", 8)
    path = tmp_path / "forty.avi"
    write_avi(path, make_video(4, frames=40, size=56).frames, fps=4)
    assert not isinstance(service.prepare("What happens?", [str(path)], 8).message.videos[0].frames, FramesOnDisk)
    frames = service.prepare("What happens?", [str(path)], 40).message.videos[0].frames
    assert isinstance(frames, FramesOnDisk) and frames.shape == (40, 56, 56, 3)
    session = service.Session()
    outputs, error = turn(session, ask("What happens?", str(path)), method="infinipot_v", num_frames=40,
                          stream_cap_mb=CAP_BYTES / 2**20, max_new_tokens=3)
    assert error is None and "streamed 40 frames in 5 chunks" in outputs[-1].status
    # no full-cache reference for a video longer than one prompt: no "x of the full cache" anywhere,
    # the reason and the full cache's bytes, computed, against the cap instead
    last = outputs[-1]
    shown = " ".join(str(v) for v in (last.status, last.scale_line, last.realised))
    assert not re.search(r"\d\.\d\dx|saved\)", shown), shown
    assert "No full-cache reference" in last.realised and re.search(r"a full cache would hold [\d.]+ KiB after the "
                                                                    r"media against the cap of 160\.0 KiB", last.realised)
    assert last.scale_line == ""
    (visual,) = session.visuals  # 20 temporal groups: the overlay draws 16 of them, evenly spaced
    assert visual.label == "video 1, 16 of 20 frames drawn"
    assert visual.keep.shape[1] == len(visual.pictures) == 16
