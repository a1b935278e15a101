"""Multi-turn correctness: a second turn on the full cache gives exactly the tokens transformers'
own ``generate`` gives on the whole two-turn conversation (an image in the first turn), so a wrong
follow-up answer can be blamed on the model, not on the runtime carrying the cache between turns."""

from __future__ import annotations

import pytest
import torch
from tests.support import TINY_MODELS, make_image

import backends
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import DEFAULT_SYSTEM, Message
from kv_arena.runtime.models import load_model

NEW_TOKENS = 8


@pytest.mark.parametrize("name", TINY_MODELS)
def test_second_turn_equals_generate_on_the_whole_conversation(name):
    loaded = load_model(name)
    adapter = loaded.adapter
    first = Message("What is in the picture?", images=[make_image(5, (112, 112))])
    second = Message("And which colour dominates?")

    conv = Conversation(loaded, backends.make_backend("full"))
    first_ids = adapter.encode_turn(first, 0, 0, DEFAULT_SYSTEM)
    answer1 = conv.ask(first, max_new_tokens=NEW_TOKENS)
    # what the runtime feeds for turn 2: the unfed end of answer 1 (its last token, an end of turn), then the turn
    second_ids = adapter.encode_turn(second, conv.seen, conv.next_position, None, list(conv.pending))
    answer2 = conv.ask(second, max_new_tokens=NEW_TOKENS)

    whole = torch.cat([first_ids.input_ids, torch.tensor([answer1.token_ids[:-1]], dtype=torch.long),
                       second_ids.input_ids], dim=1)
    reference = load_model(name)  # the same seeded weights, with transformers' own attention and cache
    reference.model.set_attn_implementation("sdpa")
    config = reference.model.config
    if config.model_type.startswith("qwen"):  # M-RoPE needs to know which tokens are the image's
        first_ids.model_kwargs["mm_token_type_ids"] = (whole == config.image_token_id).long()
    with torch.inference_mode():
        out = reference.model.generate(input_ids=whole, attention_mask=torch.ones_like(whole),
                                       **first_ids.model_kwargs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=sorted(adapter.eos_ids), pad_token_id=sorted(adapter.eos_ids)[0],
                                       return_dict_in_generate=True, output_logits=True)
    generated = out.sequences[0, whole.shape[1]:].tolist()
    assert generated[:len(answer2.token_ids)] == answer2.token_ids
    # tiny random weights repeat themselves, so the tokens alone prove little: the logits of turn 2's
    # first token (after its prefill on the carried cache) match too
    torch.testing.assert_close(conv.last_logits, out.logits[0][0].float(), rtol=1e-4, atol=1e-5)
    assert len(answer2.token_ids) == NEW_TOKENS or answer2.token_ids[-1] in adapter.eos_ids


@pytest.mark.parametrize("method,budget", [("full", 1.0), ("snapkv", 0.3), ("h2o", 0.3), ("streamingllm", 0.3),
                                           ("pyramidkv", 0.3)])
def test_a_replayed_turn_leaves_the_cache_a_method_would_have_held_from_the_start(models, method, budget):
    """Switching the method mid-conversation re-reads the turns so far (``Conversation.replay``: the
    message prefilled, the answer given fed back token by token). Replaying the answers this method
    gave itself must leave exactly its own cache: the next turn's tokens, bytes and kept positions agree."""
    loaded = models("tiny-qwen2-vl")
    first = Message("What is in the picture?", images=[make_image(5, (112, 112))])
    second = Message("And which colour dominates?")
    ran = Conversation(loaded, backends.make_backend(method, budget=budget))
    answer1 = ran.ask(first, max_new_tokens=NEW_TOKENS)
    answer2 = ran.ask(second, max_new_tokens=NEW_TOKENS)

    switched = Conversation(loaded, backends.make_backend(method, budget=budget))
    reread = switched.replay(first, answer1.token_ids)
    assert reread.new_tokens == len(answer1.token_ids) and reread.prompt_tokens == answer1.metrics.prompt_tokens
    again = switched.ask(second, max_new_tokens=NEW_TOKENS)
    assert again.token_ids == answer2.token_ids
    assert switched.cache.nbytes() == ran.cache.nbytes() and switched.seen == ran.seen
    assert all(torch.equal(a, b) for a, b in zip(switched.cache.kept_positions(), ran.cache.kept_positions()))
    torch.testing.assert_close(switched.last_logits, ran.last_logits)
