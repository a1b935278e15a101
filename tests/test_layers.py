"""app.py is a module, not a package, so ``lint-imports`` (pyproject.toml) cannot take it as a root:
here it is held to the top of the layers, reaching the engine only through its facade."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app.py"
ALLOWED = ("components", "kv_arena.service", "kv_arena.errors")


def test_app_imports_only_the_ui_and_the_engines_facade():
    imported = []
    for node in ast.walk(ast.parse(APP.read_text())):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported += [f"{node.module}.{alias.name}" for alias in node.names]
    ours = [name for name in imported if name.split(".")[0] in ("components", "kv_arena", "backends")]
    outside = [name for name in ours if not any(name == a or name.startswith(a + ".") for a in ALLOWED)]
    assert ours and not outside, outside
