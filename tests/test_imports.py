"""What ``import fxshard`` costs and provides: no torch for the package or ``fxshard --help``,
every public name on first use, and ``torch.compile(backend="fxshard")`` found by name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, env={**os.environ, **env})


def test_import_and_help_load_no_torch() -> None:
    """``fxshard --help`` answers without importing torch (1.6 s of a 4 s answer, before)."""
    result = _python("""
        import contextlib, io, re, sys
        import fxshard
        assert "torch" not in sys.modules, "import fxshard"
        from fxshard import cli
        def help(*argv):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    cli.main([*argv, "--help"])
                except SystemExit as e:
                    assert e.code == 0, (argv, e.code)
            assert "torch" not in sys.modules, argv
            return out.getvalue()
        commands = re.search(r"{([\\w,]+)}", help()).group(1).split(",")
        assert "explain" in commands and "consolidate" in commands, commands
        for command in commands:
            print(help(command).splitlines()[0])
        print("no torch")
    """)
    assert result.returncode == 0, result.stderr
    assert "usage: fxshard explain" in result.stdout and result.stdout.endswith("no torch\n")


def test_every_public_name_resolves_on_first_use() -> None:
    import fxshard.backend
    import fxshard.explain

    for name in fxshard.__all__:
        assert getattr(fxshard, name) is not None, name
    assert set(fxshard.__all__) <= set(dir(fxshard))
    # The submodules named like their functions: the package's attribute is the function.
    assert fxshard.backend is sys.modules["fxshard.backend"].backend
    assert fxshard.explain is sys.modules["fxshard.explain"].explain
    assert isinstance(fxshard.checkpoint, type(sys))
    from fxshard.ir import ops

    assert fxshard.ops is ops and fxshard.meta is sys.modules["fxshard.ir.meta"]
    with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
        fxshard.nonesuch  # noqa: B018


def test_a_clone_named_fxshard_imports_from_its_parent_folder(tmp_path: Path) -> None:
    """A script run beside a clone named ``fxshard`` finds the clone's root first; its
    __init__.py loads the package below it (an empty namespace package before, which has
    no ``compile``, installed or not)."""
    (tmp_path / "fxshard").symlink_to(ROOT, target_is_directory=True)
    result = subprocess.run(
        [sys.executable, "-c", "import fxshard, fxshard.cli; print(fxshard.__file__); print(fxshard.FxShardError)"],
        cwd=tmp_path, text=True, capture_output=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr
    path, error = result.stdout.splitlines()
    assert Path(path).resolve() == ROOT / "fxshard" / "__init__.py"
    assert error == "<class 'fxshard.ir.errors.FxShardError'>"


_COMPILE_BY_NAME = """
    import torch, fxshard
    {before}
    model = torch.compile(torch.nn.Linear(4, 3), backend="fxshard", dynamic=False)
    shards = fxshard.parameters(model)
    assert len(shards) == 1, shards  # default options: one unit
    assert model(torch.ones(2, 4)).shape == (2, 3)
    print("compiled")
"""


@pytest.mark.slow
@pytest.mark.parametrize("installed", [True, False], ids=["entry-point", "not-installed"])
def test_backend_name_is_found(tmp_path: Path, installed: bool) -> None:
    """Installed, Dynamo loads the name from pyproject's torch_dynamo_backends entry point
    (a distribution on the path that declares it, as an install writes it); from a checkout
    that is not installed, importing fxshard.backend registers it."""
    path = [str(ROOT)]
    if installed:
        dist = tmp_path / "fxshard_entry-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fxshard-entry\nVersion: 0\n")
        entry = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines()
                     if line.startswith('fxshard = "fxshard.backend:'))
        entry = entry.replace('"', "")  # TOML's string, as entry_points.txt writes it
        (dist / "entry_points.txt").write_text(f"[torch_dynamo_backends]\n{entry}\n")
        path.insert(0, str(tmp_path))
    before = "" if installed else "import fxshard.backend"
    result = _python(_COMPILE_BY_NAME.format(before=before), PYTHONPATH=os.pathsep.join(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.endswith("compiled\n")
