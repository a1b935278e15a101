"""The benchmark command: its JSON contract and its errors."""

import json

import pytest

from engine.bench import cli


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
    assert method["visual_tokens"] == 512 and method["new_tokens"] == 8
    assert abs(method["kv_bytes"] / method["kv_bytes_full"] - 0.5) < 0.01


def test_every_budgeted_method_holds_at_most_its_budget_of_the_full_bytes(capsys):
    """Issue #17's axis: budget = fraction of the full cache's bytes held after the prompt."""
    code, out = run_json(capsys, "--model", "tiny-qwen2-vl", "--budget", "0.2", "--max-new-tokens", "4",
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


def test_bench_question_after_and_set(capsys):
    code, out = run_json(capsys, "--methods", "streamingllm", "--budget", "0.3", "--set", "sink_tokens=8",
                         "--question-after", "--max-new-tokens", "4")
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
])
def test_bench_errors_are_one_line(capsys, argv, message):
    code, out = run_json(capsys, *argv)
    assert code == 2 and message in out.err and "Traceback" not in out.err


def test_random_variants_have_the_real_shapes():
    """Shipped configs build the real architectures (on the meta device: no memory)."""
    import torch

    from engine.runtime.models import MODELS, _model_class, shipped_config

    expected = {"Qwen/Qwen2-VL-2B-Instruct": 2.21, "Qwen/Qwen2.5-VL-7B-Instruct": 8.29, "llava-hf/llava-1.5-7b-hf": 7.06,
                "Qwen/Qwen3-VL-8B-Instruct": 8.77}
    for spec in MODELS.values():
        if spec.source == "random" and spec.repo in expected:
            with torch.device("meta"):
                model = _model_class(spec.family)(shipped_config(spec.repo))
            assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - expected[spec.repo]) < 0.02
    assert shipped_config("llava-hf/llava-1.5-7b-hf", num_layers=2).get_text_config().num_hidden_layers == 2


def test_stream_mode_holds_a_capped_method_under_the_cap_plus_one_chunk():
    from engine.bench import stream

    args = stream.parse_args(["--model", "tiny-qwen2-vl", "--frame-size", "56", "--frames-per-chunk", "4",
                              "--cap-mb", "0.1", "--decode-steps", "2", "--one", "infinipot_v:16"])
    (row,) = stream.run(args)
    assert row["method"] == "infinipot_v" and row["frames"] == 16 and row["chunks"] >= 4
    assert row["peak_kv_bytes"] <= row["cap_bytes"] + row["largest_chunk_bytes"]
    assert row["kv_bytes_end_of_video"] <= row["cap_bytes"] and row["peak_rss_bytes"] > 0
