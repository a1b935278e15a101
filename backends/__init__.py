"""KV-cache methods, one file each, found by name.

Every module in this package that defines a :class:`KVBackend` subclass with its own ``name``
is registered on import; adding a method is adding a file. A subclass defined anywhere else (a
test's reference backend, say) is never registered, whatever was imported first. A method module
that fails to import fails discovery loudly, naming the module and its error: a method silently
missing from the picker would be worse than an app that does not start.

A name ``selector+store`` (``snapkv+fp8``) is a stack (:mod:`backends.stack`): :func:`backend_class`
resolves it wherever a method's name is taken; it is never listed by :func:`available`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from .base import KVBackend
from .params import BUDGET
from .stack import is_stack, stacked

_REGISTRY: dict[str, type[KVBackend]] = {}


def _discover() -> dict[str, type[KVBackend]]:
    if not _REGISTRY:
        for info in pkgutil.iter_modules(__path__):
            try:
                importlib.import_module(f"{__name__}.{info.name}")
            except Exception as exc:
                raise ImportError(f"the method module backends.{info.name} failed to import: "
                                  f"{exc.__class__.__name__}: {exc}") from exc

        for cls in _all_subclasses(KVBackend):
            if "name" in cls.__dict__ and cls.__module__.startswith(f"{__name__}."):
                _REGISTRY.setdefault(cls.name, cls)
    return _REGISTRY


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def available() -> list[str]:
    """Registered method names, the reference (``is_reference``: the full cache) first."""
    registry = _discover()
    return sorted(registry, key=lambda n: (not registry[n].is_reference, n))


def backend_class(name: str) -> type[KVBackend]:
    registry = _discover()
    if name not in registry and is_stack(name):  # "snapkv+fp8": a selector on a quantised store (backends.stack)
        return stacked(name, registry)
    if name not in registry:
        raise ValueError(f"unknown method '{name}'; choose from: {', '.join(available())}")
    return registry[name]


def reference_name() -> str:
    """The method every figure is measured against: the one class flagged ``is_reference``."""
    names = [n for n in available() if _discover()[n].is_reference]
    if len(names) != 1:
        raise ImportError(f"exactly one method must be the reference (is_reference); found {names or 'none'}")
    return names[0]


def is_reference(name: str) -> bool:
    """Whether ``name`` is the reference method (False for a name that is no method)."""
    cls = _discover().get(name)
    return bool(cls and cls.is_reference)


def names_where(wanted: Callable[[type[KVBackend]], bool]) -> list[str]:
    """The registered methods whose class has a capability, in :func:`available`'s order: the
    engine finds a method by what it can do, never by its name."""
    return [n for n in available() if wanted(_discover()[n])]


def make_backend(name: str, budget: float = 1.0, **params) -> KVBackend:
    """Build a method by name; raises ValueError with a readable message on bad input. A method
    without a budget (``uses_budget`` False: the full cache, MPIC...) gets 1.0 whatever is asked:
    its own parameters decide what it holds."""
    cls = backend_class(name)
    cls.check_params(params)  # before the dataclass __init__, which would raise a bare TypeError
    budget = BUDGET.coerce(budget)  # a budget off its range is refused, whether the method uses one or not
    return cls(budget=budget if cls.uses_budget else 1.0, **params)


def make_reference() -> KVBackend:
    """The reference method (the full cache), built."""
    return make_backend(reference_name())


__all__ = ["available", "backend_class", "is_reference", "make_backend", "make_reference", "names_where",
           "reference_name"]
