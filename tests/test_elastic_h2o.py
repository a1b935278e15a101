"""Elastic Cache and H2O: the algorithms on hand-made tensors, then both on the tiny models
(bytes that track the budget, multi-turn on a compressed cache; lossless at budget 1.0 is in
test_runtime's registry-wide matrix)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.support import answer, make_image

import backends
from backends.base import AttentionCall, KVLayer
from backends.elastic_cache import ElasticCache, midpoint_buckets, select_anchors
from backends.h2o import H2O, ScoredLayer
from engine.runtime.generate import Conversation
from engine.runtime.inputs import Message
from engine.runtime.models import load_model

METHODS = ["elastic_cache", "h2o"]


def filled(layer: KVLayer, tokens: int, heads: int = 2, dim: int = 4, seed: int = 0) -> KVLayer:
    g = torch.Generator().manual_seed(seed)
    layer.append(torch.randn(1, heads, tokens, dim, generator=g), torch.randn(1, heads, tokens, dim, generator=g),
                 torch.arange(tokens))
    return layer


def call(phase: str, seen: int, q: int, layer_idx: int = 0) -> AttentionCall:
    positions = torch.arange(seen - q, seen)
    return AttentionCall(layer_idx=layer_idx, num_layers=1, phase=phase, positions=positions,
                         rope_ids=positions[None], layout=None, seen=seen, step=0)


# --- Elastic Cache on hand-made tensors ------------------------------------------------------------


def test_buckets_follow_the_midpoint_rule():
    # anchors 0, 4, 9: boundaries floor(4/2)=2 and floor(13/2)=6; a tie (token 2) goes left
    assert midpoint_buckets(torch.arange(12), torch.tensor([0, 4, 9])).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]
    # by token position, not cache index: a history with gaps (multi-turn) splits at position 10
    held = torch.tensor([0, 1, 5, 6, 20, 21])
    assert midpoint_buckets(held, torch.tensor([1, 20])).tolist() == [0, 0, 0, 0, 1, 1]


def test_merged_entries_are_bucket_means_at_anchor_positions():
    layer = filled(KVLayer(), 10)
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
    layer = filled(KVLayer(), 20, seed=1)
    query = torch.randn(1, 4, 20, 4, generator=torch.Generator().manual_seed(2))
    method.after_attention(call("prefill", 20, 20), layer, query, layer.keys, 0.5)
    assert layer.get_seq_length() == 10 and method.report.truncation_index == [7]
    assert method.report.merged == [10]
    for seen in range(21, 30):
        before = layer.positions[0].tolist()
        g = torch.Generator().manual_seed(seen)
        layer.append(torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g), torch.tensor([seen - 1]))
        method.after_attention(call("decode", seen, 1), layer, query[:, :, :1], layer.keys, 0.5)
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
    layer = filled(KVLayer(), 20, seed=3)
    query = torch.randn(1, 4, 20, 4, generator=torch.Generator().manual_seed(4))
    method.after_attention(call("prefill", 20, 20), layer, query, layer.keys, 0.5)
    anchors = layer.positions[0].tolist()
    assert len(anchors) == math.ceil(budget * 20) and method.report.truncation_index == [len(anchors)]
    for seen in range(21, 53):
        g = torch.Generator().manual_seed(seen)
        layer.append(torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g), torch.tensor([seen - 1]))
        method.after_attention(call("decode", seen, 1), layer, query[:, :, :1], layer.keys, 0.5)
        held = layer.positions[0].tolist()
        assert len(held) == math.ceil(budget * seen) and held[-1] == seen - 1
    assert held[:len(anchors)] == anchors  # all anchors, then the most recent generated tokens
    assert held[len(anchors):] == list(range(52 - (len(held) - len(anchors)), 52))


def test_truncation_index_is_the_papers_on_long_prompts_and_never_falls():
    method = ElasticCache(budget=0.5)  # d = 25
    assert [method.truncation_index(m) for m in (4, 25, 30, 50, 51, 400)] == [4, 25, 25, 25, 26, 375]
    kept = [method.truncation_index(m) for m in range(1, 200)]
    assert kept == sorted(kept)


# --- H2O on hand-made tensors -----------------------------------------------------------------------


def test_h2o_keeps_recent_window_and_heaviest_per_kv_head():
    layer = filled(ScoredLayer(), 16)
    layer.scores = torch.stack([torch.arange(16.0), torch.arange(16.0).flip(0)])  # heads disagree
    H2O(budget=0.5, recent_share=0.25).evict(layer, 8)  # 2 recent + 6 heavy
    assert layer.positions.tolist() == [[8, 9, 10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5, 14, 15]]
    assert layer.scores[1].tolist() == [15, 14, 13, 12, 11, 10, 1, 0]  # scores travel with entries


def test_h2o_adds_the_decode_row_averaged_over_each_gqa_group():
    method = H2O(budget=1.0)
    layer = filled(ScoredLayer(), 6)
    before = layer.scores.clone()
    layer.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.tensor([6]))
    row = torch.rand(4, 1, 7).softmax(-1)
    method.after_attention(call("decode", 7, 1), layer, torch.zeros(1, 4, 1, 4), layer.keys, 0.5, row)
    torch.testing.assert_close(layer.scores[:, :6], before + row[:, 0, :6].view(2, 2, 6).mean(1))
    assert layer.scores[:, 6].gt(0).all()


def test_h2o_counts_its_score_buffer_and_fits_it_in_the_budget():
    layer = filled(ScoredLayer(), 100, dim=8)  # per head and token: 2 x 8 x 4 bytes of K/V, 4 of score
    assert layer.nbytes() == layer.keys.nbytes + layer.values.nbytes + layer.scores.nbytes
    assert layer.scores.nbytes == 2 * 100 * 4
    method = H2O(budget=0.5)
    target = method.target(100, layer)
    assert target == math.floor(0.5 * 100 * 64 / 68) == 47  # not 50: the scores take their share
    method.evict(layer, target)
    full_bytes = 2 * 2 * 100 * 8 * 4
    assert layer.nbytes() <= 0.5 * full_bytes < layer.nbytes() + 2 * 68
    assert isinstance(H2O(budget=1.0).new_layer(0), KVLayer) and not isinstance(H2O(budget=1.0).new_layer(0), ScoredLayer)


@pytest.mark.parametrize("name,bad", [("elastic_cache", {"truncation_distance": 0}),
                                      ("elastic_cache", {"protected_tokens": 0}),
                                      ("h2o", {"recent_share": 1.5}), ("h2o", {"window": 4})])
def test_bad_parameters_are_refused(name, bad):
    with pytest.raises(ValueError):
        backends.make_backend(name, budget=0.5, **bad)


# --- on the tiny models -----------------------------------------------------------------------------

PROMPT = "Describe the image."


def two_turns(loaded, backend):
    conv = Conversation(loaded, backend)
    first = conv.ask(Message(PROMPT, images=[make_image(1, (224, 224))]), max_new_tokens=6)
    second = conv.ask(Message("And the colours?"), max_new_tokens=6)
    return first.token_ids + second.token_ids, conv


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava"])  # M-RoPE and 1-D RoPE
@pytest.mark.parametrize("name", METHODS)
def test_second_turn_is_compressed_on_top_of_the_history(models, name, model):
    _, conv = two_turns(models(model), backends.make_backend(name, budget=0.5))
    first_turn_end = conv.layouts[1].start
    for layer, kept in zip(conv.cache.layers, conv.cache.kept_positions()):
        held = math.ceil(0.5 * conv.seen) if name == "elastic_cache" else conv.backend.target(conv.seen, layer)
        assert kept.shape[1] == held
        assert (kept[:, 1:] > kept[:, :-1]).all()  # token order kept, no duplicates
        assert (kept < first_turn_end).any() and (kept >= first_turn_end).any()
        if name == "elastic_cache":
            assert (kept == kept[:1]).all() and kept[0, 0] == 0  # anchors shared by heads; first token kept
    assert len(conv.backend.report.kept) == conv.loaded.num_layers


# tiny-llava's seed-0 weights say EOS after 2 tokens; its seed-1 weights answer 64
@pytest.mark.parametrize("model,seed", [("tiny-qwen2-vl", 0), ("tiny-llava", 1)])
def test_kv_bytes_track_the_budget_after_64_tokens(models, model, seed):
    loaded = models(model) if seed == 0 else load_model(model, seed=seed)
    message = Message(PROMPT, images=[make_image(0, (224, 224))])
    full, _ = answer(loaded, backends.make_backend("full"), message, 64)
    assert full.metrics.new_tokens == 64
    for name in METHODS:
        for budget in (0.2, 0.5):
            update, _ = answer(loaded, backends.make_backend(name, budget=budget), message, 64)
            assert update.metrics.new_tokens == 64, (name, budget)
            ratio = update.metrics.kv_bytes / full.metrics.kv_bytes
            assert abs(ratio - budget) <= 0.02, (name, budget, ratio)
            prefill_ratio = update.metrics.kv_bytes_prefill / full.metrics.kv_bytes_prefill
            assert abs(prefill_ratio - budget) <= 0.02, (name, budget, prefill_ratio)


def test_h2o_scores_move_while_decoding(models):
    conv = Conversation(models("tiny-qwen2-vl"), backends.make_backend("h2o", budget=0.5))
    stream = conv.stream(Message(PROMPT, images=[make_image(0, (224, 224))]), max_new_tokens=12)
    next(stream)  # after prefill, before the first decode step
    report = conv.backend.report
    start = [(report.kept[i].clone(), report.scores[i].clone()) for i in range(conv.loaded.num_layers)]
    for _ in stream:
        pass
    for (kept0, scores0), kept1, scores1 in zip(start, report.kept, report.scores):
        for h in range(kept0.shape[0]):
            before = dict(zip(kept0[h].tolist(), scores0[h].tolist()))
            after = dict(zip(kept1[h].tolist(), scores1[h].tolist()))
            survivors = before.keys() & after.keys()
            assert survivors
            assert all(after[p] > before[p] for p in survivors)  # every decode row adds attention
