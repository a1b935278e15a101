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
    (["--memory-gb", "inf"], "--memory-gb must be positive and finite"),
    (["--memory-gb", "H100"], "expects GiB or a card"),
    (["--visual-tokens", "1000000000"], "must fit tiny-qwen2-vl's context"),
    (["--device", "nope"], "--device: no device 'nope'"),
    (["--max-model-len", "0"], "--max-model-len must lie in"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must lie in (0, 1]"),
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


def test_a_method_that_rotates_stored_keys_is_measured_too(capsys):
    """AttentionPack rebuilds keys through the model's rotary tables: the bench's prefill hands them over
    (its default methods ended in a TypeError before)."""
    assert cli.main(TINY + ["--methods", "full,attention_pack", "--json"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["attention_pack"]["bytes_per_visual_token"] < rows["full"]["bytes_per_visual_token"]


def test_vllms_figures_on_qwen2_vl_2b_at_24_gb_and_fp8_fits_about_twice_the_tokens(capsys):
    argv = ["--mode", "capacity", "--memory-gb", "A10G", "--methods", "full,fp8,int4,snapkv+fp8", "--visual-tokens", "128",
            "--num-layers", "1", "--json"]
    assert cli.main(argv) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    full, fp8 = rows["full"], rows["fp8"]
    assert full["memory_gb"] == 24 and full["vllm_max_model_len"] == 32768 and full["vllm_gpu_memory_utilization"] == 0.92
    available = int(0.92 * 24 * capacity.GIB - full["weight_bytes"] - full["vllm_profiled_peak_bytes"] - full["reserve_bytes"])
    assert full["vllm_available_bytes"] == available
    blocks = available // (16 * full["full_bytes_per_token_config"])
    assert full["vllm_kv_tokens"] == 16 * blocks and full["vllm_concurrency"] == pytest.approx(blocks / 2048)
    assert 1.8 <= fp8["vs_full"] <= 2.1 and 1.8 <= fp8["vllm_concurrency"] / full["vllm_concurrency"] <= 2.1
    assert fp8["bytes_per_visual_token"] == 28 * 2 * 2 * (128 + 2)  # layers, K and V, KV heads, codes + scale
    assert 3.5 <= rows["int4"]["vs_full"] <= 4 and 9 <= rows["snapkv+fp8"]["vs_full"] <= 11  # budget 0.2 at 8 bits
