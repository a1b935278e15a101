"""MPIC (Zhao et al., "MPIC: Position-Independent Multimodal Context Caching System for Efficient
MLLM Serving", arXiv:2502.01960) with the paper's baselines, as modes of one backend.

The runtime (``kv_arena/mpic/linking.py``) stores each uploaded image's or video's KV, computed once after
a fixed prefix (the system prompt), and hands this backend the stored spans of a new prompt as
:class:`StoredMedia`. The backend chooses what to recompute and runs that attention:

* Linking (Sec. 4.2, the "linker"): cached keys are post-RoPE at their stored position; moving them
  by ``delta`` positions is one more rotation by ``delta`` (rotations compose). A moved Qwen-VL
  image shifts its temporal, height and width ids alike, so the same rotation is exact for M-RoPE.
* ``mpic`` (Sec. 5, MPIC-k): one forward step feeds all text tokens and the first ``k`` tokens of
  every stored image (video: of the whole clip). Their attention sees the linked cache, where the
  fed tokens' slots (the zero "dummy cache" of Fig. 7) are overwritten in place with fresh KV at
  every layer; every other image token keeps its stored KV.
* ``full_reuse`` (Sec. 3.2): recompute the text only, in two steps, as the paper describes it: the
  text's KV on its own, then the first output token from the concatenated cache (the last prompt
  token, fed again, is the only query that sees the stored images).
* ``cacheblend`` (Yao et al., EuroSys 2025, Sec. 4; the paper's CacheBlend-r, Sec. 6.1): every token
  goes through the layers before ``check_layer``; there all new text (it has no stored KV) plus
  ceil(r x reused tokens), r = 15%, of the stored tokens with the largest key deviation from the
  stored cache are chosen, and only they continue; the others keep their stored KV from
  ``check_layer`` on. r is a share of the reused tokens, not of the prompt (CacheBlend Sec. 4
  selects r% of the reused KV; text is recomputed on top), so a long question never crowds the
  image tokens out. Deviation as in LMCache's blender: squared key difference, layer 1.
* ``prefix``: reuse only an exact token prefix of an earlier prompt of the session (the runtime
  restores it; everything after the first difference is computed as without a cache).
* ``recompute``: no reuse: the reference every TTFT is divided by.

A span the store missed (expired, evicted, damaged file) is recomputed in full. Nothing is evicted
(the prefill leaves the full cache), so the budget does not apply.

Runtime protocol (:class:`~backends.media_reuse.ReusesMedia`, driven by ``kv_arena/mpic/linking.py``):
``plan`` -> the chunk tokens each forward step feeds; ``link`` opens every layer's slots before the
steps, ``unlink`` closes them (``abort`` also drops them); ``narrow_rows`` hands over, once, the rows
that go on to the next layers (CacheBlend).

Report (:class:`MPICReport`, ``self.report``): ``recomputed`` / ``reused``: per layer, the token
indices whose KV this prompt computed / linked from the store; ``linked``: per stored span its token
span, rotary shift and label; ``steps``: forward steps of the prefill.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import KVBackend, KVLayer, Report
from .layout import PromptLayout
from .params import param
from .media_reuse import ReusesMedia, StoredMedia
from .rope import rotate

MODES = ("mpic", "prefix", "full_reuse", "cacheblend", "recompute")


def shift_keys(keys: torch.Tensor, delta: int, rotary, rope_dims: int) -> torch.Tensor:
    """Move post-RoPE keys ``(1, H, n, D)`` by ``delta`` positions: R(p + delta) k = R(delta) R(p) k."""
    if delta == 0:
        return keys
    ids = torch.full((rope_dims, 1), int(delta), dtype=torch.long, device=keys.device)
    cos, sin = rotary(ids)
    norm = (cos * cos + sin * sin).sqrt()  # tables scaled by the model (YaRN) must not scale twice
    return rotate(keys, cos / norm, sin / norm)


class LinkedLayer(KVLayer):
    """A dense layer that can open a prompt chunk as slots: stored KV where linked, zeros elsewhere.
    Tokens fed while it is open write their fresh KV into their own slots, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.start: int | None = None  # absolute index of the open chunk's first token
        self.length = 0  # tokens in the open chunk
        self.offset = 0  # where its first token sits in this layer
        self.stored: torch.Tensor | None = None  # (chunk,) bool: the slot holds linked KV
        self.fill: Callable | None = None  # like -> [(chunk index, keys, values)], read at the first write
        self.save_replaced = False  # keep what the next write overwrites (CacheBlend's check layer)
        self.replaced: tuple | None = None  # (slots, keys, values, was_stored) of the last write

    def open(self, start: int, length: int, fill: Callable, save_replaced: bool = False) -> None:
        self.start, self.length, self.fill, self.save_replaced = start, length, fill, save_replaced

    def close(self) -> None:
        self.start = self.fill = self.replaced = None
        self.save_replaced = False

    def append(self, keys, values, positions):
        if self.start is None:
            return super().append(keys, values, positions)
        if self.fill is not None:
            self._materialise(keys)
        slots = positions.to(keys.device) - self.start + self.offset
        if self.save_replaced:
            self.replaced = (slots, self.keys[:, :, slots].clone(), self.values[:, :, slots].clone(),
                             self.stored[slots - self.offset].clone())
        self.keys[:, :, slots] = keys
        self.values[:, :, slots] = values
        self.stored[slots - self.offset] = False
        return self.keys, self.values

    def _materialise(self, like: torch.Tensor) -> None:
        """Append the chunk's slots: linked KV where stored, the zero dummy elsewhere."""
        shape = (1, like.shape[1], self.length, like.shape[3])
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        self.stored = torch.zeros(self.length, dtype=torch.bool, device=like.device)
        for first, k, v in self.fill(like):
            keys[:, :, first:first + k.shape[2]], values[:, :, first:first + k.shape[2]] = k, v
            self.stored[first:first + k.shape[2]] = True
        self.offset, self.fill = self.get_seq_length(), None
        super().append(keys, values, torch.arange(self.start, self.start + self.length, device=like.device))

    def truncate(self, length: int) -> None:
        """Back to the first ``length`` entries (a link abandoned half-way)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
            self.positions = self.positions[:, :length]
        self.close()


@dataclass
class MPICReport(Report):
    """This prompt's reuse: ``reused`` (per layer, 1-D token positions linked from the store) and
    what was computed instead."""

    # per layer: 1-D token positions whose KV this prompt computed
    recomputed: list[torch.Tensor] | None = None
    # forward steps of the prefill (None: the prompt was not planned by ``plan``, e.g. a restored prefix)
    steps: int | None = None
    # per stored span: {"span": [start, end], "shift": rotary shift, "label": str}
    linked: list[dict] | None = None


@dataclass(eq=False)
class MPIC(KVBackend, ReusesMedia):
    name = "mpic"
    title = "MPIC (position-independent media cache)"
    does = "reuses"
    paper = "https://arxiv.org/abs/2502.01960"
    summary = ("Links each image's stored KV at its new position and recomputes only the text and the first k "
               "tokens of every image; prefix caching, full reuse, CacheBlend and full recompute as modes.")
    mode: str = param("mpic", "What to reuse: MPIC-k, exact prefix, full reuse (text only), CacheBlend-r, or nothing.",
                      choices=MODES)
    k: int = param(32, "MPIC-k: tokens at the start of every image that are recomputed (paper: 32).", 0, 4096, 1)
    recompute_ratio: float = param(0.15, "CacheBlend-r: share of the reused (stored) tokens recomputed, on top of "
                                   "all new text (paper: 15%).", 0.0, 1.0, 0.01)
    check_layer: int = param(1, "CacheBlend: layer whose key deviation picks the recomputed tokens.", 0, 128, 1)
    uses_budget = False
    report_type: ClassVar[type[Report]] = MPICReport

    def __post_init__(self) -> None:
        super().__post_init__()
        self._layers: list[LinkedLayer] | None = None  # open while a linked prefill runs
        self._step = 0  # forward steps done in this prefill
        self._narrow: torch.Tensor | None = None  # rows for the runtime to keep after this layer
        self._chunk = self._fed = torch.zeros(0, dtype=torch.long)  # the chunk's token indices, those fed

    @property
    def reuse(self) -> str | None:
        """What the runtime should fetch: stored ``"media"``, a ``"prefix"``, or nothing."""
        return {"prefix": "prefix", "recompute": None}.get(self.mode, "media")

    @property
    def reuse_label(self) -> str:
        return {"mpic": f"MPIC-{self.k}", "prefix": "prefix caching", "full_reuse": "full reuse",
                "cacheblend": f"CacheBlend-{self.recompute_ratio:.0%}", "recompute": "full recompute"}[self.mode]

    def new_layer(self, layer_idx: int) -> KVLayer:
        return LinkedLayer()

    # --- what to recompute ---------------------------------------------------------------------
    def plan(self, layout: PromptLayout, links: list[StoredMedia | None]) -> list[torch.Tensor]:
        """Chunk-relative indices of the tokens each forward step feeds."""
        fed = torch.ones(layout.length, dtype=torch.bool)
        for link in filter(None, links):
            first, end = link.span[0] - layout.start, link.span[1] - layout.start
            if self.mode == "mpic":
                fed[first + self.k:end] = False
            elif self.mode == "full_reuse":
                fed[first:end] = False
        rows = fed.nonzero().squeeze(1)
        steps = [rows[:-1], rows[-1:]] if self.mode == "full_reuse" and len(rows) > 1 else [rows]
        self._chunk = torch.arange(layout.start, layout.end)
        self._fed = self._chunk[rows]
        self.report = MPICReport(recomputed=[], reused=[], steps=len(steps),
                                 linked=[{"span": list(link.span), "shift": link.shift, "label": link.label}
                                         for link in filter(None, links)])
        return steps

    def link(self, layers: list[LinkedLayer], layout: PromptLayout, links: list[StoredMedia | None],
             rotary, rope_dims: int) -> None:
        """Open every layer's slots for this chunk; stored KV is read (and shifted) at first use."""
        stored = [link for link in links if link is not None]

        def fill(i: int):
            def pieces(like: torch.Tensor):
                for link in stored:
                    k, v = link.fetch(i)
                    k = shift_keys(k.to(like.device, like.dtype), link.shift, rotary, rope_dims)
                    yield link.span[0] - layout.start, k, v.to(like.device, like.dtype)
            return pieces

        check = min(self.check_layer, len(layers) - 1)
        for i, layer in enumerate(layers):
            layer.open(layout.start, layout.length, fill(i), save_replaced=self.mode == "cacheblend" and i == check)
        self._layers, self._step, self._narrow = layers, 0, None
        self.report.recomputed = [self._fed] * len(layers)

    def unlink(self) -> None:
        """Close the slots; report, per layer, which tokens kept their stored KV."""
        for layer in self._layers or []:
            stored = layer.stored.cpu() if layer.stored is not None else torch.zeros(len(self._chunk), dtype=torch.bool)
            self.report.reused.append(self._chunk[stored])
            layer.close()
        self._layers = None

    def abort(self, lengths: list[int]) -> None:
        """Drop a half-done link: every layer back to its length before it."""
        for layer, length in zip(self._layers or [], lengths):
            layer.truncate(length)
        self._layers = None

    def narrow_rows(self) -> torch.Tensor | None:
        """Rows of the current step that go on to the next layers, once (None: all)."""
        rows, self._narrow = self._narrow, None
        return rows

    def report_prefix(self, reused: torch.Tensor, recomputed: torch.Tensor, num_layers: int) -> None:
        self.report = MPICReport(reused=[reused] * num_layers, recomputed=[recomputed] * num_layers)

    # --- attention over the linked cache -------------------------------------------------------
    def attend(self, call, query, key, value, scaling):
        if self._layers is None:
            return None
        layer = self._layers[call.layer_idx]
        key_pos = layer.positions[0]
        visible = key_pos[None, :] <= call.positions.to(key_pos.device)[:, None]
        if self.mode == "full_reuse" and self._step == 0:  # the text's KV on its own (Sec. 3.2)
            visible[:, layer.offset:layer.offset + layer.length] &= ~layer.stored[None, :]
        if layer.replaced is None:
            return _sdpa(query, key, value, visible, scaling)
        rows = self._blend(layer, call)
        out = query.new_zeros(query.shape)  # rows outside ``rows`` leave before the next layer
        out[:, :, rows] = _sdpa(query[:, :, rows], layer.keys, layer.values, visible[rows], scaling)
        self._narrow = rows
        later = len(self._layers) - call.layer_idx
        self.report.recomputed[call.layer_idx:] = [call.positions[rows].cpu()] * later
        return out

    def _blend(self, layer: LinkedLayer, call) -> torch.Tensor:
        """CacheBlend's choice at the check layer; unchosen rows get their stored KV back."""
        slots, old_k, old_v, was_stored = layer.replaced
        deviation = ((layer.keys[:, :, slots] - old_k).float() ** 2).sum(dim=(0, 1, 3))
        forced = ~was_stored  # no stored KV: text, and spans the store missed
        forced[-1] = True  # the last prompt token produces the first output token
        deviation[forced] = float("inf")
        # r of the *reused* tokens on top of every forced one: text never eats into the share
        count = int(forced.sum()) + math.ceil(self.recompute_ratio * int((~forced).sum()) - 1e-9)
        rows = deviation.topk(min(count, len(deviation))).indices.sort().values
        back = was_stored.clone()
        back[rows] = False
        layer.keys[:, :, slots[back]], layer.values[:, :, slots[back]] = old_k[:, :, back], old_v[:, :, back]
        layer.stored[slots[back] - layer.offset] = True
        layer.replaced = None
        return rows

    def after_forward(self, cache, call) -> None:
        if self._layers is not None:
            self._step += 1


def _sdpa(query, key, value, visible, scaling):
    return F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype), attn_mask=visible,
                                          scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
