"""The fast paths of issue #20 against their dense references: column sums summed by the prefill
attention itself, column sums of chosen rows without a second softmax, GQA without key copies, decode attention over
parts, the CPU meter, and ``--mode decode``'s command line."""

from __future__ import annotations

import json

import pytest
import torch

import backends
from backends.attention_math import (
    attend_segments,
    attention_column_sums,
    attention_probs,
    causal_attention,
    causal_attention_column_sums,
    decode_attention,
    dense_segment,
)
from backends.base import AttentionCall
from kv_arena.bench import cli
from kv_arena.runtime.attention import ForwardRun
from kv_arena.runtime.cache import KVCache

HEADS, KV_HEADS, DIM, SCALE = 6, 2, 8, 8 ** -0.5


def qkv(tokens: int, new: int | None = None, seed: int = 0):
    torch.manual_seed(seed)
    new = tokens if new is None else new
    return (torch.randn(1, HEADS, new, DIM), torch.randn(1, KV_HEADS, tokens, DIM), torch.randn(1, KV_HEADS, tokens, DIM))


def reference_probs(query, key):
    """Dense float64 softmax with the keys copied per query head and the offset causal mask."""
    k = key.repeat_interleave(HEADS // KV_HEADS, dim=1)[0].double()
    scores = query[0].double() @ k.transpose(-1, -2) * SCALE
    new, held = query.shape[2], key.shape[2]
    visible = torch.arange(held)[None, :] <= torch.arange(held - new, held)[:, None]
    return scores.masked_fill(~visible, float("-inf")).softmax(-1), scores.masked_fill(~visible, float("-inf"))


@pytest.mark.parametrize("tokens,new,chunk", [(300, 300, 64), (300, 40, 16), (300, 1, 64), (130, 130, 7)])
def test_one_pass_attention_gives_the_output_and_the_column_sums(tokens, new, chunk):
    query, key, value = qkv(tokens, new)
    probs, _ = reference_probs(query, key)
    out, sums = causal_attention_column_sums(query, key, value, SCALE, chunk=chunk)
    v = value.repeat_interleave(HEADS // KV_HEADS, dim=1)[0].double()
    assert torch.allclose(out[0].double(), probs @ v, atol=1e-5)
    assert torch.allclose(out, causal_attention(query, key, value, SCALE), atol=1e-5)
    assert sums.dtype == torch.float32 and torch.allclose(sums.double(), probs.sum(1), atol=1e-5)


def test_column_sums_of_chosen_rows_equal_the_dense_softmax_columns():
    query, key, value = qkv(300, 120)
    sums = attention_column_sums(query, key, SCALE, torch.arange(180, 300), chunk=32)
    assert torch.allclose(sums.double(), reference_probs(query, key)[0].sum(1), atol=1e-5)


@pytest.mark.parametrize("name", ["h2o", "elastic_cache"])
def test_scoring_methods_take_their_sums_from_the_prefill_attention(name):
    assert backends.make_backend(name, budget=0.5).needs_prefill_column_sums
    assert not backends.make_backend(name, budget=1.0).needs_prefill_column_sums  # exact SDPA when nothing is ranked


def test_probs_and_decode_attention_use_groups_without_copying_keys():
    query, key, value = qkv(50, 1)
    probs = reference_probs(query, key)[0]
    assert torch.allclose(attention_probs(query, key, SCALE).double(), probs, atol=1e-6)
    out, row = decode_attention(query, key, value, SCALE)
    assert torch.allclose(out, causal_attention(query, key, value, SCALE), atol=1e-6) and torch.equal(row, attention_probs(query, key, SCALE))


def test_attend_segments_equals_attention_over_the_concatenated_parts():
    query, key, value = qkv(50, 1)
    parts = [dense_segment(key[:, :, a:b], value[:, :, a:b]) for a, b in ((0, 20), (20, 21), (21, 50))]
    out, row = attend_segments(query, SCALE, KV_HEADS, parts)
    assert torch.allclose(out, causal_attention(query, key, value, SCALE), atol=1e-6)
    assert torch.allclose(row, attention_probs(query, key, SCALE), atol=1e-7)


def test_cpu_meter_adds_hook_time_and_settles_without_a_device():
    run = ForwardRun(KVCache(backends.make_backend("full"), 1), AttentionCall(0, 1, "decode", torch.tensor([0]),
                                                                               torch.zeros(1, 1), None, 1, 0))
    assert run.timed(lambda x: x + 1, 1) == 2
    assert run.overhead_s > 0 and run.settle() == run.overhead_s and not run.events


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen3-vl"])  # M-RoPE, interleaved M-RoPE
def test_decode_bench_runs_and_reports_every_ratio(capsys, model):
    code = cli.main(["--mode", "decode", "--model", model, "--methods", "h2o,attention_pack,zipvl",
                       "--visual-tokens", "64", "--repeats", "1", "--steps", "2", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["method"] for r in rows] == ["full", "h2o", "attention_pack", "zipvl", "sdpa"]
    full = rows[0]
    assert full["kv_ratio"] == 1.0 and full["decode_ratio"] == 1.0 and full["vs_sdpa_prefill"] > 0
    assert all(r["ideal"] <= 1.0 and r["scoring_ratio"] >= 0 for r in rows[1:4])
    assert rows[1]["kv_ratio"] < 0.5  # h2o at budget 0.2


def test_decode_bench_rejects_bad_input(capsys):
    assert cli.main(["--mode", "decode", "--model", "tiny-qwen2-vl", "--methods", "nope"]) == 2
    assert cli.main(["--mode", "decode", "--model", "tiny-qwen2-vl", "--visual-tokens", "x"]) == 2
    assert "error" in capsys.readouterr().err
