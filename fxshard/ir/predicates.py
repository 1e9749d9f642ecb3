"""Node classification: every ``is_*`` question a pass asks about a node.

Passes call these instead of comparing targets or names themselves, so the
answer to "is this a collective?" lives in one place. ``marker`` reads a
trace-time marker's arguments, the one place that knows their positions;
``collective_args`` reads a lowered collective's, by the names in the
operator's schema (``bind``), on a graph's node or on a call at run time.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxshard.ir import compat, meta, ops
from fxshard.ir.errors import GraphInvariantError

_c10d = compat.c10d_functional

ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
ALL_TO_ALL = _c10d.all_to_all_single.default
WAIT = _c10d.wait_tensor.default

COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)
# Each collective's kind, as reports, dumps and traces name it.
KINDS = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce",
         ALL_TO_ALL: "all_to_all"}


def is_call(node: fx.Node) -> bool:
    return node.op == "call_function"


def is_placeholder(node: fx.Node) -> bool:
    return node.op == "placeholder"


def is_output(node: fx.Node) -> bool:
    return node.op == "output"


def is_unshard_marker(node: fx.Node) -> bool:
    return is_call(node) and node.target is ops.UNSHARD


def is_reduce_grad_marker(node: fx.Node) -> bool:
    return is_call(node) and node.target is ops.REDUCE_GRAD


def is_replicate_marker(node: fx.Node) -> bool:
    return is_call(node) and node.target is ops.REPLICATE


def is_allreduce_grad_marker(node: fx.Node) -> bool:
    return is_call(node) and node.target is ops.ALLREDUCE_GRAD


def is_marker(node: fx.Node) -> bool:
    return is_call(node) and node.target in _MARKERS


class MarkerKind(enum.Enum):
    """What a trace-time marker stands for (``fxshard.ir.ops``)."""

    UNSHARD = "unshard"  # a flat shard becomes the full flat parameter: an all-gather
    REPLICATE = "replicate"  # a flat parameter kept whole on every rank: no collective
    REDUCE_GRAD = "reduce_grad"  # a full flat gradient becomes the shard's: a reduce-scatter
    ALLREDUCE_GRAD = "allreduce_grad"  # a whole parameter's gradient: an all-reduce

    @property
    def is_gradient(self) -> bool:
        return self in (MarkerKind.REDUCE_GRAD, MarkerKind.ALLREDUCE_GRAD)


_MARKERS = {ops.UNSHARD: MarkerKind.UNSHARD, ops.REPLICATE: MarkerKind.REPLICATE,
            ops.REDUCE_GRAD: MarkerKind.REDUCE_GRAD, ops.ALLREDUCE_GRAD: MarkerKind.ALLREDUCE_GRAD}


@dataclass(frozen=True)
class Marker:
    """A marker node's arguments, by name.

    ``value`` is the node it stands on (the shard, or the gradient). Parameter
    markers carry ``compute_dtype`` (gathered and computed in; None: the
    shard's) and the ``reduce_dtype`` their gradient will be reduced in;
    gradient markers carry ``reduce_dtype`` and ``out_dtype`` (the shard
    gradient's, when it differs). None: no cast.
    """

    kind: MarkerKind
    node: fx.Node
    value: fx.Node
    group: int
    world_size: int
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    # Offload: the device the full buffer computes on (parameter markers), and the one the
    # shard's gradient goes back to (gradient markers). None: the value's own device.
    device: torch.device | None = None

    @property
    def offloaded(self) -> bool:
        """Does the shard live on another device than it computes on (as traced)?"""
        return self.device is not None


def marker(node: fx.Node) -> Marker | None:
    """``node``'s marker arguments, or None if it is not a marker; raises on a malformed one."""
    kind = _MARKERS.get(node.target) if is_call(node) else None  # type: ignore[call-overload]
    if kind is None:
        return None
    args: list[Any] = list(node.args) + [None] * (6 - len(node.args))
    value, group, world_size, first, second, device = args[:6]
    if (len(node.args) > 6 or not isinstance(value, fx.Node) or not isinstance(group, int)
            or not isinstance(world_size, int)
            or not all(d is None or isinstance(d, torch.dtype) for d in (first, second))
            or not (device is None or isinstance(device, torch.device))):
        raise GraphInvariantError(f"{node.name}: malformed fxshard.{kind.value} marker {node.args}")
    if kind.is_gradient:
        return Marker(kind, node, value, group, world_size, reduce_dtype=first, out_dtype=second,
                      device=device)
    return Marker(kind, node, value, group, world_size, compute_dtype=first, reduce_dtype=second,
                  device=device)


def is_all_gather(node: fx.Node) -> bool:
    return is_call(node) and node.target is ALL_GATHER


def is_reduce_scatter(node: fx.Node) -> bool:
    return is_call(node) and node.target is REDUCE_SCATTER


def is_all_reduce(node: fx.Node) -> bool:
    return is_call(node) and node.target is ALL_REDUCE


def is_all_to_all(node: fx.Node) -> bool:
    return is_call(node) and node.target is ALL_TO_ALL


def is_collective(node: fx.Node) -> bool:
    return is_call(node) and node.target in COLLECTIVES


def bind(op: compat.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``op``'s arguments by the names in its schema: ``args`` in order, then ``kwargs``, then
    the schema's defaults."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(compat.schema(op).arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


@dataclass(frozen=True)
class CollectiveArgs:
    """A functional collective's arguments, by their schema names.

    ``input`` is what it sends (a node on a graph, a tensor at run time): all_gather's
    shard, the others' full buffer. ``group_size`` is what the op was given (all_gather,
    reduce_scatter) or counted from its splits (all_to_all); all_reduce names only its group.
    """

    op: compat.OpOverload
    input: Any
    group_name: str
    group_size: int | None = None
    reduce_op: str | None = None

    @property
    def kind(self) -> str:
        return KINDS[self.op]

    def ranks(self) -> int:
        """The ranks of its group; all_reduce's from the process group its name resolves to."""
        if self.group_size is not None:
            return self.group_size
        return int(compat.resolve_process_group(self.group_name).size())


def collective_call(op: object, args: Sequence[Any], kwargs: Mapping[str, Any]) -> CollectiveArgs | None:
    """The arguments of a call of functional collective ``op``; None for any other op."""
    if not isinstance(op, compat.OpOverload) or op not in KINDS:
        return None
    a = bind(op, args, kwargs)
    name = a["group_name"]
    if not isinstance(name, str):  # a ProcessGroup, which later releases' schemas take as well
        name = getattr(name, "group_name", name)
    if not isinstance(name, str):
        raise ValueError(f"{op}: group name {name!r}")
    if op is ALL_TO_ALL:
        size: int | None = len(a["output_split_sizes"])
    else:
        size = a.get("group_size")
    return CollectiveArgs(op, a["input"], name, size, a.get("reduce_op"))


def collective_args(node: fx.Node) -> CollectiveArgs:
    """A lowered collective's arguments; raises ``ValueError`` on any other node."""
    found = collective_call(node.target, node.args, node.kwargs) if is_call(node) else None
    if found is None:
        raise ValueError(f"{node.name} ({node.target}) is not a lowered collective")
    return found


def group_name(node: fx.Node) -> str:
    """The process group a lowered collective runs on."""
    return collective_args(node).group_name


def set_group_name(node: fx.Node, name: str) -> None:
    collective_args(node)  # raises on anything else
    target = node.target
    assert isinstance(target, compat.OpOverload)
    index = [a.name for a in compat.schema(target).arguments].index("group_name")
    if index < len(node.args):
        node.args = (*node.args[:index], name, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, "group_name": name}


def is_wait(node: fx.Node) -> bool:
    return is_call(node) and node.target is WAIT


def is_free(node: fx.Node) -> bool:
    return is_call(node) and node.target is ops.FREE


def is_getitem(node: fx.Node) -> bool:
    return is_call(node) and node.target is operator.getitem


def is_tangent(node: fx.Node) -> bool:
    return meta.is_tangent(node)


def is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, compat.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def is_view(node: fx.Node) -> bool:
    """True when the node's result aliases (a view of) its first tensor input.

    Read from the operator schema's alias annotations, e.g.
    ``split_with_sizes(Tensor(a -> *) self, ...) -> Tensor(a)[]``; ``getitem``
    of such a result is a view too.
    """
    if is_wait(node):  # wait_tensor returns its input
        return True
    if is_getitem(node):
        parent = node.args[0]
        return isinstance(parent, fx.Node) and is_view(parent)
    target = node.target
    if not (is_call(node) and isinstance(target, compat.OpOverload)):
        return False
    schema = compat.schema(target)
    if schema.is_mutable:
        return False
    return any(r.alias_info is not None for r in schema.returns)


def mutates(node: fx.Node) -> bool:
    """An aten op that writes to an argument (its schema is mutable: ``add_``, ``copy_``)."""
    target = node.target
    return is_call(node) and isinstance(target, compat.OpOverload) and compat.schema(target).is_mutable


def written_arguments(op: object, args: Sequence[Any]) -> list[Any]:
    """The positional ``args`` an operator writes to (its schema's mutable arguments); none
    for anything but an OpOverload. Works on fx nodes' args and on run-time tensors alike."""
    schema = compat.schema(op) if isinstance(op, compat.OpOverload) else None
    if schema is None or not schema.is_mutable:
        return []
    return [value for arg, value in zip(schema.arguments, args)
            if arg.alias_info is not None and arg.alias_info.is_write]


def allocates(node: fx.Node) -> bool:
    """A deterministic aten op whose one tensor result is a new storage: not a
    view or alias of an input, not a mutation, not random."""
    target = node.target
    return (
        is_call(node)
        and isinstance(target, compat.OpOverload)
        and target.namespace == "aten"
        and not is_view(node)
        and not is_random(node)
        and not compat.schema(target).is_mutable
        and all(r.alias_info is None for r in compat.schema(target).returns)
        and isinstance(node.meta.get("val"), torch.Tensor)
    )

