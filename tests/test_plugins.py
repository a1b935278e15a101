"""Methods from other packages (docs/plugins.md): the example package of docs/plugins.md, installed
with ``pip install --target`` and put on PYTHONPATH, is a method in the library, the bench and the
app (through /chat); a package whose module fails to import leaves the rest serving and is named in
the log; the registry's refusals are one line each; the interface a plugin subclasses is still the
one the docs list; and every method here passes ``kv_arena.testing``, the checks a plugin's tests call."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tests.app_support import control_kwargs, free_port

import backends
from backends.base import AttentionCall, KVBackend, KVLayer, Report
from backends.layout import PromptLayout
from kv_arena import testing

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "plugins.md").read_text()
BROKEN = "kv-broken-method"
BROKEN_FILES = {
    "pyproject.toml": ('[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
                       f'[project]\nname = "{BROKEN}"\nversion = "0.1.0"\n\n'
                       '[tool.setuptools]\npy-modules = ["kv_broken_method"]\n\n'
                       '[project.entry-points."kv_arena.methods"]\nbroken = "kv_broken_method:Broken"\n'),
    "kv_broken_method.py": 'raise ImportError("kv_broken_method needs libnothing, which is not installed")\n',
}


def example_files() -> dict[str, str]:
    """docs/plugins.md's example package: each code block that opens with ``# <file name>``."""
    blocks = re.findall(r"```(?:toml|python)\n# ([\w.]+)\n(.*?)```", DOC, re.S)
    return {name: body for name, body in blocks if name in ("pyproject.toml", "kv_recent_window.py")}


def write_package(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def run(args: list[str], plugins: Path, **kw) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(plugins), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    """A folder the example package and the broken one are pip-installed into (offline)."""
    pytest.importorskip("setuptools")  # pip builds both with the environment's own (no build isolation)
    root = tmp_path_factory.mktemp("plugins")
    example = write_package(root / "kv-recent-window", example_files())
    broken = write_package(root / BROKEN, BROKEN_FILES)
    target = root / "site"
    done = run(["-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-build-isolation",
                "--target", str(target), str(example), str(broken)], target, timeout=300)
    assert done.returncode == 0, done.stderr
    return target


def test_the_docs_example_is_complete():
    files = example_files()
    assert set(files) == {"pyproject.toml", "kv_recent_window.py"}
    assert 'recent_window = "kv_recent_window:RecentWindow"' in files["pyproject.toml"]
    assert len(files["pyproject.toml"].splitlines()) + len(files["kv_recent_window.py"].splitlines()) <= 45


def test_the_library_lists_the_plugin_and_names_the_broken_package(plugins):
    code = ("import json, kv_arena; from kv_arena import backends, service; "
            "print(json.dumps([kv_arena.methods(), backends.package_of('recent_window'), "
            "service.shown_title(service.method_spec('recent_window')), "
            "dict(service.blind.battle_methods()), service.title_of('recent_window')]))")
    done = run(["-c", code], plugins, timeout=120)
    assert done.returncode == 0, done.stderr
    names, package, title, drawn, everywhere = json.loads(done.stdout)
    assert names == sorted(backends.available() + ["recent_window"], key=lambda n: (n != "full", n))
    assert package == "kv-recent-window" and title == "Recent window (from kv-recent-window)"
    # it takes a budget: the blind test may draw it, and names its package (as Compare's column and the reveal)
    assert drawn["recent_window"] == everywhere == title
    said = [line for line in done.stderr.splitlines() if "method plugin" in line]
    assert len(said) == 1 and BROKEN in said[0] and "ImportError" in said[0] and "libnothing" in said[0], said


def test_the_bench_runs_the_plugin_at_half_the_full_caches_bytes(plugins):
    done = run(["-m", "kv_arena.bench", "--model", "tiny-arena-vl", "--methods", "full,recent_window",
                "--budget", "0.5", "--max-new-tokens", "8", "--repeats", "1", "--json"], plugins, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {row["method"]: row for row in json.loads(done.stdout)}
    row = rows["recent_window"]
    assert row["budget"] == 0.5 and row["new_tokens"] > 0
    assert 0.40 <= row["realised_fraction"] <= 0.60 and 0.40 <= row["kv_ratio"] <= 0.60, row
    assert row["kv_bytes_full_prefill"] == rows["full"]["kv_bytes_prefill"]


def test_the_app_answers_with_the_plugin_through_chat_and_logs_the_broken_package(plugins, tmp_path):
    from gradio_client import Client

    port = free_port()
    env = os.environ | {"PYTHONPATH": str(plugins), "OMP_NUM_THREADS": "1", "GRADIO_SERVER_NAME": "127.0.0.1",
                        "GRADIO_SERVER_PORT": str(port), "KV_ARENA_PRELOAD": "0", "KV_ARENA_MODEL": "tiny-qwen2-vl"}
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            url = f"http://127.0.0.1:{port}/"
            deadline = time.time() + 120
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=2) as page:
                        shown = page.read().decode()  # the page's config: the pickers' choices, About
                        break
                except OSError:
                    assert time.time() < deadline and proc.poll() is None, log.read_text()
                    time.sleep(1)
            client = Client(url, verbose=False)
            job = client.submit(message={"text": "What is shown?", "files": []}, history=[],
                                **control_kwargs(model="tiny-qwen2-vl", method="recent_window", max_new_tokens=4),
                                api_name="/chat")
            history, _, status, *_ = job.result(timeout=120)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert history[-1]["role"] == "assistant" and history[-1]["content"], history
    assert "Recent window" in status, status
    assert "Recent window (from kv-recent-window)" in shown
    said = [line for line in log.read_text().splitlines() if "method plugin" in line]
    assert len(said) == 1 and BROKEN in said[0] and "ImportError" in said[0], said


# --- the registry's refusals, one line each ----------------------------------------------------
REFUSED = {  # entry name -> (its value, its module's source, what the log line says)
    "snapkv": ("refused_taken:Taken", "from kv_arena.backends.snapkv import SnapKV as Taken\n", "already a method's"),
    "not_a_method": ("refused_plain:Plain", "class Plain:\n    name = 'not_a_method'\n", "no subclass"),
    "misnamed": ("refused_misnamed:Misnamed", "from kv_arena.backends.base import KVBackend\n"
                 "class Misnamed(KVBackend):\n    name = 'other'\n", "not the entry's"),
    "crashes": ("refused_crash:X", "raise RuntimeError('boom\\nsecond line')\n", "RuntimeError: boom second line"),
}


def test_a_refused_or_broken_plugin_is_one_line_naming_its_package(tmp_path, monkeypatch, caplog):
    for name, (value, source, _) in REFUSED.items():
        (tmp_path / f"{value.split(':')[0]}.py").write_text(source)
        info = tmp_path / f"kv_plugin_{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kv-plugin-{name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[kv_arena.methods]\n{name} = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kv_arena.methods"):
        found = backends.find_plugins(taken=set(backends.available()))
    assert found == {}
    lines = [r.getMessage() for r in caplog.records if r.name == "kv_arena.methods"]
    assert len(lines) == len(REFUSED), lines
    for name, (_, _, says) in REFUSED.items():
        line = next(line for line in lines if f"'{name}'" in line)
        assert f"kv-plugin-{name}" in line and says in line and "\n" not in line, line


# --- the interface a plugin subclasses stays as docs/plugins.md lists it ----------------------
SEAMS = {  # version 1 (docs/plugin-api-changelog.md): a seam's parameters as plugins call or override them
    "new_layer": "(self, layer_idx: 'int') -> 'KVLayer'",
    "attend": "(self, call: 'AttentionCall', query, key, value, scaling: 'float') -> 'torch.Tensor | None'",
    "after_attention": "(self, call: 'AttentionCall', layer: 'KVLayer', query, key, scaling: 'float', attn_row=None) -> 'None'",
    "prefill_rows": "(self, call: 'AttentionCall') -> 'torch.Tensor | None'",
    "select_visual": "(self, tokens: 'VisionTokens') -> 'torch.Tensor'",
    "before_forward": "(self, cache, call: 'AttentionCall') -> 'None'",
    "after_forward": "(self, cache, call: 'AttentionCall') -> 'None'",
    "media_scale": "(self) -> 'float'",
    "budget_tokens": "(self, total: 'int', minimum: 'int' = 1) -> 'int'",
}
MEMBERS = {
    KVBackend: ["name", "title", "paper", "summary", "does", "holds_budget_while_decoding", "uses_budget",
                "streams_under_cap", "cap_replaces_budget", "shortens_prefill", "overlay_meaning", "resizes_media",
                "lossless_params", "report_type", "budget", "report", "config", "param_specs", "check_params",
                "reset_report", "needs_decode_attention", "needs_prefill_column_sums", "narrows_prefill",
                "selects_visual_tokens", *SEAMS],
    KVLayer: ["keys", "values", "positions", "append", "append_decode", "keep", "replace", "read_decode",
              "tensors", "nbytes", "get_seq_length", "kept_positions"],
    AttentionCall: ["layer_idx", "num_layers", "phase", "positions", "rope_ids", "layout", "seen", "step", "rotary",
                    "column_sums", "cap_bytes", "hidden", "is_prefill", "cap_entries"],
    Report: ["kept", "layer_budgets", "overlay", "reused", "realised_fraction", "note", "ensure_layers", "to_dict"],
    PromptLayout: ["start", "end", "system", "visuals", "text", "images", "videos", "visual_mask"],
}


def test_the_plugin_interface_is_the_one_the_docs_list():
    for cls, members in MEMBERS.items():
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        found = KVLayer() if cls is KVLayer else cls  # a layer's tensors are set on construction
        for member in members:
            assert hasattr(found, member) or member in fields, \
                f"{cls.__name__}.{member} is gone: a plugin may use it (docs/plugin-api-changelog.md)"
            assert f"`{member}" in DOC, f"docs/plugins.md does not name {cls.__name__}.{member}"
    for seam, signature in SEAMS.items():
        assert str(inspect.signature(getattr(KVBackend, seam))) == signature, seam


def test_a_plugin_written_against_todays_interface_passes_kv_arena_testing(tmp_path):
    """The docs' example, loaded as a module of its own (registered nowhere), passes every check."""
    path = tmp_path / "kv_recent_window.py"
    path.write_text(example_files()["kv_recent_window.py"])
    spec = importlib.util.spec_from_file_location("kv_recent_window_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    testing.check_method(module.RecentWindow)
    with pytest.raises(AssertionError, match="recent_window at budget 0.1: holds"):
        testing.check_budget_held(module.RecentWindow, budget=0.1, minimum=64)  # 64 tokens: over a tenth


def test_kv_arena_testing_needs_neither_pytest_nor_the_apps_stack():
    code = "import sys, kv_arena.testing; print(sorted({'pytest', 'gradio'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("method", backends.available())
def test_every_method_here_passes_kv_arena_testing(method):
    """What a plugin's tests call, on every method of the project (lossless at budget 1.0 on every
    tiny model is test_runtime's matrix, which calls ``testing.check_lossless``)."""
    ran = [model for model in testing.MODELS if testing.runs_on(method, model)]
    assert ran
    for model in ran:
        for check in (testing.check_budget_held, testing.check_realised_bytes, testing.check_second_turn):
            check(method, model)
