"""The pointer loss of tiny-arena-vl v3's stage 2 (training/pointer_loss.py): the attention weights it
reads are the model's own, its seam changes nothing the model computes, and every answer word points
at the object it names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_arena.runtime.vision_attention import VISION_ATTENTION_NAME
from kv_arena.tiny import drawn_scenes as scenes
from tests.support import training_module

train = training_module("train_arena_v3")
pointer = training_module("pointer_loss")


@pytest.fixture(scope="module")
def model_and_chats():
    model, adapter = train.checkpoints.build_v3(3)
    model.eval()
    kinds = ("colour", "moving", "pair", "objects")
    chats = [train.encode(adapter, scenes.item(7, kind, 2, 0.4)) for kind in kinds]
    chats.append(train.encode(adapter, scenes.out_of_scope(7, 1, 0.4)))
    chats[0] = dataclasses.replace(chats[0], hidden=chats[0].visual_at[::3])  # an eviction mask in the batch
    return model, adapter, chats


def eager_weights(model, chats, pad: int, layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention weights from transformers' eager attention (float mask)."""
    answer_loss = training_module("answer_loss")
    model.set_attn_implementation({"text_config": "eager", "vision_config": VISION_ATTENTION_NAME})
    ids, pos, _ = answer_loss.padded(chats, [s.positions for s in chats], pad)
    mask = answer_loss.hidden_mask(chats, ids.shape[1])
    mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    embeds = model.model.get_input_embeddings()(ids)
    images, videos = train.visual_features(model, chats)
    embeds = embeds.masked_scatter((ids == model.config.image_token_id)[..., None], images)
    embeds = embeds.masked_scatter((ids == model.config.video_token_id)[..., None], videos)
    with torch.no_grad():
        out = model.model.language_model(inputs_embeds=embeds, position_ids=pos, attention_mask=mask,
                                         use_cache=False, output_attentions=True)
    return out.attentions[layer]


def test_the_weights_it_reads_are_eager_attentions_and_the_pass_is_unchanged(model_and_chats):
    model, adapter, chats = model_and_chats
    pad = adapter.tokenizer.pad_token_id
    model.set_attn_implementation({"text_config": pointer.POINTER_ATTENTION, "vision_config": VISION_ATTENTION_NAME})
    p = pointer.Pointing(1, (0, 3), pointer.rows_of(chats))
    with torch.no_grad():
        loss, hits = train.forward(model, chats, pad, p)[:2]
        plain_loss, plain_hits = train.forward(model, chats, pad)[:2]
    assert torch.equal(loss, plain_loss) and hits == plain_hits  # collecting weights changes nothing
    weights = eager_weights(model, chats, pad, 1)
    expected = torch.stack([weights[b, [0, 3], at][:, tokens].sum(-1) for b, at, tokens in p.rows])
    (log_mass,) = p.log_masses
    assert log_mass.shape == (len(p.rows), 2)
    torch.testing.assert_close(p.mass(), expected, rtol=1e-4, atol=1e-6)
    assert float(p.loss()) == pytest.approx(float(-expected.double().log().mean()), rel=1e-3)


def test_every_answer_word_points_at_the_object_it_names(model_and_chats):
    _, _, chats = model_and_chats
    rows = pointer.rows_of(chats)
    expected = []
    for b, s in enumerate(chats):
        for turn, answer in zip(s.item.turns, s.answers):
            words = turn.answer.split()
            assert len(answer) == len(words) + 1  # one token a word, then the end of turn
            if s.item.kind != "unknown":
                assert len(turn.parts) == len(words) and set().union(*turn.parts) <= set(turn.tokens)
            expected += [(b, at, [s.visual_at[k] for k in part]) for (at, _), part in zip(answer, turn.parts)]
    assert rows == expected and {b for b, _, _ in rows} == {0, 1, 2, 3}  # nothing of the out-of-scope picture
    pair = chats[2].item.question
    assert [len(p) for p in pair.parts] == [len(set(p)) for p in pair.parts] and set(pair.parts[0]).isdisjoint(pair.parts[1])
    listed = chats[3].item.question  # "red star blue ring": a colour and a shape for each object, both read it
    assert listed.parts[0::2] == listed.parts[1::2]
    assert all(max(tokens) < chats[b].after for b, _, tokens in rows)  # about the media


def test_its_gradient_reaches_the_queries_and_keys_of_its_layer_only(model_and_chats):
    model, adapter, chats = model_and_chats
    model.set_attn_implementation({"text_config": pointer.POINTER_ATTENTION, "vision_config": VISION_ATTENTION_NAME})
    model.zero_grad()
    p = pointer.Pointing(1, (0,), pointer.rows_of(chats[:2]))
    train.forward(model, chats[:2], adapter.tokenizer.pad_token_id, p)
    p.loss().backward()
    layers = model.model.language_model.layers
    assert layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert layers[1].self_attn.k_proj.weight.grad.abs().sum() > 0
    assert layers[1].self_attn.v_proj.weight.grad is None or not layers[1].self_attn.v_proj.weight.grad.any()
    assert all(layer.self_attn.q_proj.weight.grad is None or not layer.self_attn.q_proj.weight.grad.any()
               for layer in layers[2:])
    model.zero_grad()


def test_the_probe_reports_shares_per_layer_and_the_bar(model_and_chats, capsys):
    model, adapter, _ = model_and_chats
    probe = training_module("probe_v3")
    model.set_attn_implementation({"text_config": pointer.POINTER_ATTENTION, "vision_config": VISION_ATTENTION_NAME})
    shares = probe.attention(model, adapter, 2)
    layers = model.config.text_config.num_hidden_layers
    assert set(shares) == set(probe.KINDS)
    assert all(len(row) == layers + 1 and all(0.0 <= v <= 1.0 for v in row) for row in shares.values())
    from_word = probe.attention(model, adapter, 2, "word")  # the first hop, read at the naming word
    assert all(len(row) == layers + 1 and row[-1] == shares[kind][-1] for kind, row in from_word.items())
    assert probe.bar(model, adapter, 1) is False  # random weights answer nothing right
    table = capsys.readouterr().out
    assert "| pair |" in table and "| unknown |" in table and "not met" in table
    sizes = probe.by_size(model, adapter, 2)  # right/asked by the smallest named object's side
    assert set(sizes) == set(probe.scenes.QUESTION_TYPES)
    assert all(sum(n for _, n in row) == 2 and all(0 <= r <= n for r, n in row) for row in sizes.values())


def test_its_gradient_flows_where_the_head_looks_elsewhere():
    """A head that gives the named tokens almost nothing (weight 1e-13) is the one to teach: the loss,
    taken from the logits, still has a gradient there (a weight clamped before its log had none)."""

    class Layer(torch.nn.Module):
        layer_idx, num_key_value_groups = 0, 1

    query = torch.zeros(1, 1, 4, 8, requires_grad=True)
    key = torch.zeros(1, 1, 4, 8)
    key[0, 0, :, 0] = torch.tensor([0.0, 0.0, -30.0, 0.0])  # key 2, the named one, far below the others
    with torch.no_grad():
        query[0, 0, 3, 0] = 1.0
    p = pointer.Pointing(0, (0,), [(0, 3, [2])])
    with pointer.pointing(p):
        pointer.pointer_attention(Layer(), query, key, key, None, scaling=1.0)
    assert float(p.mass().detach()) < 1e-12
    p.loss().backward()
    assert query.grad[0, 0, 3, 0] > 1.0  # a step down the gradient raises the named key's logit, -30 q


def test_each_answer_word_has_the_word_of_its_question_that_names_its_object(model_and_chats):
    _, adapter, chats = model_and_chats
    colour, moving, pair, listed, odd = chats
    assert pointer.naming_words(colour.item.question) == [colour.item.question.text.rstrip("?").split()[-1]]
    assert pointer.naming_words(moving.item.question) == ["moves"]
    shapes = pointer.naming_words(pair.item.question)  # "What colours are the star and the ring?"
    assert len(shapes) == 2 and all(w in scenes.SHAPES for w in shapes)
    assert pointer.naming_words(listed.item.question) == [] and not odd.item.question.parts  # no hop: no object
    for s in chats:  # every turn, the follow-ups included: the word itself, after the media and before the answer
        assert len(s.words_at) == len(s.item.turns)
        for turn, answer, words_at in zip(s.item.turns, s.answers, s.words_at):
            assert [adapter.tokenizer.decode([s.ids[i]]).strip() for i in words_at] == pointer.naming_words(turn)
            assert all(s.after <= i < answer[0][0] for i in words_at)


def test_the_two_hops_find_the_object_from_its_word_and_the_word_from_the_answer(model_and_chats):
    model, adapter, chats = model_and_chats
    find, relay = pointer.hop_rows(chats)
    expected_find, expected_relay = [], []
    for b, s in enumerate(chats):
        for turn, answer, words_at in zip(s.item.turns, s.answers, s.words_at):
            for (at, _), word_at, part in zip(answer, words_at, turn.parts):
                expected_find.append((b, word_at, [s.visual_at[k] for k in part]))
                expected_relay.append((b, at, [word_at]))
    assert find == expected_find and relay == expected_relay and {b for b, _, _ in find} == {0, 1, 2, 3}  # a list's follow-up names one
    model.set_attn_implementation({"text_config": pointer.POINTER_ATTENTION, "vision_config": VISION_ATTENTION_NAME})
    find, relay = pointer.hop_rows(chats[1:])  # chats[0] hides tokens a training chat never hides: the asked ones
    hops = pointer.Pointing(0, (0, 2), find), pointer.Pointing(1, (0, 2), relay)
    with torch.no_grad():
        train.forward(model, chats[1:], adapter.tokenizer.pad_token_id, *hops)
    assert [p.mass().shape for p in hops] == [(len(find), 2), (len(relay), 2)]
    assert all(0 < float(p.mass().min()) and float(p.mass().max()) <= 1 + 1e-6 for p in hops)
