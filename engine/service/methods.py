"""The KV-cache methods as the UI describes them: plain dictionaries from the registry, so the
panels, the Compare tab and the About page never import a backend (or torch) themselves."""

from __future__ import annotations

import backends
from backends.descriptions import describe
from backends.media_reuse import ReusesMedia


def reuses_media(name: str) -> bool:
    """Whether the method reuses media KV stored beforehand (MPIC): its turns store the message's
    media first, its conversation gets a linker, its chat has a media library and a TTFT panel.
    False for a name that is no method."""
    try:
        return issubclass(backends.backend_class(name), ReusesMedia)
    except ValueError:
        return False


def method_specs() -> list[dict]:
    """Every registered method as :func:`method_spec` describes it, the full cache first."""
    return [method_spec(name) for name in backends.available()]


def method_spec(name: str) -> dict:
    """One method's description (:func:`~backends.descriptions.describe`: title, paper, summary,
    parameters...) and ``reuses_media`` (:func:`reuses_media`); ValueError if unknown."""
    return describe(backends.backend_class(name)) | {"reuses_media": reuses_media(name)}
