"""Stacks (backends/stack.py): a method that chooses tokens on a quantised store, by name wherever a
method's name is taken; the budget is the selector's, the bytes what the stack holds; bad stacks
refused in one line."""

from __future__ import annotations

import pytest
import torch
from tests.support import make_image

import backends
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message
from kv_arena.service import method_spec, plan_turn
from kv_arena.service import Settings


@pytest.mark.parametrize("name,message", [
    ("nope+fp8", "unknown method 'nope'"), ("snapkv+nope", "unknown method 'nope'"),
    ("fp8+snapkv", "the store comes second"), ("snapkv+h2o", "h2o is no quantised store"),
    ("snapkv+streamingllm", "no quantised store"), ("fp8+int4", "two stores"),
    ("kivi+fp8", "kivi does more than choose tokens"), ("h2o+fp8", "h2o does more than choose tokens"),
    ("adakv+int4", "adakv does more"), ("snapkv+fp8+int4", "a stack is a method that chooses tokens"),
    ("snapkv+", "a stack is"), ("+fp8", "a stack is")])
def test_bad_stacks_are_refused_in_one_line(name, message):
    with pytest.raises(ValueError, match=message) as caught:
        backends.make_backend(name, budget=0.4)
    assert "\n" not in str(caught.value)


def test_a_stack_is_the_selector_with_the_stores_layers():
    cls = backends.backend_class("snapkv+fp8")
    assert cls is backends.backend_class("snapkv+fp8") and cls.name == "snapkv+fp8"
    assert "snapkv+fp8" not in backends.available() and cls.uses_budget
    method = backends.make_backend("snapkv+fp8", budget=0.4, window_size=8)
    assert method.budget == 0.4 and method.window_size == 8  # the selector's budget and parameters
    assert type(method.new_layer(0)).__name__ == "TokenHeadLayer"
    spec = method_spec("snapkv+int4")
    assert spec["title"] == "SnapKV + INT4 (vLLM)" and spec["does"] == "drops, quantises"
    with pytest.raises(ValueError, match="no parameter format"):
        backends.make_backend("snapkv+fp8", format="none")


def test_at_budget_one_a_stack_holds_and_answers_what_its_store_does(models):
    loaded = models("tiny-qwen2-vl")
    message = Message("What is shown?", images=[make_image(0, (224, 224))])
    answers = {}
    for name in ("fp8", "snapkv+fp8"):
        conv = Conversation(loaded, backends.make_backend(name, budget=1.0))
        answers[name] = (conv.ask(message, max_new_tokens=6, ignore_eos=True).token_ids, conv.cache.nbytes())
    assert answers["fp8"] == answers["snapkv+fp8"]


@pytest.mark.parametrize("selector", ["snapkv", "pyramidkv", "streamingllm", "random", "vl_cache", "fastv"])
@pytest.mark.parametrize("store", ["fp8", "int4"])
def test_a_stack_keeps_the_selectors_count_and_holds_its_entries_coded_over_two_turns(models, selector, store):
    loaded = models("tiny-qwen2-vl")
    cfg = loaded.text_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_entry = 2 * cfg.num_key_value_heads * ((head_dim + 4) if store == "fp8" else (head_dim // 2 + 4 + 1))  # float32
    alone, stacked = (Conversation(loaded, backends.make_backend(n, budget=0.4)) for n in (selector, f"{selector}+{store}"))
    for message in (Message("What is shown?", images=[make_image(1, (224, 224))]), Message("And the colours?")):
        alone.ask(message, max_new_tokens=6, ignore_eos=True)
        stacked.ask(message, max_new_tokens=6, ignore_eos=True)
        assert stacked.cache.tokens_per_layer() == alone.cache.tokens_per_layer()
        assert stacked.cache.nbytes() == per_entry * sum(stacked.cache.tokens_per_layer())
    assert stacked.cache.nbytes() < 0.4 * alone.cache.nbytes() * (1 if store == "int4" else 2)


def test_the_service_and_kv_arena_compress_take_a_stack(models):
    plan = plan_turn(Settings(method="snapkv+int4", budget=0.3), streamed=False)
    assert plan.backend.name == "snapkv+int4" and plan.backend.budget == 0.3
    import kv_arena
    loaded = models("tiny-qwen2-vl")
    try:
        with kv_arena.compress(loaded.model, "snapkv+fp8", budget=0.4) as press:
            assert press.backend.name == "snapkv+fp8"
    finally:
        from kv_arena.runtime.attention import ATTENTION_NAME
        loaded.model.set_attn_implementation({"text_config": ATTENTION_NAME})
    with pytest.raises(ValueError, match="two stores"):
        with kv_arena.compress(loaded.model, "fp8+int4"):
            pass


def test_keep_on_a_coded_layer_is_what_snapkv_keeps():
    """SnapKV's after_attention drops entries of a coded layer as of a dense one: per head, by index."""
    method = backends.make_backend("snapkv+fp8", budget=0.5, window_size=2, kernel_size=1)
    layer = method.new_layer(0)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g)
    dense_k, _ = layer.append(keys, values, torch.arange(10))
    from backends.base import AttentionCall
    call = AttentionCall(0, 1, "prefill", torch.arange(10), torch.arange(10)[None], None, seen=10, step=0)
    method.after_attention(call, layer, torch.randn(1, 4, 10, 16, generator=g), dense_k, 0.25)
    assert layer.get_seq_length() == 5 and layer.kept_positions()[:, -2:].tolist() == [[8, 9], [8, 9]]
    kept_k, _ = layer.dense()
    for h in range(2):
        assert torch.equal(kept_k[0, h], dense_k[0, h, layer.kept_positions()[h]])


def test_compare_takes_a_stack_beside_the_formats(media):
    """Compare's method list (sent through the API as names) takes a stack and fp8 as any method."""
    from tests.app_support import ask, config

    from components import compare
    from kv_arena import service

    runs = list(compare.respond(ask("What is this?", media["image"]), ["snapkv+fp8", "fp8"], service.Session(),
                                config(max_new_tokens=3)))
    table = runs[-1].table
    assert [row[0] for row in table] == ["Full cache", "SnapKV + FP8 (vLLM)", "FP8 (vLLM)"]
    held = [float(row[2].rstrip("x")) for row in table[1:]]
    assert held[0] < held[1] < 1  # the stack holds less than its store alone


def test_the_chats_method_picker_offers_the_stacks_and_a_turn_runs_on_one(media):
    """Chat's picker lists SnapKV on each store, as Compare's boxes do, and a turn answers with it."""
    from tests.app_support import ask, turn

    from components import compare, settings
    from kv_arena import service

    offered = [name for _, name in settings.offered("tiny-qwen2-vl")]
    assert offered[-2:] == service.stacks_of("snapkv") == ["snapkv+fp8", "snapkv+int4"]
    assert [name for _, name in compare.choices("tiny-qwen2-vl")][-2:] == offered[-2:]
    outputs, error = turn(service.Session(), ask("What is this?", media["image"]), method="snapkv+fp8", budget=0.4)
    assert error is None and outputs[-1].status.startswith("**SnapKV + FP8 (vLLM)**")


def test_a_stack_takes_its_selectors_parameters_and_shows_them():
    """SnapKV + FP8 runs with the SnapKV parameters set under Advanced, and the picker shows that fold."""
    from components import settings
    from kv_arena import service

    chosen = Settings.make({"snapkv": {"window_size": 8}}, method="snapkv+fp8")
    assert chosen.method_params("snapkv+fp8") == chosen.method_params("snapkv") == {"window_size": 8}
    assert service.params_owner("snapkv+int4") == "snapkv" and service.params_owner("h2o") == "h2o"
    groups = [s["name"] for s in service.method_specs() if settings.own_params(s)]
    shown = [g for g, group in zip(groups, settings.on_method("snapkv+fp8")[3:]) if group.visible]
    assert shown == ["snapkv"]
