"""What every pass is told: the plan, the world, and which graph it is looking at."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from fxshard.ir.checkpointing import Checkpointing
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.layout import Layout
from fxshard.ir.options import ShardingOptions
from fxshard.ir.plan import ShardPlan

GraphKind = Literal["joint", "forward", "backward", "inference"]


@dataclass(frozen=True)
class GradSync:
    """What a training step does with each flat group's gradient.

    By default it reduces it. Inside ``no_sync`` (``accumulate``) it adds it to
    the group's unsharded accumulator and communicates nothing. The groups in
    ``flush`` have an accumulated sum waiting: the step reduces gradient + sum
    and releases the accumulator (the first synced step after ``no_sync``).
    """

    accumulate: bool = False
    flush: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.accumulate and self.flush:
            raise ValueError("a step either accumulates or flushes accumulated gradients")

    @property
    def reduces(self) -> bool:
        """Does this step reduce gradients at all (anything but ``no_sync``)?"""
        return not self.accumulate

    def __repr__(self) -> str:
        if self.accumulate:
            return "GradSync(accumulate)"
        return f"GradSync(flush={sorted(self.flush)})" if self.flush else "GradSync(reduce)"


REDUCE = GradSync()


@dataclass(frozen=True)
class Holding:
    """How one flat group is held and moved, one value (``PassContext.holding``); with a
    direction, the lowering table's key (``LoweringKey.of``).

    ``topology``: "local" (one rank: no collective), "replicated" (whole on every rank:
    NO_SHARD), "sharded" (over the shard group), "hybrid" (HSDP: sharded, and replicated
    over ``layout.replicate``).
    ``gather``, how a gather's bytes travel: "dtype", the group's compute dtype (its
    shard's, or mixed precision's param_dtype); otherwise the key of the group's wire format
    (``FlatGroup.wire``, an option's: e.g. "quantized_tensor" for
    ``MixedPrecision(gather_dtype=...)``), whose lowering rows encode the shard before the
    gather and decode the gathered bytes to the compute dtype.
    ``reduce``, a reduction's: "dtype", summed by the collective in the reduce dtype;
    "terms" (``reduce_in_rank_order``), each rank's term sent as it is and summed in rank
    order where it lands.
    ``placement``, where the shard lives: "device", where it computes; "cpu", on the host
    (``offload_policy=CPUOffloadPolicy()``), its gradient reduced on the device and copied
    back, the optimizer stepping there.
    """

    topology: str
    gather: str = "dtype"
    reduce: str = "dtype"
    placement: str = "device"

    def wire(self, reduces: bool) -> str:
        return self.reduce if reduces else self.gather


@dataclass(frozen=True)
class PassContext:
    plan: ShardPlan
    # Over which ranks the flat groups are sharded, and the process groups the
    # collectives run on (fxshard.ir.layout). No process group (one rank):
    # markers lower to nothing, no collectives.
    layout: Layout
    graph: GraphKind
    # Forward graph of a training step: outputs past this index are the
    # tensors saved for backward (AOTAutograd's calling convention).
    num_user_outputs: int | None = None
    verify: bool = True
    options: ShardingOptions = ShardingOptions()
    grad_sync: GradSync = REDUCE
    # Flat group -> its unsharded gradient accumulator (no_sync), owned by the driver.
    accumulators: Mapping[int, torch.Tensor] = field(default_factory=dict, compare=False)
    # The regions whose activations backward recomputes (activation_checkpointing=).
    checkpointing: Checkpointing | None = None
    # "inductor": Inductor compiles the emitted graphs (what a pass may emit differs).
    compute: str = "eager"

    def unit_of(self, group: int) -> str:
        if not 0 <= group < len(self.plan.groups):
            raise GraphInvariantError(
                f"flat group {group} is not in the plan ({len(self.plan.groups)} groups): "
                "the graph was traced for another plan"
            )
        return self.plan.groups[group].unit

    def counts_in_flight(self, group: int) -> bool:
        """Does this group's gathered buffer count toward ``max_inflight_gathers``?

        Only units the one-unit lookahead prefetches do. A unit that is not resharded is
        resident; the root, resharded or not, is gathered for the whole forward when the
        model reads it at both ends (an embedding tied to the output head), and counting
        it would leave no slot to prefetch any block (FSDP2 keeps its root out of the
        lookahead too).
        """
        return self.reshards(group) and self.unit_of(group) != ""

    def reshards(self, group: int) -> bool:
        """Is this group's gathered buffer freed after forward and gathered again in backward?"""
        return self.options.reshards(self.unit_of(group))

    def partitioned(self, group: int) -> bool:
        """hpZ: does this group's forward keep a piece of its gathered buffer over the layout's
        partition, which backward gathers within (``reshard_within_pass``)?"""
        return (self.layout.partition is not None and self.reshards(group)
                and not self.plan.groups[group].replicated)

    def holding(self, group: int) -> Holding:
        """How this group is held and moved: the lowering table's key, less its direction
        (``fxshard/passes/lowering.py``)."""
        if not self.layout.communicates:
            topology = "local"
        elif self.plan.groups[group].replicated:
            topology = "replicated"
        else:
            topology = "hybrid" if self.layout.replicate is not None else "sharded"
        wire = self.plan.groups[group].wire
        gather = wire.key if wire is not None and topology != "replicated" else "dtype"
        reduce = "terms" if self.options.reduce_in_rank_order and topology != "local" else "dtype"
        return Holding(topology, gather, reduce, "cpu" if self.options.offloads(self.unit_of(group)) else "device")

    def keeps_buffer(self, group: int) -> bool:
        """In the joint graph: does backward read this group's forward buffer (not resharded,
        or hpZ, whose forward then keeps only a piece of it) rather than gather it again?"""
        return not self.reshards(group) or self.partitioned(group)
