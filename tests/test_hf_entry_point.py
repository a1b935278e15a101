"""The public entry point (``kv_arena.hf``): any method on a stock transformers model through its own
``generate``, token for token and byte for byte what the app's runtime gives, over two turns."""

from __future__ import annotations

import re

import pytest
import torch
from tests.support import make_image, make_video

import backends
from backends.media_reuse import ReusesMedia
from kv_arena.errors import UserError
from kv_arena.hf import Chat, compress, save_offline
from kv_arena.runtime.attention import ATTENTION_NAME
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.runtime.vision_attention import vision_attention
from kv_arena.runtime.vision_tokens import refusal

PLAIN = [name for name in backends.available() if not issubclass(backends.backend_class(name), ReusesMedia)]
FIRST, SECOND = "What is shown?", "And the colours?"


def stock(loaded):
    """The runtime's model as a stock one: transformers' own attention until ``compress`` runs."""
    loaded.model.set_attn_implementation("sdpa")
    return loaded.model


@pytest.fixture
def restore(models):
    yield
    for name in ("tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-llava"):
        loaded = models(name)
        loaded.model.set_attn_implementation({"text_config": ATTENTION_NAME,
                                              "vision_config": vision_attention(loaded.spec.family)})


def budget_of(method: str) -> float:
    return 0.3 if backends.backend_class(method).uses_budget else 1.0


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava"])  # M-RoPE and 1-D RoPE
@pytest.mark.parametrize("method", PLAIN)
def test_generate_gives_the_runtimes_tokens_and_bytes_over_two_turns(models, restore, name, method):
    loaded = models(name)
    image = make_image(0, (224, 224))
    backend = backends.make_backend(method, budget=budget_of(method))
    refused = refusal(loaded.model, backend)
    if refused is not None:  # the model's vision tower cannot serve it (VisionZip on Qwen-VL): both refuse alike
        with pytest.raises(UserError, match=re.escape(refused)):
            Conversation(loaded, backend)
        with pytest.raises(UserError, match=re.escape(refused)):
            with compress(stock(loaded), method, budget=budget_of(method)):
                pass
        return
    conv = Conversation(loaded, backend)
    ref = [conv.ask(Message(FIRST, images=[image]), max_new_tokens=8), conv.ask(Message(SECOND), max_new_tokens=8)]

    model, adapter = stock(loaded), loaded.adapter
    chat = Chat(model, adapter.tokenizer, adapter.image_processor, adapter.processor)
    eos = sorted(adapter.eos_ids)
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    with compress(model, method, budget=budget_of(method)) as press:
        inputs = chat.turn(FIRST, images=[image])
        out = model.generate(**inputs, **{press.keyword: press.cache}, **settings)
        first = out[0, inputs["input_ids"].shape[1]:].tolist()
        inputs = chat.turn(SECOND, after=out)
        out = model.generate(**inputs, **{press.keyword: press.cache}, **settings)
        second = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert [first, second] == [r.token_ids for r in ref], method
    assert press.nbytes() == conv.cache.nbytes() and press.cache.seen == conv.seen, method
    held, expected = press.kept_positions(), conv.cache.kept_positions()
    assert all(torch.equal(a, b) for a, b in zip(held, expected)), method
    cls = backends.backend_class(method)
    if cls.uses_budget and not cls.resizes_media and method not in ("full", "infinipot_v", "evs"):
        assert press.nbytes() < press.full_nbytes()  # it compressed something (InfiniPot-V, EVS: video tokens only)
    if cls.resizes_media:  # Downsample: a smaller picture (fewer visual tokens), held whole
        full = Conversation(loaded, backends.make_reference()).encode(Message(FIRST, images=[image]), close_turn=True)
        assert ref[0].metrics.visual_tokens < sum(v.length for v in full.layout.visuals)
    assert model.config.get_text_config()._attn_implementation == "sdpa"  # restored after the block


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_the_cache_is_taken_under_either_name(models, restore, keyword):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name renamed on the way in,
    with a FutureWarning, until 5.40 / 6.0). ``compress`` finds the cache under either name; the
    old name warns where the new one exists (the suite fails on a deprecation of our own making, so
    the warning is expected here by name); before 5.24 only the old name exists."""
    loaded = models("tiny-qwen2-vl")
    model, adapter = stock(loaded), loaded.adapter
    inputs = Chat(model, adapter.tokenizer, adapter.image_processor).turn("Hi", images=[make_image(0, (224, 224))])
    with compress(model, "snapkv", budget=0.5) as press:
        if press.keyword == "past_key_values" and keyword == "cache":
            pytest.skip("this transformers release has no `cache` keyword yet")
        if keyword != press.keyword:
            with pytest.warns(FutureWarning, match="past_key_values"):
                out = model.generate(**inputs, **{keyword: press.cache}, max_new_tokens=3, do_sample=False)
        else:
            out = model.generate(**inputs, **{keyword: press.cache}, max_new_tokens=3, do_sample=False)
    assert press.cache.seen == out.shape[1] - 1 and press.nbytes() < press.full_nbytes()


def test_a_deprecated_keyword_in_our_call_fails_the_suite(models, restore):
    """pytest.ini turns FutureWarning and DeprecationWarning into errors: a deprecated name in our
    own call fails a test the day it is announced, not the day it is removed."""
    from transformers import DynamicCache

    from kv_arena.runtime.forward import cache_keyword

    loaded = models("tiny-qwen2-vl")
    model, adapter = stock(loaded), loaded.adapter
    if cache_keyword(model) != "cache":
        pytest.skip("this transformers release has not renamed past_key_values")
    inputs = Chat(model, adapter.tokenizer, adapter.image_processor).turn("Hi")
    with pytest.raises(FutureWarning, match="past_key_values"):
        model.generate(**inputs, past_key_values=DynamicCache(), max_new_tokens=1)
    with pytest.raises(FutureWarning, match="past_key_values"):
        model(**inputs, past_key_values=DynamicCache())


def test_qwen3_vl_video_and_sampling_from_a_saved_checkpoint(tmp_path):
    """The README's path: an offline checkpoint loaded by from_pretrained, an image and a video,
    greedy then sampling on the same cache; sampling is seeded like any generate."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    path = save_offline("tiny-qwen3-vl", tmp_path / "tiny-qwen3-vl")
    model = Qwen3VLForConditionalGeneration.from_pretrained(path)
    chat = Chat(model, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path, backend="pil"))
    inputs = chat.turn("What moves?", images=[make_image(1, (224, 224))], videos=[make_video(2)])
    answers = []
    for _ in range(2):
        with compress(model, "h2o", budget=0.25) as press:
            out = model.generate(**inputs, **{press.keyword: press.cache}, max_new_tokens=6, do_sample=False)
            torch.manual_seed(0)
            more = model.generate(**chat.turn("Why?", after=out), **{press.keyword: press.cache}, max_new_tokens=6,
                                  do_sample=True, temperature=0.9, top_p=0.9)
        answers.append(more[0, out.shape[1]:].tolist())
        assert press.report.kept is not None and len(press.kept_positions()) == 4
        assert abs(press.nbytes() / press.full_nbytes() - 0.25) < 0.01  # H2O holds its budget while decoding
    assert answers[0] == answers[1]


def test_what_cannot_run_is_refused_clearly(models, restore):
    loaded = models("tiny-qwen2-vl")
    model, adapter = stock(loaded), loaded.adapter
    with pytest.raises(ValueError, match="stored"):
        with compress(model, "mpic"):
            pass
    with pytest.raises(ValueError, match="unknown method"):
        with compress(model, "nope"):
            pass
    with pytest.raises(ValueError, match="window_size"):
        with compress(model, "snapkv", budget=0.2, window_size=0):
            pass
    inputs = Chat(model, adapter.tokenizer, adapter.image_processor).turn("Hi")
    with compress(model, "snapkv", budget=0.5), pytest.raises(ValueError, match=r"(cache|past_key_values)=press.cache"):
        model.generate(**inputs, max_new_tokens=2)
    batch = {"input_ids": inputs["input_ids"].repeat(2, 1), "attention_mask": inputs["attention_mask"].repeat(2, 1)}
    with compress(model, "snapkv", budget=0.5) as press, pytest.raises(ValueError, match="batch 1"):
        model.generate(**batch, **{press.keyword: press.cache}, max_new_tokens=2)
    with pytest.raises(ValueError, match="follow-up carries text"):
        Chat(model, adapter.tokenizer, adapter.image_processor).turn("and?", images=[make_image(0)],
                                                                      after=inputs["input_ids"])
    # after the blocks the model is stock again: its own attention, no hooks
    assert model.config.get_text_config()._attn_implementation == "sdpa"
    assert not model._forward_pre_hooks and not model.get_decoder()._forward_hooks
