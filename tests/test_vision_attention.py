"""The Qwen-VL vision towers' attention (kv_arena/runtime/vision_attention.py): one SDPA call per
window length gives what transformers' per-window loop gives, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.support import TINY_MODELS, make_image, make_video

from kv_arena.runtime.inputs import Message
from kv_arena.runtime.models import load_model
from kv_arena.runtime.vision_attention import VISION_ATTENTION_NAME, windowed_sdpa


def per_window(query, key, value, bounds):
    """The reference: each window on its own, as transformers' non-flash vision attention does."""
    parts = [F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (query, key, value)))
             for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    return torch.cat(parts, dim=2).transpose(1, 2)


def test_windows_of_several_lengths_attend_only_within_themselves():
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 3, 23, 8, requires_grad=True) for _ in range(3))
    bounds = torch.tensor([0, 4, 8, 9, 16, 20, 23])  # lengths 4, 4, 1, 7, 4, 3
    module = torch.nn.Module().eval()
    out, _ = windowed_sdpa(module, query, key, value, cu_seq_lens_q=bounds, scaling=8 ** -0.5)
    expected = per_window(query, key, value, bounds)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (query, key, value))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (query, key, value)))


@pytest.mark.parametrize("name", [n for n in TINY_MODELS if "qwen" in n])
def test_the_vision_tower_sees_the_same_pictures_through_either_attention(name):
    loaded = load_model(name)  # its own: other tests switch the shared models' attention
    assert loaded.model.config.vision_config._attn_implementation == VISION_ATTENTION_NAME  # what load_model sets
    message = Message("Look.", images=[make_image(1, (140, 112))], videos=[make_video(2, frames=4, size=112)], num_frames=4)
    kw = loaded.adapter.encode_turn(message, 0, 0, None).model_kwargs
    inner = loaded.model.model

    def features():
        with torch.no_grad():
            images = inner.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output
            videos = inner.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"]).pooler_output
        return [torch.cat(list(f)) if isinstance(f, (list, tuple)) else f for f in (images, videos)]

    ours = features()
    loaded.model.set_attn_implementation({"vision_config": "sdpa"})
    theirs = features()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
