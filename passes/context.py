"""What every pass is told: the plan, the world, and which graph it is looking at."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.options import ShardingOptions
from fxshard.ir.plan import ShardPlan

GraphKind = Literal["joint", "forward", "backward", "inference"]
# What a training step does with each unit's gradient: reduce it (the default),
# add it to an unsharded accumulator without communicating (inside no_sync), or
# reduce it together with the accumulated sum (the first synced step after).
GradSync = Literal["reduce", "accumulate", "flush"]


@dataclass(frozen=True)
class PassContext:
    plan: ShardPlan
    world_size: int
    # Name of the c10d process group the collectives run on. None means no
    # process group (world size 1): markers lower to nothing, no collectives.
    group_name: str | None
    graph: GraphKind
    # Forward graph of a training step: outputs past this index are the
    # tensors saved for backward (AOTAutograd's calling convention).
    num_user_outputs: int | None = None
    verify: bool = True
    options: ShardingOptions = ShardingOptions()
    # Names of the process groups of the in-flight slots, when collectives in
    # flight together must go on different groups (assign_groups_pass).
    inflight_groups: tuple[str, ...] = ()
    grad_sync: GradSync = "reduce"
    # Flat group -> its unsharded gradient accumulator (no_sync), owned by the driver.
    accumulators: Mapping[int, torch.Tensor] = field(default_factory=dict, compare=False)

    def unit_of(self, group: int) -> str:
        if not 0 <= group < len(self.plan.groups):
            raise GraphInvariantError(
                f"flat group {group} is not in the plan ({len(self.plan.groups)} groups): "
                "the graph was traced for another plan"
            )
        return self.plan.groups[group].unit

    def reshards(self, group: int) -> bool:
        """Is this group's gathered buffer freed after forward and gathered again in backward?"""
        return self.options.reshards(self.unit_of(group))
