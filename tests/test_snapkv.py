"""SnapKV (backends/snapkv.py) on hand-made tensors: pooled votes of the observation window, top-k
per KV head, the window always kept."""

from __future__ import annotations


import torch
from tests.support import causal_probs, prefill_call, random_layer

from backends.attention_math import kv_group_mean
from backends.snapkv import SnapKV, pool_votes, snapkv_scores, window_and_top_k


def test_pooling_spreads_a_vote_to_its_neighbours():
    votes = torch.tensor([[0.0, 0.0, 6.0, 0.0, 0.0, 0.0, 3.0]])
    avg = pool_votes(votes, 3, "avgpool")  # zero padding counts, as F.avg_pool1d in the authors' code
    torch.testing.assert_close(avg, torch.tensor([[0.0, 2.0, 2.0, 2.0, 0.0, 1.0, 1.0]]))
    assert pool_votes(votes, 3, "maxpool").tolist() == [[0.0, 6.0, 6.0, 6.0, 0.0, 3.0, 3.0]]
    assert pool_votes(votes, 1).tolist() == votes.tolist()
    assert pool_votes(votes, 4).shape == votes.shape  # an even kernel keeps the length


def test_window_and_top_k():
    scores = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    assert window_and_top_k(scores, 8, 3, 5).tolist() == [[0, 2, 5, 6, 7], [3, 4, 5, 6, 7]]
    assert window_and_top_k(scores, 8, 3, 2).tolist() == [[6, 7], [6, 7]]  # budget inside the window


def test_snapkv_keeps_window_and_each_kv_heads_own_choice():
    tokens, dim, window = 40, 8, 4
    layer = random_layer(tokens, seed=3)
    query = torch.zeros(1, 4, tokens, dim)
    query[:, :2, -window:] = layer.keys[:, 0:1, 10:11] * 30  # KV head 0's group looks at token 10
    query[:, 2:, -window:] = layer.keys[:, 1:2, 25:26] * 30  # KV head 1's group looks at token 25
    SnapKV(budget=0.25, window_size=window, kernel_size=3).after_attention(
        prefill_call(tokens), layer, query, layer.keys, dim ** -0.5)
    kept = layer.positions.tolist()
    assert [len(k) for k in kept] == [10, 10] and layer.nbytes() == 2 * 2 * 10 * dim * 4
    assert all(k[-window:] == list(range(36, 40)) for k in kept)
    assert 10 in kept[0] and 25 in kept[1] and kept[0] != kept[1]
    assert {9, 11} <= set(kept[0]) and {24, 26} <= set(kept[1])  # pooled neighbours come along


def test_snapkv_scores_average_window_rows_then_gqa_groups():
    g = torch.Generator().manual_seed(1)
    query, key = torch.randn(1, 4, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    scores = snapkv_scores(query, key, 0.3, 5, 1)
    reference = causal_probs(query, key, 0.3)[:, -5:, :7].mean(dim=1)
    torch.testing.assert_close(scores, kv_group_mean(reference, 2))
