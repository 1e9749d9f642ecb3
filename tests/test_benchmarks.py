"""The benchmark runs with one command (in its quick mode here) and writes JSON, a table and a chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the slowest test (about a minute); the table tests below stay in the fast tier
def test_quick_benchmark_writes_results_and_agrees_with_fsdp2_on_volume(tmp_path: Path) -> None:
    systems = ["ddp", "fsdp2", "fxshard", "fxshard_onegroup", "fsdp2_bf16", "fxshard_bf16"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--models", "gpt",
         "--systems", ",".join(systems), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == set(systems)
    assert not any("failed" in r for r in rows.values()), rows
    # Every row names the torch release it ran on (--append may keep rows of another).
    assert {r["torch"] for r in rows.values()} == {report["meta"]["torch"]} == {torch.__version__}
    # Same units (one per block, resident root) -> the same bytes on the wire as FSDP2,
    # counted by the same counter, plus the ranks' agreement before forward and
    # backward (8 bytes from each of the 2 ranks, twice); DDP all-reduces 2x the parameters.
    assert rows["fxshard"]["comm_bytes"] == rows["fsdp2"]["comm_bytes"] + 2 * 8 > 16
    assert not any(r["comm_uncounted"] for r in rows.values())
    # One gloo group instead of per-slot groups moves the same bytes; only the time differs.
    assert rows["fxshard_onegroup"]["comm_bytes"] == rows["fxshard"]["comm_bytes"]
    assert rows["fxshard_onegroup"]["comm_groups"] == 1 < rows["fxshard"]["comm_groups"]
    assert rows["fxshard_onegroup"]["step_s_vs_fxshard"] is not None
    # The agreement's time: measured (2 calls per measured step, forward and backward),
    # a positive part of the step.
    fx = rows["fxshard"]
    assert fx["agreement_calls"] == 2 * report["meta"]["steps"]
    assert 0 < fx["agreement_s"] < fx["step_s"]
    assert 0 < fx["agreement_share"] < 1 and len(fx["agreement_share_ranks"]) == 2
    assert "agreement_s" not in rows["fsdp2"]
    # Same model, same data: the same losses as DDP.
    for a, b in zip(rows["fxshard"]["losses"], rows["ddp"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert rows["fxshard"]["step_s_vs_fsdp2"] is not None and rows["fsdp2"]["step_s_vs_fsdp2"] == 1.0
    # bf16 parameters, fp32 reduction: FSDP2-bf16's bytes plus the agreement; the gathers
    # move half the fp32 bytes (the agreement's 16 stay int64), the reduce-scatters the same.
    bf16, ref16 = rows["fxshard_bf16"], rows["fsdp2_bf16"]
    assert bf16["comm_bytes"] == ref16["comm_bytes"] + 2 * 8 < rows["fxshard"]["comm_bytes"]
    assert 2 * ref16["comm_by_kind"]["all_gather"] == rows["fsdp2"]["comm_by_kind"]["all_gather"]
    assert 2 * (bf16["comm_by_kind"]["all_gather"] - 16) == fx["comm_by_kind"]["all_gather"] - 16
    assert bf16["comm_by_kind"]["reduce_scatter"] == fx["comm_by_kind"]["reduce_scatter"]
    # The same bf16 computation as FSDP2's (bit for bit in tests/test_recipe.py).
    assert bf16["losses"] == pytest.approx(ref16["losses"], rel=1e-3)
    # The bf16 rows' ratios are against FSDP2-bf16; step_s_vs_fsdp2 stays against fp32 FSDP2.
    assert ref16["step_s_vs_fsdp2_bf16"] == 1.0 and bf16["step_s_vs_fsdp2_bf16"] is not None
    assert "step_s_vs_fxshard" not in bf16 and "step_s_vs_fsdp2_bf16" not in fx
    table = (tmp_path / "latest.md").read_text()
    assert "| gpt | fxshard |" in table and "| gpt | fxshard_onegroup |" in table and "×FSDP2" in table
    assert f"| gpt | fsdp2_bf16 | {ref16['step_s'] * 1000:.0f} | 1.00 |" in table
    assert "_bf16 rows: bf16 parameters for compute" in table
    assert "Overheads of fxshard's safety features" in table
    assert f"| gpt | fxshard | {fx['agreement_s'] * 1000:.1f} | {fx['agreement_share']:.1%} (" in table
    assert (tmp_path / "latest.png").stat().st_size > 10_000


def test_table_shows_out_of_memory_and_what_the_tracker_cannot_see() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run

    error = RuntimeError("process 0 terminated\nRuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. "
                         "DefaultCPUAllocator: can't allocate memory: you tried to allocate 50331648 bytes. "
                         "Error code 12 (Cannot allocate memory)")
    reason = run._failure(error)
    assert reason == "out of memory: you tried to allocate 50331648 bytes"
    gib = 1 << 30
    row = dict(step_s=1.0, peak_bytes=None, rss_bytes=gib, comm_bytes=None, memory_limit_bytes=9 * gib)
    results = [{"model": "large", "system": "ddp", "failed": reason, "memory_limit_bytes": 9 * gib},
               {"model": "large", "system": "fxshard_inductor", **row}]
    run.ratios(results)
    table = run.markdown(results, {"machine": "m", "torch": "t", "world_size": 2,
                                   "params": {"large": 720_000_000}})
    assert "| large | ddp | failed: out of memory: you tried to allocate 50331648 bytes |" in table
    assert "| n/v |" in table and "n/v: not measured" in table
    assert "large: 0.72B parameters; each rank's data memory capped at 9.0 GiB" in table


def test_append_keeps_and_marks_the_earlier_runs_rows() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run

    row = dict(step_s=2.0, peak_bytes=1, rss_bytes=1, comm_bytes=1)
    earlier = {"meta": {"machine": "old", "steps": 3, "params": {"large": 7, "net": 5}},
               "results": [{"model": "net", "system": "fsdp2", **row},
                           {"model": "large", "system": "fsdp2", **row}]}
    meta: dict = {"machine": "new", "steps": 10}
    results, params = run.keep_earlier([{"model": "net", "system": "fsdp2", **row, "step_s": 1.0}],
                                       {"net": 6}, meta, earlier)
    assert [(r["model"], r["step_s"], "earlier_run" in r) for r in results] == [
        ("net", 1.0, False), ("large", 2.0, True)]
    assert params == {"large": 7, "net": 6} and meta["earlier_run"] == {"machine": "old", "steps": 3}
    run.ratios(results)
    table = run.markdown(results, {"machine": "m", "torch": "t", "world_size": 2})
    assert "| large† | fsdp2 | 2000 | 1.00 |" in table and "| net | fsdp2 | 1000 | 1.00 |" in table
    assert "†: large measured in a separate run of this benchmark" in table


def test_auto_benchmark_compares_with_the_fastest_that_fits_and_marks_the_same_program() -> None:
    """benchmarks/auto.py's summary on made-up rows: a faster system over the budget is not the
    yardstick; a system with auto()'s graphs is marked, and its steps and auto()'s are pooled
    (one program); a budget no schedule meets is a row."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import auto
    import run

    mib = 1 << 20

    def row(system: str, step: float, peak: int, graphs: str | None) -> dict:
        return {"system": system, "units": 3, "schedule": "defaults", "step_s": step,
                "steps_s": [step] * 3,
                "step_spread_s": [step * 0.9, step * 1.5], "peak_bytes": peak * mib,
                "predicted_step_s": step, "predicted_peak_bytes": peak * mib, "graphs": graphs,
                "compile_s": 1.0}

    result = {"model": "gpt", "label": "GPT", "budget_bytes": 100 * mib, "load_1min_before": 1.0,
              "load_1min": 2.0,
              "rows": [row("fsdp2", 1.2, 100, None), row("by_class(Block)", 1.0, 90, "a"),
                       row("by_size(2 block = 8)", 0.5, 140, "b"),
                       {"system": "by_size(2 block = 8), budget", "failed": "memory_budget 100 MiB cannot be met"},
                       {**row("auto()", 1.02, 99, "a"), "chosen": "by_class(Block), resharded"}]}
    result["summary"] = auto.summarize(result)
    s = result["summary"]
    assert s["fastest_that_fits"] == "by_class(Block)" and s["fastest_is_auto_graphs"]
    # One program ("a"): the pooled median of its six steps, 1.0, 1.0, 1.0, 1.02, 1.02, 1.02.
    assert s["auto_over_fastest"] == 1.0 and s["auto_over_fastest_by_system"] == 1.02 / 1.0
    assert s["fastest_step_s"] == s["auto_step_s"] == pytest.approx(1.01)
    assert s["auto_peak_over_budget"] == 0.99 and s["met"]
    table = auto.markdown([result], {"machine": "x86_64, 2 cores", "torch": "t", "fxshard": "f",
                                     "subnormals": run.subnormals(False), "rounds": 2, "per_round": 1})
    # The first line says what was done with subnormal floats, not what was asked.
    assert "fxshard f; subnormal floats not flushed (this CPU cannot). Budget:" in table
    assert "| GPT | 100.0 | by_class(Block) (auto()'s graphs) | 1010.0 | by_class(Block), resharded | 1010.0 | " \
        "1.00 | 1.02 |" in table
    # Another program at 1.07x the fastest misses the 1.05 bound.
    result["rows"][-1] = {**row("auto()", 1.07, 99, "c"), "chosen": "by_size(N/2)"}
    s = auto.summarize(result)
    assert s["auto_over_fastest"] == pytest.approx(1.07) and not s["met"]
    assert "| GPT | by_size(2 block = 8) | 3 | defaults | 500.0 (450-750) | 140.0 | no |" in table
    assert "| GPT | by_class(Block) | 3 | defaults | 1000.0 (900-1500) | 90.0 | yes | 1000.0 | 90.0 | = |" in table
    assert "failed: memory_budget 100 MiB cannot be met" in table


def test_time_benchmark_gives_each_models_errors_run_by_run() -> None:
    """benchmarks/time.py on made-up rows of two runs: each model's step error in each run, how
    many fall within 15%, and how many of its collectives over 1 MB within 25% of their time alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("time_benchmark", ROOT / "benchmarks" / "time.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def row(run: int, measured: float, predicted: float, big: list[tuple[float, float]]) -> dict:
        return {"label": "net", "world_size": 2, "run": run, "params": 1e6, "units": 2,
                "measured_step_s": measured, "predicted_step_s": predicted,
                "measured_forward_backward_s": measured, "predicted_forward_backward_s": predicted,
                "measured_optimizer_s": 0.0, "predicted_optimizer_s": 0.0, "predicted_compute_s": predicted,
                "predicted_exposed_comm_s": 0.0, "load_1min": 1.0,
                "big_collectives": [{"kind": "all_gather", "unit": "fc1", "input_bytes": 2e6,
                                     "measured_alone_s": m, "predicted_alone_s": p, "predicted_in_step_s": p}
                                    for m, p in big]}

    rows = [row(1, 0.100, 0.098, [(0.010, 0.011), (0.010, 0.013)]),  # -2%; +10%, +30%
            row(2, 0.100, 0.080, [(0.010, 0.009), (0.010, 0.010)])]  # -20%; -10%, 0%
    table = module.markdown(rows, {"machine": "x86_64, 2 cores", "torch": "t", "subnormals": "s", "fxshard": "f",
                                    "steps": 10})
    assert "| net | 2 | -2%, -20% | 1 of 2 | 3 of 4 |" in table
    assert "| net, run 2 | 2 | 1.00M | 2 | 100.0 | 80.0 | -20% |" in table
    # The host's pace before the calibration and after the steps, where the row has it.
    paced = module.markdown([{**rows[0], "host_matmul_s_before": 0.0021, "host_matmul_s_after": 0.0032}],
                            {"machine": "x86_64, 2 cores", "torch": "t", "subnormals": "s", "fxshard": "f",
                             "steps": 10})
    assert "| 1.0, 1.0 | 2.10, 3.20 |" in paced and "| 1.0, 1.0 | - |" in table
    # One run: no run numbers, no summary.
    single = module.markdown([{**rows[0], "run": 1}], {"machine": "x86_64, 2 cores", "torch": "t", "subnormals": "s",
                                                        "fxshard": "f", "steps": 10})
    assert "run by run" not in single and "| net | 2 | 1.00M |" in single
    # One process with a group of its own ("1g") is a row and a summary line of its own,
    # apart from one process without one.
    alone = [{**r, "world_size": 1, "ranks": ranks, "big_collectives": []}
             for r in rows for ranks in ("1g", "1")]
    both = module.markdown(alone, {"machine": "x86_64, 2 cores", "torch": "t", "subnormals": "s", "fxshard": "f",
                                   "steps": 10})
    assert "| net | 1g | -2%, -20% | 1 of 2 | - |" in both and "| net | 1 | -2%, -20% | 1 of 2 | - |" in both
    assert "| net, run 1 | 1g | 1.00M |" in both and "a gloo process group of its own" in both
    with pytest.raises(SystemExit):
        module.main(["--world-sizes", "2,2g"])
