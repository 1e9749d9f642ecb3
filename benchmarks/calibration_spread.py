"""Where a two-rank prediction's spread comes from: the network calibration, measured again
and again beside the step it predicts.

    python benchmarks/calibration_spread.py                # the deep narrow MLP, 12 rounds
    python benchmarks/calibration_spread.py --rounds 6

One job of 2 gloo ranks, one thread each, compiles a model once (the deep narrow MLP of
benchmarks/time.py by default), then, round after round: the network measured afresh
(``calibrate.calibrate`` on an empty cache: latencies and bandwidths, contention,
starvation, latency sharing; the device's rates stay the first round's), the report's
predicted step with those rates, and the median of a few measured steps right after. The
step is the same program every round, so the measured column is the host's drift, and the
predicted column the calibration's spread
(``benchmarks/results/calibration_spread.{json,md}``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _time_benchmark() -> Any:
    """benchmarks/time.py, its models and helpers (a module named ``time`` cannot be imported
    by name: the standard library's is built in)."""
    import importlib.util

    found = importlib.util.spec_from_file_location("time_benchmark", HERE / "time.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def rank_main(rank: int, port: int, name: str, rounds: int, steps: int, scratch: str) -> None:
    import fxshard
    from fxshard.driver.report import calibrate
    from fxshard.policies import by_class, by_size
    spec = _time_benchmark().spec

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ["FXSHARD_CACHE_DIR"] = os.path.join(scratch, f"cache-{rank}-first")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    s = spec(name)
    torch.manual_seed(0)
    policy = by_class(s["block"]) if s["block"] is not None else by_size(s["min_params"])
    sharded = fxshard.compile(s["make"](), policy=policy, optimizer=torch.optim.AdamW)
    driver = sharded._driver
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    x, y = s["inputs"](torch.Generator().manual_seed(100 + rank))

    def measured() -> float:
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            s["loss"](sharded(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    measured()  # warm up
    rows: list[dict[str, Any]] = []
    kept: list[Any] = []  # each round's rates
    for i in range(rounds):
        os.environ["FXSHARD_CACHE_DIR"] = os.path.join(scratch, f"cache-{rank}-{i}")
        calibrate._NETWORKS.clear()  # the network measured afresh; the device's rates kept
        start = time.perf_counter()
        rates = calibrate.calibrate(driver.world, driver.device)
        seconds = time.perf_counter() - start
        driver.rates = rates
        kept.append(rates)
        predicted = sharded.report().predicted_step_seconds
        rows.append({"round": i, "calibration_s": seconds, "predicted_step_s": predicted,
                     "measured_step_s": measured(),
                     **{f"{kind}_latency_s": link.latency for kind, link in rates.network.links.items()},
                     **{f"{kind}_bandwidth": link.bandwidth for kind, link in rates.network.links.items()},
                     "contention": rates.contention, "starvation": rates.starvation,
                     "latency_sharing": rates.latency_sharing, "latency_sharing_mixed": rates.latency_sharing_mixed,
                     "load_1min": os.getloadavg()[0]})
        if rank == 0:
            r = rows[-1]
            print(f"  round {i}: predicted {r['predicted_step_s'] * 1e3:.1f} ms, measured "
                  f"{r['measured_step_s'] * 1e3:.1f} ms", flush=True)
    _what_if(sharded, driver, kept, rows)
    tails = _one_call_at_a_time(calibrate.measured_group(driver.world))  # every rank calls it: collectives
    if rank == 0:
        torch.save({"label": s.get("label", name), "rows": rows, "calls": tails}, os.path.join(scratch, "rows.pt"))
    dist.destroy_process_group()


# The calibrated numbers, in the groups one measurement each makes (``calibrate.calibrate``).
FACTORS = ("network", "contention", "starvation", "latency_sharing", "latency_sharing_mixed")


def _sharing(value: float | None) -> str:
    """A row's latency sharing beside a reduce_scatter ("-": recorded before calibration measured it)."""
    return "-" if value is None else f"{value:.2f}"


def _what_if(sharded: Any, driver: Any, kept: list[Any], rows: list[dict[str, Any]]) -> None:
    """Each round predicted again with one factor of its calibration at the rounds' typical
    value (the network: the round whose all_gather latency is the median; the others: their
    median), the rest its own: how far each measurement alone moves the prediction. Written
    into ``rows`` as ``with_typical_<factor>_s``. Nothing runs or communicates."""
    from dataclasses import replace

    by_latency = sorted(kept, key=lambda r: r.network.links["all_gather"].latency)
    typical: dict[str, Any] = {"network": by_latency[len(kept) // 2].network}
    for factor in FACTORS[1:]:
        typical[factor] = statistics.median(getattr(r, factor) for r in kept)
    for rates, row in zip(kept, rows):
        for factor in FACTORS:
            driver.rates = replace(rates, **{factor: typical[factor]})
            row[f"with_typical_{factor}_s"] = sharded.report().predicted_step_seconds
    driver.rates = kept[-1]


def _one_call_at_a_time(group: dist.ProcessGroup, calls: int = 600, window: int = 60) -> dict[str, Any]:
    """A 64 KiB all_gather and reduce_scatter (calibration's smallest size), ``calls`` times each,
    each call and its wait timed alone: the spread of one call, and of the mean over ``window`` calls in a
    row (calibration's count at that size)."""
    from fxshard.driver.report.calibrate import _collective, _wait

    n, name = group.size(), group.group_name
    numel = (1 << 16) // 4 // n * n
    found: dict[str, Any] = {}
    for kind in ("all_gather", "reduce_scatter"):
        issue, _ = _collective(kind, torch.ones(numel), torch.ones(numel // n), n, name)
        _wait(issue())
        times = []
        for _ in range(calls):  # each call and its wait, as calibration times them
            start = time.perf_counter()
            _wait(issue())
            times.append(time.perf_counter() - start)
        ordered = sorted(times)
        means = [statistics.fmean(times[i:i + window]) for i in range(0, calls, window)]
        found[kind] = {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
                       "p90_s": ordered[int(0.9 * calls)], "p99_s": ordered[int(0.99 * calls)],
                       "window": window, "window_means_s": means}
    return found


def markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    rows = result["rows"]
    ms, us = 1e3, 1e6
    lines = [f"Machine: {meta['machine']}; torch {meta['torch']}; gloo, 2 ranks, one thread each; fxshard "
             f"{meta['fxshard']}. {result['label']}, compiled once; each round the network calibrated afresh "
             f"(the device's rates kept), the predicted step with it, then the median of {meta['steps']} "
             "measured steps on rank 0 (forward, loss, backward, AdamW step).", "",
             "| round | all_gather / reduce_scatter / all_reduce latency us | contention | starvation | "
             "latency sharing, two all_gathers / beside a reduce_scatter | predicted ms | measured ms | error | "
             "load |",
             "|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['all_gather_latency_s'] * us:.0f} / {r['reduce_scatter_latency_s'] * us:.0f}"
                     f" / {r['all_reduce_latency_s'] * us:.0f} | {r['contention']:.2f} | {r['starvation']:.2f} | "
                     f"{r['latency_sharing']:.2f} / {_sharing(r.get('latency_sharing_mixed'))} | "
                     f"{r['predicted_step_s'] * ms:.1f} | "
                     f"{r['measured_step_s'] * ms:.1f} | {r['predicted_step_s'] / r['measured_step_s'] - 1:+.0%} | "
                     f"{r['load_1min']:.1f} |")

    def spread(key: str) -> str:
        values = [r[key] for r in rows]
        mid = statistics.median(values)
        return f"{min(values) / mid - 1:+.0%} to {max(values) / mid - 1:+.0%} of its median"

    def within_of(key: str) -> int:
        return sum(abs(r[key] / r["measured_step_s"] - 1) <= 0.15 for r in rows)

    within = within_of("predicted_step_s")
    lines += ["", f"Measured step: {spread('measured_step_s')}. Predicted step: {spread('predicted_step_s')}. "
              f"all_gather latency: {spread('all_gather_latency_s')}. Predicted within 15% of the step "
              f"measured right after: {within} of {len(rows)} rounds.", "",
              "Each round predicted again with one factor of its calibration at the rounds' typical value "
              "(the network: the round with the median all_gather latency, its latencies and bandwidths; the "
              "others: their median) and the rest its own: how far that one measurement moves the prediction.",
              "", "| factor held typical | predicted within 15% | predicted step vs its median |",
              "|---|---:|---|"]
    if all(f"with_typical_{f}_s" in rows[0] for f in FACTORS):
        for factor in FACTORS:
            lines.append(f"| {factor.replace('_', ' ')} | {within_of(f'with_typical_{factor}_s')} of {len(rows)} | "
                         f"{spread(f'with_typical_{factor}_s').removesuffix(' of its median')} |")
    lines += ["",
              "A 64 KiB collective (calibration's smallest size) timed call by call after the rounds, 600 "
              "calls each, and the mean of each 60 calls in a row (calibration's count at that size):", "",
              "| kind | median us | mean us | p90 us | p99 us | means of 60 in a row, us |",
              "|---|---:|---:|---:|---:|---|"]
    for kind, c in result.get("calls", {}).items():
        lines.append(f"| {kind} | {c['median_s'] * us:.0f} | {c['mean_s'] * us:.0f} | {c['p90_s'] * us:.0f} | "
                     f"{c['p99_s'] * us:.0f} | {min(c['window_means_s']) * us:.0f} to "
                     f"{max(c['window_means_s']) * us:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import platform

    from run import fxshard_version

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", help="a model of benchmarks/time.py: net, gpt or mlp")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fxshard-spread-") as scratch:
        mp.spawn(rank_main, args=(_time_benchmark()._port(), args.model, args.rounds, args.steps, scratch), nprocs=2)
        result = torch.load(os.path.join(scratch, "rows.pt"), weights_only=False)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "fxshard": fxshard_version(), "steps": args.steps}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration_spread.json").write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")
    table = markdown(result, meta)
    (out / "calibration_spread.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
