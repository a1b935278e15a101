"""VisionZip (backends/visionzip.py): the image tokens it keeps, and the features the projector then
reads, are the paper's rule recomputed here from transformers' own tower outputs (eager attention
weights, hidden states); the decoder computes and caches those rows only; nothing dropped is the
full cache; towers without a CLS token are refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tests.support import make_image

import backends
from backends.visionzip import split_counts
from kv_arena.errors import UserError
from kv_arena.hf import compress
from kv_arena.runtime.attention import ATTENTION_NAME
from kv_arena.runtime.generate import Conversation
from kv_arena.runtime.inputs import Message

FIRST = Message("What is shown?", images=[make_image(0), make_image(1, (224, 224))])
SECOND = Message("And this one?", images=[make_image(2)])


@torch.no_grad()
def tower_outputs(model, pixel_values):
    """Per image: the CLS row of the attention in the layer the projector reads (heads kept), the
    patch features it outputs, and its patch keys (from its input, as the layer computes them)."""
    assert model.config.vision_feature_layer == -2
    tower = model.model.vision_tower
    model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "eager"})
    try:
        out = tower(pixel_values, output_hidden_states=True, output_attentions=True)
    finally:
        model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
    layer = tower.encoder.layers[-2]  # hidden_states[-2] is its output, hidden_states[-3] its input
    keys = layer.self_attn.k_proj(layer.layer_norm1(out.hidden_states[-3]))
    keys = keys.view(*keys.shape[:2], layer.self_attn.num_heads, -1)  # (B, T, H, D)
    return out.attentions[-2][:, :, 0, 1:], out.hidden_states[-2][:, 1:], keys[:, 1:]


def paper_choice(cls_row, features, keys, keep: float, share: float):
    """One image, written out from the paper: the CLS attention averaged over heads picks the
    dominant tokens; of the rest, targets one every (rest // contextual) in image order, each other
    token joins the target of most similar key (cosine, keys averaged over heads), a target becomes
    its group's mean. Returns (kept token indices, {target: merged feature})."""
    n = features.shape[0]
    kept_count = math.ceil(keep * n - 1e-9)
    contextual = math.floor(share * kept_count + 0.5)
    score = cls_row.float().mean(0)
    dominant = sorted(range(n), key=lambda t: -float(score[t]))[: kept_count - contextual]
    rest = [t for t in range(n) if t not in set(dominant)]
    step = len(rest) // contextual
    targets = [rest[i * step] for i in range(contextual)]
    key = keys.float().mean(1)
    groups = {t: [t] for t in targets}
    for t in rest:
        if t not in groups:
            best = max(targets, key=lambda g: float(F.cosine_similarity(key[t], key[g], dim=0)))
            groups[best].append(t)
    merged = {g: features[members].float().mean(0) for g, members in groups.items()}
    return sorted(dominant + targets), merged


class ProjectorInput:
    """Test helper: records what the projector reads (after the runtime's pre-hook)."""

    def __init__(self, model):
        self.seen = []
        self.handle = model.model.multi_modal_projector.register_forward_hook(
            lambda module, args, out: self.seen.append(args[0].detach().clone()))


@pytest.mark.parametrize("keep,share", [(0.333, 0.156), (0.111, 0.156), (0.05, 0.5)])
def test_kept_tokens_and_merged_features_are_the_papers(models, keep, share):
    loaded = models("tiny-llava")
    conv = Conversation(loaded, backends.make_backend("visionzip", keep=keep, contextual_share=share))
    recorder = ProjectorInput(loaded.model)
    try:
        for message in (FIRST, SECOND):  # a second turn with its own image chooses again
            chunk = conv.encode(message, close_turn=True)
            cls_rows, features, keys = tower_outputs(loaded.model, chunk.model_kwargs["pixel_values"])
            choices = [paper_choice(cls_rows[b], features[b], keys[b], keep, share) for b in range(len(features))]
            conv.ask(message, max_new_tokens=2, ignore_eos=True)
            read = recorder.seen[-1]
            for b, (kept, merged) in enumerate(choices):
                for target, feature in merged.items():
                    torch.testing.assert_close(read[b, target].float(), feature, rtol=1e-5, atol=1e-5)
                dominant = sorted(set(kept) - set(merged))
                torch.testing.assert_close(read[b, dominant], features[b, dominant])
            images = chunk.layout.visuals
            held = set(range(chunk.layout.start, chunk.layout.end)) - {t for v in images for t in range(*v.span)}
            held |= {image.span[0] + t for image, (kept, _) in zip(images, choices) for t in kept}
            tail = sorted(held) + list(range(chunk.layout.end, conv.seen))
            for positions in conv.cache.kept_positions():
                assert positions[0].tolist()[-len(tail):] == tail
    finally:
        recorder.handle.remove()


def test_the_decoder_computes_the_kept_rows_only_and_the_report_says_so(models):
    loaded = models("tiny-llava")
    rows = []
    hooks = [layer.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
             for layer in loaded.language_model().layers]
    try:
        conv = Conversation(loaded, backends.make_backend("visionzip"))
        update = conv.ask(FIRST, max_new_tokens=1)
    finally:
        for h in hooks:
            h.remove()
    m = update.metrics
    kept = m.prompt_tokens - m.visual_tokens + 2 * 192  # two images of 576 tokens: 162 + 30 each
    assert rows[: loaded.num_layers] == [kept] * loaded.num_layers
    report = conv.backend.report
    assert report.layer_budgets == [kept / conv.seen] * loaded.num_layers
    assert report.realised_fraction == pytest.approx(kept / m.prompt_tokens)
    assert conv.cache.tokens_per_layer() == [kept] * loaded.num_layers


def test_dropping_nothing_through_the_hooks_is_the_full_cache(models):
    loaded = models("tiny-llava")
    ref_conv = Conversation(loaded, backends.make_reference())
    backend = backends.make_backend("visionzip", keep=0.9999)  # ceil(0.9999 x 576) = 576: all kept, hooks on
    assert backend.selects_visual_tokens and backend.narrows_prefill
    conv = Conversation(loaded, backend)
    for message in (FIRST, SECOND):
        ref = ref_conv.ask(message, max_new_tokens=8, ignore_eos=True)
        got = conv.ask(message, max_new_tokens=8, ignore_eos=True)
        assert got.token_ids == ref.token_ids and got.metrics.kv_bytes == ref.metrics.kv_bytes


def test_a_prompt_without_images_runs_in_full(models):
    loaded = models("tiny-llava")
    conv = Conversation(loaded, backends.make_backend("visionzip"))
    conv.ask(Message("Hello there"), max_new_tokens=2)
    assert conv.cache.tokens_per_layer() == [conv.seen] * loaded.num_layers


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_a_tower_without_a_cls_token_is_refused_in_one_line(models, name):
    loaded = models(name)
    with pytest.raises(UserError, match="VisionZip ranks an image's tokens by the CLS token's attention") as caught:
        Conversation(loaded, backends.make_backend("visionzip"))
    assert "\n" not in str(caught.value) and loaded.model.config.model_type in str(caught.value)
    with pytest.raises(UserError, match="CLS token"):
        with compress(loaded.model, "visionzip"):
            pass
    assert not loaded.model.get_decoder()._forward_pre_hooks  # nothing left installed
    Conversation(loaded, backends.make_backend("visionzip", keep=1.0)).ask(FIRST, max_new_tokens=1)  # keeps all: runs


def test_counts_are_the_papers_settings_and_bad_parameters_are_refused():
    assert split_counts(576, 0.333, 0.156) == (162, 30)
    assert split_counts(576, 0.222, 0.156) == (108, 20)
    assert split_counts(576, 0.111, 0.156) == (54, 10)
    assert split_counts(576, 1.0, 0.156) == (486, 90)  # every token kept: the contextual ones absorb nothing
    assert split_counts(16, 0.01, 0.156) == (1, 0)
    with pytest.raises(ValueError, match="keep"):
        backends.make_backend("visionzip", keep=0)
    with pytest.raises(ValueError, match="contextual_share"):
        backends.make_backend("visionzip", contextual_share=1.5)


def test_the_app_refuses_it_on_such_a_model_before_any_gpu_call():
    from kv_arena import service

    settings = service.Settings.make(model="tiny-qwen2-vl", method="visionzip", max_new_tokens=2)
    session = service.Session()
    with pytest.raises(UserError, match="CLS token"):
        list(service.chat_turn(session, settings, service.prepare("What is shown?", [])))
    with pytest.raises(UserError, match="CLS token"):
        list(service.compare(session, settings, ["snapkv", "visionzip"], service.prepare("What is shown?", [])))
    assert session.conv is None
    session.close()
