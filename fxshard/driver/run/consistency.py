"""Rank agreement: before every forward and every backward, the ranks prove they run the same step.

Each phase of a compiled step starts with one tiny all_gather: every rank
sends 8 bytes, the fingerprint of the collectives it is about to issue in
this phase (kind, shape, dtype, group and unit of each, and the phase). Ranks
whose fingerprints agree proceed, whatever their input shapes: a smaller last
batch issues the same collectives. Ranks that would issue different
collectives (one in eval mode or without grad, another model, a rank that
skipped a backward) learn it before any of them issues one, exchange their
descriptions, and every rank raises ``CollectiveMismatchError`` naming each
rank's step and the first collective that differs. Without this, gloo aborts
the process on mismatched sizes, or mismatched collectives of equal size
exchange the wrong bytes silently.

A rank whose peers never arrive (gone, stalled, in another collective such as
a barrier) raises after the driver's timeout; see ``runtime.with_comm_groups``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxshard.driver.run.runtime import World, comm_device, wait_within
from fxshard.ir import compat
from fxshard.ir.collectives import Collective
from fxshard.ir.errors import CollectiveMismatchError, FxShardError

Description = dict[str, Any]
AGREEMENT_BYTES = 8  # each rank's contribution to the agreement all_gather


def agree(phase: str, fingerprint: bytes, describe: Callable[[], Description], world: World) -> None:
    """Every rank about to run ``phase`` with ``fingerprint`` meets here; raise unless all agree."""
    if world.group is None or world.job_size == 1 or dist.get_backend(world.group) == "fake":
        return  # nobody to agree with (torch's fake process group communicates nothing)
    group = world.job_group
    device = comm_device(group)
    mine = torch.frombuffer(bytearray(fingerprint), dtype=torch.int64).clone().to(device)
    everyone = torch.empty(world.job_size, dtype=torch.int64, device=device)
    with compat.no_python_context():  # the backward's agreement runs inside a backward
        work = compat.all_gather_single(everyone, mine, group=group, async_op=True)
    seconds = world.timeout.total_seconds() if world.timeout is not None else None
    wait_within(work, seconds, lambda what: FxShardError(
        f"{world.who()}: the other ranks did not reach the {phase} of this step {what}: "
        "a peer is gone, stalled, or busy elsewhere (validation or a barrier on "
        "some ranks only). Every rank must call the model the same number of times, in the "
        "same order; fxshard.compile(..., timeout=seconds) sets how long to wait (default: the "
        "process group's timeout)."
    ), group)
    if bool((everyone == mine).all()):
        return
    descriptions: list[Description | None] = [None] * world.job_size
    with compat.no_python_context():
        dist.all_gather_object(descriptions, describe(), group=group)
    raise CollectiveMismatchError(_mismatch(descriptions, world))


def with_buffer_broadcast(fingerprint: bytes) -> bytes:
    """The fingerprint of a phase that starts with the broadcast of rank 0's buffers."""
    return hashlib.sha256(fingerprint + b"broadcast_buffers").digest()[:AGREEMENT_BYTES]


def describe_step(phase: str, graph: str, grad: bool, inputs: list[torch.Tensor],
                  collectives: list[Collective], broadcast: bool = False) -> Description:
    shapes = describe_tensors(inputs)
    issued = (["broadcast of rank 0's buffers"] if broadcast else []) + [str(c) for c in collectives]
    return {"phase": phase, "mode": "train" if graph != "inference" else "eval/inference",
            "grad": grad, "inputs": shapes or "none", "collectives": issued}


def _mismatch(descriptions: list[Description | None], world: World) -> str:
    """The ranks' steps (``descriptions``, in the job group's order), each under its job rank."""
    steps = [d or {} for d in descriptions]
    members = world.job_members()
    lines = [f"ranks would issue different collectives (seen from {world.who()}):"]
    for r, d in zip(members, steps):
        lines.append(f"  rank {r}: {d.get('phase')} of a {d.get('mode')} step, grad "
                     f"{'on' if d.get('grad') else 'off'}, inputs {d.get('inputs')}, "
                     f"{len(d.get('collectives', []))} collectives")
    seqs = [list(d.get("collectives", [])) for d in steps]
    for i in range(max(len(s) for s in seqs)):
        issued = [s[i] if i < len(s) else "(nothing: its phase ends here)" for s in seqs]
        if len(set(issued)) > 1:
            lines.append(f"collective #{i} of the step differs:")
            lines += [f"  rank {r}: {c}" for r, c in zip(members, issued)]
            break
    else:
        lines.append("their collectives print alike but the phases differ")
    lines.append(
        "Every rank must run the same steps in the same order: the same model, policy and "
        "options, the same mode (train/eval) and grad mode, forward then backward. Input "
        "shapes may differ where they change no collective (a smaller last batch)."
    )
    return "\n".join(lines)


def describe_tensors(tensors: Sequence[torch.Tensor]) -> str:
    """"float32[4, 12], int64[4]": dtypes and shapes, as messages and reports show inputs."""
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
