"""Stress: fxshard's emitted collectives in a tight loop on gloo ranks must not corrupt the heap.

``ProcessGroupGloo::runLoop`` writes the group's status (the name of the last
completed work, a heap string for the functional all_gather's
"ALLGATHER_COALESCED") from its worker threads without a lock, after the work
is marked done (docs/devices.md). Two worker threads of one group can write it
at once, and free the same buffer twice, in two ways:

- two collectives in flight together on one group: fxshard puts those on
  different groups (assign_groups_pass);
- a collective waited and the next issued on the same group at once, the first
  worker thread still writing: seen under load (a full CI run), never alone.
  fxshard's gloo groups have one worker thread each (compat.one_thread_gloo).

Both are checked structurally, every run, on 1 rank as on 2: a single rank's
gathers and reduce-scatters are collectives on gloo all the same, and they once
ran on the default group's two threads (an abort in DDP parity at world size 1).
The loop itself, with glibc's tcache off so that a double free aborts at once,
is the smoke test.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard.ir import compat
from fxshard.ir import predicates as P
from fxshard.policies import by_class

from models import MLP

ITERATIONS = 1000


def _shared_in_flight(schedule: list) -> list[str]:  # type: ignore[type-arg]
    """Collectives issued on a group while another collective on it is still in flight."""
    in_flight: dict[str, str] = {}
    found = []
    for node, tensor in schedule:
        if tensor is None:
            in_flight = {g: n for g, n in in_flight.items() if n != node.args[0].name}
            continue
        group = node.args[-1]
        if group in in_flight:
            found.append(f"{node.name} with {in_flight[group]} on group {group}")
        in_flight[group] = node.name
    return found


def _stress(rank: int, world_size: int, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    torch.manual_seed(0)
    # Eight small units, up to four gathers prefetched, and the reduce-scatters
    # of backward overlapping the next unit's gather.
    sharded = fxshard.compile(MLP(d_in=8, hidden=8, d_out=8, depth=8), policy=by_class(nn.Linear),
                              max_inflight_gathers=4)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    F.mse_loss(sharded(x), y).backward()  # trace, and one real step
    # The emitted schedule's collectives alone, issued and waited where the
    # graphs issue and wait them, in a tight loop: no compute in between.
    schedule = []
    for gm in (sharded.graphs["forward"], sharded.graphs["backward"]):
        for node in gm.graph.nodes:
            if P.is_collective(node):
                val = node.args[0].meta["val"]
                schedule.append((node, torch.randn(val.shape, dtype=val.dtype)))
            elif P.is_wait(node):
                schedule.append((node, None))
    shared = _shared_in_flight(schedule)
    if shared:  # deterministic, whether or not this run happens to crash
        raise AssertionError(f"collectives in flight together on one group: {shared}")
    threads = {name: compat.gloo_threads(compat.resolve_process_group(name))
               for name in {node.args[-1] for node, tensor in schedule if tensor is not None}}
    if len(threads) < 2 or any(n != 1 for n in threads.values()):
        raise AssertionError(f"fxshard's gloo groups must have one worker thread each: {threads}")
    for _ in range(ITERATIONS):
        issued = {}
        for node, tensor in schedule:
            if tensor is not None:
                issued[node] = node.target(tensor, *node.args[1:])
            else:
                torch.ops._c10d_functional.wait_tensor(issued.pop(node.args[0]))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow  # a stress loop; the fast tier runs the same collectives in every 2-rank test
@pytest.mark.parametrize("world_size", [1, 2])
def test_emitted_collectives_in_a_tight_loop_do_not_corrupt_the_heap(world_size: int) -> None:
    previous = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.tcache_count=0"  # read by the spawned ranks at start
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_stress, args=(world_size, os.path.join(tmp, "store")), nprocs=world_size)
    finally:
        if previous is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = previous
