"""The attention the Qwen-VL vision towers run, registered through transformers' AttentionInterface.

A Qwen-VL vision block attends within windows (Qwen2.5-VL: 112 px squares; every block: one
image or frame pair), packed in one sequence with their boundaries in ``cu_seqlens``. transformers
hands those boundaries to the attention function in one call only on its varlen path, which it
takes when the implementation's name says "flash" (``utils.generic.is_flash_attention_requested``);
on any other path its vision attention loops over the windows in Python, one small SDPA call (and
its backward) per window. Windows of one token, as tiny-arena-vl's vision tower has, make that
thousands of calls per image. This function takes the varlen path's arguments and runs plain
SDPA once per distinct window length, the windows of that length as a batch: the same result,
no flash-attn needed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VISION_ATTENTION_NAME = "sdpa_windows_on_flash_path"  # "flash" routes cu_seqlens here in one call


def windowed_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                  scaling: float | None = None, dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """(1, heads, n, d) query, key and value packed by window (``cu_seq_lens_q``: the windows'
    bounds, keys the same) -> (1, n, heads, d): each token attends to its own window only."""
    n = query.shape[2]
    bounds = cu_seq_lens_q if cu_seq_lens_q is not None else torch.tensor([0, n])
    starts, lengths = bounds[:-1].to(query.device), (bounds[1:] - bounds[:-1]).to(query.device)
    out = torch.empty_like(query)
    for length in lengths.unique().tolist():
        at = starts[lengths == length, None] + torch.arange(length, device=query.device)  # (windows, length)
        q, k, v = (t[0][:, at].transpose(0, 1) for t in (query, key, value))  # (windows, heads, length, d)
        part = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if module.training else 0.0, scale=scaling)
        out[0][:, at] = part.transpose(0, 1)
    return out.transpose(1, 2), None


AttentionInterface.register(VISION_ATTENTION_NAME, windowed_sdpa)

# the vision towers whose attention packs windows by cu_seqlens (transformers' Qwen-VL models)
WINDOWED_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


def vision_attention(family: str) -> str:
    """The vision tower's attn_implementation for a model family: :func:`windowed_sdpa` where the
    tower packs windows, plain SDPA elsewhere (CLIP, SigLIP: one sequence per image)."""
    return VISION_ATTENTION_NAME if family in WINDOWED_FAMILIES else "sdpa"
