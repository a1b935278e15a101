"""KIVI: codes against a reference written from the paper's equations, the residual windows and their
flush schedule (Algorithm 1), the error bound, the bytes held, transformers' QuantizedCache backend
on the same tensors, and a chat on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from tests.support import make_image

import backends
from backends.kivi import KIVILayer, channel_group
import backends.kivi
from backends.attention_math import attention_probs, causal_attention
from backends.quant import QuantTensor, unpack
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message

HEADS, DIM, G, R = 2, 64, 8, 16


def kv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HEADS, tokens, DIM, generator=g)
    keys[..., 3] *= 20  # an outlier channel, as in the paper's Fig. 2
    return keys, torch.randn(1, HEADS, tokens, DIM, generator=g)


def reference_quant(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's asymmetric quantisation (Sec. 3.1) of one group ``x`` (1-D): codes and dequantised."""
    low, high = x.min(), x.max()
    scale = (high - low) / (2**bits - 1)
    codes = torch.round((x - low) / scale).clamp(0, 2**bits - 1)
    return codes, codes * scale + low


def reference_kivi(keys: torch.Tensor, values: torch.Tensor, bits: int):
    """Algorithm 1 after a prefill of l tokens, element by element: keys per channel in groups of G
    tokens for the first l - (l mod R), values per token in groups of G channels for the first l - R."""
    l = keys.shape[2]
    key_quantised, value_quantised = l - l % R, max(0, l - R)
    key_codes = torch.zeros(HEADS, key_quantised, DIM)
    key_hat = keys[0].clone()
    for h in range(HEADS):
        for start in range(0, key_quantised, G):
            for c in range(DIM):
                codes, hat = reference_quant(keys[0, h, start:start + G, c], bits)
                key_codes[h, start:start + G, c], key_hat[h, start:start + G, c] = codes, hat
    value_codes = torch.zeros(HEADS, value_quantised, DIM)
    value_hat = values[0].clone()
    for h in range(HEADS):
        for t in range(value_quantised):
            for start in range(0, DIM, G):
                codes, hat = reference_quant(values[0, h, t, start:start + G], bits)
                value_codes[h, t, start:start + G], value_hat[h, t, start:start + G] = codes, hat
    return key_codes, key_hat, value_codes, value_hat


def layer_codes(layer: KIVILayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's key and value codes, unpacked, as (H, n, D)."""
    qk, qv = layer.quant_keys, layer.quant_values
    keys = unpack(qk.codes, qk.bits, qk.shape[-1]).reshape(HEADS, -1, DIM)
    values = unpack(qv.codes, qv.bits, DIM).reshape(HEADS, -1, DIM)  # a token's D codes packed as one row
    return keys.float(), values.float()


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_and_dequantised_cache_equal_the_papers_equations(bits):
    keys, values = kv(77)
    layer = KIVILayer(bits, G, R)
    out_k, out_v = layer.append(keys, values, torch.arange(77))
    assert torch.equal(out_k, keys) and torch.equal(out_v, values)  # the prefill attends in full precision
    ref_kc, ref_k, ref_vc, ref_v = reference_kivi(keys, values, bits)
    codes_k, codes_v = layer_codes(layer)
    assert torch.equal(codes_k, ref_kc) and torch.equal(codes_v, ref_vc)
    dense_k, dense_v = layer.dense()
    assert torch.allclose(dense_k[0], ref_k, atol=1e-5) and torch.allclose(dense_v[0], ref_v, atol=1e-5)


def test_residual_windows_stay_exact_and_flush_on_algorithm_1s_schedule():
    keys, values = kv(40)
    layer = KIVILayer(2, G, R)
    layer.append(keys[:, :, :21], values[:, :, :21], torch.arange(21))
    assert (layer.keys.shape[2], layer.values.shape[2]) == (21 % R, R)
    first_block = layer.quant_keys.codes.clone()
    for t in range(21, 40):
        layer.append_decode(keys[:, :, t:t + 1], values[:, :, t:t + 1], torch.tensor([t]))
        layer.flush()  # KIVI.after_forward's, after the step's attention
        l = t + 1
        assert (layer.keys.shape[2], layer.values.shape[2]) == (l % R, R)  # keys: l mod R; values: the newest R
        out_k, out_v = layer.dense()
        assert torch.equal(out_k[:, :, l - l % R:], keys[:, :, l - l % R:l])  # the residuals are exact
        assert torch.equal(out_v[:, :, l - R:], values[:, :, l - R:l])
        assert out_k.shape[2] == out_v.shape[2] == l
    assert torch.equal(layer.quant_keys.codes[:, :, :first_block.shape[2]], first_block)  # never re-quantised
    assert layer.full_precision_positions().tolist() == list(range(32, 40))


@pytest.mark.parametrize("bits", [2, 4])
def test_dequantisation_error_is_within_half_a_step(bits):
    keys, values = kv(64, seed=3)
    layer = KIVILayer(bits, G, R)
    layer.append(keys, values, torch.arange(64))
    dense_k, dense_v = layer.dense()
    step_k = layer.quant_keys.scale.float().expand(layer.quant_keys.shape).reshape(1, HEADS, -1, DIM)
    step_v = layer.quant_values.scale.float().expand(layer.quant_values.shape).reshape(1, HEADS, -1, DIM)
    assert step_k.shape[2] == 64 and step_v.shape[2] == 48  # keys: all 64 (64 mod R = 0); values: all but R
    assert ((dense_k - keys).abs() <= step_k / 2 + 1e-5).all()
    assert ((dense_v[:, :, :48] - values[:, :, :48]).abs() <= step_v / 2 + 1e-5).all()


def test_bytes_held_are_codes_scales_zero_points_and_residuals():
    keys, values = kv(77)
    layer = KIVILayer(2, G, R)
    layer.append(keys.half(), values.half(), torch.arange(77))
    key_tokens, value_tokens = 64, 61
    codes = HEADS * key_tokens * DIM * 2 // 8 + HEADS * value_tokens * DIM * 2 // 8
    scales = 2 * 2 * (HEADS * key_tokens // G * DIM + HEADS * value_tokens * DIM // G)  # scale + zero, fp16
    residual = 2 * HEADS * DIM * (13 + 16)
    assert layer.byte_parts() == {"codes": codes, "padding": 0, "scales": scales, "residual": residual}
    assert layer.nbytes() == codes + scales + residual


def test_same_codes_as_transformers_quantized_cache_quanto_backend():
    """transformers' QuantizedCache with optimum-quanto quantises along one axis in groups of
    contiguous elements; fed KIVI's groups (one row per group) it must reproduce KIVI's dequantised
    keys and values exactly."""
    pytest.importorskip("optimum.quanto")
    from transformers.cache_utils import QuantoQuantizedLayer

    keys, values = kv(64, seed=5)
    for bits in (2, 4):
        layer = KIVILayer(bits, G, R)
        layer.append(keys, values, torch.arange(64))
        dense_k, dense_v = layer.dense()
        theirs = QuantoQuantizedLayer(nbits=bits, q_group_size=G)
        # keys: a group is G tokens of one channel; values: G channels of one token
        key_groups = keys[0, :, :48].reshape(HEADS, 6, G, DIM).transpose(-1, -2).reshape(-1, G)
        value_groups = values[0, :, :48].reshape(-1, G)
        key_hat = theirs._dequantize(theirs._quantize(key_groups.contiguous(), axis=0))
        value_hat = theirs._dequantize(theirs._quantize(value_groups.contiguous(), axis=0))
        key_hat = key_hat.reshape(HEADS, 6, DIM, G).transpose(-1, -2).reshape(1, HEADS, 48, DIM)
        assert torch.allclose(dense_k[:, :, :48], key_hat, atol=1e-5), bits
        assert torch.allclose(dense_v[:, :, :48], value_hat.reshape(1, HEADS, 48, DIM), atol=1e-5), bits


def decode_step(layer: KIVILayer, t: int, seed: int):
    """One decode token stored (not flushed) and a query for it."""
    g = torch.Generator().manual_seed(seed)
    heads, dim = layer.keys.shape[1], layer.keys.shape[3]
    layer.append_decode(torch.randn(1, heads, 1, dim, generator=g), torch.randn(1, heads, 1, dim, generator=g),
                        torch.tensor([t]))
    return torch.randn(1, 2 * heads, 1, dim, generator=g)


@pytest.mark.parametrize("bits,dim,tokens", [(2, 64, 77), (4, 64, 100), (8, 64, 40), (2, 20, 61), (4, 6, 50), (2, 8, 10)])
def test_a_decode_query_reads_the_codes_and_equals_attention_over_the_dequantised_cache(monkeypatch, bits, dim, tokens):
    """Keys scored from their codes (q s . codes + q . z per channel group), values mixed a block at a
    time: the same output and softmax row as exact attention over the dequantised cache, and no
    whole key or value tensor is dequantised (QuantTensor.dequantize is never called)."""
    g = torch.Generator().manual_seed(dim + tokens)
    keys, values = torch.randn(1, HEADS, tokens, dim, generator=g) * 3, torch.randn(1, HEADS, tokens, dim, generator=g)
    layer = KIVILayer(bits, G, R)
    layer.append(keys, values, torch.arange(tokens))
    query = decode_step(layer, tokens, seed=1)
    dense_k, dense_v = layer.dense()
    monkeypatch.setattr(QuantTensor, "dequantize", lambda self: pytest.fail("a decode read dequantised a tensor"))
    monkeypatch.setattr("backends.kivi.READ_BLOCK", 16)  # several blocks
    out, row = layer.read_decode(query, dim ** -0.5)
    torch.testing.assert_close(out, causal_attention(query, dense_k, dense_v, dim ** -0.5), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(row, attention_probs(query, dense_k, dim ** -0.5), atol=1e-7, rtol=1e-5)


def test_a_flush_step_attends_in_full_precision_first_as_the_authors_code():
    """At a flush the step's query reads the R keys and R + 1 values in full precision, then they are
    quantised (jy-yuan/KIVI attends, then quantises); the runtime flushes in KIVI.after_forward."""
    keys, values = kv(2 * R - 1)
    layer = KIVILayer(2, G, R)
    layer.append(keys, values, torch.arange(2 * R - 1))
    assert (layer.keys.shape[2], layer.values.shape[2]) == (R - 1, R)
    query = decode_step(layer, 2 * R - 1, seed=2)
    assert (layer.keys.shape[2], layer.values.shape[2]) == (R, R + 1)  # nothing quantised before the attention
    before_k, before_v = layer.dense()
    out, _ = layer.read_decode(query, DIM ** -0.5)
    torch.testing.assert_close(out, causal_attention(query, before_k, before_v, DIM ** -0.5), atol=2e-6, rtol=1e-5)
    layer.flush()
    assert (layer.keys.shape[2], layer.values.shape[2]) == (0, R)  # then the R keys and the oldest value
    after_k, after_v = layer.dense()
    assert not torch.allclose(out, causal_attention(query, after_k, after_v, DIM ** -0.5), atol=1e-4)  # the other order


def test_value_groups_do_not_pad_on_their_own_and_a_row_s_padding_is_counted():
    """D = 20 at G = 8: value groups of g = 5 channels (10 bits at 2 bits). Packed group by group they
    took 2 bytes each, 8 a token; packed a token's row at a time they take the 5 bytes the 40 bits
    need. D = 6 at 2 bits: a row of 12 bits held in 2 bytes, for keys and values: the 4 unused bits of
    each row are counted in the bytes held and reported apart."""
    layer = KIVILayer(2, G, R)
    layer.append(torch.randn(1, HEADS, 40, 20), torch.randn(1, HEADS, 40, 20), torch.arange(40))
    assert channel_group(20, G) == 5 and layer.quant_values.shape[-2:] == (4, 5)
    assert layer.quant_values.codes.shape == (1, HEADS, 40 - R, 5) and layer.byte_parts()["padding"] == 0

    layer = KIVILayer(2, G, R)
    layer.append(torch.randn(1, HEADS, 40, 6), torch.randn(1, HEADS, 40, 6), torch.arange(40))
    key_rows, value_rows = HEADS * 32, HEADS * (40 - R)  # keys: 40 - 40 mod R tokens; values: 40 - R
    assert layer.quant_keys.codes.shape[-1] == layer.quant_values.codes.shape[-1] == 2  # ceil(12 bits / 8)
    parts = layer.byte_parts()
    assert parts["padding"] == (key_rows + value_rows) * 4 // 8
    assert parts["codes"] == (key_rows + value_rows) * 12 // 8
    assert parts["codes"] + parts["padding"] == layer.quant_keys.codes.numel() + layer.quant_values.codes.numel()
    assert layer.nbytes() == sum(parts.values())
    assert "padding" in backends.kivi.__doc__


def test_value_groups_fall_back_to_a_divisor_of_the_head_dim():
    assert channel_group(128, 32) == 32 and channel_group(80, 32) == 20 and channel_group(8, 32) == 8


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="bits"):
        backends.make_backend("kivi", bits=3)
    with pytest.raises(ValueError, match="multiple of group_size"):
        backends.make_backend("kivi", group_size=32, residual=100)


def test_a_chat_on_a_tiny_model_holds_the_bits_it_reports(models):
    loaded = models("tiny-qwen2-vl")
    method = backends.make_backend("kivi")
    conv = Conversation(loaded, method)
    first = conv.ask(Message("What is shown?", images=[make_image(0)]), max_new_tokens=8, ignore_eos=True)
    second = conv.ask(Message("And the colours?"), max_new_tokens=8, ignore_eos=True)
    report = method.report
    assert second.metrics.kv_bytes == conv.cache.nbytes() == sum(sum(b.values()) for b in report.bytes)
    cfg = loaded.text_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    full = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * conv.seen * head_dim * 4  # float32
    assert report.realised_fraction == pytest.approx(conv.cache.nbytes() / full)
    heads, seen = cfg.num_key_value_heads, conv.seen
    key_tokens, value_tokens = seen - seen % 128, seen - 128  # Algorithm 1's residuals: l mod R and R
    expected = {"codes": heads * (key_tokens + value_tokens) * head_dim * 2 // 8, "padding": 0,
                "scales": 2 * 4 * heads * (key_tokens // 32 * head_dim + value_tokens * head_dim // channel_group(head_dim, 32)),
                "residual": 4 * heads * head_dim * (seen % 128 + 128)}
    assert report.bytes == [expected] * cfg.num_hidden_layers
    assert report.realised_fraction < 0.5
    assert conv.cache.tokens_per_layer() == [conv.seen] * cfg.num_hidden_layers  # KIVI keeps every token
    assert first.metrics.kv_bytes < math.ceil(0.4 * full)
    assert all(o.numel() == conv.seen % 128 for o in report.overlay)
