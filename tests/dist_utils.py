"""Run a function on N real gloo ranks (torch.multiprocessing.spawn) and collect results."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, out_dir: str, fn: Callable[..., Any],
            args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    # A file store, not a TCP port: test processes running side by side (pytest -n)
    # never race for a port.
    store = dist.FileStore(os.path.join(out_dir, "store"), world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank of a fresh gloo group; results by rank.

    ``fn`` must be importable (a module-level function). An exception on any
    rank is raised here.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, out_dir, fn, args), nprocs=world_size)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
