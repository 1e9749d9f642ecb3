"""Node classification: every ``is_*`` question a pass asks about a node.

Passes call these instead of comparing targets or names themselves, so the
answer to "is this a collective?" lives in one place. ``marker`` reads a
trace-time marker's arguments, the one place that knows their positions.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
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


# Position of the group name among each collective's arguments.
_GROUP_ARG = {ALL_GATHER: 2, REDUCE_SCATTER: 3, ALL_REDUCE: 2, ALL_TO_ALL: 3}


def _group_arg(node: fx.Node) -> int:
    target = node.target
    if not isinstance(target, compat.OpOverload) or target not in _GROUP_ARG:
        raise ValueError(f"{node.name} ({target}) is not a lowered collective")
    return _GROUP_ARG[target]


def group_name(node: fx.Node) -> str:
    """The process group a lowered collective runs on."""
    name = node.args[_group_arg(node)]
    assert isinstance(name, str), f"{node.name}: group name {name!r}"
    return name


def set_group_name(node: fx.Node, name: str) -> None:
    index = _group_arg(node)
    node.args = (*node.args[:index], name, *node.args[index + 1:])


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

