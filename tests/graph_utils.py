"""Helpers for graph-structure tests: a fake process group, node queries, normalised text."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from fxshard.ir import meta
from fxshard.ir import predicates as P


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A process group of ``world_size`` ranks in this one process; collectives are not run."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def nodes(gm: fx.GraphModule, pred) -> list[fx.Node]:  # type: ignore[no-untyped-def]
    return [n for n in gm.graph.nodes if pred(n)]


def units_of(gm: fx.GraphModule, pred) -> list[str]:  # type: ignore[no-untyped-def]
    """Unit names of the nodes matching ``pred``, in graph order."""
    out = []
    for n in nodes(gm, pred):
        info = meta.get_info(n)
        assert info is not None, f"{n.name} has no fxshard metadata"
        out.append(info.unit)
    return out


def is_gather_wait(n: fx.Node) -> bool:
    return P.is_wait(n) and P.is_all_gather(n.args[0])  # type: ignore[arg-type]


def normalised_ops(gm: fx.GraphModule) -> list[str]:
    """One line per call node: the operator, names stripped, e.g. ``all_gather_into_tensor``."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            target = n.target
            name = str(target.overloadpacket) if isinstance(target, torch._ops.OpOverload) else target.__name__
            out.append(name)
    return out
