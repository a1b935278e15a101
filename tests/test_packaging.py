"""What `pip install .` ships (pyproject.toml): the library without the app's stack, the methods and
the offline model under kv_arena's own name, and requirements.txt the same ranges as the library
plus its `app` extra. .ci/run's "library" stage installs it in a bare environment and uses it."""

from __future__ import annotations

import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PROJECT["tool"]["setuptools"]
APP_STACK = {"gradio", "accelerate", "bitsandbytes", "decord", "plotly", "redis", "spaces"}


def _requirements(lines) -> set[str]:
    out = set()
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            out.add(str(Requirement(line)))
    return out


def test_the_library_installs_without_the_apps_stack():
    library = {Requirement(r).name for r in PROJECT["project"]["dependencies"]}
    assert {"torch", "transformers", "numpy", "pillow"} <= library
    assert not library & APP_STACK, library & APP_STACK
    assert APP_STACK <= {Requirement(r).name for r in PROJECT["project"]["optional-dependencies"]["app"]}


def test_requirements_txt_is_the_library_and_its_app_extra():
    # Spaces and the Dockerfile install requirements.txt before the repository is there, so it lists
    # the ranges itself; .ci/run's floor stage pins each of its lower bounds
    declared = _requirements(PROJECT["project"]["dependencies"] + PROJECT["project"]["optional-dependencies"]["app"])
    assert _requirements((ROOT / "requirements.txt").read_text().splitlines()) == declared


def test_every_package_of_kv_arena_is_shipped_and_nothing_top_level_but_kv_arena():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kv_arena").rglob("__init__.py")}
    assert found <= set(SETUPTOOLS["packages"]), found - set(SETUPTOOLS["packages"])
    assert {name.split(".")[0] for name in SETUPTOOLS["packages"]} == {"kv_arena"}
    assert SETUPTOOLS["package-dir"]["kv_arena.backends"] == "backends"
    assert SETUPTOOLS["package-dir"]["kv_arena.assets"] == "assets"


def test_the_offline_model_and_its_examples_are_package_data():
    """The bundle and its generation's examples are drawn and shipped; every other generation's
    would be shipped once drawn (a new generation's weights are all a switch copies)."""
    from kv_arena.tiny import generations

    patterns = SETUPTOOLS["package-data"]["kv_arena.assets"]
    needed = {"tiny-arena-vl/config.json", "tiny-arena-vl/model.safetensors"}
    needed |= {f for _, files in generations.of().scenes.examples().values() for f in files}
    for name in needed:
        assert (ROOT / "assets" / name).is_file(), name
    for generation in generations.GENERATIONS.values():
        needed |= {f for _, files in generation.scenes.examples().values() for f in files}
    for name in needed:
        assert any(fnmatch(name, pattern) for pattern in patterns), f"{name} is not shipped"
    assert not any(fnmatch("screenshot.png", pattern) for pattern in patterns)  # the README's, not the library's


def test_in_a_checkout_kv_arena_backends_is_backends_the_same_modules():
    import backends
    import backends.snapkv

    import kv_arena.backends
    from kv_arena.backends.base import KVBackend

    assert kv_arena.backends is backends
    assert sys.modules["kv_arena.backends.snapkv"] is backends.snapkv
    assert KVBackend is backends.base.KVBackend
    assert backends.backend_class("snapkv") is backends.snapkv.SnapKV
