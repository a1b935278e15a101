"""The uncompressed cache: every key and value of every token. The reference for all figures."""

from dataclasses import dataclass

from .base import KVBackend


@dataclass(eq=False)
class FullCache(KVBackend):
    name = "full"
    title = "Full cache"
    does = "keeps"
    summary = "Keeps every key and value; the reference every other method is measured against."
    uses_budget = False
    is_reference = True
