"""The one seam between MPIC and where its media KV lives: what the linker, the upload step, the
benchmarks and the app ask of a store. :class:`~.kv_store.KVStore` (memory and local disk, one
process) and :class:`~.server_store.ServerStore` (a Valkey/Redis server shared by replicas, that
local store in front) both are one; ``kv_arena.service.store.media_store`` picks which."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .kv_store import Entry


@runtime_checkable
class MediaStore(Protocol):
    def put(self, session: str, model: str, key: str, tensors: dict[str, torch.Tensor], meta: dict,
            to_disk: bool = True) -> Entry: ...

    def get(self, session: str, model: str, key: str) -> Entry | None: ...

    def flush(self) -> None: ...

    def put_prefix(self, session: str, model: str, identity: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None: ...

    def match_prefix(self, session: str, model: str, identity: torch.Tensor) -> tuple[int, Entry | None]: ...

    def library(self, session: str) -> list[dict]: ...

    def drop_session(self, session: str) -> None: ...

    def sweep_namespaces(self) -> None: ...

    def health_note(self) -> str:
        """One line for the user while the store serves less than it should ("" when all is well)."""
        ...
