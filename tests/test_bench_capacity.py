"""``--mode capacity``: what each method's cache fits beside the weights (issue #60), and the app's
computed sentence built on the same arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kv_arena.bench import cli
from kv_arena.runtime import capacity

# a tiny model, short prompts: the arithmetic and the JSON, in seconds
TINY = ["--mode", "capacity", "--model", "tiny-qwen2-vl", "--memory-gb", "4", "--reserve-gb", "0.25",
        "--methods", "full,snapkv,kivi", "--budget", "0.2", "--visual-tokens", "128", "--frame", "112x112",
        "--picture", "224x224", "--conversation-tokens", "512"]


@pytest.fixture(scope="module")
def rows():
    from kv_arena.bench import capacity as mode

    return {r["method"]: r for r in mode.run(mode.parse_args(TINY[2:]))}


def test_the_full_caches_count_is_the_room_over_its_bytes_per_token(rows):
    full = rows["full"]
    assert full["bytes_per_visual_token"] == full["bytes_per_text_token"] == full["full_bytes_per_token_config"]
    room = 4 * capacity.GIB - full["weight_bytes"] - full["reserve_bytes"]
    assert full["room_bytes"] == int(room) and full["tokens_fit"] == int(room // full["full_bytes_per_token_config"])
    plain = (4 * capacity.GIB - full["weight_bytes"]) / full["bytes_per_visual_token"]  # no reserve
    assert 0.85 * plain <= full["tokens_fit"] <= plain
    # 112 x 112 frames: 4 x 4 merged patches a pair of frames; 224 x 224 pictures: 8 x 8
    assert full["tokens_per_frame"] == 8 and full["tokens_per_picture"] == 64
    assert full["frames_fit"] == room // (16 * full["bytes_per_visual_token"]) * 2
    assert full["conversations_fit"] == room // (512 * full["bytes_per_text_token"])


def test_snapkv_and_kivi_fit_several_times_the_full_caches_tokens(rows):
    assert 3.5 <= rows["snapkv"]["vs_full"] <= 6
    assert rows["kivi"]["vs_full"] >= 3 and rows["kivi"]["params"]["bits"] == 2
    for row in rows.values():
        assert row["tokens_fit"] == int(row["room_bytes"] // row["bytes_per_visual_token"])
        assert row["conversations_fit"] <= row["room_bytes"] // (512 * row["bytes_per_text_token"])


def test_json_rows_and_a_table(capsys):
    assert cli.main(TINY + ["--methods", "full", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert {"tokens_fit", "frames_fit", "pictures_fit", "conversations_fit", "bytes_per_visual_token",
            "bytes_per_text_token", "weight_bytes"} <= row.keys()


@pytest.mark.parametrize("argv, message", [
    (["--memory-gb", "-1"], "--memory-gb must be positive"),
    (["--model", "random:Qwen/Qwen2-VL-2B-Instruct", "--memory-gb", "4"], "holds no cache: the weights take 4.11 GiB"),
    (["--methods", "nope"], "unknown method"),
    (["--methods", "visionzip"], "before the decoder"),
    (["--picture", "wide"], "--picture expects WIDTHxHEIGHT"),
    (["--visual-tokens", "100"], "multiple of 16"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    code = cli.main(TINY + argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_qwen2_vl_frames_and_pictures_at_the_processors_sizes():
    from kv_arena.runtime.models import shipped_config

    media = capacity.media_tokens(shipped_config("Qwen/Qwen2-VL-2B-Instruct"), (1280, 720), (448, 448))
    assert (media.frame_group, media.frames_per_group, media.per_frame) == (256, 2, 128)
    assert media.picture == 46 * 26  # 1288 x 728 px after rounding to 28 px


def test_the_apps_sentence_says_frames_of_this_video_on_an_a10g():
    from kv_arena.service import capacity as room
    from kv_arena.service.view_types import KeptVisual

    line = room.room_sentence(1000, {"SnapKV": 0.25}, 4 * capacity.GIB, tokens_per_frame=100)
    left = 19 * capacity.GIB  # 24 GiB - 4 of weights - 1 of reserve
    assert line == (f"*Computed, not measured:* on an A10G (24 GB) beside the weights, this budget holds about "
                    f"{left // 25_000:,} frames of this video (100 tokens a frame, as here) instead of "
                    f"{left // 100_000:,} with the full cache. The card shows CUDA 22.5 GiB, so about 8% fewer fit.")
    # 23,028 MiB shown: 17.5 GiB of room instead of 19 (the sold 24 less the weights and the reserve)
    video = KeptVisual("video 1", "video", "kept", [], np.zeros((1, 2, 2, 2)), tokens=1024, frames=16)
    picture = KeptVisual("image 1", "image", "kept", [], np.zeros((1, 1, 2, 2)), tokens=256, frames=1)
    assert room.media_of([picture, video]) == (64, 256) and room.media_of(None) == (None, None)
    from components.at_scale import compare_speed_line, scale_line

    assert "frames of this video (64 tokens a frame" in scale_line("SnapKV", 0.2, 2000, visuals=[video])
    assert "pictures like this one" in scale_line("SnapKV", 0.2, 2000, visuals=[picture])
    both = compare_speed_line({"SnapKV": 0.2, "KIVI": 0.19}, 2000, visuals=[video])
    assert "with SnapKV" in both and "with KIVI, instead of" in both
    with pytest.raises(ValueError, match="holds no cache"):
        room.room_sentence(1000, {"SnapKV": 0.25}, 24 * capacity.GIB)
    # more than one conversation reaches: the room is for several at once, and the sentence says so
    long = room.room_sentence(1000, {"SnapKV": 0.25}, 4 * capacity.GIB, tokens_per_frame=100, context=32_768)
    assert long.endswith("with the full cache (in several conversations at once: one stops at the model's "
                         "32,768-token context). The card shows CUDA 22.5 GiB, so about 8% fewer fit.")
    assert "several" not in room.room_sentence(1000, {"SnapKV": 0.25}, 4 * capacity.GIB, context=10**9)


def test_the_gpu_check_keeps_the_capacity_tables_when_it_writes_its_page(tmp_path):
    from kv_arena.bench.gpu_check import kept_sections

    page = tmp_path / "gpu.md"
    assert kept_sections(page) == ""
    page.write_text("# The GPU check\n\n**Not run yet.**\n\n## Capacity\n\nthe tables\n")
    assert kept_sections(page) == "\n## Capacity\n\nthe tables\n"
