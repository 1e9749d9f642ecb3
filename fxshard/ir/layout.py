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

The layout is the job's one topology value. It is built once, where the process
groups are made (``driver/run/runtime.with_comm_groups``, from a ``DeviceMesh``'s
rows, or from ``mesh_shape`` under torch's fake process group for ``explain``),
and carried by the runtime's ``World``: each dimension's size, this rank's place
in it, the job's ranks of this rank's group along it, and the names of its process
groups (one per in-flight slot). The passes, the plan's replicas, calibration and
the report read it; the runtime resolves a dimension's groups from their names
(``World.groups``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CommGroup:
    """One dimension of the layout: ``size`` ranks and the process groups its collectives use.

    ``name`` is the c10d group name a collective names (None: no process group,
    size 1, so collectives lower to nothing). ``slots`` are the groups of the
    in-flight slots over the same ranks, when collectives in flight together must
    go on different groups (``assign_groups_pass``; empty: all on ``name``).
    ``rank`` is this rank's place in the dimension's group, and ``ranks`` the job's
    (global) ranks of that group in its order (empty where no process group names
    them: one rank).
    """

    size: int
    name: str | None
    slots: tuple[str, ...] = ()
    rank: int = 0
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a layout dimension needs at least one rank, not {self.size}")
        if self.name is None and self.size != 1:
            raise ValueError(f"{self.size} ranks need a process group to communicate over")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if self.ranks and len(self.ranks) != self.size:
            raise ValueError(f"a group of {self.size} ranks named {len(self.ranks)}: {list(self.ranks)}")

    @property
    def groups(self) -> tuple[str, ...]:
        """Every process group's name over this dimension's ranks: each slot's, or its one."""
        return self.slots or ((self.name,) if self.name is not None else ())


@dataclass(frozen=True)
class Layout:
    """How the ranks hold every flat group: sharded over ``shard``, and for HSDP the same
    shards held by every rank of ``replicate``."""

    shard: CommGroup
    replicate: CommGroup | None = None
    partition: CommGroup | None = None

    def __post_init__(self) -> None:
        if self.partition is not None and self.shard.size % self.partition.size:
            raise ValueError(f"a partition of {self.partition.size} ranks does not divide a shard group of "
                             f"{self.shard.size}")

    @property
    def shard_rank(self) -> int:
        """This rank's place in the shard group: which piece of every flat group its shard holds
        (FlatGroup.piece). A lowering that works on the shard's parameters one by one reads it
        (a quantized gather's amax per parameter); the collectives it issues do not depend on it."""
        return self.shard.rank

    @property
    def partition_rank(self) -> int:
        """This rank's place in its hpZ partition: the piece of a gathered buffer it keeps."""
        return self.partition.rank if self.partition is not None else 0

    def without_slots(self) -> Layout:
        """The same layout with every collective on its dimension's one group (no in-flight slots)."""
        def one(dim: CommGroup | None) -> CommGroup | None:
            return replace(dim, slots=()) if dim is not None else None

        return Layout(replace(self.shard, slots=()), one(self.replicate), one(self.partition))

    def describe(self) -> str:
        """This rank's place in the dimensions beyond its shard group, for reports; "" on one
        flat group."""
        parts = []
        if self.replicate is not None:
            parts.append(f"replica {self.replicate.rank} of {self.replicate.size}")
        if self.partition is not None:
            parts.append(f"rank {self.partition.rank} of {self.partition.size} in its hpZ partition")
        return "; ".join(parts)

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
