"""The eviction methods on the tiny models, side by side: bad parameters refused; for those that
hold the budget while decoding (Elastic Cache, H2O), bytes that track it after 64 tokens and a
second turn compressed on top of the history; for those that compress each prompt (VL-Cache,
SnapKV, PyramidKV), realised bytes that match their realised per-layer budgets and a question
asked after the media. Lossless at budget 1.0 is test_runtime's registry-wide matrix; each
method's own algorithm is in its test_<method>.py."""

from __future__ import annotations

import math

import pytest
from tests.support import answer, make_image

import backends
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.models import load_model

DECODE_TIME = ["elastic_cache", "h2o"]  # hold the budget while decoding
PROMPT_TIME = ["vl_cache", "snapkv", "pyramidkv"]  # compress each prompt, then append


@pytest.mark.parametrize("name,bad", [("elastic_cache", {"truncation_distance": 0}),
                                      ("elastic_cache", {"protected_tokens": 0}),
                                      ("h2o", {"recent_share": 1.5}), ("h2o", {"window": 4}),
                                      ("snapkv", {"pooling": "median"}), ("snapkv", {"kernel_size": 0}),
                                      ("snapkv", {"window_size": 0}), ("pyramidkv", {"beta": 0.5}),
                                      ("vl_cache", {"threshold": 0.9}), ("vl_cache", {"window_size": 32}),
                                      ("adakv", {"alpha": -0.1}), ("kivi", {"bits": 3}),
                                      ("kivi", {"residual": 100})])
def test_bad_parameters_are_refused(name, bad):
    with pytest.raises(ValueError):
        backends.make_backend(name, budget=0.5, **bad)


PROMPT = "Describe the image."


def two_turns(loaded, backend):
    conv = Conversation(loaded, backend)
    first = conv.ask(Message(PROMPT, images=[make_image(1, (224, 224))]), max_new_tokens=6)
    second = conv.ask(Message("And the colours?"), max_new_tokens=6)
    return first.token_ids + second.token_ids, conv


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava"])  # M-RoPE and 1-D RoPE
@pytest.mark.parametrize("name", DECODE_TIME)
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
    for name in DECODE_TIME:
        for budget in (0.2, 0.5):
            update, _ = answer(loaded, backends.make_backend(name, budget=budget), message, 64)
            assert update.metrics.new_tokens == 64, (name, budget)
            ratio = update.metrics.kv_bytes / full.metrics.kv_bytes
            assert abs(ratio - budget) <= 0.02, (name, budget, ratio)
            prefill_ratio = update.metrics.kv_bytes_prefill / full.metrics.kv_bytes_prefill
            assert abs(prefill_ratio - budget) <= 0.02, (name, budget, prefill_ratio)


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava"])  # M-RoPE and 1-D RoPE
def test_realised_bytes_match_realised_budgets(models, model):
    loaded = models(model)
    message = Message(PROMPT, images=[make_image(0, (224, 224))])
    full, _ = answer(loaded, backends.make_backend("full"), message, 1)  # one token: no decode step
    for name in PROMPT_TIME:
        for budget in (0.1, 0.4):
            update, conv = answer(loaded, backends.make_backend(name, budget=budget), message, 1)
            report = conv.backend.report
            realised = sum(report.layer_budgets) / len(report.layer_budgets)
            ratio = update.metrics.kv_bytes_prefill / full.metrics.kv_bytes_prefill
            assert abs(ratio - realised) <= 0.02, (name, budget, ratio, realised)
            held = conv.cache.tokens_per_layer()
            assert held == [round(b * conv.seen) for b in report.layer_budgets]
            if name != "vl_cache":  # VL-Cache may leave clipped budget unspent
                assert abs(realised - budget) <= 0.02, (name, budget, realised)
            if name == "pyramidkv" and math.ceil(budget * conv.seen) > 32:  # a pyramid above the window
                assert held == sorted(held, reverse=True) and held[0] > held[-1]


@pytest.mark.parametrize("name", PROMPT_TIME)
def test_text_before_image_question_after_and_a_second_turn(models, name):
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend(name, budget=0.4))
    conv.feed(Message("", images=[make_image(2, (224, 224))]))  # the question comes later
    conv.ask(Message("Which colour dominates?"), max_new_tokens=3)
    conv.ask(Message("Now this one.", images=[make_image(3, (224, 224))], media_first=False), max_new_tokens=3)
    for kept in conv.cache.kept_positions():
        assert (kept[:, 1:] > kept[:, :-1]).all()  # token order kept, no duplicates
        assert (kept < conv.layouts[-1].start).any()  # the compressed history is still there
    held = conv.cache.tokens_per_layer()
    assert sum(held) <= 4 * math.ceil(0.4 * conv.seen) + 2 * 4  # two decoded tokens appended per layer
