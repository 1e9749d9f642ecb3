"""The README's and docs' measured tables are what benchmarks/results/*.json holds."""

from __future__ import annotations

import sys
from pathlib import Path

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
