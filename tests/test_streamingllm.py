"""StreamingLLM (backends/streamingllm.py): it holds the attention sinks and the most recent tokens,
and generates exactly what a full cache masked to those tokens generates."""

from __future__ import annotations

import math

import pytest
import torch
from tests.support import make_image

import backends
from backends.base import KVBackend
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message


class MaskedStreaming(KVBackend):
    """Test reference: a full cache whose attention sees only what StreamingLLM would hold."""

    name = "_masked_streaming_reference"

    def __init__(self, budget, sinks=4):
        super().__init__(budget)
        self.sinks = sinks
        self.allowed = None  # token indices visible to the next query (besides itself)

    def attend(self, call, query, key, value, scaling):
        if call.is_prefill:
            return None
        visible = torch.zeros(key.shape[-2], dtype=torch.bool)
        visible[self.allowed] = True
        visible[-1] = True
        scores = torch.zeros(key.shape[-2]).masked_fill(~visible, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=scores.to(query.dtype).view(1, 1, 1, -1), scale=scaling, enable_gqa=True)

    def after_forward(self, cache, call):
        keep = max(self.sinks + 1, math.ceil(self.budget * call.seen - 1e-9))
        self.allowed = list(range(self.sinks)) + list(range(call.seen - (keep - self.sinks), call.seen))


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-llava"])
def test_streamingllm_keeps_counted_tokens_and_equals_masked_full_attention(models, name):
    loaded = models(name)
    message = Message("Describe.", images=[make_image(0)])
    conv = Conversation(loaded, backends.make_backend("streamingllm", budget=0.5))
    got = conv.ask(message, max_new_tokens=16, ignore_eos=True)
    expected = math.ceil(0.5 * conv.seen)
    assert conv.cache.tokens_per_layer() == [expected] * loaded.num_layers
    positions = conv.cache.kept_positions()[0][0].tolist()
    assert positions[:4] == [0, 1, 2, 3] and positions[4:] == list(range(conv.seen - expected + 4, conv.seen))
    ref = Conversation(loaded, MaskedStreaming(0.5)).ask(message, max_new_tokens=16, ignore_eos=True)
    assert got.token_ids == ref.token_ids
