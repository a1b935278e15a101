"""The KV-cache methods as the UI describes them: plain dictionaries from the registry, so the
panels, the Compare tab and the About page never import a backend (or torch) themselves."""

from __future__ import annotations

import backends


def method_specs() -> list[dict]:
    """Every registered method as ``describe_class()`` describes it, the full cache first."""
    return [backends.backend_class(name).describe_class() for name in backends.available()]


def method_spec(name: str) -> dict:
    """One method's description (title, paper, summary, parameters); ValueError if unknown."""
    return backends.backend_class(name).describe_class()
