"""The layout: over which ranks each flat group is sharded, and where its collectives run.

A pass reads the layout from its context (``ctx.layout``) and never a world size
alone, because two numbers hide behind one today and come apart on a mesh:

- the **shard degree** (``layout.shard.size``): how many pieces a flat group is
  cut into, the all-gather's and the reduce-scatter's group size;
- the **gradient divisor** (``layout.grad_divisor``): how many ranks'
  gradients are averaged, every rank of the job.

With one flat process group both are the world size. HSDP (a 2-D mesh)
adds ``replicate``, the ranks holding the same shard: the shard degree stays the
shard group's size and the divisor becomes the product. A gradient is then
reduce-scattered over ``shard`` and its shard all-reduced over ``replicate``,
so only a shard's worth crosses between replicas.

hpZ (``reshard_after_forward=h``) adds ``partition``: blocks of h consecutive
ranks of the shard group. Forward gathers over ``shard`` as always; each rank
then keeps its ``partition_rank``-th piece of a resharded unit's gathered
buffer (1/h of it, not 1/S), and backward gathers within ``partition`` only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommGroup:
    """One dimension of the layout: ``size`` ranks and the process groups its collectives use.

    ``name`` is the c10d group name a collective names (None: no process group,
    size 1, so collectives lower to nothing). ``slots`` are the groups of the
    in-flight slots over the same ranks, when collectives in flight together must
    go on different groups (``assign_groups_pass``; empty: all on ``name``).
    """

    size: int
    name: str | None
    slots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a layout dimension needs at least one rank, not {self.size}")
        if self.name is None and self.size != 1:
            raise ValueError(f"{self.size} ranks need a process group to communicate over")


@dataclass(frozen=True)
class Layout:
    """How the ranks hold every flat group: sharded over ``shard``, and for HSDP the same
    shards held by every rank of ``replicate``."""

    shard: CommGroup
    replicate: CommGroup | None = None
    partition: CommGroup | None = None
    partition_rank: int = 0  # this rank's place in its partition: the piece it keeps
    # This rank's place in the shard group: which piece of every flat group its shard holds
    # (FlatGroup.piece). A lowering that works on the shard's parameters one by one reads it
    # (a quantized gather's amax per parameter); the collectives it issues do not depend on it.
    shard_rank: int = 0

    def __post_init__(self) -> None:
        if self.partition is not None and (self.shard.size % self.partition.size
                                           or not 0 <= self.partition_rank < self.partition.size):
            raise ValueError(f"a partition of {self.partition.size} ranks (rank "
                             f"{self.partition_rank}) does not divide a shard group of "
                             f"{self.shard.size}")
        if not 0 <= self.shard_rank < self.shard.size:
            raise ValueError(f"rank {self.shard_rank} is not in a shard group of {self.shard.size}")

    @classmethod
    def flat(cls, world_size: int, group_name: str | None, slots: tuple[str, ...] = ()) -> Layout:
        """Every rank of one process group shards every flat group (FSDP's FULL_SHARD)."""
        return cls(CommGroup(world_size, group_name, slots))

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.shard.size * (self.replicate.size if self.replicate is not None else 1)

    @property
    def grad_divisor(self) -> int:
        """Gradients are averaged over every rank of the job, as DDP does."""
        return self.world_size

    @property
    def communicates(self) -> bool:
        return self.shard.name is not None

    def labelled(self) -> tuple[tuple[str, CommGroup], ...]:
        """The layout's dimensions by name: "shard", then "replicate" and "partition" where set."""
        dims = (("shard", self.shard), ("replicate", self.replicate), ("partition", self.partition))
        return tuple((label, dim) for label, dim in dims if dim is not None)

    def dimensions(self) -> dict[str, tuple[str, int]]:
        """Each process group's dimension ("shard", "replicate", "partition") and slot there."""
        named: dict[str, tuple[str, int]] = {}
        for label, dim in self.labelled():
            if dim.name is not None:
                named[dim.name] = (label, 0)
                named.update({name: (label, i) for i, name in enumerate(dim.slots)})
        return named

    def dimension(self, group_name: str) -> CommGroup | None:
        """The dimension a collective on ``group_name`` belongs to (its slots' or its own)."""
        for _, dim in self.labelled():
            if group_name == dim.name or group_name in dim.slots:
                return dim
        return None
