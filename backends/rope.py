"""Rotary position embedding, applied and undone on cached keys.

The runtime caches keys after RoPE. Methods that transform keys along the hidden dimension
(low-rank factors) or move them to new positions need the pre-RoPE key, so they undo the rotation
with the ``(cos, sin)`` the model itself computes for those tokens (``AttentionCall.rotary``).
Those tables already merge M-RoPE's three position components into one ``(1, n, D)`` pair, so the
same two functions serve 1-D RoPE (LLaVA) and M-RoPE (Qwen2-VL, Qwen2.5-VL).

RoPE turns each pair of channels (i, i + D/2) by an angle; the inverse turns it back by the same
angle, i.e. the forward formula with ``-sin``, divided by ``cos^2 + sin^2`` (1 unless the model
scales its tables, as YaRN-style RoPE does).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _broadcast(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # (1, n, D) tables broadcast over the head axis of (1, H, n, D) keys
    return table.unsqueeze(1).to(x.dtype) if x.dim() == 4 and table.dim() == 3 else table.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: keys (1, H, n, D) with tables (1, n, D), as the model does."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    return x * cos + rotate_half(x) * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: the exact inverse of :func:`rotate` for the same tables."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
