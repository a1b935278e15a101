"""The lookup probe (training/lookup_probe.py): its M-RoPE at the model's width is the model's own,
it reads the layer input the model's heads read, and a new head fitted where the lookup is plain
finds it on chats it was not fitted on."""

from __future__ import annotations

import torch

from tests.support import training_module

probe = training_module("lookup_probe")
train = training_module("train_arena_v3")


def test_its_rotary_at_the_models_width_is_the_models_own():
    model, _ = train.checkpoints.build_v3(0)
    text = model.config.text_config
    positions = torch.stack([torch.arange(40), torch.arange(40) // 3, torch.arange(40) % 7]).float()[None]
    cos, sin = model.model.language_model.rotary_emb(torch.zeros(1), positions.long().permute(1, 0, 2))
    mine = probe.rotary(positions, text.hidden_size // text.num_attention_heads,
                        text.rope_parameters["rope_theta"], list(text.rope_parameters["mrope_section"]))
    assert torch.allclose(mine[0], cos, atol=1e-6) and torch.allclose(mine[1], sin, atol=1e-6)


def test_it_collects_each_chats_layer_input_and_what_its_answer_names():
    model, adapter = train.checkpoints.build_v3(0)
    model.eval()
    rows = probe.collect(model, adapter, "colour", 3, [1])[1]
    for i, it in enumerate(train.scenes.held_out("colour", 3)):
        s = train.encode(adapter, it)
        assert int(rows.named[i].sum()) == len(it.question.tokens) > 0
        assert int(rows.objects[i].sum()) == len(it.informative) >= int(rows.named[i].sum())
        assert rows.at[i] == s.answers[0][0][0] and rows.hidden[i, len(s.ids):].abs().sum() == 0
        assert torch.equal(rows.positions[i, :, :len(s.ids)], s.positions.float())


def lookup_rows(chats: int, seed: int) -> probe.Rows:
    """Chats of 12 tokens, three objects of three tokens each with one of four tags in a direction of
    their own; the answer's position (last) carries the named object's tag."""
    g = torch.Generator().manual_seed(seed)
    tags = torch.randn(4, 16, generator=g) * 3
    hidden = torch.randn(chats, 12, 16, generator=g) * 0.3
    named = torch.zeros(chats, 12, dtype=torch.bool)
    objects = torch.zeros(chats, 12, dtype=torch.bool)
    objects[:, :9] = True
    for c in range(chats):
        chosen = torch.randperm(4, generator=g)[:3]
        for o in range(3):
            hidden[c, 3 * o:3 * o + 3] += tags[chosen[o]]
        asked = int(torch.randint(3, (1,), generator=g))
        named[c, 3 * asked:3 * asked + 3] = True
        hidden[c, 11] += tags[chosen[asked]]
    positions = torch.arange(12).float().expand(chats, 3, 12).clone()
    return probe.Rows(hidden, positions, torch.full((chats,), 11), named, objects)


def test_a_new_head_finds_a_plain_lookup_on_chats_it_was_not_fitted_on():
    fitted, read = lookup_rows(200, 0).split(100)
    assert abs(probe.token_share(read) - 1 / 3) < 1e-6
    _, share = probe.fit(fitted, read, 8, (10000.0, [1, 1, 2]), steps=150)
    assert share > 0.9
