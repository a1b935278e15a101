"""KV-cache methods, one file each, found by name.

Every module in this package that defines a :class:`KVBackend` subclass with its own ``name``
is registered on import; adding a method is adding a file. A subclass defined anywhere else (a
test's reference backend, say) is never registered, whatever was imported first.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import KVBackend

_REGISTRY: dict[str, type[KVBackend]] = {}
BROKEN: dict[str, str] = {}  # module -> error; a test asserts it stays empty


def _discover() -> dict[str, type[KVBackend]]:
    if not _REGISTRY:
        for info in pkgutil.iter_modules(__path__):
            try:  # one broken method must not take the others (and the app) down
                importlib.import_module(f"{__name__}.{info.name}")
            except Exception as exc:  # noqa: BLE001
                BROKEN[info.name] = f"{exc.__class__.__name__}: {exc}"

        for cls in _all_subclasses(KVBackend):
            if "name" in cls.__dict__ and cls.__module__.startswith(f"{__name__}."):
                _REGISTRY.setdefault(cls.name, cls)
    return _REGISTRY


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def available() -> list[str]:
    """Registered method names, the full cache first."""
    names = sorted(_discover())
    return ["full"] + [n for n in names if n != "full"]


def backend_class(name: str) -> type[KVBackend]:
    registry = _discover()
    if name not in registry:
        raise ValueError(f"unknown method '{name}'; choose from: {', '.join(available())}")
    return registry[name]


def make_backend(name: str, budget: float = 1.0, **params) -> KVBackend:
    """Build a method by name; raises ValueError with a readable message on bad input."""
    cls = backend_class(name)
    cls.check_params(params)  # before the dataclass __init__, which would raise a bare TypeError
    return cls(budget=budget, **params)


__all__ = ["BROKEN", "available", "backend_class", "make_backend"]
