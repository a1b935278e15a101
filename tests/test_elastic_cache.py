"""Elastic Cache (backends/elastic_cache.py) on hand-made tensors: buckets, anchors, the fixed-point
truncation; its behaviour on the tiny models is in test_eviction_on_tiny_models.py."""

from __future__ import annotations

import math

import pytest
import torch
from tests.support import attention_call, fill_layer

from backends.base import KVLayer
from backends.elastic_cache import ElasticCache, midpoint_buckets, select_anchors


def test_buckets_follow_the_midpoint_rule():
    # anchors 0, 4, 9: boundaries floor(4/2)=2 and floor(13/2)=6; a tie (token 2) goes left
    assert midpoint_buckets(torch.arange(12), torch.tensor([0, 4, 9])).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]
    # by token position, not cache index: a history with gaps (multi-turn) splits at position 10
    held = torch.tensor([0, 1, 5, 6, 20, 21])
    assert midpoint_buckets(held, torch.tensor([1, 20])).tolist() == [0, 0, 0, 0, 1, 1]


def test_merged_entries_are_bucket_means_at_anchor_positions():
    layer = fill_layer(KVLayer(), 10)
    keys, values = layer.keys.clone(), layer.values.clone()
    importance = torch.zeros(10)
    importance[3] = 10.0  # with the forced first and last tokens: anchors 0, 3, 9
    ElasticCache(budget=0.3).merge(layer, importance, 3)
    assert layer.positions.tolist() == [[0, 3, 9]] * 2  # shared by both heads
    # buckets: {0, 1} (bound floor(3/2)=1), {2..6} (bound floor(12/2)=6), {7, 8, 9}
    for j, (a, b) in enumerate([(0, 2), (2, 7), (7, 10)]):
        torch.testing.assert_close(layer.keys[:, :, j], keys[:, :, a:b].mean(dim=2))
        torch.testing.assert_close(layer.values[:, :, j], values[:, :, a:b].mean(dim=2))
    assert layer.nbytes() == keys.nbytes * 3 // 10 * 2


def test_anchors_are_the_true_top_k_not_the_argsort_slip():
    importance = torch.tensor([5.0, 0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 5.0])
    forced = torch.tensor([True] + [False] * 6 + [True])
    kept = select_anchors(importance, 5, forced)
    assert kept.tolist() == [0, 2, 4, 6, 7]
    # the authors' code: indices of argsort entries greater than the forget count, used as ranks
    middle, forget = importance[1:-1], 3
    slip = (torch.where(torch.argsort(middle) > forget)[0] + 1).tolist()
    assert slip != [2, 4, 6]


def test_fixed_point_eviction_removes_the_truncation_entry_and_holds_gamma_seen():
    method = ElasticCache(budget=0.5, truncation_distance=3)
    layer = fill_layer(KVLayer(), 20, seed=1)
    query = torch.randn(1, 4, 20, 4, generator=torch.Generator().manual_seed(2))
    method.after_attention(attention_call("prefill", 20, 20), layer, query, layer.keys, 0.5)
    assert layer.get_seq_length() == 10 and method.report.truncation_index == [7]
    assert method.report.merged == [10]
    for seen in range(21, 30):
        before = layer.positions[0].tolist()
        g = torch.Generator().manual_seed(seen)
        layer.append(torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g), torch.tensor([seen - 1]))
        method.after_attention(attention_call("decode", seen, 1), layer, query[:, :, :1], layer.keys, 0.5)
        assert layer.get_seq_length() == math.ceil(0.5 * seen)
        expected = before + [seen - 1]
        if len(expected) > math.ceil(0.5 * seen):
            del expected[7]  # the entry at N_tl = 10 - 3, whatever token sits there now
        assert layer.positions[0].tolist() == expected
    assert layer.positions[0, :7].tolist() == before[:7]  # the head of the merged prompt is fixed


@pytest.mark.parametrize("budget", [0.2, 0.5])
def test_anchors_of_a_short_prompt_survive_32_decode_steps(budget):
    """On a 20-token prompt M - 25 < 0: the truncation point sits after the merged prompt, so every
    anchor stays and the tail of generated tokens is what gets evicted (not StreamingLLM's order)."""
    method = ElasticCache(budget=budget)
    layer = fill_layer(KVLayer(), 20, seed=3)
    query = torch.randn(1, 4, 20, 4, generator=torch.Generator().manual_seed(4))
    method.after_attention(attention_call("prefill", 20, 20), layer, query, layer.keys, 0.5)
    anchors = layer.positions[0].tolist()
    assert len(anchors) == math.ceil(budget * 20) and method.report.truncation_index == [len(anchors)]
    for seen in range(21, 53):
        g = torch.Generator().manual_seed(seen)
        layer.append(torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g), torch.tensor([seen - 1]))
        method.after_attention(attention_call("decode", seen, 1), layer, query[:, :, :1], layer.keys, 0.5)
        held = layer.positions[0].tolist()
        assert len(held) == math.ceil(budget * seen) and held[-1] == seen - 1
    assert held[:len(anchors)] == anchors  # all anchors, then the most recent generated tokens
    assert held[len(anchors):] == list(range(52 - (len(held) - len(anchors)), 52))


def test_truncation_index_is_the_papers_on_long_prompts_and_never_falls():
    method = ElasticCache(budget=0.5)  # d = 25
    assert [method.truncation_index(m) for m in (4, 25, 30, 50, 51, 400)] == [4, 25, 25, 25, 26, 375]
    kept = [method.truncation_index(m) for m in range(1, 200)]
    assert kept == sorted(kept)
