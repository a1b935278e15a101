"""The benchmark command: its JSON contract and its errors."""

import json

import pytest

from kv_arena.bench import cli


def run_json(capsys, *argv):
    code = cli.main(list(argv) + ["--json"])
    out = capsys.readouterr()
    return code, out


def test_bench_reports_every_field_and_a_ratio_close_to_the_budget(capsys):
    code, out = run_json(capsys, "--model", "tiny-qwen2-vl", "--methods", "streamingllm", "--budget", "0.5",
                         "--max-new-tokens", "8", "--ignore-eos")
    assert code == 0, out.err
    rows = json.loads(out.out)
    assert [r["method"] for r in rows] == ["full", "streamingllm"]
    fields = {"method", "budget", "model", "prompt_tokens", "visual_tokens", "new_tokens", "text", "ttft_s",
              "prefill_s", "decode_tok_s", "kv_bytes_prefill", "kv_bytes", "kv_bytes_full_prefill", "kv_bytes_full",
              "token_agreement"}
    assert fields <= rows[1].keys()
    full, method = rows
    assert full["token_agreement"] == 1.0 and full["kv_bytes"] == method["kv_bytes_full"]
    assert method["repeats"] == 3  # the default: one round says nothing on a shared machine
    for name in ("prefill_ratio", "decode_ratio", "overhead_ratio"):
        low, high = method[f"{name}_range"]
        assert low <= method[name] <= high
    assert method["visual_tokens"] == 512 and method["new_tokens"] == 8
    assert abs(method["kv_bytes"] / method["kv_bytes_full"] - 0.5) < 0.01


def test_every_budgeted_method_holds_at_most_its_budget_of_the_full_bytes(capsys):
    """Issue #17's axis: budget = fraction of the full cache's bytes held after the prompt."""
    code, out = run_json(capsys, "--model", "tiny-qwen2-vl", "--budget", "0.2", "--max-new-tokens", "4", "--repeats", "1",
                         "--methods", "full,attention_pack,snapkv,elastic_cache,h2o,vl_cache,pyramidkv,streamingllm,zipvl")
    assert code == 0, out.err
    rows = {r["method"]: r for r in json.loads(out.out)}
    for name, row in rows.items():
        assert row["realised_fraction"] == row["kv_bytes_prefill"] / row["kv_bytes_full_prefill"]
        if row["uses_budget"]:
            assert row["realised_fraction"] <= 0.22, (name, row["realised_fraction"])
    zipvl = rows["zipvl"]  # its own knob: no budget, tau at the paper's 0.975, its point where tau puts it
    assert not zipvl["uses_budget"] and zipvl["budget"] == 1.0 and zipvl["params"]["tau"] == 0.975
    assert 0 < zipvl["realised_fraction"] < 1


def test_visionzip_runs_on_llava_at_the_fraction_it_realises(capsys):
    code, out = run_json(capsys, "--model", "tiny-llava", "--methods", "visionzip", "--set", "keep=0.111",
                         "--max-new-tokens", "2", "--ignore-eos", "--repeats", "1")
    assert code == 0, out.err
    full, zipped = json.loads(out.out)
    assert not zipped["uses_budget"] and zipped["params"] == {"keep": 0.111, "contextual_share": 0.156}
    images = full["visual_tokens"] // 576
    kept = full["prompt_tokens"] - full["visual_tokens"] + 64 * images  # the paper's 54 + 10 of each 576-token image
    assert zipped["tokens_held"][0] == kept + 1  # the first answer token, fed before the second
    assert zipped["realised_fraction"] == pytest.approx(kept / full["prompt_tokens"])


def test_bench_question_after_and_set(capsys):
    code, out = run_json(capsys, "--methods", "streamingllm", "--budget", "0.3", "--set", "sink_tokens=8",
                         "--question-after", "--max-new-tokens", "4", "--repeats", "1")
    assert code == 0, out.err
    rows = json.loads(out.out)
    assert rows[1]["params"] == {"sink_tokens": 8} and rows[1]["question_after"]


def test_bench_list(capsys):
    code, out = run_json(capsys, "--list")
    listing = json.loads(out.out)
    assert {m["name"] for m in listing["methods"]} >= {"full", "streamingllm"}
    assert any(m["name"] == "tiny-qwen2-vl" and not m["needs_download"] for m in listing["models"])
    assert any(m["needs_download"] for m in listing["models"])
    names = {m["name"] for m in listing["models"]}
    assert {"tiny-qwen3-vl", "Qwen/Qwen3-VL-2B-Instruct", "random:Qwen/Qwen3-VL-30B-A3B-Instruct"} <= names
    zipvl = next(m for m in listing["methods"] if m["name"] == "zipvl")
    assert not zipvl["uses_budget"]
    assert next(p for p in zipvl["params"] if p["name"] == "tau")["default"] == 0.975


@pytest.mark.parametrize("argv, message", [
    (["--methods", "nope"], "unknown method"),
    (["--model", "nope"], "unknown model"),
    (["--budget", "0"], "--budget"),
    (["--set", "nope=1"], "no chosen method"),
    (["--image", "/nonexistent.png"], "not found"),
    (["--model", "tiny-qwen2-vl", "--methods", "visionzip"], "CLS token"),  # a tower without one: refused
    (["--mode", "decode", "--methods", "visionzip"], "before the decoder"),  # no tower at all in that mode
    (["--mode", "gpu-check", "--device", "cpu"], "runs on CUDA"),  # only --smoke runs off a GPU
    (["--mode", "gpu-check", "--smoke", "--limit-minutes", "0"], "--limit-minutes"),
])
def test_bench_errors_are_one_line(capsys, argv, message):
    code, out = run_json(capsys, *argv)
    assert code == 2 and message in out.err and "Traceback" not in out.err


def test_random_variants_have_the_real_shapes():
    """Shipped configs build the real architectures (on the meta device: no memory)."""
    import torch

    from kv_arena.runtime.models import MODELS, model_class, shipped_config

    expected = {"Qwen/Qwen2-VL-2B-Instruct": 2.21, "Qwen/Qwen2.5-VL-7B-Instruct": 8.29, "llava-hf/llava-1.5-7b-hf": 7.06,
                "Qwen/Qwen3-VL-8B-Instruct": 8.77}
    for spec in MODELS.values():
        if spec.source == "random" and spec.repo in expected:
            with torch.device("meta"):
                model = model_class(spec.family)(shipped_config(spec.repo))
            assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - expected[spec.repo]) < 0.02
    assert shipped_config("llava-hf/llava-1.5-7b-hf", num_layers=2).get_text_config().num_hidden_layers == 2


def test_stream_mode_holds_a_capped_method_under_the_cap_plus_one_chunk():
    from kv_arena.bench import stream

    args = stream.parse_args(["--model", "tiny-qwen2-vl", "--frame-size", "56", "--frames-per-chunk", "4",
                              "--cap-mb", "0.1", "--decode-steps", "2", "--one", "infinipot_v:16"])
    (row,) = stream.run(args)
    assert row["method"] == "infinipot_v" and row["frames"] == 16 and row["chunks"] >= 4
    assert row["peak_kv_bytes"] <= row["cap_bytes"] + row["largest_chunk_bytes"]
    assert row["kv_bytes_end_of_video"] <= row["cap_bytes"] and row["peak_rss_bytes"] > 0


def test_stream_accuracy_answers_the_offline_models_videos_under_caps_against_the_full_cache(capsys):
    # one v3 video (18 frames, 1,089 tokens; its question and the system prompt about 2% of the cache)
    code, out = run_json(capsys, "--mode", "stream", "--accuracy", "--items", "1", "--caps", "0.005,0.5",
                         "--methods", "full,infinipot_v,streamingllm")
    assert code == 0, out.err
    rows = {(r["method"], r["cap_fraction"]): r for r in json.loads(out.out)}
    assert list(rows) == [("full", None), ("infinipot_v", 0.005), ("infinipot_v", 0.5), ("streamingllm", 0.005),
                          ("streamingllm", 0.5)]
    full = rows["full", None]
    assert full["model"] == "tiny-arena-vl" and full["generation"] == 3 and full["n"] == 1
    assert full["same_as_full"] == 1.0 and full["peak_fraction"] == full["end_fraction"] == 1.0 and full["refused"] == 0.0
    assert full["right_low"] <= full["right"] <= full["right_high"]
    tiny = rows["infinipot_v", 0.005]  # below the prompt's text, which InfiniPot-V never evicts
    assert tiny["refused"] == 1.0 and tiny["right"] == 0.0 and tiny["peak_fraction"] is None
    for method in ("infinipot_v", "streamingllm"):
        half = rows[method, 0.5]
        assert half["refused"] == 0.0 and half["end_fraction"] <= 0.5 + 0.02  # rounding: one entry per layer
    assert rows["streamingllm", 0.005]["end_fraction"] <= 0.02


# --- spreads: every timed ratio comes with the range of its repeats -------------------------------
def test_spread_pairs_each_repeat_with_its_reference_and_marks_a_range_across_one():
    from kv_arena.bench.common import UNSURE, Spread

    spread = Spread.paired([1.0, 3.0, 1.8], [2.0, 4.0, 2.0])  # 0.5, 0.75, 0.9
    assert (spread.median, spread.low, spread.high, spread.repeats) == (0.75, 0.5, 0.9, 3)
    assert not spread.unsure and spread.cell() == "0.75 (0.50-0.90)"
    assert spread.fields("decode_ratio") == {"decode_ratio": 0.75, "decode_ratio_range": [0.5, 0.9]}
    across = Spread.of([0.9, 1.1, 0.95])
    assert across.unsure and across.cell().endswith(UNSURE)
    assert Spread.of([0.5]).unsure  # one run cannot tell anything from 1
    with pytest.raises(ValueError):
        Spread.paired([1.0], [1.0, 2.0])


def test_rounds_rotate_so_no_method_always_runs_first():
    from kv_arena.bench.common import rotated

    names = ["full", "a", "b"]
    assert [rotated(names, r)[0] for r in range(4)] == ["full", "a", "b", "full"]
    assert sorted(rotated(names, 2)) == sorted(names)


def test_rows_print_as_they_are_measured(capsys):
    """A live table prints each row before the next one is measured (a long run shows progress)."""
    import argparse

    from kv_arena.bench.common import run_main

    seen_before = []

    def run(args):
        yield {"n": 1}
        seen_before.append(capsys.readouterr().out)  # what was printed before the second row is measured
        yield {"n": 2}

    def live(row, first):
        return ("header\n" if first else "") + f"row {row['n']}"

    parse = lambda argv: argparse.Namespace(json=False)  # noqa: E731
    assert run_main(parse, run, lambda rows: "never", [], live=live) == 0
    assert seen_before == ["header\nrow 1\n"] and capsys.readouterr().out == "row 2\n"


def test_prefill_bench_reports_spreads_attention_share_and_ideal(capsys):
    code, out = run_json(capsys, "--mode", "prefill", "--model", "tiny-qwen2-vl", "--visual-tokens", "256",
                         "--tau", "0.975,0.5", "--repeats", "2")
    assert code == 0, out.err
    high_tau, low_tau = json.loads(out.out)
    for row in (high_tau, low_tau):
        for name in ("prefill_ratio", "attention_share", "ideal"):
            low, high = row[f"{name}_range"]
            assert low <= row[name] <= high
        assert 0 < row["attention_share"] < 1 and row["repeats"] == 2
        skipped = 1 - sum(r * r for r in row["important_ratio_per_layer"]) / row["layers"]
        assert row["ideal"] == pytest.approx(1 - row["attention_share"] * skipped, rel=0.2)  # medians of each
        assert row["ideal_range"][0] >= 1 - row["attention_share_range"][1] * skipped - 1e-9
    assert high_tau["attention_share"] == low_tau["attention_share"]  # one full-cache measurement per size
    assert low_tau["ideal"] < high_tau["ideal"] < 1  # fewer important tokens, more attention to skip


def test_decode_bench_reports_the_range_of_every_timed_ratio(capsys):
    code, out = run_json(capsys, "--mode", "decode", "--model", "tiny-qwen2-vl", "--methods", "streamingllm",
                         "--visual-tokens", "64", "--steps", "2", "--repeats", "2")
    assert code == 0, out.err
    rows = json.loads(out.out)
    full = rows[0]
    assert full["decode_ratio_range"] == [1.0, 1.0] and len(full["vs_sdpa_decode_range"]) == 2
    for row in rows[1:]:
        for name in ("scoring_ratio", "prefill_ratio", "decode_ratio"):
            low, high = row[f"{name}_range"]
            assert low <= row[name] <= high


def test_decode_table_marks_a_ratio_whose_range_crosses_one():
    from kv_arena.bench import decode
    from kv_arena.bench.common import UNSURE

    row = {"model": "m", "layers": 1, "hidden_size": 8, "device": "cpu", "dtype": "float32", "threads": 1,
           "budget": 0.2, "repeats": 3, "steps": 2, "visual_tokens": 64, "kv_ratio": 1.0, "ideal": 1.0,
           "prefill_s": 1.0, "step_s": 0.01, "scoring_ratio": 0.0, "scoring_ratio_range": [0.0, 0.0],
           "prefill_ratio": 1.0, "prefill_ratio_range": [1.0, 1.0], "decode_ratio": 1.0, "decode_ratio_range": [1.0, 1.0],
           "vs_sdpa_prefill": 1.0, "vs_sdpa_prefill_range": [0.9, 1.1], "vs_sdpa_decode": 1.0,
           "vs_sdpa_decode_range": [0.95, 1.05]}
    method = row | {"method": "snapkv", "decode_ratio": 0.8, "decode_ratio_range": [0.7, 0.85],
                    "prefill_ratio": 1.02, "prefill_ratio_range": [0.97, 1.08]}
    text = decode.table([row | {"method": "full"}, method])
    line = next(line for line in text.splitlines() if "snapkv" in line)
    assert "0.80 (0.70-0.85) " in line + " " and f"1.02 (0.97-1.08){UNSURE}" in line


# --- MPIC: time to first token and its parts ------------------------------------------------------
def test_vision_encoder_cuts_to_the_asked_depth():
    from kv_arena.errors import UserError
    from kv_arena.runtime.models import shipped_config, shrink_vision

    qwen = shipped_config("Qwen/Qwen2.5-VL-7B-Instruct")
    shrink_vision(qwen, 2)
    assert qwen.vision_config.depth == 2 and qwen.vision_config.fullatt_block_indexes == [1]  # keeps a full-attention block
    llava = shipped_config("llava-hf/llava-1.5-7b-hf")
    shrink_vision(llava, 3)
    assert llava.vision_config.num_hidden_layers == 3
    for config, layers in ((shipped_config("Qwen/Qwen2-VL-2B-Instruct"), 33), (shipped_config("Qwen/Qwen2-VL-2B-Instruct"), 0),
                           (shipped_config("llava-hf/llava-1.5-7b-hf"), 25)):
        with pytest.raises(UserError):
            shrink_vision(config, layers)


def test_ttft_parts_add_up_and_linking_skips_the_vision_encoder(tmp_path):
    from kv_arena.bench.methods import synthetic_images
    from kv_arena.mpic.kv_store import KVStore
    from kv_arena.mpic.linking import ingest
    from kv_arena.mpic.ttft import time_prompt
    from kv_arena.runtime.inputs import Message
    from kv_arena.runtime.models import load_model

    loaded = load_model("tiny-qwen2-vl")
    store = KVStore(str(tmp_path))
    images = synthetic_images(2, 224)
    for image in images:
        ingest(loaded, store, "s", image)
    message = Message("Which is brighter?", images=images, media_first=False)
    recompute = time_prompt(loaded, store, "s", message, "recompute")
    mpic = time_prompt(loaded, store, "s", message, "mpic", k=4)
    for figures in (recompute, mpic):
        parts = figures["vision_s"] + figures["linking_s"] + figures["lm_s"] + figures["other_s"]
        assert parts == pytest.approx(figures["ttft_s"], abs=1e-3) and figures["lm_s"] > 0
    assert recompute["vision_s"] > 0 and recompute["new_kv_tokens"] == recompute["prompt_tokens"]
    assert mpic["status"] == ["linked", "linked"] and mpic["vision_s"] == 0
    assert mpic["new_kv_tokens"] < mpic["prompt_tokens"]


def test_mpic_bench_reports_ratio_ranges_and_parts_per_count(capsys):
    code, out = run_json(capsys, "--mode", "mpic", "--model", "tiny-qwen2-vl", "--counts", "1,2", "--k", "4",
                         "--image-size", "224", "--repeats", "2", "--vision-layers", "1")
    assert code == 0, out.err
    rows = json.loads(out.out)
    assert [r["images"] for r in rows] == [1, 2]
    for row in rows:
        assert row["vision_layers"] == 1 and row["vision_cut"] and row["repeats"] == 2
        for mode in ("prefix", "full_reuse", "cacheblend", "mpic"):
            low, high = row[f"{mode}_ratio_range"]
            assert low <= row[f"{mode}_ratio"] <= high
        parts = row["parts"]
        assert parts["recompute"]["vision_s"] > 0 and parts["mpic"]["vision_s"] == 0
        assert parts["prefix"]["new_kv_tokens"] < row["prompt_tokens"]  # the shared system prefix is reused
        assert parts["mpic"]["new_kv_tokens"] < parts["cacheblend"]["new_kv_tokens"] < row["prompt_tokens"]
        assert row["linked"] == ["linked"] * row["images"]


def test_mpic_bench_rejects_bad_input(capsys):
    assert cli.main(["--mode", "mpic", "--model", "tiny-qwen2-vl", "--counts", "0"]) == 2
    assert cli.main(["--mode", "mpic", "--model", "tiny-qwen2-vl", "--counts", "1", "--repeats", "0"]) == 2
    assert cli.main(["--mode", "mpic", "--model", "tiny-arena-vl", "--counts", "1", "--vision-layers", "1"]) == 2
    assert "error" in capsys.readouterr().err


def test_the_readmes_methods_table_is_the_registry():
    from pathlib import Path

    from kv_arena.bench.methods import methods_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table == methods_markdown().splitlines(), "regenerate it: python -m kv_arena.bench --list --markdown"


# --- the GPU check: its CPU smoke prints the rows a lent GPU fills ------------------------------
def test_gpu_check_smoke_gives_a_row_per_method_with_the_gpu_fields(capsys):
    import backends

    code, out = run_json(capsys, "--mode", "gpu-check", "--smoke")
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["device"] == "cpu" and report["smoke"] and report["skipped"] == []
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == backends.available() and len(report["rows"]) == len(rows)  # one size: 64 visual tokens
    from kv_arena.bench.decode import acts_before_decoder

    before_decoder = {m: acts_before_decoder(m) for m in rows if acts_before_decoder(m)}  # VisionZip, Downsample
    assert set(before_decoder) == {"visionzip", "downsample"}
    for name, r in rows.items():
        assert {"decode_vs_full", "peak_memory_bytes", "same_tokens_at_lossless"} <= r.keys()
        assert r["peak_memory_bytes"] is None  # no allocator to ask on a CPU
        assert r["same_tokens_at_lossless"] is True, name
        if name in before_decoder:  # no vision tower in the timed decoder
            assert r["kv_bytes"] is None and r["not_timed"] == before_decoder[name]
            continue
        low, high = r["decode_vs_full_range"]
        assert low <= r["decode_vs_full"] <= high and r["memory_bound_bytes"] > r["kv_bytes"] > 0
    full = rows["full"]
    assert full["kv_ratio"] == 1.0 and full["decode_vs_full_range"] == [1.0, 1.0]
    assert rows["snapkv"]["kv_ratio"] <= 0.25  # budget 0.2 of a 64-token picture and its text
    from kv_arena.tiny import generations

    kinds = generations.of().scenes.QUESTION_TYPES  # one held-out scene a type of the served generation
    assert report["offline"]["same_answers_float32"] == 1.0 and report["offline"]["items"] == len(kinds) == 6


def test_gpu_check_skips_what_would_start_past_its_time_limit(capsys):
    code, out = run_json(capsys, "--mode", "gpu-check", "--smoke", "--limit-minutes", "1e-9")
    assert code == 0, out.err
    report = json.loads(out.out)
    assert [s.split(":")[0] for s in report["skipped"]] == ["speed at 64 visual tokens", "lossless", "offline"]
    assert report["offline"] is None
    assert all(r["kv_bytes"] is None and r["same_tokens_at_lossless"] is None and r["not_timed"] == "skipped"
               for r in report["rows"])


def test_accuracy_add_writes_back_to_the_run_it_adds_to(tmp_path):
    """--add reads an earlier run and writes it back there, never over the committed assets/accuracy
    (unless --out says so)."""
    from kv_arena.bench import accuracy
    from kv_arena.paths import ASSETS

    earlier = tmp_path / "v3" / "accuracy.json"
    assert accuracy.parse_args(["--add", str(earlier)]).out == str(tmp_path / "v3" / "accuracy")
    assert accuracy.parse_args(["--add", str(earlier), "--out", str(tmp_path / "o")]).out == str(tmp_path / "o")
    assert accuracy.parse_args([]).out == str(ASSETS / "accuracy")


def test_accuracy_runs_added_to_copies_of_one_run_merge_and_others_are_refused(tmp_path, capsys):
    """Two chains of --add on copies of one run (two cores) merge with --add A --from-json B: B's
    method rows join A's, A's full-cache row stays; a run of other chats is refused in one line."""
    from kv_arena.bench import accuracy

    row = [{"knob": "budget", "value": 0.2, "realised": 0.2, "n": 2}]
    base = {"model": "tiny-arena-vl", "generation": 3, "per_type": 2, "reference_answers": {"colour": ["red", "blue"]},
            "points": {"colour": {"full": [{"knob": None}], "snapkv": row}}, "refused": {}, "loyalty": "..."}
    a, b, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "other.json"
    a.write_text(json.dumps(base | {"points": {"colour": base["points"]["colour"] | {"h2o": row}}}))
    b.write_text(json.dumps(base | {"points": {"colour": base["points"]["colour"] | {"random": row}}}))
    other.write_text(json.dumps(base | {"reference_answers": {"colour": ["red", "red"]}}))
    report = accuracy.merged(str(a), str(b))
    assert list(report["points"]["colour"]) == ["full", "snapkv", "h2o", "random"]
    assert report["points"]["colour"]["full"] == [{"knob": None}]
    with pytest.raises(accuracy.UserError, match="reference_answers differs"):
        accuracy.merged(str(a), str(other))
    assert accuracy.main(["--add", str(a), "--from-json", str(other), "--no-figure"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
