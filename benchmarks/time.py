"""Predicted against measured: fxshard's time model (fxshard/ir/cost.py) on 2 gloo ranks.

    python benchmarks/time.py                 # net, gpt and a deep narrow MLP, 3 runs (results/time.{json,md})
    python benchmarks/time.py --models mlp --steps 5 --runs 1

For each model, on 2 spawned gloo ranks with one intra-op thread each (as
benchmarks/run.py), fxshard.compile with ``optimizer=torch.optim.AdamW`` (so the
prediction includes the optimizer step), a fresh calibration (a cache folder of
its own: the first measurement, what a user's first run gets), then:

- the step: forward, the loss, backward, AdamW's step and zero_grad, timed on
  rank 0 after the warm-up steps and the report that predicts them (on one rank the
  report calibrates the device, which moves glibc's mmap threshold and so the pages a
  step faults in: docs/time.md, "Fresh pages"); the median of the measured steps, against
  ``report().predicted_step_seconds``, and the pages each faulted in;
  forward + loss + backward alone, against the prediction's graphs, and the
  optimizer step alone, against its prediction;
- every distinct collective of more than 1 MB the step issues (kind, input size):
  measured alone on the group the step runs it on (the mean of 20, after one
  to warm up), against the model's time for it alone, and beside the time the
  prediction gives it inside the step (where collectives in flight together
  share the wires).

Each row also times a 512x512 matmul on every rank at once before its compile and after its
steps (``host_speed``): the host's pace, which on a shared host drifts under the rows.

Then the same model in one process (no collectives: the compute model alone), and with
``--world-sizes 1g`` in one process that made a gloo group of its own (as under torchrun
with one process), whose collectives over one rank are still called and waited.
Nothing is fitted to these numbers: the prediction uses what calibration measured
when the model was compiled. The machine is shared: its load average is recorded,
and the whole benchmark runs ``--runs`` times (3), one after the other, each model
calibrated afresh every time; the last table gives each model's errors run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "examples"))

MB = 1_000_000
DEEP = dict(width=256, depth=48, batch=64)  # the deep narrow MLP: 48 units of 66k parameters


def spec(name: str) -> dict[str, Any]:
    from run import model_spec

    if name != "mlp":
        return model_spec(name, quick=False)
    from models import MLP

    width, depth, batch = DEEP["width"], DEEP["depth"], DEEP["batch"]
    return dict(make=lambda: MLP(d_in=width, hidden=width, depth=depth, d_out=10), block=nn.Linear,
                loss=lambda o, y: F.cross_entropy(o, y), label=f"MLP {depth}x{width}",
                inputs=lambda g: (torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)))


def host_speed(calls: int = 40) -> float:
    """The host's pace at this moment: the median seconds of a 512x512 float32 matmul on one
    thread (after one to warm up), every rank at once. A shared host's pace drifts: here a
    512x512 by 512x2048 matmul took 8 ms a call and, twenty minutes later with this machine
    otherwise idle, 11-12 ms.
    Taken before a row's calibration and after its steps, it tells a row whose host changed
    pace between the two (the prediction keeps the pace calibration saw) from the model's own
    error."""
    from fxshard.driver.report.calibrate import _seconds

    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    return _seconds(lambda: torch.mm(a, a), a.device, least=0.0, calls=calls, how="median")


def _collective_alone(driver: Any, c: Any, reps: int = 20) -> float:
    """The mean seconds of collective ``c`` alone over ``reps`` calls (after one to warm up), on
    the process group the step runs it on: the statistic the model predicts, timed as
    calibration times the network."""
    from fxshard.driver.report.calibrate import _seconds
    from fxshard.ir import compat

    ops = compat.c10d_functional
    x = torch.ones(c.shape, dtype=c.dtype)
    n, name = c.group_size, c.group_name
    run = {"all_gather": lambda: ops.all_gather_into_tensor(x, n, name),
           "reduce_scatter": lambda: ops.reduce_scatter_tensor(x, c.reduce_op or "sum", n, name),
           "all_reduce": lambda: ops.all_reduce(x, c.reduce_op or "sum", name)}[c.kind]
    return _seconds(lambda: ops.wait_tensor(run()), x.device, least=0.0, calls=reps, how="mean")


def rank_main(rank: int, world_size: int, port: int, name: str, steps: int, warmup: int, out: str,
              grouped: bool = False) -> None:
    from run import flush_subnormals

    import fxshard
    from fxshard.policies import by_class, by_size

    torch.set_num_threads(1)
    flush_subnormals()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # A fresh calibration: a cache of its own.
    ranks = f"{world_size}g" if grouped else str(world_size)
    live = world_size > 1 or grouped  # a process group ("1g": one process with one of its own)
    os.environ["FXSHARD_CACHE_DIR"] = os.path.join(out, f"cache-{name}-{ranks}-{rank}")
    load_before = os.getloadavg()[0]
    if live:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    def barrier() -> None:
        if live:
            dist.barrier()

    barrier()
    pace_before = host_speed()

    s = spec(name)
    torch.manual_seed(0)
    policy = by_class(s["block"]) if s["block"] is not None else by_size(s["min_params"])
    start = time.perf_counter()
    sharded = fxshard.compile(s["make"](), policy=policy, optimizer=torch.optim.AdamW)
    calibrated = time.perf_counter() - start  # the driver calibrates when it is built
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [s["inputs"](gen) for _ in range(warmup + steps)]
    step_s, fb_s, opt_s, faulted = [], [], [], []
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            # The prediction first, then the steps it predicts: on one rank the report calibrates
            # the device here, and calibration raises glibc's mmap threshold, which decides the
            # pages a step faults in (docs/time.md, "Fresh pages"); the steps measured run in the
            # process as the report found it.
            barrier()
            report = sharded.report()
        barrier()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = s["loss"](sharded(x), y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        t2 = time.perf_counter()
        if i >= warmup:
            step_s.append(t2 - t0)
            fb_s.append(t1 - t0)
            opt_s.append(t2 - t1)
            faulted.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) * resource.getpagesize())
    barrier()
    pace_after = host_speed()
    t = report.time
    assert t is not None
    driver = sharded._driver
    rates = driver.rates
    big: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    spans = {(c.graph, c.node): c for c in t.collectives}
    from fxshard.ir import cost
    from fxshard.ir.collectives import collective_nodes

    for graph in ("forward", "backward") if world_size > 1 else ():
        for node, c in collective_nodes(graph, sharded.graphs[graph], None):
            if c.input_bytes <= MB or (c.kind, c.shape) in big:
                continue
            barrier()
            span = spans[(graph, node.name)]
            big[(c.kind, c.shape)] = {
                "kind": c.kind, "unit": c.unit, "graph": graph, "input_bytes": c.input_bytes,
                "group_size": c.group_size,
                "measured_alone_s": _collective_alone(driver, c),
                "predicted_alone_s": rates.network.seconds(c.kind, c.input_bytes, c.group_size),
                "predicted_in_step_s": span.seconds}
    # The compute stream's predicted seconds by operator, forward and backward: the collectives'
    # issue under their own names, the waits' exposed communication under wait_tensor.
    by_op: dict[str, float] = {}
    for graph in ("forward", "backward"):
        for node, (begin, end) in cost.node_times(t, graph, sharded.graphs[graph]).items():
            key = cost.op_name(node) or str(node.target)
            by_op[key] = by_op.get(key, 0.0) + end - begin
    result = {
        "model": name, "label": s.get("label", name), "rank": rank, "world_size": world_size, "ranks": ranks,
        "params": sum(g.numel for g in sharded.plan.groups), "units": len(sharded.plan.units),
        "steps": steps, "measured_step_s": statistics.median(step_s),
        "measured_forward_backward_s": statistics.median(fb_s),
        "measured_optimizer_s": statistics.median(opt_s),
        "predicted_step_s": report.predicted_step_seconds,
        # Pages faulted in a step (getrusage's minor faults, the median) and those the
        # prediction charged; the mmap threshold it walked them with, and the one the job's
        # rates knew (the smallest over the ranks; None: unknown, so the largest tensor's).
        "measured_fresh_bytes": statistics.median(faulted), "predicted_fresh_bytes": t.fresh_bytes,
        "mmap_threshold": t.mmap_threshold, "known_mmap_threshold": rates.mmap_threshold,
        "predicted_forward_backward_s": t.seconds,
        "predicted_optimizer_s": report.predicted_optimizer_seconds,
        "predicted_compute_s": t.compute_seconds, "predicted_exposed_comm_s": t.exposed_comm_seconds,
        "predicted_comm_s": t.comm_seconds, "collectives": len(t.collectives),
        "big_collectives": list(big.values()), "compile_and_calibrate_s": calibrated,
        "predicted_by_op_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:12]),  # the 12 largest
        "rates": str(rates), "load_1min": os.getloadavg()[0], "load_1min_before": load_before,
        "host_matmul_s_before": pace_before, "host_matmul_s_after": pace_after,
    }
    torch.save(result, os.path.join(out, f"{name}-{ranks}-{rank}.pt"))
    if live:
        dist.destroy_process_group()


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def ranks_of(row: dict[str, Any]) -> str:
    """A row's ranks as ``--world-sizes`` names them ("2", "1", "1g"; rows recorded before "1g"
    carry only their world size)."""
    return str(row.get("ranks", row.get("world_size", 2)))


def threshold_of(row: dict[str, Any]) -> str:
    """The glibc mmap threshold a row's prediction walked its fresh pages with, in MiB: the
    process's where some rank knew it, else the step's largest tensor's ("largest"); "none"
    where calibration found no fresh pages (``DeviceRates.fresh_bytes`` None), so nothing is
    charged."""
    if row["mmap_threshold"] is None:
        return "none"
    return f"{row['mmap_threshold'] / (1 << 20):.1f}" + ("" if row["known_mmap_threshold"] else " (largest)")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    ms = 1e3
    lines = [f"Machine: {meta['machine']}; torch {meta['torch']}; gloo, one thread per rank; "
             f"fxshard {meta['fxshard']}; {meta['subnormals']}. Predicted: `report().predicted_step_seconds` with the rates "
             "calibration measured when the model was compiled (a fresh cache); measured: the median "
             f"of {meta['steps']} steps on rank 0 (forward, loss, backward, AdamW step)"
             + (", after the report that predicts them" if meta.get("report_first") else "")
             + ". One rank: the same model in one process, no collectives: the compute model alone"
             + ("; 1g: one process with a gloo process group of its own (as under torchrun with one "
                "process), whose collectives over one rank are still called" if any(
                    r.get("ranks") == "1g" for r in rows) else "") + ". "
             "Fresh pages: the MB a measured step faulted in (the median) and the MB the prediction "
             "charged, and glibc's mmap threshold the prediction took (\"largest\": no rank knew it, "
             "so the step's largest tensor's"
             + ("; \"none\": calibration's probe found no size that faults, so nothing is charged" if any(
                 "predicted_fresh_bytes" in r and r["mmap_threshold"] is None for r in rows) else "")
             + ").", "",
             "| model | ranks | params | units | measured step ms | predicted ms | error | fwd+bwd measured / "
             "predicted ms | optimizer measured / predicted ms | predicted compute / exposed comm ms | "
             "fresh pages MB measured / predicted, threshold MiB | load | host: matmul ms before, after |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---|---|"]
    runs = max(r.get("run", 1) for r in rows)

    def name(r: dict[str, Any]) -> str:
        return f"{r['label']}, run {r['run']}" if runs > 1 else str(r["label"])

    for r in rows:
        lines.append(
            f"| {name(r)} | {ranks_of(r)} | {r['params'] / 1e6:.2f}M | {r['units']} | "
            f"{r['measured_step_s'] * ms:.1f} | "
            f"{r['predicted_step_s'] * ms:.1f} | {error(r['predicted_step_s'], r['measured_step_s']):+.0%} | "
            f"{r['measured_forward_backward_s'] * ms:.1f} / {r['predicted_forward_backward_s'] * ms:.1f} | "
            f"{r['measured_optimizer_s'] * ms:.1f} / {r['predicted_optimizer_s'] * ms:.1f} | "
            f"{r['predicted_compute_s'] * ms:.1f} / {r['predicted_exposed_comm_s'] * ms:.1f} | "
            + (f"{r['measured_fresh_bytes'] / MB:.1f} / {r['predicted_fresh_bytes'] / MB:.1f}, "
               f"{threshold_of(r)} | " if "predicted_fresh_bytes" in r else "- | ")
            + f"{r.get('load_1min_before', r['load_1min']):.1f}, {r['load_1min']:.1f} | "
            + (f"{r['host_matmul_s_before'] * ms:.2f}, {r['host_matmul_s_after'] * ms:.2f} |"
               if "host_matmul_s_before" in r else "- |"))
    lines += ["", "Collectives of more than 1 MB, each distinct kind and size once: measured alone on the "
              "step's process group (the mean of 20), the model's time for it alone, and its predicted span "
              "inside the step (collectives in flight together share the wires).", "",
              "| model | kind | unit | input MB | measured alone ms | predicted alone ms | error | "
              "predicted in the step ms |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for c in r["big_collectives"]:
            lines.append(f"| {name(r)} | {c['kind']} | {c['unit'] or '<root>'} | {c['input_bytes'] / MB:.1f} | "
                         f"{c['measured_alone_s'] * ms:.2f} | {c['predicted_alone_s'] * ms:.2f} | "
                         f"{error(c['predicted_alone_s'], c['measured_alone_s']):+.0%} | "
                         f"{c['predicted_in_step_s'] * ms:.2f} |")
    if runs > 1:
        lines += ["", "Every run: each a fresh calibration and its own steps, one after the other. The "
                  "tables above list each run's rows in turn; here each model's errors, run by run.", "",
                  "| model | ranks | step error, run by run | steps within 15% | collectives > 1 MB within 25% |",
                  "|---|---:|---|---:|---:|"]
        keys = list(dict.fromkeys((r["label"], ranks_of(r)) for r in rows))
        for label, ranks in keys:
            mine = [r for r in rows if (r["label"], ranks_of(r)) == (label, ranks)]
            errors = [error(r["predicted_step_s"], r["measured_step_s"]) for r in mine]
            big = [error(c["predicted_alone_s"], c["measured_alone_s"]) for r in mine for c in r["big_collectives"]]
            lines.append(f"| {label} | {ranks} | {', '.join(f'{e:+.0%}' for e in errors)} | "
                         f"{sum(abs(e) <= 0.15 for e in errors)} of {len(errors)} | "
                         + (f"{sum(abs(e) <= 0.25 for e in big)} of {len(big)} |" if big else "- |"))
    lines += ["", "Load: the 1-minute load average before and after each row, on a machine with "
              f"{meta['machine'].split(', ')[-1]}; above the row's own ranks, other work took CPU time "
              "from them, during the calibration or the steps. Host: the median time of a 512x512 float32 "
              "matmul on one thread, every rank at once, before the row's calibration and after its "
              "steps (then its report times the step's matmuls): the host's pace (a shared host's "
              "drifts by a third over minutes); where the two differ, the steps ran at another pace "
              "than the one calibration measured. The rates each row predicted with are in time.json."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from run import flush_subnormals, fxshard_version, machine, subnormals

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="net,gpt,mlp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--world-sizes", default="2,1",
                   help="2: the issue's runs; 1: the same model in one process, no collectives (the "
                        "compute model alone); 1g: one process with a gloo group of its own, whose "
                        "collectives over one rank are still called (as under torchrun with one process)")
    p.add_argument("--runs", type=int, default=3,
                   help="the whole benchmark this many times, one after the other, each model with a fresh "
                        "calibration every time: on a shared host one run says little (docs/time.md)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, not {args.runs}")
    sizes = [w.strip() for w in args.world_sizes.split(",") if w.strip()]
    for w in sizes:
        if not (w.isdigit() and int(w) >= 1 or w == "1g"):
            p.error(f"--world-sizes takes ranks (2, 1) or 1g (one process with a group of its own), not {w!r}")
    if args.warmup < 1:
        p.error(f"--warmup must be at least 1 (the report comes after the first step), not {args.warmup}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fxshard-time-") as scratch:
        for run in range(1, args.runs + 1):
            folder = os.path.join(scratch, f"run-{run}")  # a calibration cache of its own
            os.makedirs(folder)
            for name in filter(None, args.models.split(",")):
                for ranks in sizes:
                    n, grouped = int(ranks.rstrip("g")), ranks.endswith("g")
                    print(f"run {run}: {name} on {n} rank{'s' if n > 1 else ''}"
                          f"{' with a process group' if grouped else ''} ...", flush=True)
                    mp.spawn(rank_main, args=(n, _port(), name, args.steps, args.warmup, folder, grouped), nprocs=n)
                    rows.append({**torch.load(os.path.join(folder, f"{name}-{ranks}-0.pt"), weights_only=False),
                                 "run": run})
                    r = rows[-1]
                    print(f"  measured {r['measured_step_s'] * 1e3:.1f} ms, predicted "
                          f"{r['predicted_step_s'] * 1e3:.1f} ms "
                          f"({error(r['predicted_step_s'], r['measured_step_s']):+.0%})", flush=True)
    meta = {"machine": machine(), "subnormals": subnormals(flush_subnormals()), "torch": torch.__version__,
            "fxshard": fxshard_version(), "steps": args.steps, "warmup": args.warmup, "runs": args.runs,
            "report_first": True}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "time.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1, default=str) + "\n")
    table = markdown(rows, meta)
    (out / "time.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
