"""KV-cache methods, one file each, found by name.

Every module in this package that defines a :class:`KVBackend` subclass with its own ``name``
is registered on import; adding a method is adding a file. A subclass defined anywhere else (a
test's reference backend, say) is never registered, whatever was imported first. A method module
that fails to import fails discovery loudly, naming the module and its error: a method silently
missing from the picker would be worse than an app that does not start.

Methods from other packages (plugins) are found through the entry-point group
:data:`ENTRY_POINT_GROUP` (``recent_window = "its_module:RecentWindow"``, docs/plugins.md) when the
registry is first read, after the project's own. Someone else's broken package must not stop the app:
a plugin that fails to import, is no :class:`KVBackend` subclass, or takes a name already registered
is left out with one line in the log naming its package. :func:`package_of` says where one came from.

A name ``selector+store`` (``snapkv+fp8``) is a stack (:mod:`backends.stack`): :func:`backend_class`
resolves it wherever a method's name is taken; it is never listed by :func:`available`.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable
from importlib.metadata import entry_points

from .base import KVBackend
from .params import BUDGET
from .stack import is_stack, stacked

ENTRY_POINT_GROUP = "kv_arena.methods"

_REGISTRY: dict[str, type[KVBackend]] = {}
_PACKAGES: dict[str, str] = {}  # a plugin's method name -> the distribution it came from
# under kv_arena's name (the app logs kv_arena's lines), though the methods never import kv_arena
log = logging.getLogger("kv_arena.methods")


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
        for name, (cls, package) in find_plugins(taken=set(_REGISTRY)).items():
            _REGISTRY[name], _PACKAGES[name] = cls, package
    return _REGISTRY


def find_plugins(taken: set[str]) -> dict[str, tuple[type[KVBackend], str]]:
    """The methods other packages declare in :data:`ENTRY_POINT_GROUP`, each with its package
    (distribution name), less the ones refused with one log line each: a name in ``taken`` or
    declared twice, a module that fails to import, a class that is no :class:`KVBackend` subclass,
    whose ``name`` is not the entry's, or that claims to be the reference."""
    found: dict[str, tuple[type[KVBackend], str]] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        package = entry.dist.name if entry.dist is not None else entry.value.split(":")[0]
        plugin = f"method plugin '{entry.name}' from package {package} ({entry.value})"
        if entry.name in taken or entry.name in found:
            log.warning("%s refused: the name '%s' is already a method's", plugin, entry.name)
            continue
        try:
            cls = entry.load()
        except Exception as exc:  # someone else's package: skipped, said once
            log.warning("%s skipped: it failed to import: %s", plugin, _one_line(exc))
            continue
        if not (isinstance(cls, type) and issubclass(cls, KVBackend)):
            log.warning("%s refused: %r is no subclass of kv_arena.backends.base.KVBackend", plugin, cls)
        elif cls.__dict__.get("name") != entry.name:
            log.warning("%s refused: its class's name is '%s', not the entry's", plugin, cls.name)
        elif cls.is_reference:
            log.warning("%s refused: the project's full cache is the one reference (is_reference)", plugin)
        else:
            found[entry.name] = (cls, package)
    return found


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


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
    if name in registry:
        return registry[name]
    if is_stack(name):  # "snapkv+fp8": a selector on a quantised store (backends.stack)
        return stacked(name, registry)
    raise ValueError(f"unknown method '{name}'; choose from: {', '.join(available())}")


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


def package_of(name: str) -> str | None:
    """The package (distribution name) a plugin method came from; None for the project's own methods
    and for a name that is no method."""
    _discover()
    return _PACKAGES.get(name)


def make_backend(name: str, budget: float = 1.0, **params) -> KVBackend:
    """Build a method by name; raises ValueError with a readable message on bad input. A method
    without a budget (``uses_budget`` False: the full cache, MPIC...) gets 1.0 whatever is asked:
    its own parameters decide what it holds."""
    return build(backend_class(name), budget, **params)


def build(cls: type[KVBackend], budget: float = 1.0, **params) -> KVBackend:
    """:func:`make_backend` for a class (a method not registered: a plugin's, under test)."""
    cls.check_params(params)  # before the dataclass __init__, which would raise a bare TypeError
    budget = BUDGET.coerce(budget)  # a budget off its range is refused, whether the method uses one or not
    return cls(budget=budget if cls.uses_budget else 1.0, **params)


def make_reference() -> KVBackend:
    """The reference method (the full cache), built."""
    return make_backend(reference_name())


__all__ = ["ENTRY_POINT_GROUP", "available", "backend_class", "build", "find_plugins", "is_reference", "make_backend",
           "make_reference", "names_where", "package_of", "reference_name"]
