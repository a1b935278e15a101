"""Scoring a query against low-rank pre-RoPE keys without rebuilding them (AttentionPack's decode).

A cached key is ``rotate(c_j B, theta_j)``: token j's coefficients ``c_j`` (R,) times the basis
``B`` (R, D) per KV head, turned by RoPE. Rotation is orthogonal per channel pair, so
``q . rotate(k, theta) = k . rotate^T(q, theta)`` with ``rotate^T(q) = q cos - rotate_half(q sin)``,
and the score is ``c_j . (B rotate^T(q, theta_j))``: an R-vector per distinct rotation instead of a
rebuilt D-vector per token.

M-RoPE (Qwen2-VL, Qwen2.5-VL) turns each channel by one component of the token's rotary id: time,
row or column. A picture of T tokens has one time value and about sqrt(T) rows and columns, so per
component the query is rotated once per distinct value (``P_s[u] = B rotate^T_s(q, u)``, tiny) and
token j's score is ``sum_s c_j . P_s[u_s(j)]``: T x R x H multiply-adds per component for H query
heads (a component with one value, the time of a picture, is folded into another), instead of
T x R x W to rebuild the keys plus the rotation (W = H_kv x D). With 1-D RoPE every token has its
own angle, so :meth:`RotaryGroups.build` declines and the keys are rebuilt.

The grouping is read from the block's own RoPE tables, not from the model's config: a channel
belongs to a component when tokens sharing that component's value share the channel's cos and sin
exactly. A channel no single component explains makes the block decline, so the result is the
rebuilt keys' scores up to float rounding whatever the RoPE variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rope import rotate_half


@dataclass
class Component:
    """The tokens of a block grouped by one rotary component's value."""

    channels: torch.Tensor  # (c,) long: the channels this component turns (both of each RoPE pair)
    first: torch.Tensor  # (n_u,) int32: the first token of each value (its tables are the value's rotation)
    width: int  # tokens of the largest group
    # how the groups sit in the block: "runs" (value u is tokens u*m..u*m+m-1, e.g. the rows of a
    # picture), "strided" (value u is tokens u, u+n_u, u+2n_u..., e.g. its columns) or "gather"
    layout: str
    members: torch.Tensor | None = None  # "gather" only: (n_u, m) int32 token indices, padded with T

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.channels, self.first, self.members) if t is not None]


@dataclass
class RotaryGroups:
    """A block's tokens grouped by the value of each rotary component that turns some channel."""

    components: list[Component]

    @classmethod
    def build(cls, rope_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, query_heads: int,
              kv_heads: int) -> "RotaryGroups | None":
        """Groups for tokens with ``rope_ids`` (P, T) and their tables (1, T, D); ``None`` when no
        grouping is cheaper than rebuilding the keys (1-D RoPE) or a channel turns with no single
        component."""
        tokens, dim = cos.shape[1], cos.shape[2]
        tables = torch.cat([cos[0], sin[0]], dim=1)  # (T, 2D): a channel is explained when both match
        options = []  # (distinct values, inverse, explained (D,))
        for s in range(rope_ids.shape[0]):
            values, inverse = rope_ids[s].unique(return_inverse=True)
            first = torch.full((values.numel(),), tokens, dtype=torch.long, device=inverse.device)
            first.scatter_reduce_(0, inverse, torch.arange(tokens, device=inverse.device), "amin")
            same = (tables == tables[first[inverse]]).all(dim=0)
            explained = same[:dim] & same[dim:]
            # rotate_half pairs channel d with d + D/2: a component must explain both of a pair
            options.append((values.numel(), inverse, explained & explained.roll(dim // 2)))
        left = torch.ones(dim, dtype=torch.bool, device=cos.device)
        components, distinct = [], 0
        for count, inverse, explained in sorted(options, key=lambda o: o[0]):  # fewest values first
            mine = explained & left
            if mine.any():
                components.append(_component(mine.nonzero().squeeze(1), inverse, count, tokens))
                distinct += count
                left &= ~mine
        # rotating the query per value costs distinct x H x D x R; rebuilding costs T x H_kv x D x R
        if left.any() or distinct * query_heads >= tokens * kv_heads:
            return None
        return cls(components)

    def tensors(self) -> list[torch.Tensor]:
        return [t for c in self.components for t in c.tensors()]

    def representatives(self, rope_ids: torch.Tensor) -> list[torch.Tensor]:
        """Per component, the rotary ids (P, n_u) of one token per value: their tables are the
        value's rotation on that component's channels."""
        return [rope_ids[:, c.first.long()] for c in self.components]

    def scores(self, query: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
               tables: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Float32 scores (H_kv, G, T) of the grouped, pre-scaled query (H_kv, G, D) against the keys
        ``rotate(coef @ basis)``; ``tables`` holds (cos, sin) (1, n_u, D) of :meth:`representatives`."""
        kv_heads, groups, dim = query.shape
        tokens, rank = coef.shape
        coef = coef.float()
        per_head = basis.float().view(rank, kv_heads, dim).permute(1, 2, 0)  # (H_kv, D, R)
        projected = []  # per component: (n_u, H, R), P_s[u] = B rotate^T_s(q, u) on its channels
        for c, (cos, sin) in zip(self.components, tables):
            cos, sin = cos[0, :, None, None].float(), sin[0, :, None, None].float()  # (n_u, 1, 1, D)
            turned = (query * cos - rotate_half(query * sin)).index_select(-1, c.channels)  # rotate^T, its channels
            count = turned.shape[0]
            # (H_kv, n_u x G, c) @ (H_kv, c, R): one batched product per KV head, no broadcast copies
            p = torch.bmm(turned.transpose(0, 1).reshape(kv_heads, count * groups, -1),
                          per_head.index_select(1, c.channels))
            projected.append(p.view(kv_heads, count, groups, rank).transpose(0, 1).reshape(count, -1, rank))
        # a component with one value (the time of a picture) turns every token alike: fold it into another
        single = [i for i, p in enumerate(projected) if p.shape[0] == 1]
        many = [i for i in range(len(projected)) if i not in single] or single[:1]
        for i in single:
            if i != many[0]:
                projected[many[0]] = projected[many[0]] + projected[i]
        out = torch.zeros(tokens + 1, kv_heads * groups, device=query.device)  # row T: the padding's
        padded = None  # the coefficients and a zero row for the padding, once per call if a component gathers
        for i in many:
            c, p = self.components[i], projected[i].transpose(1, 2)  # (n_u, R, H)
            count = p.shape[0]
            if c.layout == "runs":
                out[:tokens] += torch.bmm(coef.view(count, c.width, rank), p).view(tokens, -1)
            elif c.layout == "strided":
                part = torch.bmm(coef.view(c.width, count, rank).transpose(0, 1), p)  # (n_u, m, H)
                out[:tokens].view(c.width, count, -1).add_(part.transpose(0, 1))
            else:
                if padded is None:
                    padded = torch.cat([coef, coef.new_zeros(1, rank)])
                index = c.members.flatten().long()
                part = torch.bmm(padded.index_select(0, index).view(count, c.width, rank), p)
                out.index_add_(0, index, part.view(count * c.width, -1))
        return out[:tokens].T.reshape(kv_heads, groups, tokens)


def _component(channels: torch.Tensor, inverse: torch.Tensor, count: int, tokens: int) -> Component:
    """Group the tokens by value (``inverse``: each token's value index among ``count``)."""
    order = inverse.argsort(stable=True)
    sizes = torch.bincount(inverse, minlength=count)
    width = int(sizes.max())
    starts = torch.cumsum(sizes, 0) - sizes
    slot = torch.arange(tokens, device=inverse.device) - starts[inverse[order]]
    members = torch.full((count, width), tokens, dtype=torch.int32, device=inverse.device)
    members[inverse[order], slot] = order.to(torch.int32)
    first = members[:, 0].clone()
    every = torch.arange(tokens, dtype=torch.int32, device=inverse.device)
    if count * width == tokens and torch.equal(members.flatten(), every):
        return Component(channels, first, width, "runs")
    if count * width == tokens and torch.equal(members.T.flatten(), every):
        return Component(channels, first, width, "strided")
    return Component(channels, first, width, "gather", members)
