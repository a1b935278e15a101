"""H2O (backends/h2o.py): heavy hitters per KV head on hand-made tensors, its score buffer in its
bytes, and its scores while a tiny model decodes."""

from __future__ import annotations

import math

import torch
from tests.support import attention_call, fill_layer, make_image

import backends
from backends.base import KVLayer
from backends.h2o import H2O, ScoredLayer
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message


def test_h2o_keeps_recent_window_and_heaviest_per_kv_head():
    layer = fill_layer(ScoredLayer(), 16)
    layer.scores = torch.stack([torch.arange(16.0), torch.arange(16.0).flip(0)])  # heads disagree
    H2O(budget=0.5, recent_share=0.25).evict(layer, 8)  # 2 recent + 6 heavy
    assert layer.positions.tolist() == [[8, 9, 10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5, 14, 15]]
    assert layer.scores[1].tolist() == [15, 14, 13, 12, 11, 10, 1, 0]  # scores travel with entries


def test_h2o_adds_the_decode_row_averaged_over_each_gqa_group():
    method = H2O(budget=1.0)
    layer = fill_layer(ScoredLayer(), 6)
    before = layer.scores.clone()
    layer.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.tensor([6]))
    row = torch.rand(4, 1, 7).softmax(-1)
    method.after_attention(attention_call("decode", 7, 1), layer, torch.zeros(1, 4, 1, 4), layer.keys, 0.5, row)
    torch.testing.assert_close(layer.scores[:, :6], before + row[:, 0, :6].view(2, 2, 6).mean(1))
    assert layer.scores[:, 6].gt(0).all()


def test_h2o_counts_its_score_buffer_and_fits_it_in_the_budget():
    layer = fill_layer(ScoredLayer(), 100, dim=8)  # per head and token: 2 x 8 x 4 bytes of K/V, 4 of score
    assert layer.nbytes() == layer.keys.nbytes + layer.values.nbytes + layer.scores.nbytes
    assert layer.scores.nbytes == 2 * 100 * 4
    method = H2O(budget=0.5)
    target = method.target(100, layer)
    assert target == math.floor(0.5 * 100 * 64 / 68) == 47  # not 50: the scores take their share
    method.evict(layer, target)
    full_bytes = 2 * 2 * 100 * 8 * 4
    assert layer.nbytes() <= 0.5 * full_bytes < layer.nbytes() + 2 * 68
    assert isinstance(H2O(budget=1.0).new_layer(0), KVLayer) and not isinstance(H2O(budget=1.0).new_layer(0), ScoredLayer)


PROMPT = "Describe the image."


def test_h2o_scores_move_while_decoding(models):
    conv = Conversation(models("tiny-qwen2-vl"), backends.make_backend("h2o", budget=0.5))
    stream = conv.stream(Message(PROMPT, images=[make_image(0, (224, 224))]), max_new_tokens=12)
    next(stream)  # after prefill, before the first decode step
    report = conv.backend.report
    start = [(report.kept[i].clone(), report.scores[i].clone()) for i in range(conv.loaded.num_layers)]
    for _ in stream:
        pass
    for (kept0, scores0), kept1, scores1 in zip(start, report.kept, report.scores):
        for h in range(kept0.shape[0]):
            before = dict(zip(kept0[h].tolist(), scores0[h].tolist()))
            after = dict(zip(kept1[h].tolist(), scores1[h].tolist()))
            survivors = before.keys() & after.keys()
            assert survivors
            assert all(after[p] > before[p] for p in survivors)  # every decode row adds attention
