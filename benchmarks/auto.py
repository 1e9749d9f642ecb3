"""policy=auto() against the plans a user would try, within FSDP2's measured peak, on 2 gloo ranks.

    python benchmarks/auto.py                        # net, gpt and the deep narrow MLP (results/auto.{json,md})
    python benchmarks/auto.py --models mlp --rounds 3

For each model (``benchmarks/time.py``'s: the tutorial's Net, the 12-layer GPT of
``benchmarks/run.py`` and a deep narrow MLP of 48 units of 256 x 256), in one pair of spawned
gloo ranks with one intra-op thread each:

1. FSDP2, ``fully_shard`` per block and on the root (``run.wrap("fsdp2", ...)``): a few
   steps, then the peak of one step measured with torch's MemTracker
   (``fxshard.measure.peak_memory``, as ``benchmarks/run.py`` measures every system), the
   largest over the ranks. That peak is the budget.
2. fxshard, every one with ``optimizer=torch.optim.AdamW`` (its predicted peak then counts the
   optimizer's state, as the measured one does):

   - the block policy (``by_class(Block)``; the Net, which has no block class, takes
     ``by_size(20000)``, the modules FSDP2 wraps), and ``by_size`` at 0.5, 1 and 2 times a
     block's parameters (the Net: its largest module, ``fc1``), each at fxshard's defaults
     (resharded after forward, two gathers in flight) and each again with
     ``memory_budget=`` the budget (the budget's planner chooses its resharding, prefetch
     and recomputation);
   - ``policy=auto()`` with ``memory_budget=`` the budget and ``example_inputs=`` the batch.

3. Steps in rounds: each round runs every system ``--per-round`` steps, the systems' order
   rotated by one each round, so that the machine's drift falls on every system alike; each
   step (forward, loss, backward, AdamW's step and zero_grad) is timed on rank 0 after a
   barrier, warm-up steps excluded. A system's step is the median of its timed steps.
4. Each system's peak, measured as FSDP2's was (the largest over the ranks), after the rounds.

A system fits when its measured peak is within the budget. The claim (issue 39): auto()'s
measured step is at most 1.05x the fastest system that fits, and its measured peak is
within the budget. Calibration is fresh (a cache folder of the run's own), measured when the
first fxshard driver is built. The machine is shared: its load average is recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "examples"))

MIB = 1 << 20
SIZES = (0.5, 1.0, 2.0)  # by_size at these multiples of a block's parameters
TARGET = 1.05  # the issue's bound on auto's step over the fastest that fits


def spec(name: str) -> dict[str, Any]:
    """``benchmarks/time.py``'s models (loaded by path: ``time`` is the standard library's)."""
    loaded = importlib.util.spec_from_file_location("time_benchmark", HERE / "time.py")
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return dict(module.spec(name))


def block_params(model: nn.Module, s: dict[str, Any]) -> int:
    """A block's parameters: one instance of the block class, or (no class) the largest module
    FSDP2 wraps."""
    if s["block"] is not None:
        return sum(p.numel() for p in next(m for m in model.modules() if isinstance(m, s["block"])).parameters())
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def systems(model: nn.Module, s: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(label, policy, under the budget) for every fxshard system, auto() last."""
    from fxshard.policies import auto, by_class, by_size

    block = by_class(s["block"]) if s["block"] is not None else by_size(s["min_params"])
    n = block_params(model, s)
    plans = [(repr(block), block)] + [(f"by_size({k:g} block = {round(k * n)})", by_size(round(k * n)))
                                      for k in SIZES]
    return ([(label, policy, False) for label, policy in plans]
            + [(label + ", budget", policy, True) for label, policy in plans]
            + [("auto()", auto(), True)])


def graphs_key(sharded: Any) -> str:
    """The emitted forward and backward graphs' code, its string literals (process group names,
    which differ between drivers) blanked: two systems with equal keys run the same program."""
    code = "".join(sharded.graphs[g].code for g in ("forward", "backward"))
    return hashlib.sha256(re.sub(r"'[^']*'", "''", code).encode()).hexdigest()[:12]


def rank_main(rank: int, world_size: int, port: int, name: str, args: Any, out: str) -> None:
    from run import flush_subnormals, wrap

    import fxshard
    from fxshard.measure import peak_memory

    torch.set_num_threads(1)
    flush_subnormals()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ["FXSHARD_CACHE_DIR"] = os.path.join(out, f"cache-{name}-{rank}")  # a fresh calibration
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    load_before = os.getloadavg()[0]
    s = spec(name)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [s["inputs"](gen) for _ in range(4)]

    def largest(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    models: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    rows: dict[str, dict[str, Any]] = {}

    def step(label: str, i: int) -> float:
        model, opt = models[label]
        x, y = batches[i % len(batches)]
        loss = s["loss"](model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    def peak(label: str) -> int:
        model, opt = models[label]
        x, y = batches[0]
        return largest(peak_memory(lambda: step(label, 0), model, opt, x, y))

    # FSDP2 per block and root: its measured peak is the budget.
    torch.manual_seed(0)
    fsdp2 = wrap("fsdp2", s["make"](), s, world_size)
    models["fsdp2"] = (fsdp2, torch.optim.AdamW(fsdp2.parameters(), lr=1e-4))
    for i in range(args.warmup):
        step("fsdp2", i)
    budget = peak("fsdp2")
    rows["fsdp2"] = {"system": "fsdp2", "policy": "fully_shard per block + root", "units": None}

    for label, policy, budgeted in systems(s["make"](), s):
        torch.manual_seed(0)
        options: dict[str, Any] = {"optimizer": torch.optim.AdamW}
        if budgeted:
            options["memory_budget"] = budget
        if label == "auto()":
            options["example_inputs"] = batches[0][0]
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sharded = fxshard.compile(s["make"](), policy=policy, **options)
                models[label] = (sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-4))
                step(label, 0)  # the first call traces (and under a budget, plans)
        except fxshard.BudgetError as e:  # every rank plans alike, so every rank raises
            models.pop(label, None)
            rows[label] = {"system": label, "failed": str(e).splitlines()[0].split(". There")[0]}
            continue
        compile_s = time.perf_counter() - start
        for i in range(1, args.warmup):
            step(label, i)
        report = sharded.report()
        row: dict[str, Any] = {
            "system": label, "policy": repr(sharded.plan.policy), "units": len(sharded.plan.units),
            "budgeted": budgeted, "compile_s": compile_s, "graphs": graphs_key(sharded),
            "predicted_step_s": report.predicted_step_seconds,
            "predicted_peak_bytes": largest(report.predicted_peak_bytes),
            "schedule": report.budget.chosen.describe() if report.budget is not None else "defaults"}
        if report.auto is not None:
            choice = report.auto
            row["schedule"] = choice.chosen.schedule
            row["chosen"] = choice.chosen.describe()
            row["rates"] = choice.rates
            row["trials"] = [{"plan": t.plan, "schedule": t.schedule, "predicted_step_s": t.seconds,
                              "predicted_exposed_s": t.exposed_seconds, "predicted_peak_bytes": t.peak,
                              "units": t.units, "fits": t.fits} for t in choice.trials]
        rows[label] = row

    # Rounds: every system, its order rotated each round; rank 0's times.
    labels = list(models)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            for i in range(args.per_round):
                dist.barrier()
                start = time.perf_counter()
                step(label, i)
                times[label].append(time.perf_counter() - start)
    for label in labels:
        rows[label].update(step_s=statistics.median(times[label]), steps=len(times[label]),
                           steps_s=list(times[label]),
                           step_spread_s=(min(times[label]), max(times[label])), peak_bytes=peak(label))
    if rank == 0:
        result = {"model": name, "label": s.get("label", name), "budget_bytes": budget,
                  "block_params": block_params(s["make"](), s), "rows": list(rows.values()),
                  "load_1min_before": load_before, "load_1min": os.getloadavg()[0]}
        torch.save(result, os.path.join(out, f"{name}.pt"))
    dist.destroy_process_group()


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The claim for one model: the fastest alternative that fits, auto's step over it (by the
    median step of each program, the claim; and by each one's fastest step, what the machine's
    load touches least), auto's peak over the budget.

    A program is a system's emitted graphs (``graphs``, their code's hash): systems that
    emit the same graphs run the same program, so their steps are pooled and each takes
    the pooled median (``program_step_s``). Else the fastest of several measurements of
    one program is the luckiest, and auto() (one of them) would be compared with its own
    best draw. Each system's own median stays in ``step_s`` and in the table."""
    budget = result["budget_bytes"]
    rows = [r for r in result["rows"] if "failed" not in r]
    auto = next((r for r in rows if r["system"] == "auto()"), None)
    pooled: dict[str, list[float]] = {}
    for r in rows:
        if r.get("graphs") and r.get("steps_s"):
            pooled.setdefault(r["graphs"], []).extend(r["steps_s"])
    for r in rows:
        r["fits"] = r["peak_bytes"] <= budget
        r["same_graphs_as_auto"] = auto is not None and r.get("graphs") == auto.get("graphs")
        steps = pooled.get(r.get("graphs") or "")
        r["program_step_s"] = statistics.median(steps) if steps else r["step_s"]
    fitting = [r for r in rows if r["fits"] and r["system"] != "auto()"]
    best = min(fitting, key=lambda r: r["program_step_s"]) if fitting else None
    best_min = min(fitting, key=lambda r: r["step_spread_s"][0]) if fitting else None
    summary: dict[str, Any] = {
        "fastest_that_fits": best["system"] if best else None,
        "fastest_step_s": best["program_step_s"] if best else None,
        "fastest_is_auto_graphs": bool(best and best["same_graphs_as_auto"]),
        "fastest_by_min": best_min["system"] if best_min else None,
        "auto_step_s": None, "auto_chosen": "failed", "auto_predicted_step_s": None,
        "auto_over_fastest": None, "auto_over_fastest_by_min": None, "auto_peak_over_budget": None,
        "auto_over_fastest_by_system": None, "met": False}
    if auto is None:  # no plan auto() tried fits: its BudgetError is in the rows
        return summary
    summary.update(auto_step_s=auto["program_step_s"], auto_chosen=auto.get("chosen"),
                   auto_predicted_step_s=auto["predicted_step_s"], auto_compile_s=auto["compile_s"],
                   auto_peak_over_budget=auto["peak_bytes"] / budget)
    if best is not None and best_min is not None:
        by_system = min(fitting, key=lambda r: r["step_s"])
        summary.update(auto_over_fastest=auto["program_step_s"] / best["program_step_s"],
                       auto_over_fastest_by_system=auto["step_s"] / by_system["step_s"],
                       auto_over_fastest_by_min=auto["step_spread_s"][0] / best_min["step_spread_s"][0],
                       met=auto["program_step_s"] <= TARGET * best["program_step_s"]
                       and auto["peak_bytes"] <= budget)
    return summary


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    ms = 1e3

    def opt(v: float | None, fmt: str, scale: float = 1.0) -> str:
        return "–" if v is None else format(v * scale, fmt)

    lines = [f"Machine: {meta['machine']}; torch {meta['torch']}; gloo, 2 ranks, one thread each; "
             f"fxshard {meta['fxshard']}; {meta['subnormals']}. Budget: FSDP2's measured peak (MemTracker, one step with "
             "AdamW, the largest over the ranks). Step: the median of "
             f"{meta['rounds']} rounds x {meta['per_round']} steps of each system, the systems' order "
             "rotated each round, on rank 0 (forward, loss, backward, AdamW step); fits: the measured "
             "peak within the budget. Systems that emit the same graphs run one program: their steps "
             "are pooled, and the claim compares programs (the median of the pooled steps); "
             "\"by system\": each system's own median instead, \"by fastest steps\": each one's fastest step.", "",
             "| model | budget MiB | fastest that fits | its step ms | auto()'s choice | auto() step ms | "
             "auto() / fastest | by system | by fastest steps | auto() peak / budget | auto() predicted ms | "
             "auto() compile s | load |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for res in results:
        s = res["summary"]
        same = " (auto()'s graphs)" if s["fastest_is_auto_graphs"] else ""
        lines.append(f"| {res['label']} | {res['budget_bytes'] / MIB:.1f} | {s['fastest_that_fits']}{same} | "
                     f"{opt(s['fastest_step_s'], '.1f', ms)} | {s['auto_chosen']} | "
                     f"{opt(s['auto_step_s'], '.1f', ms)} | {opt(s['auto_over_fastest'], '.2f')} | "
                     f"{opt(s.get('auto_over_fastest_by_system'), '.2f')} | "
                     f"{opt(s['auto_over_fastest_by_min'], '.2f')} | {opt(s['auto_peak_over_budget'], '.3f')} | "
                     f"{opt(s['auto_predicted_step_s'], '.1f', ms)} | {opt(s.get('auto_compile_s'), '.0f')} | "
                     f"{res['load_1min_before']:.1f}, {res['load_1min']:.1f} |")
    lines += ["", "Every system, side by side (`, budget`: with `memory_budget=` the budget, the schedule "
              "the budget's planner chose; `=`: the same emitted graphs as auto()'s, so the same program, "
              "and any difference in its step is the machine's noise):", "",
              "| model | system | units | schedule | step ms (fastest-slowest) | peak MiB | fits | "
              "predicted ms | predicted peak MiB | = |",
              "|---|---|---:|---|---:|---:|---|---:|---:|---|"]
    for res in results:
        for r in res["rows"]:
            if "failed" in r:
                lines.append(f"| {res['label']} | {r['system']} | | failed: {r['failed']} | | | | | | |")
                continue
            lo, hi = r["step_spread_s"]
            lines.append(f"| {res['label']} | {r['system']} | {r['units'] or '–'} | {r.get('schedule', '–')} | "
                         f"{r['step_s'] * ms:.1f} ({lo * ms:.0f}-{hi * ms:.0f}) | {r['peak_bytes'] / MIB:.1f} | "
                         f"{'yes' if r['fits'] else 'no'} | {opt(r.get('predicted_step_s'), '.1f', ms)} | "
                         f"{opt(r.get('predicted_peak_bytes'), '.1f', 1 / MIB)} | "
                         f"{'=' if r['same_graphs_as_auto'] and r['system'] != 'auto()' else ''} |")
    lines += ["", "Load: the 1-minute load average before and after each model's run, on a machine with "
              f"{meta['machine'].split(', ')[-1]}; above the run's own 2 ranks and their communication "
              "threads, other work took CPU time from them. auto()'s every trial (plan, schedule, predicted "
              "step and peak), the rates it predicted with and each system's compile time are in auto.json."]
    return "\n".join(lines) + "\n"


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    from run import flush_subnormals, fxshard_version, machine, subnormals

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="net,gpt,mlp")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="fxshard-auto-") as scratch:
        for name in filter(None, args.models.split(",")):
            print(f"{name} ...", flush=True)
            start = time.perf_counter()
            mp.spawn(rank_main, args=(2, _port(), name, args, scratch), nprocs=2)
            res = torch.load(os.path.join(scratch, f"{name}.pt"), weights_only=False)
            res["summary"] = summarize(res)
            res["wall_s"] = time.perf_counter() - start
            results.append(res)
            s = res["summary"]
            print(f"  auto() {s['auto_chosen']}: {s['auto_step_s'] * 1e3:.1f} ms; fastest that fits "
                  f"{s['fastest_that_fits']}: {(s['fastest_step_s'] or 0) * 1e3:.1f} ms; ratio "
                  f"{s['auto_over_fastest']}; peak / budget {s['auto_peak_over_budget']:.3f}", flush=True)
    meta = {"machine": machine(), "subnormals": subnormals(flush_subnormals()), "torch": torch.__version__,
            "fxshard": fxshard_version(), "rounds": args.rounds, "per_round": args.per_round,
            "warmup": args.warmup, "sizes_in_blocks": list(SIZES), "target": TARGET}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "auto.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str) + "\n")
    table = markdown(results, meta)
    (out / "auto.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
