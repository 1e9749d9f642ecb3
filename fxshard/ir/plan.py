"""Planning: partition a module's parameters into FSDP units and flat shards.

The planner is analysis only. It reads the module tree and a policy (and,
once a trace exists, the order in which the trace first uses each flat group)
and returns plain data: a ``ShardPlan`` of ``FSDPUnit``s, each owning one
``FlatGroup`` per (dtype, requires_grad) combination. It never touches a graph.

Flat layout of a group: each parameter starts at a multiple of ``ALIGN_BYTES``
bytes (``gap``: zeros no computation reads), and the whole is padded to a
multiple of the world size N::

    | p0 |gap| p1 | ... |gap| pk | pad |    padded_numel = N * shard_numel
    |    rank 0    |    rank 1    | ... |   rank r holds [r*shard_numel, (r+1)*shard_numel)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import prod
from typing import Any

import networkx as nx
import torch
import torch.nn as nn

from fxshard.ir.errors import PlanError
from fxshard.ir.precision import MixedPrecision, Wire
from fxshard.ir.wrapping import Policy, WrapQuery

log = logging.getLogger("fxshard")

ROOT = ""  # module path of the root module, and name of the root unit

# Each parameter starts a multiple of ALIGN_BYTES bytes into its flat group, in the
# group's dtype and in the one it is gathered and computed in. FSDP2's per-parameter
# tensors have aligned storages; a view at an unaligned offset can take another kernel
# path and round differently. Measured on this CPU, one thread: torch's 1x1 convolution
# on a 1x1 input (EfficientNet's squeeze-excite) gives other bits once its weight starts
# off a 16-byte boundary, so EfficientNet-B0 matched DDP only to within rounding
# (tests/test_alignment.py). GPU vectorized loads and cuBLAS prefer pointers aligned to
# 16 bytes or more too; that is not measured on a GPU here.
ALIGN_BYTES = 16


def align_numel(*dtypes: torch.dtype | None) -> int:
    """The alignment of a parameter's offset in a flat group, in elements: ``ALIGN_BYTES``
    in each of ``dtypes`` (the group's own, and the one it is gathered and computed in)."""
    return max(1, *(ALIGN_BYTES // d.itemsize for d in dtypes if d is not None))


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in a flat group."""

    name: str  # canonical name: the first under which the module registers it
    aliases: tuple[str, ...]  # further names of the same Parameter (tied weights)
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank's shard holds: the same elements at
    ``shard`` in that shard and at ``param`` in the parameter, flattened."""

    shard: slice
    param: slice

    @property
    def numel(self) -> int:
        return int(self.shard.stop - self.shard.start)


@dataclass(frozen=True)
class FlatGroup:
    """Parameters of one unit with one dtype and requires_grad, flattened and sharded.

    ``numel`` counts the parameters' elements; ``padded_numel`` is the length of the
    flat layout, alignment gaps and the padding to a multiple of N included (``pad``:
    all of it that is not parameter data).
    """

    index: int
    unit: str
    dtype: torch.dtype
    requires_grad: bool
    params: tuple[ParamSlot, ...]
    numel: int
    padded_numel: int
    world_size: int
    # Kept whole on every rank (parameters under ``replicate_below`` elements):
    # no gather, gradients all-reduced.
    replicated: bool = False
    # Mixed precision (fxshard.ir.precision): the dtype the group is gathered
    # and computed in, and the one its gradient is reduced in. None: no cast
    # (``dtype``, and the dtype the gradient arrives in).
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # How the group's gathers travel when not as its compute dtype: an option's wire format
    # (``precision.Wire``, from ``MixedPrecision.wire_for``), the lowering table's wire. None:
    # in the compute dtype.
    wire: Wire | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or self.dtype

    @property
    def shard_numel(self) -> int:
        return self.padded_numel if self.replicated else self.padded_numel // self.world_size

    @property
    def pad(self) -> int:
        return self.padded_numel - self.numel

    def spans(self) -> tuple[tuple[ParamSlot | None, int], ...]:
        """The flat layout in order, as (slot, length) with slot None for padding: the
        lengths add up to ``padded_numel``."""
        result: list[tuple[ParamSlot | None, int]] = []
        end = 0
        for slot in self.params:
            if slot.offset > end:
                result.append((None, slot.offset - end))
            result.append((slot, slot.numel))
            end = slot.offset + slot.numel
        if self.padded_numel > end:
            result.append((None, self.padded_numel - end))
        return tuple(result)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Where ``rank``'s shard lies in the group's flat layout: [start, stop)."""
        if self.replicated:
            return 0, self.padded_numel
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def piece(self, slot: ParamSlot, rank: int) -> Piece | None:
        """The part of ``slot`` that ``rank``'s shard holds (None: none of it). Every copy
        between parameters and shards goes through this."""
        lo, hi = self.shard_range(rank)
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start >= stop:
            return None
        return Piece(slice(start - lo, stop - lo), slice(start - slot.offset, stop - slot.offset))


@dataclass(frozen=True)
class FSDPUnit:
    name: str  # module path ("" is the root); merged units join paths with "+"
    modules: tuple[str, ...]  # the module paths whose parameters it owns
    groups: tuple[int, ...]  # indices into ShardPlan.groups

    @property
    def label(self) -> str:
        return self.name or "<root>"


@dataclass(frozen=True)
class ShardPlan:
    units: tuple[FSDPUnit, ...]  # in first-use order once traced, else registration order
    groups: tuple[FlatGroup, ...]  # fixed at compile time: index i is flat shard i
    world_size: int  # the ranks a flat group is sharded over
    policy: str
    replicas: int = 1  # HSDP's copies of the sharded model: the job has world_size * replicas ranks

    def unit(self, name: str) -> FSDPUnit:
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(f"no FSDP unit named {name!r}; units: {[u.label for u in self.units]}")

    def group_of(self, param_name: str) -> FlatGroup:
        for group in self.groups:
            if any(param_name in slot.names for slot in group.params):
                return group
        raise KeyError(f"parameter {param_name!r} is in no flat group")

    def unit_bytes(self, unit: FSDPUnit, *, gathered: bool = False) -> int:
        """The bytes of ``unit``'s flat groups at full length (padding included), in their
        dtype; ``gathered``: in the dtype they are gathered and computed in."""
        return sum(self.groups[g].padded_numel *
                   (self.groups[g].compute_dtype if gathered else self.groups[g].dtype).itemsize
                   for g in unit.groups)

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def padded_numel(self) -> int:
        return sum(g.padded_numel for g in self.groups)

    def ordered_by_first_use(self, group_order: Sequence[int]) -> ShardPlan:
        """The same plan with units ordered by the first use of any of their groups."""
        rank = {g: i for i, g in enumerate(group_order)}
        unused = len(rank)

        def first_use(unit: FSDPUnit) -> int:
            return min((rank.get(g, unused) for g in unit.groups), default=unused)

        positions = {u.name: i for i, u in enumerate(self.units)}
        units = sorted(self.units, key=lambda u: (first_use(u), positions[u.name]))
        return replace(self, units=tuple(units))

    def unit_graph(self) -> nx.DiGraph:
        """Units as nodes; ``order`` edges follow execution order, ``contains`` edges nesting."""
        graph = nx.DiGraph()
        for unit in self.units:
            numel = sum(self.groups[g].numel for g in unit.groups)
            graph.add_node(unit.label, numel=numel, groups=list(unit.groups))
        for a, b in zip(self.units, self.units[1:]):
            graph.add_edge(a.label, b.label, kind="order")
        for outer in self.units:
            for inner in self.units:
                if outer is not inner and any(
                    _is_ancestor(m, n) for m in outer.modules for n in inner.modules
                ):
                    graph.add_edge(outer.label, inner.label, kind="contains")
        return graph

    def __str__(self) -> str:
        header = ("unit", "group", "dtype", "grad", "numel", "padded", "shard", "params")
        rows = []
        for unit in self.units:
            for gi in unit.groups:
                g = self.groups[gi]
                names = ", ".join(_relative(s.name, unit.modules)
                                  + "".join(f" (= {alias})" for alias in s.aliases)  # tied weights
                                  for s in g.params)
                rows.append(
                    (unit.label, str(gi) + (" (replicated)" if g.replicated else ""),
                     _dtypes(g), "yes" if g.requires_grad else "no",
                     f"{g.numel:_}", f"{g.padded_numel:_}", f"{g.shard_numel:_}", names)
                )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
        ranks = (f"{self.world_size}" if self.replicas == 1 else
                 f"{self.world_size * self.replicas} ({self.replicas} replicas x {self.world_size} shards)")
        lines = [f"ShardPlan(world_size={ranks}, policy={self.policy}, "
                 f"units={len(self.units)}, numel={self.numel:_}, padded={self.padded_numel:_})"]
        for r in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        return "\n".join(lines)


def _is_ancestor(outer: str, inner: str) -> bool:
    return outer != inner and (outer == ROOT or inner.startswith(outer + "."))


def _relative(name: str, modules: tuple[str, ...]) -> str:
    if len(modules) > 1:
        return name
    for m in modules:
        if m and name.startswith(m + "."):
            return name[len(m) + 1:]
    return name


def _dtypes(group: FlatGroup) -> str:
    """``float32``, or with mixed precision ``float32>bfloat16`` (gathered and computed in
    bfloat16) and ``/float32`` (gradient reduced in float32)."""
    def name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")

    text = name(group.dtype)
    if group.param_dtype is not None:
        text += f">{name(group.param_dtype)}"
    if group.reduce_dtype is not None:
        text += f"/{name(group.reduce_dtype)}"
    if group.wire is not None:
        text += f" gathered as {group.wire}"
    return text


def make_plan(
    module: nn.Module,
    policy: Policy | None,
    world_size: int,
    first_use: Sequence[int] | None = None,
    *,
    bucket_bytes: int = 0,
    replicate_below: int = 0,
    replicate_all: bool = False,
    replicate: Policy | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> ShardPlan:
    """Partition ``module``'s parameters into FSDP units for ``world_size`` ranks.

    A pure function of its arguments. ``first_use`` is the order in which a
    trace first uses each flat group; without it units are in the order the
    module tree is walked (post-order, root last). ``bucket_bytes`` merges runs
    of adjacent units smaller than it (root excluded) into one unit, so they
    share one collective. Parameters with fewer than ``replicate_below``
    elements go to a replicated group of their unit; with ``replicate_all`` every
    parameter does (NO_SHARD), and with ``replicate`` every parameter of a unit
    whose modules the policy selects (each asked with the unit's parameter count;
    never the root). With ``mixed_precision``
    each group records the dtypes it is gathered, computed and reduced in;
    parameters kept at full precision get groups of their own.
    """
    if world_size < 1:
        raise PlanError(f"world_size must be at least 1, got {world_size}")
    names_of: dict[int, list[str]] = {}
    param_of: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        param_of[id(p)] = p
    precision: dict[int, tuple[torch.dtype | None, torch.dtype | None]] = {}
    wires: dict[int, Wire | None] = {}
    if mixed_precision is not None:
        for mod in module.modules():
            for own in mod._parameters.values():
                if own is not None and id(own) not in precision:
                    precision[id(own)] = mixed_precision.dtypes_for(own, mod)
                    wires[id(own)] = mixed_precision.wire_for(own, mod)
    if not param_of:
        raise PlanError(f"{type(module).__name__} has no parameters: there is nothing to shard")

    owners: dict[int, list[str]] = {pid: [] for pid in param_of}  # param -> claiming module paths
    wrapped: list[str] = []
    for pid in _claim(ROOT, module, policy, param_of, owners, wrapped):
        owners[pid].append(ROOT)
    if policy is not None and not wrapped:
        warnings.warn(
            f"policy {policy!r} matched no module of {type(module).__name__}: every parameter "
            "goes in the root unit, so the whole model is gathered at once. "
            "Check the policy's classes or threshold.",
            stacklevel=3,
        )

    # A Parameter claimed by several units (tied weights) merges those units:
    # one flat buffer cannot live in two units. Components of the "shares a
    # parameter" graph are the merged units.
    unit_paths = [*wrapped, ROOT]
    share = nx.Graph()
    share.add_nodes_from(unit_paths)
    for paths in owners.values():
        for other in paths[1:]:
            share.add_edge(paths[0], other)
    position = {p: i for i, p in enumerate(unit_paths)}
    components = sorted(
        (sorted(c, key=position.__getitem__) for c in nx.connected_components(share)),
        key=lambda c: position[c[-1]],  # a merged unit runs where its last member would
    )
    merged_name = {}
    for comp in components:
        name = ROOT if ROOT in comp else "+".join(comp)
        if len(comp) > 1:
            shared = sorted(n for pid, ps in owners.items() if len(set(ps)) > 1 for n in names_of[pid][:1])
            log.info("fxshard: units %s share parameters %s and are merged into unit %r",
                     [c or "<root>" for c in comp], shared, name or "<root>")
        for path in comp:
            merged_name[path] = name

    unit_params: dict[str, list[int]] = {}
    for pid in param_of:  # registration order
        unit = merged_name[owners[pid][0]]
        unit_params.setdefault(unit, []).append(pid)

    if bucket_bytes > 0:
        components, unit_params = _bucket(components, merged_name, unit_params, param_of,
                                          bucket_bytes)

    groups: list[FlatGroup] = []
    units: list[FSDPUnit] = []
    replicated_units = 0
    for comp in components:
        name = merged_name[comp[0]]
        pids = unit_params.get(name, [])
        if not pids:
            continue
        numel = sum(param_of[pid].numel() for pid in pids)
        whole = replicate_all or (replicate is not None and ROOT not in comp and all(
            replicate.wraps(WrapQuery(path, module.get_submodule(path), numel)) for path in comp))
        replicated_units += whole
        keys: dict[tuple[Any, ...], list[int]] = {}
        for pid in pids:
            p = param_of[pid]
            small = whole or p.numel() < replicate_below
            compute, reduce = precision.get(pid, (None, None))
            keys.setdefault((p.dtype, p.requires_grad, small, compute, reduce,
                             None if small else wires.get(pid)), []).append(pid)
        group_ids = []
        for (dtype, requires_grad, replicated, compute, reduce, wire), members in keys.items():
            slots, end, align = [], 0, align_numel(dtype, compute)
            for pid in members:
                p = param_of[pid]
                names = names_of[pid]
                offset = -(-end // align) * align
                slots.append(ParamSlot(names[0], tuple(names[1:]), tuple(p.shape), offset))
                end = offset + p.numel()
            padded = end if replicated else -(-end // world_size) * world_size
            group_ids.append(len(groups))
            groups.append(FlatGroup(len(groups), name, dtype, requires_grad, tuple(slots),
                                    sum(s.numel for s in slots), padded, world_size, replicated,
                                    compute, reduce, wire))
        units.append(FSDPUnit(name, tuple(comp), tuple(group_ids)))

    if replicate is not None and not replicate_all and not replicated_units:
        warnings.warn(
            f"replicate={replicate!r} selected no unit of the plan ({', '.join(repr(u.name or '<root>') for u in units)}"
            f"): it keeps whole units on every rank, those whose modules it selects (never the root), so "
            "every parameter stays sharded. Select the units' own modules (the policy's class), or keep "
            "small parameters whole with replicate_below=", stacklevel=3)
    plan = ShardPlan(tuple(units), tuple(groups), world_size, repr(policy))
    return plan.ordered_by_first_use(first_use) if first_use is not None else plan


def _claim(path: str, mod: nn.Module, policy: Policy | None, param_of: dict[int, nn.Parameter],
           owners: dict[int, list[str]], wrapped: list[str]) -> dict[int, None]:
    """Post-order: the parameters under ``mod`` that no unit claims, after ``mod`` itself
    claims them where ``policy`` wraps it (recorded in ``owners`` and ``wrapped``).

    A module-level function, not a closure: a nested function that calls itself is a
    reference cycle (the function, its closure cell), and its closure held ``param_of``, so
    the model's parameters outlived ``compile``'s strip until the cyclic collector ran
    (on a GPU, the whole unsharded model)."""
    unclaimed: dict[int, None] = {}  # ordered set of param ids
    for child_name, child in mod.named_children():
        unclaimed.update(_claim(f"{path}.{child_name}" if path else child_name, child, policy, param_of,
                                owners, wrapped))
    for p in mod.parameters(recurse=False):
        unclaimed[id(p)] = None
    if path != ROOT and policy is not None and unclaimed:
        numel = sum(param_of[pid].numel() for pid in unclaimed)
        if policy.wraps(WrapQuery(path, mod, numel)):
            wrapped.append(path)
            for pid in unclaimed:
                owners[pid].append(path)
            return {}
    return unclaimed


def _bucket(
    components: list[list[str]],
    merged_name: dict[str, str],
    unit_params: dict[str, list[int]],
    param_of: dict[int, nn.Parameter],
    bucket_bytes: int,
) -> tuple[list[list[str]], dict[str, list[int]]]:
    """Merge runs of adjacent units under ``bucket_bytes`` into buckets of about that size.

    Adjacent means next to each other in plan order (the post-order walk,
    which is forward order for sequential models). The root unit is never
    bucketed: it is resident by default and its window spans the step.
    """

    def nbytes(name: str) -> int:
        return sum(param_of[p].numel() * param_of[p].element_size() for p in unit_params.get(name, []))

    result: list[list[str]] = []
    params: dict[str, list[int]] = {}
    bucket: list[list[str]] = []

    def close() -> None:
        if not bucket:
            return
        modules = [m for comp in bucket for m in comp]
        name = "+".join(merged_name[comp[0]] for comp in bucket)
        if len(bucket) > 1:
            log.info("fxshard: bucketing units %s into %r", [merged_name[c[0]] for c in bucket], name)
        for m in modules:
            merged_name[m] = name
        params[name] = [p for comp in bucket for p in unit_params.get(merged_name_orig[comp[0]], [])]
        result.append(modules)
        bucket.clear()

    merged_name_orig = dict(merged_name)
    for comp in components:
        name = merged_name_orig[comp[0]]
        small = name != ROOT and nbytes(name) < bucket_bytes
        if not small:
            close()
            result.append(comp)
            params[name] = unit_params.get(name, [])
            continue
        current = sum(nbytes(merged_name_orig[c[0]]) for c in bucket)
        if bucket and current + nbytes(name) > bucket_bytes:
            close()
        bucket.append(comp)
    close()
    return result, params
