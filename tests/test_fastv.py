"""FastV (backends/fastv.py): the visual tokens it keeps after layer K are the paper's rule
recomputed here from the raw queries and keys; the layers after K run, and cache, those rows only;
and it generates what a full cache masked to them generates, decoding included."""

from __future__ import annotations

import pytest
import torch
from tests.support import TINY_MODELS, make_image

import backends
from backends.base import KVBackend
from backends.fastv import kept_rows
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message

MESSAGE = Message("What is shown?", images=[make_image(0), make_image(1, (224, 224))])


class Recorder(KVBackend):
    """Test helper: the full cache that keeps one layer's prefill queries and keys."""

    name = "_fastv_recorder"

    def __init__(self, layer: int):
        super().__init__()
        self.layer, self.seen = layer, None

    def after_attention(self, call, layer, query, key, scaling, attn_row=None):
        if call.is_prefill and call.layer_idx == self.layer:
            self.seen = (query.clone(), key.clone(), scaling, call.layout)


def paper_kept(query, key, scaling, layout, prune_ratio: float) -> set[int]:
    """FastV's rule written out: the last prompt token's softmax row over every key, averaged over
    the query heads; of the visual tokens, the round((1 - R) n) best stay (the authors' code's Python
    round), every other token stays."""
    heads, kv_heads = query.shape[1], key.shape[1]
    keys = key[0].repeat_interleave(heads // kv_heads, dim=0)  # (H, S, D)
    row = torch.softmax((query[0, :, -1:] @ keys.transpose(1, 2)).float() * scaling, dim=-1)[:, 0].mean(0)
    visual = [t for v in layout.visuals for first, end in v.token_spans for t in range(first, end)]
    keep = round((1 - prune_ratio) * len(visual))
    best = sorted(visual, key=lambda t: -float(row[t]))[:keep]
    return set(range(layout.start, layout.end)) - set(visual) | set(best)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-llava"])
@pytest.mark.parametrize("k_layer,prune_ratio", [(2, 0.5), (1, 0.75)])
def test_kept_tokens_are_the_papers_choice_and_later_layers_hold_only_them(models, name, k_layer, prune_ratio):
    loaded = models(name)
    recorder = Recorder(k_layer - 1)
    Conversation(loaded, recorder).ask(MESSAGE, max_new_tokens=1)
    expected = paper_kept(*recorder.seen, prune_ratio)

    conv = Conversation(loaded, backends.make_backend("fastv", k_layer=k_layer, prune_ratio=prune_ratio))
    update = conv.ask(MESSAGE, max_new_tokens=3, ignore_eos=True)
    prompt = update.metrics.prompt_tokens
    decoded = list(range(prompt, conv.seen))
    for i, positions in enumerate(conv.cache.kept_positions()):
        held = sorted(range(prompt)) if i < k_layer else sorted(expected)
        assert positions[0].tolist() == held + decoded, i
    report = conv.backend.report
    full = conv.cache.layers[0].nbytes() * loaded.num_layers  # the first layer holds every token
    assert report.realised_fraction == pytest.approx(conv.cache.nbytes() / full)
    assert report.layer_budgets[-1] == len(conv.cache.layers[-1].positions[0]) / conv.seen < 1


@pytest.mark.parametrize("visual,prune_ratio,kept", [(5, 0.5, 2), (9, 0.5, 4), (7, 0.5, 4), (3, 0.3, 2), (10, 0.7, 3)])
def test_kept_count_rounds_as_the_authors_code_does(visual, prune_ratio, kept):
    """round((1 - R) n), halves to even (the authors' ``round``), not ceil: 5 at R = 50% keeps 2
    (ceil: 3), 3 at R = 30% keeps 2 (ceil of 2.1: 3)."""
    assert kept == round((1 - prune_ratio) * visual)
    rows = torch.ones(visual + 3, dtype=torch.bool)
    rows[:2] = rows[-1] = False  # two text tokens first, the last prompt token after the visual ones
    scores = torch.arange(visual + 3, dtype=torch.float32)  # later visual tokens score higher
    chosen = kept_rows(scores, rows, prune_ratio).tolist()
    assert chosen == [0, 1] + list(range(2 + visual - kept, 2 + visual)) + [visual + 2]


def test_layers_after_k_compute_the_kept_rows_only(models):
    loaded = models("tiny-qwen2-vl")
    rows = []
    hooks = [layer.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))  # after the runtime's
             for layer in loaded.language_model().layers]
    try:
        conv = Conversation(loaded, backends.make_backend("fastv"))
        update = conv.ask(MESSAGE, max_new_tokens=1)
    finally:
        for h in hooks:
            h.remove()
    visual = update.metrics.visual_tokens
    prompt = update.metrics.prompt_tokens
    kept = prompt - visual + round(visual / 2)
    assert rows[:loaded.num_layers] == [prompt] * 2 + [kept] * (loaded.num_layers - 2)


class MaskedFull(KVBackend):
    """Test reference: the full cache whose layers from K on attend only to the tokens FastV kept
    (every row still computed, the dropped ones' outputs unused by the kept ones)."""

    name = "_fastv_masked_reference"

    def __init__(self, k_layer: int, dropped: set[int]):
        super().__init__()
        self.k_layer, self.dropped = k_layer, dropped

    def attend(self, call, query, key, value, scaling):
        if call.layer_idx < self.k_layer:
            return None
        held, new = key.shape[2], query.shape[2]
        keys = torch.arange(held)  # the full cache: key index = token position
        visible = torch.tensor([t not in self.dropped for t in keys.tolist()])
        causal = keys[None, :] <= (keys[-new:])[:, None]
        mask = causal & (visible[None, :] | (keys[None, :] == keys[-new:, None]))
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None],
                                                                scale=scaling, enable_gqa=True)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-llava"])
def test_generates_what_full_attention_masked_to_the_kept_tokens_generates(models, name):
    """Decoding reads the kept tokens at their original positions (M-RoPE, DeepStack included)."""
    loaded = models(name)
    conv = Conversation(loaded, backends.make_backend("fastv"))
    got = conv.ask(MESSAGE, max_new_tokens=10, ignore_eos=True)
    dropped = set(range(conv.seen)) - set(conv.cache.kept_positions()[-1][0].tolist())
    assert len(dropped) == got.metrics.visual_tokens - round(got.metrics.visual_tokens / 2)
    ref_conv = Conversation(loaded, MaskedFull(2, dropped))
    ref = ref_conv.ask(MESSAGE, max_new_tokens=10, ignore_eos=True)
    assert got.token_ids == ref.token_ids
    follow = Message("And the second one?")
    assert conv.ask(follow, max_new_tokens=6, ignore_eos=True).token_ids == \
        ref_conv.ask(follow, max_new_tokens=6, ignore_eos=True).token_ids


@pytest.mark.parametrize("name", TINY_MODELS)
def test_narrowing_to_every_row_is_the_full_cache(models, name):
    """A ratio that drops no token still runs the narrowing hooks (DeepStack re-added by them): exact."""
    loaded = models(name)
    ref = Conversation(loaded, backends.make_reference()).ask(MESSAGE, max_new_tokens=8, ignore_eos=True)
    backend = backends.make_backend("fastv", prune_ratio=1e-6)
    assert backend.narrows_prefill
    got = Conversation(loaded, backend).ask(MESSAGE, max_new_tokens=8, ignore_eos=True)
    assert got.token_ids == ref.token_ids and got.metrics.kv_bytes == ref.metrics.kv_bytes


def test_a_prompt_without_visual_tokens_and_a_shallow_model_run_in_full(models):
    loaded = models("tiny-qwen2-vl")
    conv = Conversation(loaded, backends.make_backend("fastv"))
    conv.ask(Message("Hello there"), max_new_tokens=2)
    assert conv.cache.tokens_per_layer() == [conv.seen] * loaded.num_layers
    deep = Conversation(loaded, backends.make_backend("fastv", k_layer=loaded.num_layers))
    deep.ask(MESSAGE, max_new_tokens=2)
    assert deep.cache.tokens_per_layer() == [deep.seen] * loaded.num_layers


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="k_layer"):
        backends.make_backend("fastv", k_layer=0)
    with pytest.raises(ValueError, match="prune_ratio"):
        backends.make_backend("fastv", prune_ratio=1.5)
