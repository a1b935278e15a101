"""The cache object handed to the model: transformers' ``Cache`` seam, with one backend layer per
decoder layer. It tells each layer which tokens the new keys belong to, and meters real bytes."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kv_arena.backends.base import KVBackend


class KVCache(Cache):
    def __init__(self, backend: KVBackend, num_layers: int):
        super().__init__(layers=[backend.new_layer(i) for i in range(num_layers)])
        self.backend = backend
        self.pending_positions: torch.Tensor | None = None  # token indices of the keys about to arrive
        # most bytes held at any point, new keys included before a method evicts (a streamed
        # prefill meters it: a chunk lands in full before the method brings the cache under its cap)
        self.peak_bytes = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if key_states.shape[2] == 1:  # a decode step: the seam reads compressed layers via ``read_decode``
            return layer.append_decode(key_states, value_states, self.pending_positions)
        out = layer.append(key_states, value_states, self.pending_positions)
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        return out

    def nbytes(self) -> int:
        """Bytes of every tensor the layers hold for attention (codes, scales, factors included)."""
        return sum(layer.nbytes() for layer in self.layers)

    def tokens_per_layer(self) -> list[int]:
        return [layer.get_seq_length() for layer in self.layers]

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer, the (H_kv, S) token indices held."""
        return [layer.kept_positions() for layer in self.layers]
