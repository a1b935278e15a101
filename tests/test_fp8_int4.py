"""FP8 and INT4 per token and KV head (vLLM's fp8_per_token_head, int4_per_token_head): codes against
float64 references written from vLLM's rules (E4M3's value grid enumerated from its bits, the Hadamard
matrix built by Kronecker products), the bytes held, and chats on the offline model in bfloat16."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import backends
from backends.fp8 import E4M3Codec
from backends.int4 import Int4Codec, rotate, signs, unrotate
from backends.quant import unpack
from backends.token_quant import TokenHeadLayer
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.models import load_model
from kv_arena.tiny import drawn_scenes

HEADS, DIM = 2, 32


def sample(tokens: int = 40, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, HEADS, tokens, DIM, generator=g) * torch.rand(1, HEADS, tokens, 1, generator=g) * 8
    x[..., 5] *= 10  # an outlier channel
    x[0, 0, 3] = 0  # an all-zero vector: the scale's floor
    return x.to(dtype)


def bf16_up(v: np.ndarray) -> np.ndarray:
    """float64 -> the smallest bfloat16 (8 significant bits) at or above it (positive, normal values)."""
    mantissa, exponent = np.frexp(v)  # v = m 2^e, m in [0.5, 1)
    return np.ceil(mantissa * 2.0**8) * 2.0 ** (exponent - 8)


def e4m3_grid() -> np.ndarray:
    """The non-negative finite float8_e4m3fn values, by code 0..126, from the format's bits."""
    out = []
    for code in range(127):  # 127 (0x7F) is NaN
        exponent, mantissa = code >> 3, code & 7
        out.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(out)


def reference_fp8(x: torch.Tensor) -> np.ndarray:
    """vLLM's per-token-head FP8 decoded, in float64: s = max(amax / 448, 1e-6) (held in bfloat16,
    rounded up), code = x / s rounded to the nearest E4M3 value, ties to the even code."""
    v = x.double().numpy()
    scale = bf16_up(np.maximum(np.abs(v).max(-1, keepdims=True) / 448, 1e-6))
    q = np.clip(v / scale, -448, 448)
    grid = e4m3_grid()
    mag = np.abs(q)
    hi = np.clip(np.searchsorted(grid, mag), 1, 126)
    lo = hi - 1
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.sign(q) * grid[pick] * scale


def hadamard64(dim: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.kron(np.array([[1, 1], [1, -1]]), h)
    return h / math.sqrt(dim)


def reference_int4(x: torch.Tensor, rotated: bool) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-token-head INT4 in float64: (codes, decoded). Rotation y = H (d * x); s = max((max -
    min) / 15, 1e-6) (bfloat16, rounded up); z = round(-min / s); code = round(y / s + z), both clamped
    to [0, 15] and rounded half away from zero; decoded: d * (H ((code - z) s))."""
    v = x.double().numpy()
    d = signs(DIM).double().numpy()
    h = hadamard64(DIM)
    y = (v * d) @ h.T if rotated else v
    low, high = y.min(-1, keepdims=True), y.max(-1, keepdims=True)
    scale = bf16_up(np.maximum((high - low) / 15, 1e-6))
    half_away = lambda t: np.sign(t) * np.floor(np.abs(t) + 0.5)  # noqa: E731
    zero = np.clip(half_away(-low / scale), 0, 15)
    codes = np.clip(half_away(y / scale + zero), 0, 15)
    back = (codes - zero) * scale
    return codes, (back @ h) * d if rotated else back


def test_fp8_decodes_to_the_float64_reference():
    x = sample()
    codec = E4M3Codec()
    parts = codec.encode(x)
    assert parts["codes"].dtype == torch.uint8 and parts["codes"].shape == x.shape
    assert parts["scale"].shape == (1, HEADS, 40, 1) and parts["scale"].dtype == torch.bfloat16
    got = codec.decode(parts, torch.float32).double().numpy()
    np.testing.assert_array_equal(got, reference_fp8(x))
    assert (parts["codes"].view(torch.float8_e4m3fn).float().abs() <= 448).all()  # saturated, never NaN
    assert parts["scale"][0, 0, 3].item() == pytest.approx(1e-6, rel=1e-2)  # the all-zero vector: the floor


@pytest.mark.parametrize("rotated", [False, True])
def test_int4_codes_and_decoded_values_equal_the_float64_reference(rotated):
    x = sample(seed=1)
    codec = Int4Codec(rotated)
    parts = codec.encode(x)
    assert parts["codes"].shape == (1, HEADS, 40, DIM // 2)  # two codes a byte
    assert parts["zero"].dtype == torch.uint8 and parts["scale"].dtype == torch.bfloat16
    ref_codes, ref = reference_int4(x, rotated)
    codes = unpack(parts["codes"], 4, DIM).double().numpy()
    agree = (codes == ref_codes).mean()
    # rotated, float32 and float64 sums differ in the last bits: a code on a rounding boundary may flip
    assert agree == 1.0 if not rotated else agree > 0.999
    got = codec.decode(parts, torch.float32).double().numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6 if not rotated else 0.2 * float(parts["scale"].float().max()))


def test_the_rotation_is_orthonormal_hadamard_with_fixed_signs():
    x = torch.randn(5, DIM, dtype=torch.float64).float()
    expected = (x.double().numpy() * signs(DIM).double().numpy()) @ hadamard64(DIM)
    np.testing.assert_allclose(rotate(x).double().numpy(), expected, atol=1e-5)
    torch.testing.assert_close(unrotate(rotate(x)), x, atol=1e-5, rtol=1e-5)
    assert set(signs(DIM).tolist()) == {-1.0, 1.0} and torch.equal(signs(DIM), signs(DIM))


def test_a_head_size_that_is_no_power_of_two_is_quantised_unrotated():
    x = torch.randn(1, 1, 3, 24)
    codec = Int4Codec(True)
    codec.encode(x)
    assert not codec.rotating


@pytest.mark.parametrize("method,per_vector", [("fp8", DIM + 2), ("int4", DIM // 2 + 2 + 1)])
def test_bytes_held_are_codes_scales_and_zero_points(method, per_vector):
    layer = backends.make_backend(method).new_layer(0)
    assert isinstance(layer, TokenHeadLayer)
    keys, values = sample(30, 2), sample(30, 3)
    out_k, out_v = layer.append(keys, values, torch.arange(30))
    assert out_k.dtype == torch.bfloat16 and out_k.shape == keys.shape  # the prefill reads the coded cache
    assert not torch.equal(out_k, keys)
    assert layer.nbytes() == 2 * HEADS * 30 * per_vector
    parts = layer.byte_parts()
    assert parts["codes"] == 2 * HEADS * 30 * (DIM if method == "fp8" else DIM // 2)
    assert parts["codes"] + parts["scales"] == layer.nbytes()


def test_keep_drops_codes_scales_and_positions_per_head():
    layer = backends.make_backend("fp8").new_layer(0)
    keys, values = sample(12, 4), sample(12, 5)
    layer.append(keys, values, torch.arange(12))
    dense_k, dense_v = layer.dense()
    index = torch.tensor([[0, 3, 7, 11], [1, 2, 8, 10]])
    layer.keep(index)
    assert layer.kept_positions().tolist() == index.tolist()
    kept_k, kept_v = layer.dense()
    for h in range(HEADS):
        assert torch.equal(kept_k[0, h], dense_k[0, h, index[h]]) and torch.equal(kept_v[0, h], dense_v[0, h, index[h]])
    assert layer.nbytes() == 2 * HEADS * 4 * (DIM + 2)


def test_bad_formats_are_refused():
    for method in ("fp8", "int4"):
        with pytest.raises(ValueError, match="format"):
            backends.make_backend(method, format="e5m2")
    assert backends.make_backend("fp8", budget=0.3).budget == 1.0  # no budget: the format sets the bytes


# --- on the offline model, in bfloat16 (the cache a GPU holds) ------------------------------------


@pytest.fixture(scope="module")
def arena_bf16():
    return load_model("tiny-arena-vl", dtype="bfloat16")


def picture_message(seed: int = 0) -> Message:
    item = drawn_scenes.item(seed, "colour")
    return Message(item.question.text, images=item.images())


def chat(loaded, method: str, budget: float, message: Message, turns: int = 1):
    conv = Conversation(loaded, backends.make_backend(method, budget=budget))
    answers = [conv.ask(message, max_new_tokens=6)]
    if turns > 1:
        answers.append(conv.ask(Message("What shape is it?"), max_new_tokens=6))
    return conv, answers


@pytest.mark.parametrize("method,low,high", [("fp8", 0.48, 0.56), ("int4", 0.24, 0.32), ("snapkv+fp8", 0.18, 0.24)])
def test_at_budget_0_4_on_a_picture_the_bytes_held_are_the_formats(arena_bf16, method, low, high):
    message = picture_message()
    full, full_answers = chat(arena_bf16, "full", 0.4, message)
    conv, answers = chat(arena_bf16, method, 0.4, message)
    share = conv.cache.nbytes() / full.cache.nbytes()
    assert low <= share <= high, (method, share)
    if method == "fp8":
        assert answers[0].token_ids == full_answers[0].token_ids  # answers as the full cache does
        assert conv.backend.report.realised_fraction == pytest.approx(share)
        cfg = arena_bf16.text_config
        assert conv.cache.tokens_per_layer() == [conv.seen] * cfg.num_hidden_layers  # every token kept


def test_fp8_answers_as_the_full_cache_over_two_turns(arena_bf16):
    for seed in range(3):
        message = picture_message(seed)
        _, full = chat(arena_bf16, "full", 1.0, message, turns=2)
        _, fp8 = chat(arena_bf16, "fp8", 1.0, message, turns=2)
        assert [a.token_ids for a in fp8] == [a.token_ids for a in full], seed
