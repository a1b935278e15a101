"""The KV-cache methods as the UI describes them: plain dictionaries from the registry, so the
panels, the Compare tab and the About page never import a backend (or torch) themselves."""

from __future__ import annotations

from kv_arena import backends
from kv_arena.backends.descriptions import describe
from kv_arena.backends.media_reuse import ReusesMedia
from kv_arena.backends.params import BUDGET

from ..errors import UserError


def reuses_media(name: str) -> bool:
    """Whether the method reuses media KV stored beforehand (MPIC): its turns store the message's
    media first, its conversation gets a linker, its chat has a media library and a TTFT panel.
    False for a name that is no method."""
    try:
        return issubclass(backends.backend_class(name), ReusesMedia)
    except ValueError:
        return False


def is_reference(name: str) -> bool:
    """Whether ``name`` is the method every figure is measured against (the full cache)."""
    return backends.is_reference(name)


def budget_spec() -> dict:
    """The budget every method with one takes, as its schema says (range, step, help): the slider
    reads it from here, never a copy."""
    return BUDGET.to_dict()


def reference_spec() -> dict:
    """The reference method's description (:func:`method_spec`)."""
    return method_spec(backends.reference_name())


def method_specs() -> list[dict]:
    """Every registered method as :func:`method_spec` describes it, the full cache first."""
    return [method_spec(name) for name in backends.available()]


def method_spec(name: str) -> dict:
    """One method's description (:func:`~backends.descriptions.describe`: title, paper, summary,
    parameters...) and ``reuses_media`` (:func:`reuses_media`); ValueError if unknown."""
    return describe(backends.backend_class(name)) | {"reuses_media": reuses_media(name)}


def checked_params(params: dict[str, dict]) -> dict[str, dict]:
    """Every method's parameter values of the type and range its paper's schema says (a NaN, an
    infinity, a list... is a UserError), whichever method is picked: a comparison runs the others."""
    checked: dict[str, dict] = {}
    for method, values in params.items():
        try:
            specs = {p.name: p for p in backends.backend_class(method).param_specs()}
            checked[method] = {name: specs[name].coerce(value) if name in specs else value
                               for name, value in values.items()}
        except ValueError as exc:
            raise UserError(f"{method}: {exc}") from None
    return checked
