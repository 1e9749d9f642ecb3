"""Run a function on N real gloo ranks and collect results.

Ranks start one of two ways, chosen by the module that defines the function:

- **forkserver** (the default): each rank is forked from one server process per test worker that
  has imported torch and fxshard once, about 0.1 s a start where a fresh interpreter takes about
  6 s. A forked rank ends with ``os._exit`` after its function returns: no interpreter teardown.
- **spawn**, for a module that sets ``RANKS_START_METHOD = "spawn"``: each rank is a fresh
  interpreter that exits through the normal interpreter teardown, so an abort at exit (a gloo
  worker thread dropping a collective while the interpreter finalizes: docs/situations.md, "A
  clean exit") fails the test that caused it. The modules that test exits, and the collectives
  an abort at exit was seen after (save, load, full state dicts), start their ranks this way.

Either way a rank runs with the test's environment as it is when ``run_ranks`` is called.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the forkserver imports once, before it forks any rank.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "fxshard", "fxshard.checkpoint"])


def _worker(rank: int, world_size: int, out_dir: str, fn: Callable[..., Any],
            args: tuple[Any, ...], environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # a forked rank starts with the server's environment
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


def start_method(fn: Callable[..., Any]) -> str:
    """How ``fn``'s ranks start: its module's ``RANKS_START_METHOD``, else forkserver."""
    method = getattr(sys.modules.get(fn.__module__), "RANKS_START_METHOD", "forkserver")
    assert method in ("forkserver", "spawn"), method
    return str(method)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank of a fresh gloo group; results by rank.

    ``fn`` must be importable (a module-level function). An exception on any
    rank is raised here.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, out_dir, fn, args, dict(os.environ)),
                           nprocs=world_size, start_method=start_method(fn))
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _alone(index: int, out_dir: str, fn: Callable[..., Any], args: tuple[Any, ...], environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    torch.save(fn(*args), os.path.join(out_dir, "result.pt"))


def run_alone(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a process of its own with no process group (one that makes its own,
    such as a rehearsal, leaves nothing behind in the test's); its result."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_alone, args=(out_dir, fn, args, dict(os.environ)), nprocs=1,
                           start_method=start_method(fn))
        return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)
