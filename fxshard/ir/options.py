"""Scheduling and sharding options: one frozen dataclass, passed through to every pass.

Each option's effect on the emitted graphs is described in docs/scheduling.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from fxshard.ir.spellings import ForeignOption, foreign_option

BackwardPrefetch = Literal["pre", "post"] | None

# Options that no longer exist, and what to use instead.
REMOVED = {
    "prefetch_within_peak": (
        "it placed gathers by each rank's activation sizes, so ranks with different batch sizes "
        "planned different collective schedules. The schedule now depends only on the plan, the "
        "options and the graph's structure. To lower the peak, use memory_budget=bytes (the "
        "planner reshards, limits prefetch and recomputes for you) or max_inflight_gathers=1."
    ),
}


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy``: every flat shard, its gradient and so the optimizer
    state and step live on the host. Each gather copies the shard to the device first
    (scheduled ahead with the gather), each reduction copies the shard's gradient back.
    ``pin_memory``: the host shards are pinned (page-locked) where the device is an
    accelerator, so the copies overlap compute."""

    pin_memory: bool = True


@dataclass(frozen=True)
class ShardingOptions:
    # ZeRO-3 (True): gathered parameters are freed after forward and gathered
    # again in backward. ZeRO-2 (False): kept from forward to backward. An int
    # h (FSDP2's; ZeRO++'s hpZ): after forward each rank keeps its piece of the
    # gathered parameters over groups of h consecutive ranks of the shard group,
    # and backward gathers within those groups only. h must divide the shard
    # group's size; h equal to it is True, 1 is False.
    reshard_after_forward: bool | int = True
    # The root unit, as in FSDP2, is not resharded by default: backward needs
    # it first. True reshards it like every other unit.
    reshard_root: bool = False
    # Issue unit k+1's all_gather before unit k's compute.
    forward_prefetch: bool = True
    # Backward: "pre" issues the next unit's gather before the current unit's
    # gradient computation, "post" after it, None just in time.
    backward_prefetch: BackwardPrefetch = "pre"
    # At most this many gathered buffers of resharded units alive at once;
    # a prefetch that would exceed it waits for a free. Never a CPU sync.
    max_inflight_gathers: int = 2
    # Optional cap on the bytes of those buffers.
    max_inflight_bytes: int | None = None
    # When set, exactly these units (names; "" the root) are resharded after
    # forward, whatever reshard_after_forward and reshard_root say: FSDP2's
    # per-module reshard_after_forward. The memory budget planner sets it.
    reshard_units: frozenset[str] | None = None
    # Merge runs of adjacent units smaller than this many bytes into one unit
    # (one collective each way). 0: off. Shown in the plan.
    bucket_bytes: int = 0
    # Parameters with fewer elements than this stay whole on every rank; their
    # gradients are all-reduced (DeepSpeed's persistence threshold). 0: off.
    replicate_below: int = 0
    # Sum each gradient element's terms in rank order, ((g0 + g1) + g2) + ..., on the
    # rank that keeps it, whatever the topology: an all_to_all (the reduce_scatter's
    # bytes) and local adds in place of the reduce_scatter; HSDP then gathers the
    # row's terms across replicas (S times the all_reduce's bytes there). FULL_SHARD,
    # HSDP, NO_SHARD and hpZ of one job size then give the same bits, and the same
    # as DDP with a comm hook that sums in rank order (docs/launching.md).
    reduce_in_rank_order: bool = False
    # FSDP2's offload_policy: CPUOffloadPolicy() keeps the shards, their gradients and
    # the optimizer step on the host (docs/memory.md). None: on the device.
    offload_policy: CPUOffloadPolicy | None = None
    # When set with offload_policy, exactly these units (names; "" the root) keep their
    # shards on the host, the others on the device. The memory budget planner sets it:
    # with offload_policy and memory_budget, it offloads only the units the budget needs.
    offload_units: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("reshard_root", "forward_prefetch", "reduce_in_rank_order"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} takes True or False, got {getattr(self, name)!r}")
        for name, bound in (("max_inflight_gathers", "at least 1"), ("bucket_bytes", "0 for off"),
                            ("replicate_below", "0 for off"), ("max_inflight_bytes", "None for no cap")):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)) and not (
                    value is None and name == "max_inflight_bytes"):
                raise TypeError(f"{name} takes a whole number ({bound}), got {value!r}"
                                + (": a number of bytes, e.g. 64 << 20 for 64 MiB" if "bytes" in name else ""))
        hpz = self.reshard_after_forward
        if not isinstance(hpz, int) or not isinstance(hpz, bool) and hpz < 1:
            raise ValueError(
                "reshard_after_forward takes True (reshard to the shard group), False (keep the "
                "gathered parameters for backward) or a number of ranks h >= 1 dividing the shard "
                f"group's size (keep them sharded over groups of h ranks: hpZ), got {hpz!r}"
            )
        policy = self.offload_policy
        if policy is not None and not isinstance(policy, CPUOffloadPolicy):
            if type(policy).__name__ == "CPUOffloadPolicy":  # torch.distributed.fsdp's
                object.__setattr__(self, "offload_policy",
                                   CPUOffloadPolicy(pin_memory=bool(getattr(policy, "pin_memory", True))))
            elif type(policy).__name__ == "OffloadPolicy":  # FSDP2's base class: no offload
                object.__setattr__(self, "offload_policy", None)
            else:
                raise TypeError(f"offload_policy takes fxshard.CPUOffloadPolicy() (or FSDP2's), got "
                                f"{policy!r}")
        for name in ("reshard_units", "offload_units"):
            units = getattr(self, name)
            if units is None:
                continue
            if isinstance(units, str) or not all(isinstance(u, str) for u in units):
                raise TypeError(f"{name} takes unit names, e.g. {{'blocks.0', ''}} ('' is the root), "
                                f"got {units!r}")
            object.__setattr__(self, name, frozenset(units))
        if self.offload_units and self.offload_policy is None:
            raise ValueError("offload_units names units to keep on the host, which needs "
                             "offload_policy=fxshard.CPUOffloadPolicy() too")
        member = getattr(self.backward_prefetch, "name", None)
        if type(self.backward_prefetch).__name__ == "BackwardPrefetch" and member in ("BACKWARD_PRE", "BACKWARD_POST"):
            # FSDP1's enum: its two members are "pre" and "post"
            object.__setattr__(self, "backward_prefetch", "pre" if member == "BACKWARD_PRE" else "post")
        if self.backward_prefetch not in ("pre", "post", None):
            raise ValueError(
                f"backward_prefetch must be 'pre', 'post' or None, got {self.backward_prefetch!r}"
            )
        if self.max_inflight_gathers < 1:
            raise ValueError(f"max_inflight_gathers must be at least 1, got {self.max_inflight_gathers}")
        if self.bucket_bytes < 0 or self.replicate_below < 0:
            raise ValueError("bucket_bytes and replicate_below must be non-negative")
        if self.max_inflight_bytes is not None and self.max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be positive, got {self.max_inflight_bytes}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ShardingOptions:
        known = {f.name for f in fields(cls)}
        for name, why in REMOVED.items():
            if name in kwargs:
                raise TypeError(f"fxshard option {name!r} was removed: {why}")
        unknown = sorted(set(kwargs) - known)
        hints = [hint for name in unknown if (hint := foreign_option(name, kwargs[name])) is not None]
        if hints:
            raise ForeignOption("; ".join(hints))
        if unknown:
            raise TypeError(f"unknown fxshard option(s) {unknown}; options are {sorted(known)}")
        return cls(**kwargs)

    def offloads(self, unit: str) -> bool:
        """Does ``unit``'s shard live on the host (``offload_policy``, and ``offload_units``
        where set)?"""
        if self.offload_policy is None:
            return False
        return self.offload_units is None or unit in self.offload_units

    def offloaded_groups(self, groups: Any) -> frozenset[int]:
        """The indices of the flat groups (``ShardPlan.groups``) whose shards live on the host."""
        return frozenset(g.index for g in groups if self.offloads(g.unit))

    def prefetch_mode(self, graph: str) -> BackwardPrefetch:
        """How gathers of ``graph`` ("forward", "inference", "backward") are prefetched;
        None: just in time."""
        if graph == "backward":
            return self.backward_prefetch
        return "pre" if self.forward_prefetch else None

    def reshards(self, unit: str) -> bool:
        """Is ``unit``'s gathered buffer freed after forward (and gathered again in backward)?"""
        if self.reshard_units is not None:
            return unit in self.reshard_units
        if unit == "":
            return self.reshard_root
        return self.reshard_after_forward is True or self.reshard_after_forward not in (False, 1)

    @property
    def partitions(self) -> bool:
        """Is ``reshard_after_forward`` a number of ranks (hpZ, unless it is the shard group's)?"""
        return not isinstance(self.reshard_after_forward, bool) and self.reshard_after_forward > 1

    def hpz_size(self, shard_size: int) -> int | None:
        """The ranks a resharded unit's parameters stay sharded over between forward and
        backward when that is fewer than the shard group's ``shard_size`` (hpZ); None when
        resharding is to the whole shard group, or there is none. Raises for a size that
        does not divide ``shard_size``."""
        h = self.reshard_after_forward
        if isinstance(h, bool) or h in (1, shard_size):
            return None
        if shard_size % h:
            divisors = [d for d in range(1, shard_size + 1) if shard_size % d == 0]
            raise ValueError(
                f"reshard_after_forward={h}: the shard group has {shard_size} ranks, which groups "
                f"of {h} do not divide; pass one of {divisors} (1 keeps the whole parameters, as "
                f"False does; {shard_size} reshards to the shard group, as True does)"
            )
        return h
