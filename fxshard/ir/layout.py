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

The dimensions are data: ``Layout.dims`` names each one it has, and ``DIMENSIONS``
says of each kind whether it multiplies the job's ranks or cuts another dimension's
groups, and how a report names this rank's place in it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod


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
class Dimension:
    """A kind of layout dimension, as data (``DIMENSIONS``): its ``name``; ``within``, the
    dimension whose groups it cuts into blocks (hpZ's partitions cut the shard group), or
    None where it multiplies the job's ranks; ``place``, how a report names this rank's place
    in it ("" for none), with ``{rank}`` and ``{size}``.

    A new dimension is an entry here, the ``Layout`` the runtime builds with it, and the
    lowering rows that run collectives over it (``fxshard/passes/lowering.py``)."""

    name: str
    within: str | None
    place: str


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("shard", None, ""),  # every layout has one: the flat groups are cut over it
    Dimension("replicate", None, "replica {rank} of {size}"),  # HSDP
    Dimension("partition", "shard", "rank {rank} of {size} in its hpZ partition"),  # hpZ
)
_DIMENSION = {d.name: d for d in DIMENSIONS}


@dataclass(frozen=True, init=False)
class Layout:
    """How the ranks hold every flat group: its named dimensions (``dims``, in the order of
    ``DIMENSIONS``), each a ``CommGroup``. Every layout has "shard"; HSDP adds "replicate",
    the ranks holding the same shards; hpZ adds "partition", blocks of the shard group.
    ``Layout(shard, replicate=None, partition=None, **more)`` builds one from its
    dimensions by name (None: not in the layout)."""

    dims: tuple[tuple[str, CommGroup], ...]

    def __init__(self, shard: CommGroup, replicate: CommGroup | None = None,
                 partition: CommGroup | None = None, **more: CommGroup | None) -> None:
        given = {"shard": shard, "replicate": replicate, "partition": partition, **more}
        unknown = sorted(set(given) - set(_DIMENSION))
        if unknown:
            raise ValueError(f"no layout dimension named {unknown}; the dimensions are {list(_DIMENSION)}")
        dims: tuple[tuple[str, CommGroup], ...] = tuple(
            (d.name, group) for d in DIMENSIONS if (group := given.get(d.name)) is not None)
        object.__setattr__(self, "dims", dims)
        for name, group in dims:
            within = _DIMENSION[name].within
            if within is not None:
                outer = self.get(within)
                if outer is None or outer.size % group.size:
                    raise ValueError(f"a {name} of {group.size} ranks does not divide a {within} group of "
                                     f"{outer.size if outer is not None else 0}")

    def get(self, name: str) -> CommGroup | None:
        """The dimension named ``name`` (None: not in this layout)."""
        return next((group for label, group in self.dims if label == name), None)

    @property
    def shard(self) -> CommGroup:
        group = self.get("shard")
        assert group is not None
        return group

    @property
    def replicate(self) -> CommGroup | None:
        return self.get("replicate")

    @property
    def partition(self) -> CommGroup | None:
        return self.get("partition")

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
        shard, *rest = ((name, replace(group, slots=())) for name, group in self.dims)
        return Layout(shard[1], **dict(rest))

    def describe(self) -> str:
        """This rank's place in the dimensions beyond its shard group, for reports; "" on one
        flat group."""
        return "; ".join(_DIMENSION[name].place.format(rank=group.rank, size=group.size)
                         for name, group in self.dims if _DIMENSION[name].place)

    @classmethod
    def flat(cls, world_size: int, group_name: str | None, slots: tuple[str, ...] = ()) -> Layout:
        """Every rank of one process group shards every flat group (FSDP's FULL_SHARD)."""
        return cls(CommGroup(world_size, group_name, slots))

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return prod(group.size for name, group in self.dims if _DIMENSION[name].within is None)

    @property
    def grad_divisor(self) -> int:
        """Gradients are averaged over every rank of the job, as DDP does."""
        return self.world_size

    @property
    def communicates(self) -> bool:
        return self.shard.name is not None

    def dimensions(self) -> dict[str, tuple[str, int]]:
        """Each process group's dimension ("shard", "replicate", "partition") and slot there."""
        named: dict[str, tuple[str, int]] = {}
        for label, dim in self.dims:
            if dim.name is not None:
                named[dim.name] = (label, 0)
                named.update({name: (label, i) for i, name in enumerate(dim.slots)})
        return named

    def dimension(self, group_name: str) -> CommGroup | None:
        """The dimension a collective on ``group_name`` belongs to (its slots' or its own)."""
        for _, dim in self.dims:
            if group_name == dim.name or group_name in dim.slots:
                return dim
        return None
