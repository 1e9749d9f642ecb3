"""The collectives a step issues, read off the emitted graphs.

One ordered list per step: what every rank must issue identically (the
fingerprint compared across ranks) and what the communication report adds up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.chains import chains

KINDS = P.KINDS


@dataclass(frozen=True)
class Collective:
    graph: str  # "forward", "backward" or "inference"
    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "all_to_all"
    unit: str
    shape: tuple[int, ...]  # of the input tensor
    dtype: torch.dtype
    group_size: int
    group_name: str
    reduce_op: str | None
    # The layout's dimension the group belongs to ("shard"; HSDP's "replicate") and its slot
    # there: the same on every rank, where HSDP's group names differ between rows.
    dimension: str = ""
    slot: int = 0
    lowering: str = ""  # the lowering table's entry that made it (fxshard/passes/lowering.py)
    direction: str = ""  # its chain's: "gather" (parameters in) or "reduce" (gradients out)

    @property
    def input_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize

    @property
    def bus_bytes(self) -> int:
        """Bytes each rank sends (= receives): the (N-1)/N accounting of ring algorithms."""
        return bus_bytes(self.kind, self.input_bytes, self.group_size)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        op = f", {self.reduce_op}" if self.reduce_op else ""
        group = f"{self.dimension} slot {self.slot}" if self.dimension else self.group_name
        return (f"{self.graph}: {self.kind}({dtype}{list(self.shape)}{op}, group={group} "
                f"of {self.group_size}) for unit {self.unit or '<root>'!r}")


def bus_bytes(kind: str, input_bytes: int, group_size: int) -> int:
    n = group_size
    if kind == "all_gather":  # input is one shard; each rank receives the N-1 others
        return input_bytes * (n - 1)
    if kind == "reduce_scatter":  # input is the full buffer
        return input_bytes * (n - 1) // n
    if kind == "all_reduce":  # reduce-scatter + all-gather
        return 2 * input_bytes * (n - 1) // n
    if kind == "all_to_all":  # input is the full buffer; each rank keeps its own 1/N
        return input_bytes * (n - 1) // n
    raise ValueError(kind)


def collectives(graph_name: str, gm: fx.GraphModule,
                dimensions: Mapping[str, tuple[str, int]] | None = None) -> list[Collective]:
    """The collectives ``gm``'s chains issue (``fxshard.ir.chains``), in graph order;
    ``dimensions`` names each process group's dimension of the layout and slot there
    (``Layout.dimensions``)."""
    return [c for _, c in collective_nodes(graph_name, gm, dimensions)]


def collective_nodes(graph_name: str, gm: fx.GraphModule,
                     dimensions: Mapping[str, tuple[str, int]] | None = None,
                     ) -> list[tuple[fx.Node, Collective]]:
    """``collectives``, each with the node that issues it."""
    order = order_of(gm.graph)
    issued = sorted(((c, chain) for chain in chains(gm.graph) for c in chain.collectives),
                    key=lambda pair: order[pair[0]])
    result = []
    for node, chain in issued:
        args = P.collective_args(node)
        assert isinstance(args.input, fx.Node)
        val = args.input.meta["val"]
        dimension, slot = (dimensions or {}).get(args.group_name, ("", 0))
        result.append((node, Collective(graph_name, args.kind, chain.unit, tuple(val.shape), val.dtype,
                                        args.ranks(), args.group_name, args.reduce_op, dimension, slot,
                                        chain.lowering, chain.direction.value)))
    return result


def step_collectives(graphs: dict[str, fx.GraphModule],
                     dimensions: Mapping[str, tuple[str, int]] | None = None) -> list[Collective]:
    """Forward (or inference) then backward: the order one step issues them in."""
    order = ("forward", "inference", "backward")
    return [c for name in order if name in graphs for c in collectives(name, graphs[name], dimensions)]


def fingerprint(sequence: list[Collective], phase: str = "") -> bytes:
    """8 bytes that differ when the sequence (or the phase it is issued in) differs."""
    text = phase + "\n" + "\n".join(str(c) for c in sequence)
    return hashlib.sha256(text.encode()).digest()[:8]


def bytes_per_dimension(sequence: list[Collective]) -> dict[str, int]:
    """Bus bytes of the steps' collectives per layout dimension: "shard" (inside each shard
    group) and, under HSDP, "replicate" (between replicas: what crosses nodes)."""
    totals: dict[str, int] = {}
    for c in sequence:
        if c.dimension:
            totals[c.dimension] = totals.get(c.dimension, 0) + c.bus_bytes
    return totals


def bytes_per_kind(sequence: list[Collective], agreement_bytes: int = 0,
                   broadcast_bytes: int = 0) -> dict[str, int]:
    """Bus bytes per kind and "total"; "broadcast" (rank 0's buffers) only where there is one."""
    totals = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "agreement": agreement_bytes}
    if broadcast_bytes:
        totals["broadcast"] = broadcast_bytes
    for c in sequence:  # "all_to_all" only where a step issues one (reduce_in_rank_order)
        totals[c.kind] = totals.get(c.kind, 0) + c.bus_bytes
    totals["total"] = sum(totals.values())
    return totals
