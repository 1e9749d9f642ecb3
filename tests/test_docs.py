"""The README's and docs' measured tables are what benchmarks/results/*.json holds; their code
blocks' markers, command lines and installs are well formed (tests/test_doc_examples.py runs them)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from fxshard import cli

from doc_examples import PAGES, all_blocks, blocks, commands, fxshard_argv

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tables  # noqa: E402


def test_every_results_table_agrees_with_the_results() -> None:
    assert tables.stale() == [], "run: python benchmarks/tables.py"


def test_a_hand_edit_is_caught(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(tables.render("<!-- results:scaling -->\n<!-- /results:scaling -->\n"))
    assert tables.stale((doc,)) == []
    doc.write_text(doc.read_text().replace(" s |", " s (edited) |", 1))
    assert tables.stale((doc,)) == [f"{doc}: scaling"]


# -- the code blocks (tests/doc_examples.py says how they run and how one is marked not-run) -----


def test_every_not_run_marker_gives_its_reason() -> None:
    markers = [b for page in PAGES for b in blocks(page) if b.not_run is not None]
    assert markers, "no page marks a block not-run: has the marker's syntax changed?"
    assert [b.where for b in markers if not b.not_run] == [], "<!-- not-run: REASON -->, with a reason"


def test_every_fxshard_command_line_parses_and_names_files_that_exist() -> None:
    checked = 0
    for block in all_blocks("bash"):
        for command in commands(block):
            argv = fxshard_argv(command)
            if argv is None:
                continue
            try:
                args = cli.build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{block.where}: fxshard's parser refuses {' '.join(command)!r}")
            checked += 1
            if args.command == "explain" and ".py:" in args.factory:
                file, factory = args.factory.rsplit(":", 1)
                tree = ast.parse((ROOT / file).read_text())
                defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
                assert factory in defined, f"{block.where}: {file} defines no {factory}"
    assert checked >= 5


def test_every_script_a_command_runs_exists() -> None:
    """``python examples/mnist.py``, ``torchrun ... examples/mnist.py``: a path the docs give
    exists (a bare ``train.py`` is the reader's own script)."""
    for block in all_blocks("bash"):
        for command in commands(block):
            for word in command:
                if word.endswith(".py") and "/" in word:
                    assert (ROOT / word).is_file(), f"{block.where}: no {word}"


def test_every_pip_install_of_fxshard_is_from_the_clone_with_extras_that_exist() -> None:
    """fxshard is not published: ``pip install -e ".[extra]"`` from the clone, never
    ``pip install fxshard[...]``; every extra named is one of pyproject.toml's."""
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"pip install [^`\n]*\bfxshard\[", text), f"{page.name}: pip install fxshard[...]"
        for named in re.findall(r"-e \"?'?\.\[([\w,]+)\]", text):
            assert set(named.split(",")) <= extras, f"{page.name}: no extra {named} in pyproject.toml"
