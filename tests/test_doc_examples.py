"""Every example in README.md and docs/*.md runs as written (slow tier).

How the blocks run, and how a block that cannot run is marked: tests/doc_examples.py.
The fast checks of the same blocks (markers, command lines) are in tests/test_docs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from doc_examples import PAGES, ROOT, Block, all_blocks, blocks, commands, fxshard_argv

pytestmark = pytest.mark.slow

TESTS = ROOT / "tests"


def _runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.language == "python" and b.not_run is None]


def script(page: Path) -> str:
    """The page's runnable blocks as one script; each compiled with the page's name and line
    numbers, so a traceback shows the page's own line."""
    blocks = [(b.line, b.code) for b in _runnable(page)]
    return f"""import sys

BLOCKS = {blocks!r}
for _line, _code in BLOCKS:
    exec("from doc_names import *\\nmodel = MyTransformer()", globals())
    print(f"-- {page.name}:{{_line}}", file=sys.stderr, flush=True)
    exec(compile("\\n" * _line + _code, {str(page)!r}, "exec"), globals())
"""


def _failure(page: str, stderr: str) -> str:
    """What failed: under torchrun the first rank's lines (its traceback), else the end."""
    lines = stderr.splitlines()
    for rank in ("[rank0]:", "[rank1]:"):
        if any(line.startswith(rank) for line in lines):
            lines = [line for line in lines if line.startswith(rank) or line.startswith("--")]
            break
    return f"{page}:\n" + "\n".join(lines)[-6000:]


def _environment() -> dict[str, str]:
    paths = [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _prepare(code: str, folder: Path) -> None:
    """The files the examples read, made in the folder the page runs in."""
    import doc_names

    for pretrained in doc_names.PRETRAINED:
        if pretrained in code:
            from safetensors.torch import save_model

            (folder / pretrained).mkdir(parents=True)
            save_model(doc_names.MyTransformer(), str(folder / pretrained / "model.safetensors"))
    if "from_pretrained(name)" in code:
        from transformers import LlamaConfig, LlamaForCausalLM

        tiny = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        LlamaForCausalLM(tiny).save_pretrained(folder / doc_names.name)


def _fxshard(argv: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fxshard.cli", *argv], cwd=folder, env=_environment(),
                          text=True, capture_output=True, timeout=540)


PAGES_WITH_CODE = [p for p in PAGES if _runnable(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[p.name for p in PAGES_WITH_CODE])
def test_every_python_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    text = script(page)
    _prepare(text, tmp_path)
    (tmp_path / "page.py").write_text(text)
    command = [sys.executable, "page.py"]
    if "init_process_group(" in text or "init_device_mesh(" in text:  # as the docs say: under torchrun
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "page.py"]
    result = subprocess.run(command, cwd=tmp_path, env=_environment(), text=True, capture_output=True,
                            timeout=540)
    assert result.returncode == 0, _failure(page.name, result.stderr)
    # The page's `fxshard consolidate` lines, on the checkpoint its examples saved.
    for block in blocks(page):
        for command in commands(block) if block.language == "bash" else []:
            argv = fxshard_argv(command)
            if argv and argv[0] == "consolidate":
                done = _fxshard(argv, tmp_path)
                assert done.returncode == 0, f"{block.where}: {' '.join(command)}\n{done.stderr[-4000:]}"


# A block marked not-run (its reason said on the page) is left out, as python blocks are.
EXPLAINS = [(b, c) for b in all_blocks("bash") if b.not_run is None
            for c in commands(b) if (fxshard_argv(c) or [""])[0] == "explain"]


@pytest.mark.parametrize("block, command", EXPLAINS, ids=[b.where for b, _ in EXPLAINS])
def test_every_explain_command_runs(block: Block, command: list[str], tmp_path: Path) -> None:
    for folder in ("examples", "tests"):
        (tmp_path / folder).symlink_to(ROOT / folder, target_is_directory=True)
    argv = fxshard_argv(command)
    assert argv is not None
    result = _fxshard(argv, tmp_path)
    assert result.returncode == 0, f"{block.where}: {' '.join(command)}\n{result.stderr[-4000:]}"
