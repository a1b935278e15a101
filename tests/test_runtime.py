"""The runtime: exact generation, layouts, metering, multi-turn, the registry, bad input."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.support import TINY_MODELS, answer, make_image, make_video

import backends
from backends.attention_math import causal_attention
from backends.base import Report
from backends.descriptions import describe
from kv_arena import testing
from kv_arena.errors import UserError
from kv_arena.media import load_image, load_video
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message

ROOT = Path(__file__).resolve().parents[1]


def hf_reference(loaded, message: Message, max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' own generate() with eager attention on the same ids."""
    chunk = Conversation(loaded, backends.make_backend("full")).encode(message, close_turn=True)
    ids, kwargs = chunk.input_ids, dict(chunk.model_kwargs)
    if loaded.adapter.rope_dims == 3:
        cfg = loaded.model.config
        types = torch.zeros_like(ids, dtype=torch.int)
        types[ids == cfg.image_token_id] = 1
        types[ids == cfg.video_token_id] = 2
        kwargs["mm_token_type_ids"] = types
    loaded.model.set_attn_implementation("eager")
    try:
        out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, **kwargs)
    finally:
        loaded.model.set_attn_implementation({"text_config": "kv_arena", "vision_config": "sdpa"})
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_full_cache_matches_transformers_generate(models, name):
    loaded = models(name)
    videos = [make_video(1)] if loaded.adapter.rope_dims == 3 else []
    message = Message("Describe.", images=[make_image(0, (400, 300)), make_image(1)], videos=videos)
    ours = answer(loaded, backends.make_backend("full"), message, max_new_tokens=12)[0].token_ids
    assert ours == hf_reference(loaded, message, 12)[: len(ours)]


def test_layout_spans_images_and_video_frames(models):
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("full"))
    chunk = conv.encode(Message("What changed?", images=[make_image(0), make_image(1, (224, 224))],
                                videos=[make_video(0, frames=4)]), close_turn=True)
    layout, ids = chunk.layout, chunk.input_ids[0]
    image_id, video_id = loaded.model.config.image_token_id, loaded.model.config.video_token_id
    assert [v.kind for v in layout.visuals] == ["image", "image", "video"]
    assert [v.length for v in layout.images] == [256, 64]  # 448 px -> 16x16 merged tokens, 224 px -> 8x8
    for v in layout.images:
        assert (ids[v.span[0]:v.span[1]] == image_id).all()
    video = layout.videos[0]
    assert len(video.frames) == 2  # 4 frames, temporal patch 2
    assert video.frames[0][0] == video.span[0] and video.frames[-1][1] == video.span[1]
    assert (ids[video.span[0]:video.span[1]] == video_id).all()
    assert layout.system is not None and layout.system[0] == 0
    post = ids[layout.post_vision[0]:layout.post_vision[1]]
    assert not ((post == image_id) | (post == video_id)).any() and len(post) > len("What changed?")
    assert layout.visual_mask().sum() == sum(v.length for v in layout.visuals)


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("method", backends.available())
def test_every_method_is_lossless_at_budget_one(models, name, method):
    """Same tokens and bytes as the full cache at budget 1.0, in a first and a second turn
    (``kv_arena.testing``'s check, which a plugin's tests call too)."""
    testing.check_lossless(method, models(name), image_size=448)


def test_registry_imports_every_method_and_describes_it():
    names = backends.available()  # a method module that fails to import raises here, naming itself
    assert names[0] == "full" and backends.backend_class("full").is_reference and "streamingllm" in names
    assert [n for n in names if backends.backend_class(n).is_reference] == ["full"]  # one reference
    for name in names:
        info = describe(backends.backend_class(name))
        assert info["name"] == name and info["params"][0]["name"] == "budget"
        for p in info["params"]:
            assert p["help"], (name, p["name"])


def test_only_modules_of_backends_register_methods():
    """A KVBackend subclass with a ``name`` defined outside ``backends/`` (as tests/test_streamingllm.py
    defines one), imported before the registry is first read, stays out of it."""
    code = ("import tests.test_streamingllm, backends; "
            "print(','.join(backends.available()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=os.environ | {"OMP_NUM_THREADS": "1"}).stdout.strip()
    assert "_masked_streaming_reference" not in out.split(",") and out.split(",")[0] == "full"
    assert out.split(",") == backends.available()


def test_every_method_reports_a_fresh_typed_report():
    for name in backends.available():
        cls = backends.backend_class(name)
        assert issubclass(cls.report_type, Report) and dataclasses.is_dataclass(cls.report_type), name
        first, second = backends.make_backend(name), backends.make_backend(name)
        assert type(first.report) is cls.report_type and first.report is not second.report, name
        assert first.report.to_dict() == {}, name  # nothing reported before a prompt
        old = first.report
        assert first.reset_report() is first.report is not old and type(first.report) is cls.report_type
    assert backends.backend_class("zipvl").report_type.__name__ == "ZipVLReport"
    report = Report(realised_fraction=0.5)
    report.ensure_layers(3, "kept", "overlay")
    report.ensure_layers(2, "layer_budgets", fill=1.0)
    report.kept[1] = torch.tensor([4, 5])
    report.ensure_layers(3, "kept")  # already sized: left as it is
    assert report.kept[1].tolist() == [4, 5] and report.overlay == [None] * 3 and report.layer_budgets == [1.0, 1.0]
    assert set(report.to_dict()) == {"kept", "layer_budgets", "overlay", "realised_fraction"}
    assert report.to_dict()["kept"] is report.kept  # tensors and lists left to the caller's conversion


def test_method_parameters_are_typed_dataclass_fields():
    for name in backends.available():
        cls = backends.backend_class(name)
        assert dataclasses.is_dataclass(cls) and "__dataclass_fields__" in cls.__dict__, name
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for p in cls.param_specs():
            f = fields[p.name]
            kind = type(p.default).__name__
            assert kind in ("int", "float", "bool", "str"), (name, p.name)
            assert f.type in (kind, type(p.default)) and f.default == p.default and f.init, (name, p.name, f.type)
        built = backends.make_backend(name)
        assert built.config == {p.name: p.default for p in cls.param_specs()}, name
        with pytest.raises(ValueError, match=f"{name} has no parameter nope; it takes: "
                           + (", ".join(p.name for p in cls.param_specs()) or "none")):
            backends.make_backend(name, nope=1)
        with pytest.raises(TypeError):  # built directly: the dataclass's own answer
            cls(nope=1)
    snap = backends.make_backend("snapkv", budget="0.5", window_size="16")  # strings, as from the CLI
    assert snap.window_size == 16 and type(snap.window_size) is int and snap.budget == 0.5
    assert backends.make_backend("vl_cache", redistribute="true").redistribute is True
    with pytest.raises(ValueError, match="window_size"):
        backends.make_backend("snapkv", window_size="wide")


def test_kv_bytes_are_the_bytes_of_the_tensors_held(models):
    loaded = models("tiny-qwen2-vl")
    update, conv = answer(loaded, backends.make_backend("streamingllm", budget=0.3), Message("Hi", images=[make_image(0)]))
    held = sum(t.numel() * t.element_size() for layer in conv.cache.layers for t in (layer.keys, layer.values))
    assert update.metrics.kv_bytes == held == conv.cache.nbytes()
    cfg = loaded.text_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    tokens = conv.cache.tokens_per_layer()[0]
    assert held == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * tokens * head_dim * 4  # float32
    assert update.metrics.kv_trace[-1] == update.metrics.kv_bytes
    assert len(update.metrics.kv_trace) == update.metrics.new_tokens  # after prefill + every fed token


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-llava"])
def test_multi_turn_feeds_only_new_tokens_and_keeps_the_cache(models, name):
    loaded = models(name)
    conv = Conversation(loaded, backends.make_backend("full"))
    first = conv.ask(Message("Look.", images=[make_image(0)]), max_new_tokens=5, ignore_eos=True)
    seen_after_first = conv.seen
    second = conv.ask(Message("More?", images=[make_image(2, (224, 224))]), max_new_tokens=5, ignore_eos=True)
    assert second.metrics.prompt_tokens < first.metrics.prompt_tokens  # the first image is not re-encoded
    assert conv.seen == seen_after_first + second.metrics.prompt_tokens + 4
    assert conv.cache.tokens_per_layer() == [conv.seen] * loaded.num_layers
    assert len(conv.layouts) == 2 and conv.layouts[1].start == seen_after_first


def test_question_after_compresses_media_before_the_question(models):
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("streamingllm", budget=0.2))
    setup = conv.feed(Message("", images=[make_image(0), make_image(1)]))
    assert conv.cache.tokens_per_layer()[0] == math.ceil(0.2 * setup.prompt_tokens)
    update = conv.ask(Message("What colour?"), max_new_tokens=4, ignore_eos=True)
    assert update.metrics.prompt_tokens < 40 and update.metrics.visual_tokens == 0 and update.metrics.new_tokens == 4


def test_causal_attention_matches_sdpa_causal_when_nothing_was_evicted():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    assert torch.allclose(causal_attention(q, k, v, 8 ** -0.5), ref, atol=1e-6)
    # the last 2 queries over 6 keys equal the last rows of the full computation
    assert torch.allclose(causal_attention(q[:, :, 4:], k, v, 8 ** -0.5), ref[:, :, 4:], atol=1e-6)


# --- bad input ------------------------------------------------------------------------------------


def test_bad_inputs_get_clear_messages_and_the_conversation_stays_usable(models, tmp_path):
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("full"))
    not_image = tmp_path / "notes.png"
    not_image.write_text("hello")
    with pytest.raises(UserError, match="not a readable image"):
        conv.ask(Message("hi", images=[str(not_image)]))
    with pytest.raises(UserError, match="not a video"):
        conv.ask(Message("hi", videos=[str(not_image)]))
    with pytest.raises(UserError, match="not found"):
        load_image(tmp_path / "missing.jpg")
    with pytest.raises(UserError, match="empty"):
        conv.ask(Message("   "))
    assert conv.seen == 0
    assert conv.ask(Message("hi", images=[make_image(0)]), max_new_tokens=3).metrics.new_tokens >= 1


def test_prompt_longer_than_the_context_is_refused(models, monkeypatch):
    loaded = models("tiny-qwen2-vl")
    monkeypatch.setattr(type(loaded), "max_context", property(lambda self: 300))
    conv = Conversation(loaded, backends.make_backend("full"))
    with pytest.raises(UserError, match="too long"):
        conv.ask(Message("hi", images=[make_image(0), make_image(1)]))
    assert conv.ask(Message("hi"), max_new_tokens=2).metrics.new_tokens >= 1


def test_bad_method_budget_and_model_names():
    from kv_arena.runtime.models import load_model

    with pytest.raises(ValueError, match="unknown method"):
        backends.make_backend("nope")
    with pytest.raises(ValueError, match="budget"):
        backends.make_backend("streamingllm", budget=1.5)
    with pytest.raises(ValueError, match="sink_tokens"):
        backends.make_backend("streamingllm", sink_tokens=-1)
    with pytest.raises(ValueError, match="no parameter"):
        backends.make_backend("streamingllm", window=3)
    with pytest.raises(UserError, match="unknown model"):
        load_model("no-such-model")


def test_video_file_is_decoded_uniformly(tmp_path):
    pytest.importorskip("decord")
    import numpy as np
    from PIL import Image

    path = tmp_path / "clip.gif"
    frames = [Image.fromarray(np.full((64, 64, 3), 10 * i, np.uint8)) for i in range(10)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100)
    try:
        video = load_video(str(path), num_frames=4)
    except UserError:
        pytest.skip("decord build without gif support")
    assert video.frames.shape[0] == 4
