"""What checkpoint checksums and the ranks' agreements cost: save and load with and without them,
side by side in one run, on 2 gloo ranks.

    python benchmarks/checkpoint_cost.py            # the benchmark GPT (benchmarks/run.py's "gpt")
    python benchmarks/checkpoint_cost.py --quick    # its quick shape

The model is benchmarks/run.py's GPT, sharded per block, with AdamW state;
every rank saves its shards and optimizer state. Each round times, in
alternating order so neither side always runs on a warmer cache:

- ``dcp_save`` / ``dcp_save_checked``: ``dcp.save`` of ``fxshard.get_state_dict``'s
  values with DCP's ``FileSystemWriter`` / ``fxshard.checkpoint.ChecksumWriter``
  (which reads back every item it wrote and records its CRC-32);
- the same with ``sync_files=False`` (``_nosync``): no fsync, so the difference is
  all the checksums' own work (reading back and CRC-32), against the least;
- ``dcp_load`` / ``dcp_load_checked``: ``dcp.load`` of them with
  ``FileSystemReader`` / ``ChecksumReader`` (every item checked before it is read);
- ``plain_save`` / ``fxshard_save``: the whole of a save, plain DCP's
  (``get_state_dict`` + ``dcp.save``) against ``fxshard.checkpoint.save``
  (agreements, checksums, the atomic rename);
- ``plain_load`` / ``fxshard_load``: the whole of a load (``get_state_dict`` +
  ``dcp.load`` + ``set_state_dict``) against ``fxshard.checkpoint.load``
  (metadata check, agreements, checksums);
- ``crc32_pass``: the checksums' own work alone: the CRC-32 of this rank's file, read
  once from the page cache (what ``ChecksumWriter`` adds to a save and
  ``ChecksumReader`` to a load of the same layout);
- ``set_full`` / ``content_digest``: ``fxshard.set_model_state_dict`` of a full
  state dict, and within it the digest of its parameters that the ranks compare.

Every operation starts after ``os.sync()``, so none pays for an earlier one's
writes. A time is the slowest rank's (an operation ends when its last rank does);
the ratios are of the medians over the rounds, of the fastest rounds, and the
median of each round's ratio (its pair measured back to back). The files are written with
``sync_files=True`` (DCP's default): each save ends with an fsync. The loads
read files the page cache still holds, which is where checking costs the most
relative to the read. Results: ``benchmarks/results/checkpoint_integrity.json``.
Absolute times on a shared machine are noise; the ratios are the claim.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402  (benchmarks/run.py: the benchmark's models)

import fxshard  # noqa: E402
from fxshard.backend import sharding_of  # noqa: E402
from fxshard.driver.state import state_dicts as state  # noqa: E402
from fxshard.policies import by_class  # noqa: E402

PAIRS = (("dcp_save", "dcp_save_checked"), ("dcp_save_nosync", "dcp_save_checked_nosync"),
         ("dcp_load", "dcp_load_checked"), ("plain_save", "fxshard_save"), ("plain_load", "fxshard_load"))


def _timed(fn: Callable[[], Any]) -> float:
    """The slowest rank's wall time of ``fn`` (a collective), ranks started together, with no
    data of an earlier operation left to write back (an fsync would wait for it)."""
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def hash_speeds() -> dict[str, float]:
    """One core's throughput of the hashes a checksum could use, on 64 MiB in memory."""
    data = memoryview(os.urandom(64 << 20))
    speeds = {}
    for name, fn in (("crc32", lambda: zlib.crc32(data)), ("sha256", lambda: hashlib.sha256(data).digest()),
                     ("blake2b", lambda: hashlib.blake2b(data).digest())):
        best = min(_seconds(fn) for _ in range(3))
        speeds[name] = round(64 * 1.048576 / best)
    return speeds


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, store_path: str, root: str, quick: bool, rounds: int,
           out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # plain dcp.load's, about ShardedTensor
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    spec = run.model_spec("gpt", quick)
    torch.manual_seed(0)
    sharded = fxshard.compile(spec["make"](), policy=by_class(spec["block"]))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    group = sharding_of(sharded)[1].world.comm[0]  # where fxshard.checkpoint's save and load talk
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    paths = {name: os.path.join(root, name) for name in ("plain", "checked", "fxshard")}

    def content() -> dict[str, Any]:
        msd, osd = fxshard.get_state_dict(sharded, opt)
        return {"model": msd, "optim": osd}

    def save_with(writer: type[dcp.FileSystemWriter], path: str, values: dict[str, Any],
                  sync: bool = True) -> None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        dcp.save(values, storage_writer=writer(path, sync_files=sync), process_group=group, planner=planner)

    def plain_load() -> None:
        values = content()
        dcp.load(values, storage_reader=dcp.FileSystemReader(paths["plain"]), process_group=group)
        fxshard.set_state_dict(sharded, opt, model_state_dict=values["model"],
                               optim_state_dict=values["optim"])

    def crc32_pass(directory: Path) -> None:  # what checking adds, alone: this rank's file, once
        with open(directory / f"__{rank}_0.distcp", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            fxshard.checkpoint._crc32(f, 0, size, bytearray(8 << 20))

    full = sharded.full_state_dict()  # parameters only: the GPT has no persistent buffers
    ops: dict[str, Callable[[], Any]] = {
        "dcp_save": lambda: save_with(dcp.FileSystemWriter, paths["plain"], values),
        "dcp_save_checked": lambda: save_with(fxshard.checkpoint.ChecksumWriter, paths["checked"], values),
        "dcp_save_nosync": lambda: save_with(dcp.FileSystemWriter, paths["plain"], values, False),
        "dcp_save_checked_nosync": lambda: save_with(fxshard.checkpoint.ChecksumWriter, paths["checked"],
                                                     values, False),
        "dcp_load": lambda: dcp.load(values, storage_reader=dcp.FileSystemReader(paths["plain"]),
                                     process_group=group),
        "dcp_load_checked": lambda: dcp.load(
            values, storage_reader=fxshard.checkpoint.ChecksumReader(paths["checked"]), process_group=group),
        "plain_save": lambda: save_with(dcp.FileSystemWriter, paths["plain"], content()),
        "fxshard_save": lambda: fxshard.checkpoint.save(paths["fxshard"], sharded, opt),
        "plain_load": plain_load,
        "fxshard_load": lambda: fxshard.checkpoint.load(paths["fxshard"], sharded, opt),
        "crc32_pass": lambda: crc32_pass(Path(paths["checked"])),
        "set_full": lambda: fxshard.set_model_state_dict(sharded, full),
        "content_digest": lambda: state.content_source(full.items(), "parameters"),
    }
    values = content()
    loadavg = os.getloadavg()[0]  # other processes competing for the cores: the noise
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds):
        for first, second in PAIRS:
            for name in (first, second) if r % 2 == 0 else (second, first):
                times[name].append(_timed(ops[name]))
        times["crc32_pass"].append(_timed(ops["crc32_pass"]))
        times["set_full"].append(_timed(ops["set_full"]))
        times["content_digest"].append(_timed(ops["content_digest"]))
    if rank == 0:
        data = sum(f.stat().st_size for f in Path(paths["checked"]).glob("*.distcp"))
        result = {
            "meta": {"model": spec["label"], "parameters": sum(p.numel() for p in spec["make"]().parameters()),
                     "world_size": world_size, "rounds": rounds, "quick": quick,
                     "checkpoint_bytes": data, "torch": torch.__version__,
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                     "load_average_before_after": [loadavg, os.getloadavg()[0]],
                     "what": "seconds: the slowest rank's wall time, median over the rounds"},
            "seconds": {name: statistics.median(ts) for name, ts in times.items()},
            "all_seconds": times,
            # Medians, and the fastest rounds (the least disturbed by whatever else ran).
            "ratios": {second: statistics.median(times[second]) / statistics.median(times[first])
                       for first, second in PAIRS},
            "ratios_of_fastest": {second: min(times[second]) / min(times[first]) for first, second in PAIRS},
            # Each round's pair measured back to back: the median of their ratios.
            "ratios_paired": {second: statistics.median(b / a for a, b in zip(times[first], times[second]))
                              for first, second in PAIRS},
        }
        for ratios, f in (("ratios", statistics.median), ("ratios_of_fastest", min)):
            result[ratios]["content_digest_share_of_set_full"] = f(times["content_digest"]) / f(times["set_full"])
            result[ratios]["crc32_pass_vs_dcp_save_nosync"] = f(times["crc32_pass"]) / f(times["dcp_save_nosync"])
            result[ratios]["crc32_pass_vs_dcp_load"] = f(times["crc32_pass"]) / f(times["dcp_load"])
        result["hash_mb_per_s"] = hash_speeds()
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result[k] for k in ("seconds", "ratios", "ratios_of_fastest", "ratios_paired")},
                         indent=2))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick GPT, two rounds")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every measurement (default 15)")
    p.add_argument("--out", default=str(HERE / "results" / "checkpoint_integrity.json"))
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 15)
    with tempfile.TemporaryDirectory(prefix="fxshard-ckpt-cost-") as root:
        mp.spawn(worker, args=(2, os.path.join(root, "store"), root, args.quick, rounds, args.out), nprocs=2)


if __name__ == "__main__":
    main()
