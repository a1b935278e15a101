"""Numbers an operator sets in the environment (``KV_ARENA_*``): one reading rule for all of them."""

from __future__ import annotations

import os


def env_number(name: str, default: float) -> float:
    """``name``'s value as a number, at least 0; ``default`` when unset or not a number (a typo in a
    Space's settings must not stop the app)."""
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default
