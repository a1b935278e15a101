"""AttentionPack: low-rank factors, RoPE round trip, the attention-aware group split, real bytes,
and end-to-end behaviour on the tiny models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tests.support import answer, make_image
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import backends
from backends.attention_math import attention_probs, causal_attention
from backends.attention_pack import AttentionPack, PackedLayer
from backends.low_rank import block_ranks, factorise, fitted_rank
from backends.rope import rotate, unrotate
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message

HEADS, DIM = 2, 32
WIDTH = HEADS * DIM  # the tiny models' H_kv * D


def synthetic_rotary(rope_ids: torch.Tensor):
    """1-D RoPE tables built like the models build theirs: (1, n, D)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    freqs = rope_ids[0].float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos(), emb.sin()


def layer_with(tokens: int, dtype=torch.float32, full_share=0.25, partial_on="values", seed=0):
    torch.manual_seed(seed)
    layer = PackedLayer(full_share, partial_on)
    keys, values = torch.randn(1, HEADS, tokens, DIM, dtype=dtype), torch.randn(1, HEADS, tokens, DIM, dtype=dtype)
    layer.append(keys, values, torch.arange(tokens))
    return layer, keys, values


def test_factorise_recovers_a_low_rank_matrix_at_its_rank():
    torch.manual_seed(0)
    matrix = torch.randn(200, 8) @ torch.randn(8, WIDTH)
    coef, basis = factorise(matrix, 8)
    assert coef.shape == (200, 8) and basis.shape == (8, WIDTH)
    assert (coef @ basis - matrix).abs().max() / matrix.abs().max() < 1e-5
    assert (factorise(matrix, 4)[0] @ factorise(matrix, 4)[1] - matrix).abs().max() > 1e-2  # below its rank: lossy


@pytest.mark.parametrize("rank", [8, 16, 32])
def test_oversampled_factors_are_close_to_the_best_fit_of_their_rank(rank):
    """Without oversampling svd_lowrank(q=R) misses the best rank-R fit by 3-6% on a slowly decaying
    spectrum; with R + 10 test vectors it stays within 1.5%."""
    torch.manual_seed(rank)
    matrix = torch.randn(256, WIDTH) @ torch.diag(torch.linspace(1, 0.05, WIDTH)) @ torch.linalg.qr(torch.randn(WIDTH, WIDTH))[0]
    u, s, v = torch.linalg.svd(matrix, full_matrices=False)
    best = (matrix - (u[:, :rank] * s[:rank]) @ v[:rank]).norm()
    coef, basis = factorise(matrix, rank)
    assert coef.shape == (256, rank) and basis.shape == (rank, WIDTH)
    assert (matrix - coef @ basis).norm() / best < 1.015


@pytest.mark.parametrize("model_name", ["tiny-qwen2-vl", "tiny-llava"])
def test_rope_round_trip_is_exact_for_both_rope_kinds(models, model_name):
    loaded = models(model_name)
    conv = Conversation(loaded, backends.make_backend("full"))
    n = 40
    if loaded.adapter.rope_dims == 3:  # M-RoPE: temporal, row and column ids of a visual grid
        rope_ids = torch.stack([torch.full((n,), 7), 3 + torch.arange(n) // 8, 3 + torch.arange(n) % 8])
    else:
        rope_ids = torch.arange(100, 100 + n)[None]
    cos, sin = conv.rotary(rope_ids)
    keys = torch.randn(1, HEADS, n, DIM)
    _, model_rotated = apply_rotary_pos_emb(keys, keys, cos, sin)  # what the model caches
    assert torch.allclose(rotate(keys, cos, sin), model_rotated, atol=1e-6)
    assert torch.allclose(unrotate(model_rotated, cos, sin), keys, atol=1e-5)
    assert torch.allclose(rotate(unrotate(model_rotated, cos, sin), cos, sin), model_rotated, atol=1e-5)


def rank_8(tokens: int) -> torch.Tensor:
    """(1, H_kv, tokens, D) states whose (tokens, H_kv * D) matrix has rank 8."""
    matrix = torch.randn(tokens, 8) @ torch.randn(8, WIDTH)
    return matrix.view(tokens, HEADS, DIM).transpose(0, 1)[None].contiguous()


def test_exact_rank_pack_rebuilds_the_cached_keys_and_values():
    layer, _, _ = layer_with(80)
    pre_rope, values = rank_8(80), rank_8(80)  # at their rank, factors rebuild them exactly
    cos, sin = synthetic_rotary(torch.arange(70)[None])
    post_rope = rotate(pre_rope[:, :, :70], cos, sin)  # what the runtime caches: keys after RoPE
    layer.keys, layer.values = torch.cat([post_rope, pre_rope[:, :, 70:]], dim=2), values.clone()
    assert layer.pack(torch.arange(70), torch.arange(70)[None], synthetic_rotary, (8, 8))
    assert layer.keys.shape[2] == 10 and layer.get_seq_length() == 80
    block = layer.blocks[0]  # the factors hold the pre-RoPE keys, all heads side by side
    assert torch.allclose(block.k_coef @ block.k_basis, pre_rope[0, :, :70].transpose(0, 1).reshape(70, WIDTH), atol=1e-4)
    layer.full_share = 1.0
    layer.choose_groups()
    new_k, new_v = torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM)
    out_k, out_v = layer.append(new_k, new_v, torch.tensor([80]))
    assert torch.allclose(out_k[:, :, :70], post_rope, atol=1e-4)  # rebuilt and re-rotated
    assert torch.allclose(out_v[:, :, :70], values[:, :, :70], atol=1e-4)
    assert torch.equal(out_k[:, :, 70:], torch.cat([pre_rope[:, :, 70:], new_k], dim=2))  # dense, new last
    assert torch.equal(layer.kept_positions(), torch.arange(81).expand(HEADS, -1))


def test_a_block_whose_factors_would_be_larger_stays_dense():
    layer, keys, values = layer_with(70)
    before = layer.nbytes()
    # full width: (64 + 64) x (70 + 64) factor entries > 2 x 70 x 64 dense ones
    assert not layer.pack(torch.arange(70), torch.arange(70)[None], synthetic_rotary, (WIDTH, WIDTH))
    assert not layer.blocks and layer.nbytes() == before
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_group_split_follows_the_statistic_and_the_ema():
    layer, _, _ = layer_with(16)
    layer.pack(torch.arange(12), torch.arange(12)[None], synthetic_rotary, (8, 8))
    stat = torch.zeros(16)
    stat[[2, 5, 9]] = torch.tensor([0.5, 0.3, 0.2])  # read order: the 12 packed tokens, then 4 dense
    layer.observe(stat, rows=1, alpha=0.25)
    block = layer.blocks[0]
    assert torch.allclose(block.score, 0.75 * stat[:12])
    layer.choose_groups()
    assert block.full.nonzero().squeeze(1).tolist() == [2, 5, 9]  # ceil(25% of 12) = 3, the top ones
    later = torch.zeros(16)
    later[[0, 1, 3]] = 1.0
    layer.observe(later, rows=2, alpha=0.25)  # a^Tq with Tq = 2 query rows (Eq. 1)
    assert torch.allclose(block.score, 0.0625 * 0.75 * stat[:12] + 0.9375 * later[:12])
    layer.choose_groups()
    assert block.full.nonzero().squeeze(1).tolist() == [0, 1, 3]
    _, out_v = layer.append(torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM), torch.tensor([16]))
    rebuilt = out_v[0, :, :12].transpose(0, 1).reshape(12, WIDTH)
    full = block.v_coef @ block.v_basis
    reduced = block.v_coef[:, :2] @ block.v_basis[:2]  # R / 4 = 2 components
    assert torch.allclose(rebuilt[block.full], full[block.full], atol=1e-6)
    assert torch.allclose(rebuilt[~block.full], reduced[~block.full], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_are_the_factors_plus_scalars_in_the_storage_dtype(dtype):
    layer, _, _ = layer_with(100, dtype=dtype)
    layer.pack(torch.arange(90), torch.arange(90)[None], synthetic_rotary, (16, 12))
    block, size = layer.blocks[0], torch.empty(0, dtype=dtype).element_size()
    assert block.k_coef.dtype == block.v_basis.dtype == dtype
    assert block.k_coef.numel() + block.k_basis.numel() == 90 * 16 + 16 * WIDTH
    assert block.v_coef.numel() + block.v_basis.numel() == 90 * 12 + 12 * WIDTH
    factors = (90 * 16 + 16 * WIDTH + 90 * 12 + 12 * WIDTH) * size
    dense = 2 * 10 * WIDTH * size
    scalars = 100 * 4 + 90 * 4  # float32 statistic per token, int32 rotary id per packed token
    assert layer.nbytes() == factors + dense + scalars


def test_budget_maps_to_the_largest_rank_whose_bytes_fit():
    # 256 tokens, W = 64, float32, 1-D rotary ids: R factors of K and V cost 2R(256 + 64)4 bytes
    spare, ids = 0.5 * 2 * 256 * WIDTH * 4, 256 * 4
    r = fitted_rank(spare, 256, WIDTH, 4, ids)
    assert 2 * r * (256 + WIDTH) * 4 + ids <= spare < 2 * (r + 1) * (256 + WIDTH) * 4 + ids
    assert block_ranks((0, 0), spare, 256, WIDTH, 4, ids) == (r, r)
    assert block_ranks((64, 48), spare, 256, WIDTH, 4, ids) == (64, 48)
    assert block_ranks((0, 0), -1000.0, 8, WIDTH, 4, 32) == (1, 1)  # text alone over budget


def test_bad_parameters_are_errors():
    with pytest.raises(ValueError):
        backends.make_backend("attention_pack", 0.5, partial_on="rows")
    with pytest.raises(ValueError):
        backends.make_backend("attention_pack", 0.5, full_share=1.5)
    with pytest.raises(ValueError):
        backends.make_backend("attention_pack", 0.5, rank_k=-1)
    with pytest.raises(ValueError):
        backends.make_backend("attention_pack", 0.5, window=3)


# --- the tiny models -------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["tiny-qwen2-vl", "tiny-llava"])
def test_full_width_rank_stays_dense_and_reproduces_the_full_cache(models, image, model_name):
    loaded = models(model_name)
    message = Message("Describe the image.", images=[image])
    full, _ = answer(loaded, backends.make_backend("full"), message, 10)
    backend = backends.make_backend("attention_pack", 0.5, rank_k=WIDTH, rank_v=WIDTH, full_share=1.0)
    packed, conv = answer(loaded, backend, message, 10)
    assert packed.token_ids == full.token_ids
    assert conv.cache.tokens_per_layer() == full.metrics.tokens_held
    assert not any(layer.blocks for layer in conv.cache.layers)  # the factors would be larger
    assert packed.metrics.kv_bytes == full.metrics.kv_bytes  # and no statistic is held for nothing


@pytest.mark.parametrize("rank", [0, 8, 32, 64])
def test_bytes_never_exceed_the_full_cache_at_any_budget_or_rank(models, image, rank):
    loaded = models("tiny-qwen2-vl")
    message = Message("Describe the image.", images=[image])
    full, _ = answer(loaded, backends.make_backend("full"), message, 4)
    for budget in (0.05, 0.2, 0.5, 0.8, 0.975):
        update, _ = answer(loaded, backends.make_backend("attention_pack", budget, rank_k=rank, rank_v=rank), message, 4)
        assert update.metrics.kv_bytes_prefill <= full.metrics.kv_bytes_prefill, (budget, rank)
        assert update.metrics.kv_bytes <= full.metrics.kv_bytes, (budget, rank)


@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8])
def test_rank_from_the_budget_makes_the_layer_bytes_meet_it(models, image, budget):
    """Factors, dense text and scalars together: each layer holds at most budget x its full bytes,
    and one more rank would not fit. (Here the 66 dense text tokens are 0.2 of the layer: below
    that, rank 1 is the floor.)"""
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("attention_pack", budget))
    conv.feed(Message("Describe the image.", images=[image]))
    for layer in conv.cache.layers:
        (block,) = layer.blocks
        rank, tokens, full_bytes = block.k_coef.shape[1], block.positions.numel(), layer.full_bytes()
        assert block.v_coef.shape[1] == rank
        assert layer.nbytes() <= budget * full_bytes
        assert layer.nbytes() + 2 * (tokens + WIDTH) * 4 > budget * full_bytes  # the largest rank that fits


def test_budget_one_is_exactly_the_full_cache(models, image):
    loaded = models("tiny-qwen2-vl")
    message = Message("Describe the image.", images=[image])
    full, _ = answer(loaded, backends.make_backend("full"), message, 8)
    packed, _ = answer(loaded, backends.make_backend("attention_pack", 1.0), message, 8)
    assert packed.token_ids == full.token_ids
    assert packed.metrics.kv_bytes == full.metrics.kv_bytes


def test_default_rank_compresses_visual_tokens_and_reports_groups(models, image):
    loaded = models("tiny-qwen2-vl")
    message = Message("Describe the image.", images=[image])
    full, _ = answer(loaded, backends.make_backend("full"), message, 8)
    backend = backends.make_backend("attention_pack", 0.5)
    packed, conv = answer(loaded, backend, message, 8)
    assert 0.45 < packed.metrics.kv_bytes_prefill / full.metrics.kv_bytes_prefill <= 0.5  # the layer's budget
    visual = conv.layouts[0].visuals[0]
    for i, layer in enumerate(conv.cache.layers):
        (block,) = layer.blocks
        rank = block.k_coef.shape[1]
        assert torch.equal(block.positions, torch.arange(*visual.span))
        assert block.groups is not None  # M-RoPE: decode queries are scored per distinct rotation
        full_rank, reduced = backend.report.full_rank[i], backend.report.reduced_rank[i]
        assert len(full_rank) == math.ceil(0.25 * visual.length) and len(full_rank) + len(reduced) == visual.length
        assert backend.report.bytes[i]["factors"] == 2 * (256 * rank + rank * WIDTH) * 4
        assert not layer.buffered.any()  # generated text stays dense by default (period 0)
    assert conv.cache.tokens_per_layer() == full.metrics.tokens_held


def test_the_same_request_gives_the_same_factors_and_answer_whatever_the_global_generator(models, image):
    """The randomized SVD's test vectors come from a generator of its own, seeded by the method's
    ``seed``: two identical requests give identical factors and tokens, and the global generator
    neither decides them nor moves."""
    loaded = models("tiny-qwen2-vl")
    message = Message("Describe the image.", images=[image])
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        update, conv = answer(loaded, backends.make_backend("attention_pack", 0.3), message, 6)
        assert torch.equal(torch.get_rng_state(), before)
        runs.append((update.token_ids, [b.k_coef for layer in conv.cache.layers for b in layer.blocks]))
    (ids_a, coefs_a), (ids_b, coefs_b) = runs
    assert ids_a == ids_b and all(torch.equal(a, b) for a, b in zip(coefs_a, coefs_b))
    _, other = answer(loaded, backends.make_backend("attention_pack", 0.3, seed=7), message, 6)
    assert not torch.equal(other.cache.layers[0].blocks[0].k_coef, coefs_a[0])  # the seed is what decides


def test_generated_tokens_are_packed_every_period(models, image):
    loaded = models("tiny-qwen2-vl")
    backend = backends.make_backend("attention_pack", 0.5, period=4)
    update, conv = answer(loaded, backend, Message("Describe the image.", images=[image]), 11)
    layer = conv.cache.layers[0]
    generated = [b.positions for b in layer.blocks[1:]]
    assert [len(p) for p in generated] == [4, 4]  # 10 decode steps: two periods packed, two tokens wait
    assert int(layer.buffered.sum()) == 2 and layer.buffer_rope.shape[1] == 2
    prompt = update.metrics.prompt_tokens
    assert torch.equal(torch.cat(generated), torch.arange(prompt, prompt + 8))
    assert conv.cache.tokens_per_layer() == [conv.seen] * loaded.num_layers


def test_question_after_and_a_second_image(models, image):
    loaded = models("tiny-qwen2.5-vl")
    conv = Conversation(loaded, backends.make_backend("attention_pack", 0.4))
    conv.feed(Message("", images=[image]))
    assert len(conv.cache.layers[0].blocks) == 1
    first = conv.ask(Message("What is in it?"), max_new_tokens=4)
    second = conv.ask(Message("And this one?", images=[make_image(1)]), max_new_tokens=4)
    assert first.token_ids and second.token_ids
    assert [len(layer.blocks) for layer in conv.cache.layers] == [2] * loaded.num_layers
    assert conv.cache.tokens_per_layer() == [conv.seen] * loaded.num_layers


@pytest.mark.parametrize("partial_on", ["values", "keys", "both", "none"])
def test_decode_attend_in_factor_space_equals_attention_over_the_rebuilt_cache(partial_on):
    layer, _, _ = layer_with(50, partial_on=partial_on)
    layer.observe(torch.rand(50), rows=1, alpha=0.25)
    layer.pack(torch.arange(5, 45), torch.arange(5, 45)[None], synthetic_rotary, (6, 6))
    layer.choose_groups()
    assert 0 < int(layer.blocks[0].full.sum()) < 40  # both groups are read
    layer.append(torch.randn(1, HEADS, 3, DIM), torch.randn(1, HEADS, 3, DIM), torch.arange(50, 53))
    keys, values = layer.append(torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM), torch.tensor([53]))
    query, scaling = torch.randn(1, 2 * HEADS, 1, DIM), DIM ** -0.5  # GQA: two query heads per KV head
    out, row = layer.read_decode(query, scaling)
    assert torch.allclose(out, causal_attention(query, keys, values, scaling), atol=1e-5)
    assert torch.allclose(row, attention_probs(query, keys, scaling), atol=1e-6)


def test_decode_append_stores_without_rebuilding():
    layer, _, _ = layer_with(20)
    layer.pack(torch.arange(16), torch.arange(16)[None], synthetic_rotary, (4, 4))
    new_k = torch.randn(1, HEADS, 1, DIM)
    dense_k, _ = layer.append_decode(new_k, torch.randn(1, HEADS, 1, DIM), torch.tensor([20]))
    assert dense_k.shape[2] == 5 and torch.equal(dense_k[:, :, -1:], new_k)  # the dense part only
    assert layer.get_seq_length() == 21 and layer.score.numel() == 5 and layer.buffered.numel() == 5


def test_layers_share_one_forward_pass_of_rope_tables():
    backend = AttentionPack(budget=0.2)
    layers = [backend.new_layer(i) for i in range(2)]
    calls = []

    def counting_rotary(rope_ids):
        calls.append(rope_ids.shape[1])
        return synthetic_rotary(rope_ids)

    torch.manual_seed(0)
    for layer in layers:
        layer.append(torch.randn(1, HEADS, 20, DIM), torch.randn(1, HEADS, 20, DIM), torch.arange(20))
        layer.pack(torch.arange(16), torch.arange(16)[None], counting_rotary, (4, 4))
    calls.clear()
    keys = [layer.block_keys(layer.blocks[0], HEADS, DIM) for layer in layers]
    assert calls == [16] and not torch.equal(keys[0], keys[1])  # one table for both layers' own factors
    backend.after_forward(None, None)
    assert layers[0].tables.rotary is None  # between passes the cache holds no function of the runtime
    backend.before_forward(None, SimpleNamespace(rotary=counting_rotary))
    layers[0].block_keys(layers[0].blocks[0], HEADS, DIM)
    assert calls == [16, 16]  # a new forward pass computes them again


def visual_rope_ids() -> torch.Tensor:
    """M-RoPE ids of a 2-frame 4 x 8 video, then a 4 x 8 image, placed as Qwen2-VL places them."""
    video = torch.stack([torch.arange(64) // 32, 3 + torch.arange(64) % 32 // 8, 3 + torch.arange(64) % 8])
    image = torch.stack([torch.full((32,), 11), 11 + torch.arange(32) // 8, 11 + torch.arange(32) % 8])
    return torch.cat([video, image], dim=1)


def image_rope_ids() -> torch.Tensor:
    """M-RoPE ids of one 8 x 12 picture: one time value, its rows, its columns."""
    return torch.stack([torch.full((96,), 5), 5 + torch.arange(96) // 12, 5 + torch.arange(96) % 12])


@pytest.mark.parametrize("partial_on", ["values", "keys"])
@pytest.mark.parametrize("media, layouts", [
    ("video and image", [("runs", 3), ("gather", 8), ("gather", 16)]),  # frames are runs; rows, columns gathered
    ("image", [("runs", 1), ("runs", 8), ("strided", 12)]),  # one time value; rows are runs, columns strided
])
def test_mrope_blocks_score_the_query_per_distinct_rotation(models, partial_on, media, layouts):
    """With M-RoPE a block's tokens share a few rotations per component (time, row, column): the
    decode query is scored from the factors once per distinct value, and equals attention over the
    rebuilt keys."""
    rotary = Conversation(models("tiny-qwen2-vl"), backends.make_backend("full")).rotary
    layer, _, _ = layer_with(100, partial_on=partial_on)
    layer.observe(torch.rand(100), rows=1, alpha=0.25)
    ids = visual_rope_ids() if media == "video and image" else image_rope_ids()
    assert layer.pack(torch.arange(2, 98), ids, rotary, (6, 6), query_heads=2 * HEADS)
    groups = layer.blocks[0].groups
    assert [(c.layout, c.first.numel()) for c in groups.components] == layouts  # fewest values first
    assert sorted(torch.cat([c.channels for c in groups.components]).tolist()) == list(range(DIM))
    layer.choose_groups()
    keys, values = layer.append(torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM), torch.tensor([100]))
    query, scaling = torch.randn(1, 2 * HEADS, 1, DIM), DIM ** -0.5
    out, row = layer.read_decode(query, scaling)
    assert torch.allclose(row, attention_probs(query, keys, scaling), atol=1e-6)
    assert torch.allclose(out, causal_attention(query, keys, values, scaling), atol=1e-5)


def test_one_d_rope_gives_every_token_its_own_rotation_so_keys_are_rebuilt():
    layer, _, _ = layer_with(50)
    assert layer.pack(torch.arange(40), torch.arange(40)[None], synthetic_rotary, (6, 6), query_heads=2 * HEADS)
    assert layer.blocks[0].groups is None


def test_rotary_groups_are_counted_in_the_bytes(models):
    rotary = Conversation(models("tiny-qwen2-vl"), backends.make_backend("full")).rotary
    layer, _, _ = layer_with(100)
    layer.pack(torch.arange(2, 98), visual_rope_ids(), rotary, (6, 6))
    factors = 2 * (96 * 6 + 6 * WIDTH) * 4
    dense, statistic, rope_ids = 2 * 4 * WIDTH * 4, 100 * 4, 3 * 96 * 4
    # channel indices (int64), one first token per value (int32), the gathered rows' and columns' members
    groups = DIM * 8 + (3 + 8 + 16) * 4 + (8 * 16 + 16 * 8) * 4
    assert layer.nbytes() == factors + dense + statistic + rope_ids + groups
