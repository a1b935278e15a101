"""The README and docs/ as a newcomer pastes them: every command a page's ``bash`` blocks name exists
and takes the flags it is given (``python -m kv_arena.bench`` through its mode's own parser, a script
through its ``parse_args``, or each flag found in its source), every ``python`` block compiles, and
every relative link leads to a file. Nothing is run here: the README's snippets run in
test_app_client.py and test_hf_entry_point.py, docs/mcp.md's client in test_app_mcp.py."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from kv_arena.bench.cli import MODES

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# pages the index links to that another change writes (the MPIC store's own page)
PENDING = {ROOT / "docs" / "mpic_store.md"}


def commands(text: str) -> list[list[str]]:
    """Each command of ``text``'s bash blocks as words: continuation lines joined, comments,
    ``[optional]`` parts and leading ``NAME=value`` settings dropped, ``&&`` chains split."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line)  # a comment, whole line or trailing
            line = re.sub(r"\[[^\]]*\]", "", line)  # an optional part, as usage lines write it
            for part in line.split("&&"):
                words = shlex.split(part)
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words.pop(0)
                if words:
                    found.append(words)
    return found


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"doc_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_python(args: list[str]) -> None:
    """``python ...``: a module or script that exists and parses these flags."""
    if args[:2] == ["-m", "kv_arena.bench"]:
        rest = args[2:]
        module = "kv_arena.bench.methods"
        if "--mode" in rest:
            i = rest.index("--mode")
            module, rest = MODES[rest[i + 1]], rest[:i] + rest[i + 2:]
        importlib.import_module(module).parse_args(rest)  # argparse exits on a flag it does not take
    elif args[:2] == ["-m", "pytest"]:
        for target in (a for a in args[2:] if not a.startswith("-")):
            assert (ROOT / target.split("::")[0]).exists(), target
    elif args[0] == "-m":  # a module of the repository (training.*, tools.*)
        module = importlib.import_module(args[1])
        check_flags(module, Path(module.__file__).read_text(), args[1], args[2:])
    else:
        script = ROOT / args[0]
        assert script.is_file(), f"no {args[0]}"
        source = script.read_text()
        check_flags(load_script(script) if "def parse_args(" in source else None, source, args[0], args[1:])


def check_flags(module, source: str, name: str, flags: list[str]) -> None:
    """``flags`` parse (the module's ``parse_args``), or at least each is named in its source."""
    if module is not None and hasattr(module, "parse_args"):
        module.parse_args(flags)
        return
    for flag in (a.split("=")[0] for a in flags if a.startswith("--")):
        assert f'"{flag}"' in source, f"{name} takes no {flag}"


def check(words: list[str]) -> None:
    program, args = words[0], words[1:]
    if program == "python":
        check_python(args)
    elif program == "bash":
        assert (ROOT / args[0]).is_file(), args[0]
    elif program == "pip":
        for i, arg in enumerate(args):
            if arg in ("-r", "-c"):
                assert (ROOT / args[i + 1]).is_file(), args[i + 1]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_exists_and_takes_its_flags(page):
    for words in commands(page.read_text()):
        try:
            check(words)
        except SystemExit as exc:  # argparse refused the flags
            pytest.fail(f"{page.name}: {' '.join(words)} does not parse (exit {exc.code})")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_compile_and_links_lead_to_files(page):
    text = page.read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        ast.parse(block)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"^[a-z]+:", target):
            path = (page.parent / target).resolve()
            assert path.exists() or path in PENDING, f"{page.name} links to {target}"


def test_the_readme_stays_a_door_and_no_page_speaks_of_the_machine_s_other_work():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    for page in PAGES:
        text = page.read_text().lower()
        for phrase in ("training job", "other jobs", "load average", "this task"):
            assert phrase not in text, f"{page.name}: '{phrase}'"


def test_commands_are_found_as_pasted():
    text = "```bash\nOMP_NUM_THREADS=1 python -m kv_arena.bench --mode decode \\\n    --steps 4 [--json]   # note\n```\n"
    assert commands(text) == [["python", "-m", "kv_arena.bench", "--mode", "decode", "--steps", "4"]]
