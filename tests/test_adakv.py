"""AdaKV (backends/adakv.py): Algorithm 1's head-wise allocation against a reference written from the
paper's equations, the head-wise layer's exact attention and honest bytes, and chats on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from tests.support import causal_probs, make_image, prefill_call, random_layer

import backends
from backends.adakv import AdaKV, HeadwiseLayer, headwise_top_k, mixed_top_k
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message

TOKENS, KV_HEADS, HEADS, DIM, WINDOW, KERNEL = 60, 2, 4, 8, 4, 3


def reference_adakv(query, key, budget: float, alpha: float, kernel: int = KERNEL, pooling: str = "avgpool") -> list[set[int]]:
    """Ada-SnapKV from the papers, element by element: SnapKV's votes (softmax of the window's
    queries, averaged over the window, average-pooled with zero padding, averaged over each GQA
    group), every head's window kept, each head's top floor(alpha x even share), then the best of
    all heads' remaining votes until the layer holds H_kv x budget x T entries."""
    probs = causal_probs(query, key, DIM ** -0.5)[:, -WINDOW:, : TOKENS - WINDOW].mean(dim=1)  # (H, T - w)
    half = kernel // 2
    pooled = torch.zeros_like(probs)
    for j in range(TOKENS - WINDOW):
        lo, hi = max(0, j - half), min(TOKENS - WINDOW, j + half + 1)
        pooled[:, j] = probs[:, lo:hi].sum(dim=1) / kernel if pooling == "avgpool" else probs[:, lo:hi].max(dim=1).values
    votes = pooled.view(KV_HEADS, HEADS // KV_HEADS, -1).mean(dim=1)
    count = math.ceil(budget * TOKENS - 1e-9)
    share = count - WINDOW
    kept = [set(range(TOKENS - WINDOW, TOKENS)) for _ in range(KV_HEADS)]
    for h in range(KV_HEADS):
        order = sorted(range(TOKENS - WINDOW), key=lambda j: -float(votes[h, j]))
        kept[h] |= set(order[: int(alpha * share)])
    rest = sorted(((float(votes[h, j]), h, j) for h in range(KV_HEADS) for j in range(TOKENS - WINDOW)
                   if j not in kept[h]), reverse=True)
    for _, h, j in rest[: KV_HEADS * share - sum(len(k) - WINDOW for k in kept)]:
        kept[h].add(j)
    return kept


def reference_authors_adakv(query, key, budget: float, alpha: float, kernel: int) -> list[set[int]]:
    """The AdaKV authors' allocation (FFY0/AdaKV ``AdaptiveSnapKVCluster``), element by element: the
    window's votes max-pooled with ``kernel``, GQA groups averaged; the joint top B = H_kv x b of
    every head's votes (b = budget x T - window) counts c_h per head; head h keeps its window and its
    own top round((1 - alpha) c_h + int(alpha b)), halves to even."""
    probs = causal_probs(query, key, DIM ** -0.5)[:, -WINDOW:, : TOKENS - WINDOW].mean(dim=1)
    half = kernel // 2
    pooled = torch.stack([probs[:, max(0, j - half):j + half + 1].max(dim=1).values for j in range(TOKENS - WINDOW)], 1)
    votes = pooled.view(KV_HEADS, HEADS // KV_HEADS, -1).mean(dim=1)
    share = math.ceil(budget * TOKENS - 1e-9) - WINDOW
    joint = sorted(((float(votes[h, j]), h) for h in range(KV_HEADS) for j in range(TOKENS - WINDOW)), reverse=True)
    counts = [sum(1 for _, h in joint[: KV_HEADS * share] if h == head) for head in range(KV_HEADS)]
    kept = []
    for h in range(KV_HEADS):
        capacity = round(counts[h] * (1 - alpha) + int(share * alpha))
        order = sorted(range(TOKENS - WINDOW), key=lambda j: -float(votes[h, j]))
        kept.append(set(order[:capacity]) | set(range(TOKENS - WINDOW, TOKENS)))
    return kept, votes


def same_choice(layer, kept: list[set[int]], votes: torch.Tensor) -> bool:
    """Head by head the same window, the same count and the same votes chosen (max pooling makes
    neighbours tie, and which of two tied entries a top-k takes is arbitrary)."""
    for h, expected in enumerate(kept):
        got = set(layer.head(h)[2].tolist())
        window = set(range(TOKENS - WINDOW, TOKENS))
        if len(got) != len(expected) or not window <= got:
            return False
        values = lambda chosen: sorted(float(votes[h, j]) for j in chosen - window)
        if values(got) != pytest.approx(values(expected), abs=1e-7):
            return False
    return True


def skewed_inputs(seed: int):
    """Head 0's group looks at one token, head 1's attention is spread. Returns the layer, the queries and the layer's keys before any eviction."""
    source = random_layer(TOKENS, KV_HEADS, DIM, seed)
    layer = HeadwiseLayer()
    layer.append(source.keys, source.values, torch.arange(TOKENS))
    g = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(1, HEADS, TOKENS, DIM, generator=g) * 0.3
    query[:, :2, -WINDOW:] = source.keys[:, 0:1, 12:13] * 4
    return layer, query, source.keys


def test_headwise_top_k_gives_each_head_its_floor_then_the_best_over_all():
    scores = [torch.tensor([9.0, 8.0, 7.0, 6.0]), torch.tensor([1.0, 0.5, 0.2, 3.0])]
    assert [i.tolist() for i in headwise_top_k(scores, 5, 0)] == [[0, 1, 2, 3], [3]]
    assert [i.tolist() for i in headwise_top_k(scores, 4, 2)] == [[0, 1], [0, 3]]  # the floor protects head 1
    assert [i.tolist() for i in headwise_top_k([torch.tensor([5.0]), torch.tensor([1.0, 2.0, 3.0])], 3, 0)] == [[0], [1, 2]]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("budget,alpha", [(0.25, 0.2), (0.4, 0.0), (0.25, 1.0)])
def test_kept_sets_equal_the_papers_allocation(seed, budget, alpha):
    layer, query, keys = skewed_inputs(seed)
    AdaKV(budget=budget, window_size=WINDOW, kernel_size=KERNEL, alpha=alpha).after_attention(
        prefill_call(TOKENS), layer, query, layer.keys, DIM ** -0.5)
    expected = reference_adakv(query, keys, budget, alpha)
    got = [set(layer.head(h)[2].tolist()) for h in range(KV_HEADS)]
    assert got == expected
    assert sum(map(len, got)) == KV_HEADS * math.ceil(budget * TOKENS - 1e-9)


def test_mixed_top_k_mixes_the_joint_counts_with_the_even_split():
    scores = [torch.tensor([9.0, 8.0, 7.0, 6.0]), torch.tensor([1.0, 0.5, 0.2, 3.0])]
    # budget 4: the joint top 4 are all head 0's (c = 4, 0); b = 2, int(0.5 b) = 1: round(2 + 1), round(0 + 1)
    assert [i.tolist() for i in mixed_top_k(scores, 4, 0.5)] == [[0, 1, 2], [3]]
    # budget 6: c = 4, 2; int(0.5 x 3) = 1: 3 and 2 entries, one under the budget (the authors' int)
    assert [i.tolist() for i in mixed_top_k(scores, 6, 0.5)] == [[0, 1, 2], [0, 3]]
    assert [i.tolist() for i in mixed_top_k(scores, 4, 0.0)] == [[0, 1, 2, 3], []]  # alpha 0: the joint top-k
    assert [i.tolist() for i in mixed_top_k(scores, 4, 1.0)] == [[0, 1], [0, 3]]  # alpha 1: the even split


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("budget", [0.25, 0.4])
def test_mix_allocation_equals_the_authors_code(seed, budget):
    layer, query, keys = skewed_inputs(seed)
    AdaKV(budget=budget, window_size=WINDOW, kernel_size=7, pooling="maxpool", alpha=0.5, allocation="mix").after_attention(
        prefill_call(TOKENS), layer, query, layer.keys, DIM ** -0.5)
    kept, votes = reference_authors_adakv(query, keys, budget, 0.5, 7)
    assert same_choice(layer, kept, votes)
    assert len({len(k) for k in kept}) > 1  # the heads were given different shares
    floor, query, _ = skewed_inputs(seed)  # kvpress's floor rule on the same max-pooled scores: its own reference
    AdaKV(budget=budget, window_size=WINDOW, kernel_size=7, pooling="maxpool", alpha=0.5).after_attention(
        prefill_call(TOKENS), floor, query, floor.keys, DIM ** -0.5)
    assert same_choice(floor, reference_adakv(query, keys, budget, 0.5, 7, "maxpool"), votes)


def test_the_default_is_kvpress_and_says_so():
    method = backends.make_backend("adakv")
    assert (method.allocation, method.alpha, method.pooling, method.kernel_size) == ("floor", 0.2, "avgpool", 5)
    assert "kvpress" in AdaKV.summary and "authors" in AdaKV.summary
    with pytest.raises(ValueError, match="allocation"):
        backends.make_backend("adakv", allocation="even")


def test_headwise_layer_holds_only_what_it_kept_and_attends_exactly():
    layer, query, _ = skewed_inputs(0)
    dense_keys, dense_values = layer.keys.clone(), layer.values.clone()
    AdaKV(budget=0.25, window_size=WINDOW, kernel_size=KERNEL).after_attention(
        prefill_call(TOKENS), layer, query, layer.keys, DIM ** -0.5)
    count = 15  # ceil(0.25 x 60) per head on average
    assert layer.entries() == KV_HEADS * count and layer.get_seq_length() == count
    assert layer.nbytes() == 2 * KV_HEADS * count * DIM * 4 + 4 * KV_HEADS  # SnapKV's bytes + one int32 length per head
    kept = layer.kept_positions()
    assert kept.shape == (KV_HEADS, max(layer.head_lengths()))
    # a new token attends over each head's own kept entries: the same as masked dense attention
    g = torch.Generator().manual_seed(9)
    new_k, new_v, q = (torch.randn(1, KV_HEADS, 1, DIM, generator=g), torch.randn(1, KV_HEADS, 1, DIM, generator=g),
                       torch.randn(1, HEADS, 1, DIM, generator=g))
    layer.append_decode(new_k, new_v, torch.tensor([TOKENS]))
    out, _ = layer.read_decode(q, DIM ** -0.5)
    keys, values = torch.cat([dense_keys, new_k], dim=2), torch.cat([dense_values, new_v], dim=2)
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        held = torch.tensor(sorted(set(layer.head(kv)[2].tolist())))
        probs = (q[0, h] @ keys[0, kv, held].T * DIM ** -0.5).softmax(-1)
        torch.testing.assert_close(out[0, h], probs @ values[0, kv, held])
    assert layer.get_seq_length() == count + 1


def test_alpha_one_is_snapkv_and_a_lower_alpha_moves_budget_between_heads(models):
    loaded = models("tiny-qwen2-vl")
    message, follow = Message("What is shown?", images=[make_image(0)]), Message("And the colours?")
    runs = {}
    for name, params in (("snapkv", {}), ("adakv", {"alpha": 1.0}), ("adakv", {"alpha": 0.2})):
        conv = Conversation(loaded, backends.make_backend(name, budget=0.3, **params))
        tokens = [conv.ask(m, max_new_tokens=6, ignore_eos=True).token_ids for m in (message, follow)]
        runs[name, params.get("alpha")] = tokens, conv
    (snap_tokens, snap), (even_tokens, even), (_, ada) = runs.values()
    assert even_tokens == snap_tokens
    assert all(torch.equal(a, b) for a, b in zip(even.cache.kept_positions(), snap.cache.kept_positions()))
    lengths = ada.backend.report.head_budgets
    assert any(len(set(per_head)) > 1 for per_head in lengths)  # heads keep different numbers of entries
    heads = loaded.text_config.num_key_value_heads
    for layer, snap_layer in zip(ada.cache.layers, snap.cache.layers):
        assert layer.entries() == heads * snap_layer.get_seq_length()  # the same entries in all
        assert layer.nbytes() == snap_layer.nbytes() + (4 * heads if layer.headwise else 0)


def test_bad_alpha_raises():
    with pytest.raises(ValueError, match="alpha"):
        backends.make_backend("adakv", alpha=1.5)
