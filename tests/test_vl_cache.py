"""VL-Cache (backends/vl_cache.py): sparsity, per-layer budget allocation and the post-vision
window on hand-made tensors, and layer budgets that follow each layer's sparsity on a tiny model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tests.support import answer, causal_probs, make_image, prefill_call, random_layer

import backends
from backends.base import KVLayer
from backends.layout import PromptLayout, VisualSpan
from backends.vl_cache import (
    VLCache,
    allocate_budgets,
    post_vision_statistics,
    threshold_sparsity,
)
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.models import load_model


PROMPT = "Describe the image."


def test_threshold_sparsity_counts_zeros_among_causal_entries_only():
    probs = torch.tensor([
        [[0.5, 0.004, 0.496, 0.0], [0.25, 0.25, 0.25, 0.25]],  # head 0: 0.004 < 1% of 0.5
        [[0.98, 0.01, 0.01, 0.0], [0.997, 0.001, 0.001, 0.001]],  # head 1: 0.01 survives, 3 x 0.001 do not
    ])
    zeros, causal = threshold_sparsity(probs, torch.tensor([2, 3]), 0.01)
    assert zeros.tolist() == [1, 3] and int(causal) == 7  # the masked entry of row 0 is not a zero


def test_post_vision_statistics_match_the_full_matrix_rows():
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 4, 20, 8, generator=g) * 3, torch.randn(1, 2, 20, 8, generator=g)
    sparsity, received = post_vision_statistics(query, key, 8 ** -0.5, rows=7, threshold=0.05, chunk=3)
    probs = causal_probs(query, key, 8 ** -0.5)[:, -7:]  # the reference builds T x T; the method does not
    kept = (probs >= 0.05 * probs.amax(-1, keepdim=True)).sum(dim=(1, 2))
    causal = sum(range(14, 21))
    torch.testing.assert_close(sparsity, 1 - kept.float() / causal)
    torch.testing.assert_close(received, probs.sum(dim=(0, 1)))


def test_layer_budgets_follow_density_and_clip():
    sparsity = torch.tensor([0.2, 0.6, 0.7, 0.9])
    betas = allocate_budgets(sparsity, 0.25)  # no clip at this budget
    torch.testing.assert_close(betas.sum(), torch.tensor(0.25 * 4))  # alpha x L before clipping
    torch.testing.assert_close(betas, (1 - sparsity) / (1 - sparsity).sum() * 0.25 * 4)
    clipped = allocate_budgets(torch.tensor([0.0, 0.0, 0.999, 1.0]), 0.6)  # 1.2, 1.2, 0.0012, ~0
    assert clipped.tolist() == pytest.approx([1.0, 1.0, 0.01, 0.01])  # both bounds
    assert clipped.sum() < 0.6 * 4  # the paper leaves the clipped budget unspent
    spread = allocate_budgets(torch.tensor([0.0, 0.5, 0.8, 0.9]), 0.7, redistribute=True)
    assert spread.max() == 1.0 and spread.min() >= 0.01
    torch.testing.assert_close(spread.sum(), torch.tensor(0.7 * 4))
    assert allocate_budgets(sparsity, 1.0, redistribute=True).tolist() == [1.0] * 4


def test_the_floor_is_paid_for_by_the_other_layers():
    sparsity = torch.tensor([0.0, 0.9999, 0.9999, 0.9999])
    betas = allocate_budgets(sparsity, 0.02)  # shares 0.0799, 8e-6 x 3: the floor would add 0.03
    assert betas[1:].tolist() == pytest.approx([0.01] * 3)
    assert float(betas.sum()) == pytest.approx(0.02 * 4) and float(betas[0]) == pytest.approx(0.05)
    for redistribute in (False, True):
        for alpha in (0.01, 0.05, 0.3, 0.9):
            betas = allocate_budgets(torch.tensor([0.0, 0.3, 0.999, 0.99999]), alpha, redistribute)
            assert float(betas.sum()) <= alpha * 4 + 1e-5 and float(betas.min()) >= 0.01 - 1e-7


def sharp_query(layer: KVLayer, tokens: int, target: int, rows: int, dim: int = 8) -> torch.Tensor:
    """Queries whose last ``rows`` rows all look at token ``target`` only (both KV heads made equal)."""
    layer.keys[:, 1] = layer.keys[:, 0]
    query = torch.zeros(1, 4, tokens, dim)  # the other rows: uniform attention
    query[:, :, -rows:] = layer.keys[:, :1, target : target + 1] * 40
    return query


def test_vl_cache_allocates_by_sparsity_once_every_layer_is_known():
    tokens, dim = 24, 8
    layout = PromptLayout(0, tokens, visuals=[VisualSpan("image", (2, 20))])  # 4 post-vision tokens
    method = VLCache(budget=0.5)
    layers = [random_layer(tokens, seed=i) for i in range(2)]
    queries = [torch.zeros(1, 4, tokens, dim), sharp_query(layers[1], tokens, 7, 4)]  # dense, then sparse
    for i, (layer, query) in enumerate(zip(layers, queries)):
        method.after_attention(prefill_call(tokens, i, 2, layout), layer, query, layer.keys, dim ** -0.5)
        assert layer.get_seq_length() == tokens  # nothing evicted before every layer is known
    method.after_forward(SimpleNamespace(layers=layers), prefill_call(tokens, 1, 2, layout))
    report = method.report
    sparsity = report.sparsity
    assert report.post_vision_tokens == 4 and sparsity[0] == 0.0 and sparsity[1] > 0.9
    density = [1 - s for s in sparsity]
    expected = [min(1.0, max(0.01, d / sum(density) * 0.5 * 2)) for d in density]
    assert report.planned_budgets == pytest.approx(expected)
    kept = [layer.get_seq_length() for layer in layers]
    assert kept == [math.ceil(b * tokens) for b in expected] and kept[0] > kept[1]
    assert report.layer_budgets == [k / tokens for k in kept]
    assert report.realised_budget == sum(kept) / (2 * tokens)
    assert layers[1].positions[0].tolist() == list(range(tokens - kept[1], tokens))  # newest post-vision tokens


def test_vl_cache_realised_total_is_at_most_alpha_plus_one_token_per_layer():
    tokens, dim, layers_n, alpha = 200, 8, 4, 0.05
    layout = PromptLayout(0, tokens, visuals=[VisualSpan("image", (2, 190))])  # 10 post-vision tokens
    method = VLCache(budget=alpha)
    layers = [random_layer(tokens, seed=i) for i in range(layers_n)]
    queries = [torch.zeros(1, 4, tokens, dim)] + [sharp_query(layers[i], tokens, 7, 10) for i in range(1, layers_n)]
    for i, (layer, query) in enumerate(zip(layers, queries)):  # one dense layer, three very sparse ones
        method.after_attention(prefill_call(tokens, i, layers_n, layout), layer, query, layer.keys, dim ** -0.5)
    method.after_forward(SimpleNamespace(layers=layers), prefill_call(tokens, layers_n - 1, layers_n, layout))
    assert method.report.planned_budgets[1:] == pytest.approx([0.01] * 3)  # at the floor
    kept = sum(layer.get_seq_length() for layer in layers)
    assert kept <= alpha * layers_n * tokens + layers_n


def test_vl_cache_keeps_post_vision_tokens_then_the_most_attended():
    tokens, dim = 24, 8
    layout = PromptLayout(0, tokens, visuals=[VisualSpan("image", (2, 20))])
    method = VLCache(budget=0.3)
    layers = [random_layer(tokens, seed=5)]
    query = sharp_query(layers[0], tokens, 7, 4)
    method.after_attention(prefill_call(tokens, 0, 1, layout), layers[0], query, layers[0].keys, dim ** -0.5)
    method.after_forward(SimpleNamespace(layers=layers), prefill_call(tokens, 0, 1, layout))
    kept = layers[0].positions  # one layer: beta = alpha; shared by both heads
    assert kept.shape == (2, math.ceil(0.3 * tokens)) and (kept[0] == kept[1]).all()
    assert kept[0, -4:].tolist() == [20, 21, 22, 23] and 7 in kept[0].tolist()


def test_vl_cache_falls_back_to_the_last_tokens_when_nothing_follows_the_image():
    method = VLCache(budget=0.5, fallback_window=6)
    ends_on_image = PromptLayout(0, 30, visuals=[VisualSpan("image", (3, 30))])
    assert method.observed_rows(prefill_call(30, layout=ends_on_image)) == 6
    text_first = PromptLayout(0, 30, visuals=[VisualSpan("image", (10, 27))])
    assert method.observed_rows(prefill_call(30, layout=text_first)) == 3
    assert method.observed_rows(prefill_call(30, layout=PromptLayout(0, 30))) == 30  # a text-only turn


def test_vl_cache_layer_budgets_follow_each_layers_sparsity():
    loaded = load_model("tiny-qwen2-vl", seed=3)  # its own copy: sharpen the attention of layers 1 and 3
    attn = [layer.self_attn for layer in loaded.language_model().layers]
    with torch.no_grad():
        for i, scale in [(1, 8.0), (3, 4.0)]:
            attn[i].q_proj.weight.mul_(scale)
            attn[i].k_proj.weight.mul_(scale)
    message = Message(PROMPT, images=[make_image(0, (224, 224))])
    update, conv = answer(loaded, backends.make_backend("vl_cache", budget=0.3), message, 1)
    report = conv.backend.report
    sparsity, planned = report.sparsity, report.planned_budgets
    assert sparsity[1] > sparsity[3] > sparsity[0] and planned[1] < planned[3] < planned[0]
    assert abs(sum(planned) - 0.3 * 4) < 1e-4  # nothing clipped here: alpha x L
    assert len(set(conv.cache.tokens_per_layer())) > 1
    total = sum(conv.cache.tokens_per_layer()) / (4 * conv.seen)
    assert report.realised_budget == pytest.approx(total)
    after_image = conv.layouts[0].post_vision
    assert report.post_vision_tokens == after_image[1] - after_image[0] > len(PROMPT)
