"""Which sizes the network's calibration fits its line through: the five it times now (64 KiB,
1, 4, 8 and 16 MiB on the CPU) against the three it timed before (64 KiB, 1 and 16 MiB).

    python benchmarks/network_sizes.py              # 12 calibrations (results/network_sizes.{json,md})
    python benchmarks/network_sizes.py --rounds 4

One job of 2 gloo ranks, one thread each. Each round: ``calibrate.measure_network`` on a
group of its own (every size's calls interleaved, as a compile calibrates), its five points
fitted as calibration fits them, and the same calls' 64 KiB, 1 MiB and 16 MiB points fitted
alone (the three-size line, without timing anything twice); then all_gathers and
reduce_scatters of 1, 3, 6, 12 and 16 MiB (full buffer) timed alone, the mean of 20 after one
to warm up, as benchmarks/time.py times a step's collectives; each line's prediction of each
against it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SIZES = (1 << 20, 3 << 20, 6 << 20, 12 << 20, 16 << 20)
KINDS = ("all_gather", "reduce_scatter")
THREE = (0, 1, -1)  # 64 KiB, 1 MiB and 16 MiB among the five


def rank_main(rank: int, world_size: int, port: int, rounds: int, out: str) -> None:
    from run import flush_subnormals

    from fxshard.driver.report import calibrate
    from fxshard.ir import compat
    from fxshard.ir.cost import Link, bus_bytes

    torch.set_num_threads(1)
    flush_subnormals()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    ops, n = compat.c10d_functional, world_size
    fitted: list[list[tuple[float, float]]] = []
    fit = calibrate.fit

    def keeping(points: list[tuple[float, float]]) -> Link:  # the points each fit was given
        fitted.append(list(points))
        return fit(points)

    calibrate.fit = keeping  # type: ignore[assignment]
    rows = []
    for r in range(rounds):
        fitted.clear()
        five = calibrate.measure_network(group)
        three = {}
        for i, kind in enumerate(calibrate.KINDS):  # measure_network fits each kind's flight, then its issue
            flight, held = (fit([points[j] for j in THREE]) for points in fitted[2 * i:2 * i + 2])
            three[kind] = Link(flight.latency, flight.bandwidth, issue_latency=held.latency,
                               issue_bandwidth=held.bandwidth)
        for kind in KINDS:
            for size in SIZES:
                numel = size // 4 // n * n
                full, shard = torch.ones(numel), torch.ones(numel // n)
                issue, given = calibrate._collective(kind, full, shard, n, group.group_name)
                alone = calibrate._seconds(lambda call=issue: ops.wait_tensor(call()), full.device, least=0.0, calls=20,
                                           how="mean")
                bus = bus_bytes(kind, given, n)
                rows.append({"round": r, "kind": kind, "bytes": size, "measured_s": alone,
                             "five_s": five.links[kind].seconds(bus, n), "three_s": three[kind].seconds(bus, n)})
    calibrate.fit = fit  # type: ignore[assignment]
    if rank == 0:
        torch.save(rows, os.path.join(out, "rows.pt"))
    dist.destroy_process_group()


def summary(rows: list[dict[str, Any]], key: str) -> tuple[int, float]:
    errors = [r[key] / r["measured_s"] - 1.0 for r in rows]
    return sum(abs(e) <= 0.25 for e in errors), (sum(e * e for e in errors) / len(errors)) ** 0.5


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Machine: {meta['machine']}; torch {meta['torch']}; gloo over 2 ranks, one thread each; fxshard "
             f"{meta['fxshard']}; {meta['rounds']} calibrations. Each collective timed alone (the mean of 20) "
             "against the line calibration fits through its five sizes and through three of the same calls.", "",
             "| kind | MiB | measured ms (min-max) | five sizes: error (min-max) | three sizes: error (min-max) |",
             "|---|---:|---|---|---|"]
    for kind in KINDS:
        for size in SIZES:
            mine = [r for r in rows if r["kind"] == kind and r["bytes"] == size]
            measured = [r["measured_s"] * 1e3 for r in mine]
            cells = []
            for key in ("five_s", "three_s"):
                errors = [r[key] / r["measured_s"] - 1.0 for r in mine]
                cells.append(f"{sorted(errors)[len(errors) // 2]:+.0%} ({min(errors):+.0%} to {max(errors):+.0%})")
            lines.append(f"| {kind} | {size >> 20} | {sorted(measured)[len(measured) // 2]:.2f} "
                         f"({min(measured):.2f}-{max(measured):.2f}) | {cells[0]} | {cells[1]} |")
    (five, five_rms), (three, three_rms) = summary(rows, "five_s"), summary(rows, "three_s")
    lines += ["", f"Within 25%: five sizes {five} of {len(rows)} (root mean square error {five_rms:.0%}), "
                  f"three sizes {three} of {len(rows)} ({three_rms:.0%}). The error's middle value per row, "
                  "then its range over the calibrations."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from run import fxshard_version, machine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="fxshard-network-sizes-") as scratch:
        mp.spawn(rank_main, args=(2, port, args.rounds, scratch), nprocs=2)
        rows = torch.load(os.path.join(scratch, "rows.pt"), weights_only=False)
    meta = {"machine": machine(), "torch": torch.__version__, "fxshard": fxshard_version(), "rounds": args.rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "network_sizes.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    table = markdown(rows, meta)
    (out / "network_sizes.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
