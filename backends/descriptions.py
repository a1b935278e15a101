"""A method described in plain values, for the UI's cards and controls and ``kv_arena.bench --list``:
its name, title, paper, summary, what it holds, and each parameter's spec (budget first).

Only what shows a method reads this; a method itself never does.
"""

from __future__ import annotations

from typing import Any

from .base import KVBackend
from .params import BUDGET


def describe(method: type[KVBackend]) -> dict[str, Any]:
    """``method``'s class attributes and parameter specs (:meth:`~backends.params.Param.to_dict`), JSON-ready."""
    return {
        "name": method.name,
        "title": method.title,
        "paper": method.paper,
        "summary": method.summary,
        "does": method.does,
        "is_reference": method.is_reference,
        "holds_budget_while_decoding": method.holds_budget_while_decoding,
        "uses_budget": method.uses_budget,
        "streams_under_cap": method.streams_under_cap,
        "cap_replaces_budget": method.cap_replaces_budget,
        # it picks an image's tokens before the language model reads them (VisionZip): models whose
        # vision tower lacks what it reads refuse it
        "chooses_image_tokens": method.select_visual is not KVBackend.select_visual,
        "params": [BUDGET.to_dict()] + [p.to_dict() for p in method.param_specs()],
    }
