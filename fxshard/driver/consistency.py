"""Rank consistency: before a step's first run, every rank proves it will issue the same collectives.

A rank whose graphs differ (another model shape, another policy, another
input signature that changes a collective) would otherwise hang in the first
mismatched collective, or silently exchange garbage. The check costs one
8-byte all_gather per traced signature; on a mismatch all ranks learn the
first collective that differs and raise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxshard.driver.runtime import World, wait_within
from fxshard.ir.collectives import Collective, fingerprint
from fxshard.ir.errors import CollectiveMismatchError


def check_same_collectives(sequence: list[Collective], world: World, timeout: float) -> None:
    if world.group is None or world.size == 1 or dist.get_backend(world.group) == "fake":
        return  # nobody to agree with (torch's fake process group communicates nothing)
    digest = torch.frombuffer(bytearray(fingerprint(sequence)), dtype=torch.int64).clone()
    device = _comm_device(world.group)
    mine = digest.to(device)
    everyone = torch.empty(world.size, dtype=torch.int64, device=device)
    work = dist.all_gather_single(everyone, mine, group=world.group, async_op=True)
    wait_within(work, timeout, lambda: CollectiveMismatchError(
        f"rank {world.rank}: not every rank reached the collective check of a newly traced "
        f"step within {timeout:g}s. Ranks must call the model with the same input shapes, "
        "mode (train/eval) and grad mode, so that they trace the same steps."
    ))
    if bool((everyone == mine).all()):
        return
    sequences: list[list[str] | None] = [None] * world.size
    dist.all_gather_object(sequences, [str(c) for c in sequence], group=world.group)
    raise CollectiveMismatchError(_describe(sequences, world.rank))


def _describe(sequences: list[list[str] | None], rank: int) -> str:
    seqs = [s or [] for s in sequences]
    length = max(len(s) for s in seqs)
    for i in range(length):
        issued = [s[i] if i < len(s) else "(nothing: its step ends here)" for s in seqs]
        if len(set(issued)) > 1:
            lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(issued))
            return (
                f"ranks would issue different collectives (seen from rank {rank}); "
                f"collective #{i} of the step differs:\n{lines}\n"
                "Every rank must build the same model with the same policy and options, and "
                "call it with the same input shapes."
            )
    return "ranks' collective fingerprints differ but their sequences print alike"


def _comm_device(group: dist.ProcessGroup) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend in ("xccl", "ccl") and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")
