"""The second protocol a method may implement: reusing media KV stored beforehand.

A method that is a :class:`ReusesMedia` acts on the KV of images and videos the runtime computed
once and stored (MPIC: "MPIC: Position-Independent Multimodal Context Caching System for Efficient
MLLM Serving", arXiv:2502.01960). Without a store (a plain ``model.generate``) it would be the
full cache, so the public entry point refuses it, and the app gives it a store. The runtime
(``kv_arena.mpic.linking``) drives it for each prompt chunk:

* ``reuse`` -> what to fetch: ``"media"`` (each stored image or video of the prompt, by content),
  ``"prefix"`` (the longest exact token prefix of an earlier prompt, which the runtime restores and
  then reports with ``report_prefix``), or ``None`` (compute as without a store);
* ``plan(layout, links)`` -> the chunk-relative token indices each forward step feeds;
* ``link(...)`` opens every layer's slots before the steps, ``unlink()`` closes them after,
  ``abort(lengths)`` instead drops them (a stored file failed half-way);
* ``narrow_rows()``, asked before each decoder layer, hands over once the rows of the step that go
  on to the next layers (None: all of them);
* ``reuse_label``: the method's setting as a reader names it (``"MPIC-32"``, ``"prefix caching"``).

Nothing else tests a method's name: the runtime, the service and the UI ask for this capability.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import KVLayer, PromptLayout


@dataclass
class StoredMedia:
    """One visual span of the prompt whose KV the store holds."""

    span: tuple[int, int]  # absolute token indices in this prompt
    shift: int  # rotary delta from the stored position to this one
    fetch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> stored (keys, values); may wait for disk
    label: str = ""


class ReusesMedia(ABC):
    """A KV-cache method that reuses stored media KV (see the module's docstring for the order of calls)."""

    @property
    @abstractmethod
    def reuse(self) -> str | None:
        """What the runtime should fetch for a prompt: ``"media"``, ``"prefix"`` or None."""

    @property
    @abstractmethod
    def reuse_label(self) -> str:
        """The setting as a reader names it, lower case unless a name (``"MPIC-32"``, ``"full recompute"``)."""

    @abstractmethod
    def plan(self, layout: PromptLayout, links: list[StoredMedia | None]) -> list[torch.Tensor]:
        """Chunk-relative indices of the tokens each forward step feeds (``links``: per visual of
        ``layout``, its stored KV or None where it is recomputed)."""

    @abstractmethod
    def link(self, layers: list[KVLayer], layout: PromptLayout, links: list[StoredMedia | None],
             rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], rope_dims: int) -> None:
        """Open every layer's slots for this chunk, the stored KV moved to its new positions
        (``rotary``: rotary ids -> (cos, sin), as the model computes them)."""

    @abstractmethod
    def unlink(self) -> None:
        """Close the slots after the last step."""

    @abstractmethod
    def abort(self, lengths: list[int]) -> None:
        """Drop a half-done link: every layer back to its length before it."""

    @abstractmethod
    def narrow_rows(self) -> torch.Tensor | None:
        """Rows of the current step that go on to the next layers, handed over once (None: all)."""

    @abstractmethod
    def report_prefix(self, reused: torch.Tensor, recomputed: torch.Tensor, num_layers: int) -> None:
        """Report a prompt whose first tokens were restored from an earlier prompt (``reuse ==
        "prefix"``): the 1-D token positions reused and computed, alike in every layer."""
