"""Attention arithmetic the methods share: exact causal attention over a (compressed) cache, and
attention probabilities recomputed for chosen query rows only, in float32 and in chunks, so no
method ever builds the T x T matrix or needs eager attention.

Speed rules: GQA is handled by viewing the query heads of a group as extra rows of one
matmul against their KV head, never by copying the keys per query head; a full causal prefill runs
SDPA's fused causal kernel (``is_causal``), not an explicit mask; and the attention a key receives
from every prompt query (H2O, Elastic Cache) comes out of the prefill attention itself
(:func:`causal_attention_column_sums`): the softmax that weights the values is the one summed, so
scoring costs no second pass over the causal half.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COLUMN_CHUNK = 256  # query rows per block of column sums: bounds the (H, rows, S) float32 block
ATTENTION_CHUNK = 64  # query rows per block of the one-pass attention: its (H, rows, S) block stays in cache


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact attention where the q new tokens are the last q keys: (1, H, q, D) -> (1, H, q, D).

    Every cached entry before the new tokens is visible to all of them, whatever was evicted or
    merged, so one offset causal mask is right for every layer's own cache length. When the new
    tokens are the whole cache the mask is SDPA's own ``is_causal`` (its fused kernel); a single
    query needs none.
    """
    q_len, k_len = query.shape[-2], key.shape[-2]
    return F.scaled_dot_product_attention(
        query, _as(key, query), _as(value, query), attn_mask=_offset_mask(q_len, k_len, query.device),
        is_causal=1 < q_len == k_len, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
    )


def causal_attention_column_sums(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                                 chunk: int = ATTENTION_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_attention` computed in blocks of query rows, with what H2O and Elastic Cache score
    with: the attention each key receives, summed over the new queries, (H, S) float32.

    One pass: each block's float32 softmax weights the values and is summed over its rows. On this
    CPU, blocks of 64 rows run within ~10% of SDPA's fused kernel, where SDPA followed by a second
    pass over the scores took twice as long. The new tokens are the last keys (offset-causal).
    """
    heads, q_len, dim = query.shape[1:]
    kv_heads, held = key.shape[1], key.shape[2]
    group, first = heads // kv_heads, held - q_len
    keys, values = key[0].float(), value[0].float()  # (KV, S, D); no copy when already float32
    out = torch.empty_like(query)
    sums = torch.zeros(heads, held, dtype=torch.float32, device=query.device)
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        rows, seen = stop - start, first + stop  # causal: these rows see keys 0..seen-1
        q = query[0, :, start:stop].float().reshape(kv_heads, group * rows, dim)
        scores = torch.matmul(q * scaling, keys[:, :seen].transpose(-1, -2)).view(kv_heads, group, rows, seen)
        own = torch.arange(first + start, seen, device=query.device)  # the block's own keys: the diagonal
        scores[..., first + start:].masked_fill_(own[None, :] > own[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        mixed = torch.matmul(probs.view(kv_heads, group * rows, seen), values[:, :seen])
        out[0, :, start:stop] = mixed.view(heads, rows, dim).to(out.dtype)
        sums[:, :seen] += probs.sum(dim=2).view(heads, seen)
    return out, sums


def _as(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == like.dtype else tensor.to(like.dtype)


def _offset_mask(q_len: int, k_len: int, device) -> torch.Tensor | None:
    """Bool (q, k) mask of the new tokens sitting at the end of the keys; None where SDPA needs none."""
    if q_len == 1 or q_len == k_len:
        return None
    rows = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return torch.arange(k_len, device=device)[None, :] <= rows


def _grouped_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, keys: int | None = None) -> torch.Tensor:
    """Scaled float32 scores (H, q, S') of every query head against its KV head's first ``keys``
    keys (all by default). The G query heads of a group are G x q rows of one matmul: no key copy."""
    heads, q_len, dim = query.shape[1:]
    kv_heads = key.shape[1]
    q = query[0].float().reshape(kv_heads, heads // kv_heads * q_len, dim)
    k = key[0, :, :keys].float()
    return torch.matmul(q * scaling, k.transpose(-1, -2)).view(heads, q_len, -1)


def _visible(query_index: torch.Tensor, keys: int) -> torch.Tensor:
    """(q, keys) bool: query i sees keys 0..query_index[i]."""
    return torch.arange(keys, device=query_index.device)[None, :] <= query_index[:, None]


def attention_probs(query: torch.Tensor, key: torch.Tensor, scaling: float,
                    query_index: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scaling) in float32 for the given query rows: (H, q, S).

    ``query_index[i]`` is the index in ``key`` of query i's own token: it sees keys 0..index
    (causal). ``None`` lets every query see every key (the decode query).
    """
    scores = _grouped_scores(query, key, scaling)
    if query_index is not None:
        scores = scores.masked_fill_(~_visible(query_index.to(scores.device), scores.shape[-1])[None], float("-inf"))
    return scores.softmax(dim=-1)


def row_logsumexp(query: torch.Tensor, key: torch.Tensor, scaling: float, query_index: torch.Tensor,
                  chunk: int = COLUMN_CHUNK) -> torch.Tensor:
    """(H, q) float32 log-sum-exp of each query's causal scaled scores (when no kernel gave it)."""
    parts = []
    for start in range(0, query.shape[2], chunk):
        index = query_index[start : start + chunk].to(key.device)
        scores = _grouped_scores(query[:, :, start : start + chunk], key, scaling, int(index.max()) + 1)
        parts.append(scores.masked_fill_(~_visible(index, scores.shape[-1])[None], float("-inf")).logsumexp(-1))
    return torch.cat(parts, dim=1)


def attention_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float, query_index: torch.Tensor,
                          chunk: int = COLUMN_CHUNK) -> torch.Tensor:
    """Attention each key receives, summed over the given query rows: (H, S), float32, chunked.

    For rows whose attention was not computed by :func:`causal_attention_column_sums` (a method's
    own ``attend``, or a unit test): each row's log-sum-exp first, then one ``exp(q k - lse)`` block
    over the keys its rows can see. ``query_index[i]`` is query i's own index among the keys.
    """
    held = key.shape[2]
    lse = row_logsumexp(query, key, scaling, query_index, chunk)
    total = torch.zeros(query.shape[1], held, dtype=torch.float32, device=key.device)
    for start in range(0, query.shape[2], chunk):
        index = query_index[start : start + chunk].to(key.device)
        keys = int(index.max()) + 1  # causal: later keys receive nothing from these rows
        probs = _grouped_scores(query[:, :, start : start + chunk], key, scaling, keys)
        probs = probs.sub_(lse[:, start : start + chunk, None]).exp_()
        first = int(index.min()) + 1  # keys every row of the block sees: only the rest need the mask
        probs[:, :, first:].masked_fill_(~_visible(index, keys)[None, :, first:], 0.0)
        total[:, :keys] += probs.sum(dim=1)
    return total


def prompt_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float,
                       computed: torch.Tensor | None = None) -> torch.Tensor:
    """The attention each key received from a prefill's new queries (the last keys): ``computed``
    when the prefill attention summed it (``call.column_sums``), else :func:`attention_column_sums`."""
    if computed is not None:
        return computed
    held, new = key.shape[2], query.shape[2]
    return attention_column_sums(query, key, scaling, torch.arange(held - new, held, device=query.device))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query over every key: the output (1, H, 1, D) and its float32 softmax row
    (H, 1, S), from one pass (for methods that score with the row they attend with)."""
    probs = attention_probs(query, key, scaling)
    return mix_values(probs, value).to(query.dtype), probs


def mix_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """probs (H, q, S) @ value (1, H_kv, S, D) per GQA group, in float32: (1, H, q, D)."""
    heads, q_len, held = probs.shape
    kv_heads = value.shape[1]
    out = torch.matmul(probs.reshape(kv_heads, heads // kv_heads * q_len, held), value[0].float())
    return out.view(1, heads, q_len, -1)


Segment = tuple  # (scores(q) -> (H_kv, G, n), mix(p) -> (H_kv, G, D)), both float32


def attend_segments(query: torch.Tensor, scaling: float, kv_heads: int,
                    segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query (1, H, 1, D) over a cache held in parts (codes, factors, a dense tail),
    never concatenated into dense keys and values: ``scores(q)`` gives a part's float32 scores for
    the grouped, pre-scaled query q (H_kv, G, D); ``mix(p)`` its output for probabilities p
    (H_kv, G, n). The softmax runs over every part at once. Returns the output (1, H, 1, D) and
    the softmax row (H, 1, S) in the parts' order."""
    heads, dim = query.shape[1], query.shape[-1]
    q = query[0, :, -1].float().reshape(kv_heads, heads // kv_heads, dim) * scaling
    scores = [score(q) for score, _ in segments]
    probs = torch.cat(scores, dim=-1).softmax(dim=-1)
    parts = probs.split([s.shape[-1] for s in scores], dim=-1)
    out = sum(mix(p) for (_, mix), p in zip(segments, parts))
    return out.reshape(1, heads, 1, dim).to(query.dtype), probs.view(heads, 1, -1)


def dense_segment(keys: torch.Tensor, values: torch.Tensor) -> Segment:
    """A part held as dense (1, H_kv, n, D) keys and values, for :func:`attend_segments`."""
    return (lambda q: torch.matmul(q, keys[0].float().transpose(-1, -2)),
            lambda p: torch.matmul(p, values[0].float()))


def kv_group_mean(per_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Average query-head statistics over each GQA group: (H, ...) -> (H_kv, ...)."""
    return per_head.view(num_kv_heads, per_head.shape[0] // num_kv_heads, *per_head.shape[1:]).mean(dim=1)
