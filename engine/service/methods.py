"""The KV-cache methods as the UI describes them: plain dictionaries from the registry, so the
panels, the Compare tab and the About page never import a backend (or torch) themselves."""

from __future__ import annotations

import backends
from backends.descriptions import describe


def method_specs() -> list[dict]:
    """Every registered method as :func:`~backends.descriptions.describe` describes it, the full cache first."""
    return [describe(backends.backend_class(name)) for name in backends.available()]


def method_spec(name: str) -> dict:
    """One method's description (title, paper, summary, parameters); ValueError if unknown."""
    return describe(backends.backend_class(name))
