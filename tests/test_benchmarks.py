"""The benchmark runs with one command (in its quick mode here) and writes JSON, a table and a chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_results_and_agrees_with_fsdp2_on_volume(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--models", "gpt",
         "--systems", "ddp,fsdp2,fxshard", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"ddp", "fsdp2", "fxshard"}
    # Same units (one per block, resident root) -> the same bytes on the wire as FSDP2,
    # counted by the same counter; DDP all-reduces 2x the parameters instead.
    assert rows["fxshard"]["comm_bytes"] == rows["fsdp2"]["comm_bytes"] > 0
    assert not any(r["comm_uncounted"] for r in rows.values())
    # Same model, same data: the same losses as DDP.
    for a, b in zip(rows["fxshard"]["losses"], rows["ddp"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert rows["fxshard"]["step_s_vs_fsdp2"] is not None and rows["fsdp2"]["step_s_vs_fsdp2"] == 1.0
    table = (tmp_path / "latest.md").read_text()
    assert "| gpt | fxshard |" in table and "×FSDP2" in table
    assert (tmp_path / "latest.png").stat().st_size > 10_000
