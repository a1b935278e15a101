"""Attention arithmetic the methods share: exact causal attention over a (compressed) cache, and
attention probabilities recomputed for chosen query rows only, in float32 and in chunks, so no
method ever builds the T x T matrix or needs eager attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact attention where the q new tokens are the last q keys: (1, H, q, D) -> (1, H, q, D).

    Every cached entry before the new tokens is visible to all of them, whatever was evicted or
    merged, so one offset causal mask is right for every layer's own cache length.
    """
    q_len, k_len = query.shape[-2], key.shape[-2]
    mask = None
    if q_len > 1:
        rows = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
        mask = torch.arange(k_len, device=query.device)[None, :] <= rows
    return F.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def _expand_kv(key: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(1, H_kv, S, D) -> (H, S, D), repeating each KV head for its query group."""
    groups = num_heads // key.shape[1]
    return key[0].repeat_interleave(groups, dim=0) if groups > 1 else key[0]


def attention_probs(query: torch.Tensor, key: torch.Tensor, scaling: float,
                    query_index: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scaling) in float32 for the given query rows: (H, q, S).

    ``query_index[i]`` is the index in ``key`` of query i's own token: it sees keys 0..index
    (causal). ``None`` lets every query see every key (the decode query).
    """
    q = query[0].float()
    k = _expand_kv(key, q.shape[0]).float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if query_index is not None:
        visible = torch.arange(k.shape[1], device=k.device)[None, :] <= query_index.to(k.device)[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
    return scores.softmax(dim=-1)


def attention_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float,
                          query_index: torch.Tensor | None = None, chunk: int = 256) -> torch.Tensor:
    """Attention each key receives, summed over the given query rows: (H, S), float32, chunked."""
    total = None
    for start in range(0, query.shape[2], chunk):
        rows = query[:, :, start : start + chunk]
        index = None if query_index is None else query_index[start : start + chunk]
        part = attention_probs(rows, key, scaling, index).sum(dim=1)
        total = part if total is None else total + part
    return total


def kv_group_mean(per_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Average query-head statistics over each GQA group: (H, ...) -> (H_kv, ...)."""
    return per_head.view(num_kv_heads, per_head.shape[0] // num_kv_heads, *per_head.shape[1:]).mean(dim=1)
