"""The code blocks of README.md and docs/*.md, for the tests that run and check them.

A ```python block runs (tests/test_doc_examples.py, slow tier): each page's blocks run in
order as one script, so a block may use what an earlier block of its page made
(``sharded``, ``opt``). Before each block the script runs ``from doc_names import *``
again (tests/doc_names.py): ``torch``, ``torch.distributed as dist``, ``fxshard``,
``by_class`` and ``by_size``, and the names the docs leave to the reader (``model``, a
new one before every block, ``Block``, ``loader``, ``loss_fn``, ``config``, ...), bound
to small stand-ins. A page whose blocks call ``dist.init_process_group`` runs under
torchrun on 2 ranks; the others in one process. A traceback names the page and its line.

A block that cannot run where the tests run says so, with its reason, in an HTML comment
on the line before it (not shown when the page is rendered)::

    <!-- not-run: needs Intel XPU devices (xccl) -->
    ```python

An empty reason is an error (tests/test_docs.py), so nothing is skipped silently.

A ```bash block's ``fxshard`` command lines are parsed by the CLI's own parser, the
files they name must exist, and ``pip install -e ".[extra]"`` must name an extra of
pyproject.toml (tests/test_docs.py, fast tier); ``fxshard explain`` lines also run
(tests/test_doc_examples.py).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int            # the fence's line, 1-based; the code starts on the next line
    language: str
    code: str
    not_run: str | None  # the reason, where the block is marked not-run ("" for a marker without one)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a code block that never closes")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(before)
        found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1 : end]),
                           marker.group(1).strip() if marker else None))
        i = end + 1
    return found


def all_blocks(language: str) -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.language == language]


def commands(block: Block) -> list[list[str]]:
    """The shell commands of a bash block, as argument lists: comments dropped, lines
    continued with a backslash joined, ``&&`` chains split."""
    text = re.sub(r"\\\n", " ", block.code)
    result: list[list[str]] = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            if words[:cut]:
                result.append(words[:cut])
            words = words[cut + 1 :]
    return result


def fxshard_argv(command: list[str]) -> list[str] | None:
    """The arguments of an ``fxshard ...`` command line (None for any other command)."""
    return command[1:] if command and command[0] == "fxshard" else None
