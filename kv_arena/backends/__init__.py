"""In a checkout only: ``kv_arena.backends`` is the repository's top-level ``backends/``, the same
module objects under both names.

An installed kv_arena (``pip install .``) ships ``backends/`` itself as this package (pyproject.toml's
``package-dir``; this file is not in the wheel), so nothing named ``backends`` lands in site-packages.
In the repository the methods stay in ``backends/`` and the tests import them as ``backends``: were
``kv_arena.backends.base`` loaded a second time under this name, its classes would be other classes
(``isinstance`` false, a method registered twice). So this package *is* ``backends``: it loads that
one from the folder next to ``kv_arena/`` and registers it, and every module of it, under this name.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

_FOLDER = Path(__file__).resolve().parents[2] / "backends"


def _checkout_backends():
    """The repository's ``backends`` package: the one already imported, else loaded from its folder
    (whatever else named ``backends`` is on sys.path)."""
    module = sys.modules.get("backends")
    if module is None:
        spec = importlib.util.spec_from_file_location("backends", _FOLDER / "__init__.py",
                                                      submodule_search_locations=[str(_FOLDER)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["backends"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["backends"]
            raise
    if [Path(p).resolve() for p in getattr(module, "__path__", ())] != [_FOLDER]:
        raise ImportError(f"'backends' is already imported from {getattr(module, '__file__', module)}, "
                          f"not from this checkout's {_FOLDER}")
    return module


_backends = _checkout_backends()
for _info in pkgutil.iter_modules(_backends.__path__):  # each module under both names, loaded once
    sys.modules[f"{__name__}.{_info.name}"] = importlib.import_module(f"backends.{_info.name}")
sys.modules[__name__] = _backends  # the import system hands this entry to whoever imports kv_arena.backends
