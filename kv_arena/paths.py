"""Where the shipped files are: the offline model's bundle (tiny-arena-vl) and the example media.

An installed kv_arena carries them as package data in ``kv_arena/assets`` (pyproject.toml maps the
repository's ``assets/`` there); a checkout reads the repository's ``assets/`` next to ``kv_arena/``.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent

IN_CHECKOUT = not (_PACKAGE / "assets").is_dir()  # False for `pip install .` (not in place)
ASSETS = _PACKAGE.parent / "assets" if IN_CHECKOUT else _PACKAGE / "assets"
