"""ZipVL: the adaptive count, bit packing, quantisation error and bytes, the token-sparse prefill,
and end-to-end behaviour on the tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from tests.support import make_image

import backends
from backends.attention_math import attention_probs, causal_attention
from backends.base import AttentionCall
from backends.descriptions import describe
from backends.quant import FULL_BITS, pack, quantize, unpack
from backends.zipvl import ZipVL, ZipVLLayer, adaptive_count, important_mask, probe_rows
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.models import load_model

HEADS, DIM = 2, 32


def packed_nbytes(shape: tuple[int, ...], bits: int, groups: int, scale_size: int) -> int:
    """What a quantised layer's realised bytes are checked against: bytes of a tensor of ``shape`` at ``bits`` (packed along the last dim) with ``groups``
    (scale, zero point) pairs of ``scale_size`` bytes each; 16 bits is the dense tensor itself."""
    rows = math.prod(shape[:-1])
    if bits == FULL_BITS:
        return rows * shape[-1] * scale_size
    return rows * math.ceil(shape[-1] * bits / 8) + 2 * groups * scale_size



# --- Eq. 6 and the split ----------------------------------------------------------------------


def test_adaptive_count_on_hand_made_scores():
    scores = torch.tensor([0.1, 5.0, 2.0, 0.4, 2.5])  # sorted: 5, 2.5, 2, 0.4, 0.1 (sum 10)
    assert adaptive_count(scores, 0.5) == 1  # 5 >= 5
    assert adaptive_count(scores, 0.51) == 2  # 7.5
    assert adaptive_count(scores, 0.94) == 3  # 9.5 >= 9.4
    assert adaptive_count(scores, 0.96) == 4  # 9.9
    assert adaptive_count(scores, 0.999) == 5
    assert adaptive_count(scores, 1.0) == 5  # every token
    assert adaptive_count(scores, 0.45, total=20.0) == 3  # against n probe rows: 9.5 >= 0.45 x 20
    assert adaptive_count(torch.ones(8), 0.5) == 4  # uniform attention needs half the tokens for half the mass


def test_important_mask_takes_the_top_normalised_scores_and_the_forced_ones():
    scores = torch.tensor([0.3, 0.9, 0.1, 0.5, 0.2])
    assert important_mask(scores, 2).tolist() == [False, True, False, True, False]
    assert important_mask(scores, 2, torch.tensor([4])).tolist() == [False, True, False, False, True]


def test_probe_rows_are_recent_plus_seeded_random():
    rows = probe_rows(1000, 64, 64, seed=3)
    assert rows.numel() == 128 and rows[-64:].tolist() == list(range(936, 1000))
    assert (rows[:64] < 936).all() and rows[:64].unique().numel() == 64
    assert torch.equal(rows, probe_rows(1000, 64, 64, seed=3)) and not torch.equal(rows, probe_rows(1000, 64, 64, seed=4))
    assert probe_rows(100, 64, 64, seed=0).tolist() == list(range(100))  # short prompts: every row (exact Eq. 5)


# --- packing, quantisation, bytes --------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [32, 7])
def test_pack_unpack_round_trip_is_exact(bits, n):
    codes = torch.randint(0, 1 << bits, (3, 5, n), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == math.ceil(n * bits / 8)  # 8 // bits codes a byte
    assert torch.equal(unpack(packed, bits, n), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [2, 4])
def test_quantisation_error_is_within_half_a_step(bits):
    torch.manual_seed(bits)
    x = torch.randn(1, HEADS, 50, DIM) * torch.linspace(0.1, 8, DIM)  # outlier channels, as keys have
    for reduce_dim in (2, 3):  # keys per channel, values per token
        q = quantize(x, bits, reduce_dim)
        step = q.scale.float()
        assert ((q.dequantize() - x).abs() <= step / 2 + 1e-6).all()
        levels = (1 << bits) - 1
        span = x.amax(dim=reduce_dim, keepdim=True) - x.amin(dim=reduce_dim, keepdim=True)
        assert torch.allclose(step, span / levels, rtol=1e-6)
    assert (quantize(x, 2, 2).dequantize() - x).abs().mean() > (quantize(x, 4, 2).dequantize() - x).abs().mean()


def test_bf16_scales_are_rounded_outward_so_the_bound_holds():
    torch.manual_seed(0)
    x = torch.randn(1, HEADS, 40, DIM, dtype=torch.bfloat16)
    q = quantize(x, 4, 3)
    assert q.scale.dtype == torch.bfloat16
    codes = unpack(q.codes, 4, DIM).float()  # the bound before the final cast to bfloat16
    assert ((codes * q.scale.float() + q.zero.float() - x.float()).abs() <= q.scale.float() / 2 + 1e-6).all()


@pytest.mark.parametrize("bits, dtype", [(2, torch.float16), (4, torch.bfloat16), (8, torch.float32), (16, torch.bfloat16)])
def test_bytes_of_a_packed_tensor_equal_the_formula(bits, dtype):
    tokens = 37
    x = torch.randn(1, HEADS, tokens, DIM).to(dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    keys, values = quantize(x, bits, 2), quantize(x, bits, 3)
    assert keys.nbytes() == packed_nbytes(x.shape, bits, HEADS * DIM, size)  # one scale per channel
    assert values.nbytes() == packed_nbytes(x.shape, bits, HEADS * tokens, size)  # one scale per token
    if bits != 16:
        assert keys.nbytes() == HEADS * tokens * DIM * bits // 8 + 2 * HEADS * DIM * size
    else:
        assert keys.nbytes() == x.numel() * size


def test_layer_holds_codes_scales_and_buffer_and_reads_dense():
    torch.manual_seed(0)
    layer = ZipVLLayer(4, 2)
    keys, values = torch.randn(1, HEADS, 20, DIM), torch.randn(1, HEADS, 20, DIM)
    layer.append(keys, values, torch.arange(20))
    important = torch.arange(20) % 4 == 0
    layer.compress(important)
    assert layer.buffered == 0 and layer.get_seq_length() == 20
    out_k, out_v = layer.append(torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM), torch.tensor([20]))
    assert out_k.shape == (1, HEADS, 21, DIM) and layer.buffered == 1
    order = layer.kept_positions()[0]
    assert order[:5].tolist() == [0, 4, 8, 12, 16] and order[-1] == 20  # important, other, buffer
    assert torch.equal(out_k[:, :, :5], quantize(keys[:, :, important], 4, 2).dequantize())  # keys per channel
    assert torch.equal(out_v[:, :, 5:20], quantize(values[:, :, ~important], 2, 3).dequantize())  # values per token
    parts = layer.byte_parts()
    expected = (packed_nbytes((1, HEADS, 5, DIM), 4, HEADS * DIM, 4) + packed_nbytes((1, HEADS, 5, DIM), 4, HEADS * 5, 4)
                + packed_nbytes((1, HEADS, 15, DIM), 2, HEADS * DIM, 4) + packed_nbytes((1, HEADS, 15, DIM), 2, HEADS * 15, 4))
    assert parts["codes"] + parts["scales"] == expected and parts["buffer"] == 2 * HEADS * DIM * 4
    assert layer.nbytes() == expected + parts["buffer"]


# --- the token-sparse prefill ------------------------------------------------------------------


def test_sparse_attention_runs_on_the_important_tokens_only():
    """attend's output equals attention among Q[T], K[T], V[T]; other rows are zero."""
    torch.manual_seed(0)
    zip_vl = ZipVL(0.5, recent_probes=4, random_probes=4, bits_important=16, bits_other=16)
    layer = zip_vl.new_layer(0)
    n = 40
    q, k, v = torch.randn(1, 4, n, DIM), torch.randn(1, HEADS, n, DIM), torch.randn(1, HEADS, n, DIM)
    layer.append(k, v, torch.arange(n))
    call = AttentionCall(0, 1, "prefill", torch.arange(n), torch.arange(n)[None], None, n, 0)
    out = zip_vl.attend(call, q, k, v, DIM ** -0.5)
    zip_vl.after_attention(call, layer, q, k, DIM ** -0.5)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[zip_vl.report.important[0]] = True  # the split, as reported (tokens 0..n-1)
    assert 0 < mask.sum() < n and mask[-1]  # sparse, and the last prompt token always attends
    assert torch.allclose(out[:, :, mask], causal_attention(q[:, :, mask], k[:, :, mask], v[:, :, mask], DIM ** -0.5))
    assert (out[:, :, ~mask] == 0).all()
    assert zip_vl.report.p[0] == mask.sum()  # Eq. 6's count
    assert zip_vl.report.important_ratio[0] == pytest.approx(mask.float().mean().item())


# --- on the tiny models ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava"])
def test_tau_one_and_no_quantisation_equals_the_full_cache(models, name):
    loaded = models(name)
    message = Message("What is shown?", images=[make_image(0)])
    ref = Conversation(loaded, backends.make_backend("full")).ask(message, max_new_tokens=10, ignore_eos=True)
    conv = Conversation(loaded, backends.make_backend("zipvl", tau=1.0, bits_important=16, bits_other=16))
    got = conv.ask(message, max_new_tokens=10, ignore_eos=True)
    assert got.token_ids == ref.token_ids and got.metrics.kv_bytes == ref.metrics.kv_bytes
    assert conv.backend.report.important_ratio == [1.0] * loaded.num_layers


@pytest.fixture(scope="module")
def bf16_qwen():
    return load_model("tiny-qwen2-vl", dtype="bfloat16")


def _bytes_formula(conv) -> int:
    """What the report's split says the cache must weigh: packed K/V per block, plus the buffer."""
    total = 0
    for layer in conv.cache.layers:
        size = layer.keys.element_size()
        for block in layer.blocks:
            for count, bits in ((block.important.numel(), layer.bits_high), (block.other.numel(), layer.bits_low)):
                if count:
                    shape = (1, layer.keys.shape[1], count, layer.keys.shape[3])
                    total += packed_nbytes(shape, bits, shape[1] * shape[3], size)  # keys: per channel
                    total += packed_nbytes(shape, bits, shape[1] * count, size)  # values: per token
        total += 2 * layer.keys.numel() * size
    return total


@pytest.mark.parametrize("tau, below", [(0.5, 0.25), (0.975, 0.30)])
def test_mixed_precision_bytes_at_16_bits(bf16_qwen, tau, below):
    """Bytes are the packed formula for the realised split. At tau 0.5
    the cache is below a quarter of the bf16 full cache; at tau 0.975 the random tiny model marks
    ~90% of its (near-identical) tokens important, so 4-bit dominates: just above 0.25."""
    message = Message("What is shown?", images=[make_image(0), make_image(1)])
    full = Conversation(bf16_qwen, backends.make_backend("full")).ask(message, max_new_tokens=6, ignore_eos=True)
    conv = Conversation(bf16_qwen, backends.make_backend("zipvl", tau=tau))
    got = conv.ask(message, max_new_tokens=6, ignore_eos=True)
    ratio = got.metrics.kv_bytes / full.metrics.kv_bytes
    assert got.metrics.kv_bytes == conv.cache.nbytes() == _bytes_formula(conv)
    assert ratio < below
    # its point on the realised-bytes axis, as the runtime measures it after the prefill
    prefill_ratio = got.metrics.kv_bytes_prefill / full.metrics.kv_bytes_prefill
    assert conv.backend.report.realised_fraction == pytest.approx(prefill_ratio)
    report = conv.backend.report
    assert conv.cache.tokens_per_layer() == [conv.seen] * bf16_qwen.num_layers  # nothing evicted
    for i in range(bf16_qwen.num_layers):
        important, other = report.important[i], report.other[i]
        assert important.numel() + other.numel() == conv.seen - 5  # the 5 decoded tokens still buffered
        assert report.important_ratio[i] == important.numel() / (conv.seen - 5) < 1.0
        assert sum(report.bytes[i].values()) == conv.cache.layers[i].nbytes()


def test_generated_tokens_are_quantised_every_period(models):
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("zipvl", tau=0.9, period=8))
    conv.ask(Message("Hi", images=[make_image(0)]), max_new_tokens=20, ignore_eos=True)
    layer = conv.cache.layers[0]
    assert len(layer.blocks) == 1 + 19 // 8 and layer.buffered == 19 % 8  # 19 tokens fed while decoding
    assert layer.get_seq_length() == conv.seen


def test_multi_turn_and_the_overlay_shows_the_important_tokens(models):
    from kv_arena.service import Prepared, kept_visuals

    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("zipvl", tau=0.9))
    messages = [Message("Look.", images=[make_image(0)]), Message("More?", images=[make_image(2, (224, 224))])]
    first = conv.ask(messages[0], max_new_tokens=4, ignore_eos=True)
    second = conv.ask(messages[1], max_new_tokens=4, ignore_eos=True)
    assert second.metrics.prompt_tokens < first.metrics.prompt_tokens and len(second.token_ids) == 4
    assert conv.cache.tokens_per_layer() == [conv.seen] * loaded.num_layers
    report = conv.backend.report
    important = report.important[0]
    assert important.numel() + report.other[0].numel() == conv.seen - 3  # 3 decoded tokens still buffered
    assert conv.seen - 3 - 1 in important.tolist()  # the second prompt's last token
    visuals = kept_visuals(conv, [Prepared(m, str(i)) for i, m in enumerate(messages)])
    assert len(visuals) == 2
    span = conv.layouts[0].visuals[0].span
    inside = ((important >= span[0]) & (important < span[1])).sum().item()
    assert visuals[0].keep[0].mean() == pytest.approx(inside / (span[1] - span[0]))
    assert 0 < visuals[0].keep.mean() < 1  # some visual tokens at 4 bits, some at 2


def test_bad_parameters_raise():
    for params in ({"bits_important": 3}, {"bits_other": 5}, {"bits_important": 2, "bits_other": 4},
                   {"recent_probes": 0, "random_probes": 0}, {"period": 0}, {"tau": 1.5}, {"tau": 0}):
        with pytest.raises(ValueError):
            backends.make_backend("zipvl", **params)
    with pytest.raises(ValueError):
        backends.make_backend("zipvl", 1.5)


def test_tau_is_a_named_parameter_and_the_budget_is_not_used():
    assert ZipVL().tau == 0.975 and ZipVL(tau=0.8).tau == 0.8
    assert ZipVL(budget=0.2).tau == 0.975  # no budget: the app and the benches pass 1.0, like MPIC's
    info = describe(ZipVL)
    assert info["uses_budget"] is False
    assert {"name": "tau", "default": 0.975}.items() <= next(p for p in info["params"] if p["name"] == "tau").items()


def test_prefill_bench_runs_at_a_tiny_size(capsys):
    import json

    from kv_arena.bench import cli

    code = cli.main(["--mode", "prefill", "--model", "random:Qwen/Qwen2-VL-2B-Instruct", "--num-layers", "1",
                       "--visual-tokens", "256", "--budget", "0.975,0.5", "--repeats", "1", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = json.loads(out.out)
    assert [(r["visual_tokens"], r["tau"]) for r in rows] == [(256, 0.975), (256, 0.5)]
    assert rows[0]["full_s"] == rows[1]["full_s"] > 0  # one full-cache measurement per size
    assert all(r["zipvl_s"] > 0 for r in rows)
    assert 0 < rows[1]["important_ratio"] < rows[0]["important_ratio"] <= 1  # a lower tau keeps fewer tokens
    assert cli.main(["--mode", "prefill", "--budget", "0.9,high"]) == 2


def test_decode_attend_from_codes_equals_attention_over_the_dequantised_cache():
    torch.manual_seed(0)
    layer = ZipVLLayer(4, 2)
    layer.append(torch.randn(1, HEADS, 30, DIM), torch.randn(1, HEADS, 30, DIM), torch.arange(30))
    layer.compress(torch.arange(30) % 3 == 0)
    layer.append(torch.randn(1, HEADS, 3, DIM), torch.randn(1, HEADS, 3, DIM), torch.arange(30, 33))
    keys, values = layer.append(torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM), torch.tensor([33]))
    query, scaling = torch.randn(1, 2 * HEADS, 1, DIM), DIM ** -0.5
    out, row = layer.read_decode(query, scaling)
    assert torch.allclose(out, causal_attention(query, keys, values, scaling), atol=1e-5)
    assert torch.allclose(row, attention_probs(query, keys, scaling), atol=1e-6)
    dense_k, _ = layer.append_decode(torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM), torch.tensor([34]))
    assert dense_k.shape[2] == 5 and layer.get_seq_length() == 35  # stored; only the buffer returned
