"""A KV cache coded per token and KV head, as a serving engine stores it (vLLM's ``*_per_token_head``
cache dtypes): each token's key vector in each KV head is coded on its own, with its own scale, and
so is its value. Shared by :mod:`backends.fp8` and :mod:`backends.int4`, which bring the code
(a :class:`TokenCodec`); this module holds the layer and its bytes.

* Written, then read (vLLM's Triton backend writes the new keys and values into the cache and its
  attention reads them from there, a prefill's own tokens included): ``append`` codes the new tokens
  and returns the whole layer decoded, so every query, in a prefill too, attends over what the cache
  holds. The decoded tensors are transient; only the codes and scales stay.
* Every part (codes, scales, zero points) has the token on dim 2, so a method that chooses tokens can
  drop entries with ``keep`` as from a dense layer: a stack (``snapkv+fp8``, :mod:`backends.stack`)
  quantises what its selector keeps. Merging entries (``replace``) is refused.
* Bytes held = every part's bytes, nothing else (``tensors``); ``byte_parts`` splits codes from
  scales and zero points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .base import KVBackend, KVLayer, Report


class TokenCodec(Protocol):
    """How one format codes a (1, H, n, D) tensor per token and head, and back."""

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parts by name ("codes" first), each (1, H, n, ...): the token on dim 2."""

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The (1, H, n, D) tensor in ``dtype`` that ``parts`` stand for."""


class TokenHeadLayer(KVLayer):
    """Keys and values held only as ``codec``'s parts; ``keys`` / ``values`` stay empty (they carry
    the cache's dtype and device for transformers)."""

    def __init__(self, codec: TokenCodec) -> None:
        super().__init__()
        self.codec = codec
        self.key_parts: dict[str, torch.Tensor] = {}
        self.value_parts: dict[str, torch.Tensor] = {}

    def append(self, keys, values, positions):
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        heads = keys.shape[1]
        new_pos = positions.to(keys.device).view(1, -1).expand(heads, -1)
        self.positions = new_pos.clone() if self.positions is None else torch.cat([self.positions, new_pos], dim=1)
        self.key_parts = _joined(self.key_parts, self.codec.encode(keys))
        self.value_parts = _joined(self.value_parts, self.codec.encode(values))
        return self.dense()

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held key and value, decoded, in cache order (transient)."""
        return (self.codec.decode(self.key_parts, self.keys.dtype),
                self.codec.decode(self.value_parts, self.values.dtype))

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the entries at ``index`` ((S',) or (H_kv, S')): every part is gathered along the tokens."""
        heads = self.positions.shape[0]
        if index.dim() == 1:
            index = index.view(1, -1).expand(heads, -1)
        index = index.to(self.positions.device)
        self.key_parts = {n: _gather(t, index) for n, t in self.key_parts.items()}
        self.value_parts = {n: _gather(t, index) for n, t in self.value_parts.items()}
        self.positions = self.positions.gather(1, index)

    def replace(self, keys, values, positions) -> None:
        raise NotImplementedError("a cache coded per token keeps or drops entries; it does not merge them")

    def tensors(self) -> list[torch.Tensor]:
        return list(self.key_parts.values()) + list(self.value_parts.values())

    def byte_parts(self) -> dict[str, int]:
        """Bytes held: ``codes`` and ``scales`` (scales and zero points)."""
        parts = [self.key_parts, self.value_parts]
        codes = sum(_nbytes(p["codes"]) for p in parts if p)
        return {"codes": codes, "scales": self.nbytes() - codes}


def _joined(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return new if not old else {n: torch.cat([old[n], new[n]], dim=2) for n in new}


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` (1, H, S, w) at ``index`` (H, S') along dim 2."""
    return t.gather(2, index[None, :, :, None].expand(1, index.shape[0], index.shape[1], t.shape[-1]))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def full_precision_bytes(layer: KVLayer) -> int:
    """What ``layer``'s entries would hold as dense keys and values in the cache's dtype."""
    if layer.keys is None or layer.positions is None:
        return 0
    heads, dim = layer.positions.shape[0], _head_dim(layer)
    return 2 * layer.get_seq_length() * heads * dim * layer.keys.element_size()


def _head_dim(layer: KVLayer) -> int:
    if isinstance(layer, TokenHeadLayer):
        return layer.codec.head_dim
    return layer.keys.shape[-1]


@dataclass
class TokenQuantReport(Report):
    """What a cache coded per token holds; ``layer_budgets`` is the share of the same entries' bytes in
    the cache's dtype a layer holds."""

    # per layer: bytes held, {"codes": int, "scales": int} (scales: scales and zero points)
    bytes: list[dict[str, int] | None] | None = None
    # the format the cache is coded in ("e4m3", "int4"; "none": not coded)
    format: str | None = None


def report_bytes(method, cache) -> None:
    """Fill ``method.report`` (a :class:`TokenQuantReport`) from ``cache``'s layers:
    per layer ``bytes`` and ``layer_budgets`` (bytes held / the same entries in the cache's dtype), and
    ``realised_fraction`` over all layers."""
    layers = cache.layers
    report = method.report
    report.ensure_layers(len(layers), "bytes", "layer_budgets")
    fulls, helds = [full_precision_bytes(layer) for layer in layers], [layer.nbytes() for layer in layers]
    for i, (layer, full, held) in enumerate(zip(layers, fulls, helds)):
        report.layer_budgets[i] = held / full if full else None
        report.bytes[i] = layer.byte_parts() if isinstance(layer, TokenHeadLayer) else {"codes": held, "scales": 0}
    report.realised_fraction = sum(helds) / sum(fulls) if sum(fulls) else None


@dataclass(eq=False)
class TokenQuantStore(KVBackend):
    """What FP8 and INT4 share: every token kept, coded per token and KV head by :meth:`codec`, no
    budget; a subclass's ``format`` field set to "none" is the full cache (``lossless_params``)."""

    does = "quantises"
    paper = "https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache.html"
    uses_budget = False
    quantised_store = True
    lossless_params: ClassVar[dict] = {"format": "none"}
    report_type: ClassVar[type[Report]] = TokenQuantReport

    def codec(self) -> TokenCodec:
        """A new codec for one layer (its format's)."""
        raise NotImplementedError

    def new_layer(self, layer_idx: int) -> KVLayer:
        return KVLayer() if self.format == "none" else TokenHeadLayer(self.codec())

    def after_forward(self, cache, call) -> None:
        report_bytes(self, cache)
        self.report.format = self.format


__all__ = ["TokenCodec", "TokenHeadLayer", "TokenQuantReport", "TokenQuantStore", "full_precision_bytes",
           "report_bytes"]
