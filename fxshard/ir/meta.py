"""Node metadata: fxshard's own in one record per node, and the only readers of torch's.

Everything fxshard records on a node is one ``Record`` under
``node.meta["fxshard"]``: the ``NodeInfo`` of a node fxshard made (its role,
flat group, unit and collective chain) and, on a backward copy of a forward
value, the forward node it copies. Passes read and write it through the
accessors below (``get_info``, ``set_info``, ``role_of``, ``mark_copy``,
``copies_in``), never through the key. A node made in another's place takes the
other's torch metadata through ``provenance``, never fxshard's record. The one
graph-level record, a graph's scheduling positions, is
``fxshard.ir.schedule.schedule_of(gm)``.

Torch's conventions are read and written here alone, so a change in a torch
release is mended in one place:
- AOTAutograd tags each node of a joint graph with ``meta["partitioner_tag"]``
  ("is_forward" / "is_backward") and names the gradients of the outputs
  ``tangents_*`` (``is_backward``, ``tag_backward``, ``is_tangent``);
- the module path of a traced node, recorded while tracing with
  ``torch.fx.traceback.annotate`` (``annotate_module``), lands in
  ``meta["custom"]`` (``module_path``); a graph Dynamo captured carries
  ``meta["nn_module_stack"]`` instead, whose paths read ``L['self'].blocks.0``
  (or ``L['self'].blocks[0]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch.fx import traceback as fx_traceback

KEY = "fxshard"
# The module path's name inside torch's ``meta["custom"]``, where ``annotate_module`` puts it.
MODULE_ANNOTATION = "fxshard.module"

class Role(enum.Enum):
    """What a node fxshard made is for. The value is what dumps and reports print."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    WAIT = "wait"
    FREE = "free"
    CAST = "cast"  # mixed precision: a shard cast before its gather, a gradient before its reduction
    SCALE = "scale"  # a gradient divided by the ranks it is averaged over (before or after its sum)
    TO_DEVICE = "to_device"  # offload: a shard copied from the host before its gather
    TO_HOST = "to_host"  # offload: a reduced gradient copied to the host, where the optimizer steps
    # A wire format's (FlatGroup.wire) work before its collective: what its encoding needs
    # (a quantized gather's scales, from its amax) and the shard encoded (scaled and cast).
    ENCODE = "encode"
    DECODE = "decode"  # a wire format's bytes back in the compute dtype (dequantized, scaled)
    SUM = "sum"  # reduce_in_rank_order: the ranks' received terms added in rank order
    CAST_BACK = "cast_back"  # mixed precision: a reduced gradient cast to the shard's dtype
    ACCUMULATE = "accumulate"  # no_sync: a gradient added to (or flushed from) its accumulator
    SAVED = "saved_buffer"  # backward input: a gathered buffer kept from forward (not resharded)
    PIECE = "kept_piece"  # hpZ: this rank's piece of a gathered buffer, kept from forward for backward
    REMAT = "remat"  # backward copy of a parameter-only computation


class Direction(enum.Enum):
    """Which way a collective chain moves a flat group."""

    GATHER = "gather"  # parameters come in: a buffer that compute reads
    REDUCE = "reduce"  # a gradient goes out: the shard's gradient


@dataclass(frozen=True)
class ChainTag:
    """Names the collective chain a node belongs to (``fxshard.ir.chains``): its number in the
    graph, which way it moves, and the entry of the lowering table that made it."""

    id: int
    direction: Direction
    lowering: str


@dataclass(frozen=True)
class NodeInfo:
    """What a node fxshard made is for."""

    role: Role
    group: int  # index of the flat group (ShardPlan.groups) the node works on
    unit: str  # name of the FSDP unit that owns that group
    chain: ChainTag | None = None  # the collective chain the node is part of
    # Declared by its lowering as part of the chain's issue though it reads one of the
    # chain's waits: a collective whose result the next collective needs before it can be
    # issued (a quantized gather's amax all_reduce, its wait, the quantization). Scheduling
    # moves it with the gather; the chain's tail starts at the other waits.
    issues: bool = False
    # Declared part of the issue, and agreed once at the graph's start: a value the ranks
    # must share before the chain issues that reads nothing the step computes (a quantized
    # "tensor" gather's amax, its all_reduce, its wait and the scales). Scheduling places it
    # with the graph's first nodes, so its wait never queues behind another unit's gather.
    agrees: bool = False


@dataclass(frozen=True)
class Record:
    """Everything fxshard records on one node: the value of ``node.meta["fxshard"]``."""

    info: NodeInfo | None = None  # set on the nodes fxshard made (``set_info``)
    # A backward copy of a forward value (a rematerialized parameter chain, a recomputed
    # activation): the name of the forward node it computes again (``mark_copy``).
    copy_of: str | None = None


def record(node: fx.Node) -> Record:
    found = node.meta.get(KEY)
    return found if isinstance(found, Record) else Record()


def _update(node: fx.Node, **changes: Any) -> None:
    node.meta[KEY] = dataclasses.replace(record(node), **changes)


def set_info(node: fx.Node, info: NodeInfo) -> None:
    _update(node, info=info)


def get_info(node: fx.Node) -> NodeInfo | None:
    return record(node).info


def role_of(node: fx.Node) -> Role | None:
    info = get_info(node)
    return info.role if info is not None else None


_PARTITIONER_TAG = "partitioner_tag"


def is_tangent(node: fx.Node) -> bool:
    """A backward input that is the gradient of a forward output."""
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def is_backward(node: fx.Node) -> bool:
    """In a joint graph: computed in backward (tagged so, or a tangent)."""
    return node.meta.get(_PARTITIONER_TAG) == "is_backward" or is_tangent(node)


def tag_backward(node: fx.Node) -> None:
    """Have the partitioner put ``node`` in the backward graph."""
    node.meta[_PARTITIONER_TAG] = "is_backward"


# The module path is written while tracing, before there is a node to hold a record:
# ``torch.fx.traceback.annotate`` puts it in ``meta["custom"]`` of every node traced inside,
# and AOTAutograd carries ``meta["custom"]`` over to the joint graph's nodes (and the
# partitioner to the forward and backward graphs'). So it lives there, not in ``Record``.
_CUSTOM = "custom"


def annotate_module(path: str) -> contextlib.AbstractContextManager[Any]:
    """While entered, every node traced is computed by the module at ``path``."""
    return fx_traceback.annotate({MODULE_ANNOTATION: path})


def set_module_path(node: fx.Node, path: str) -> None:
    """Record on a hand-made node what ``annotate_module`` records while tracing."""
    node.meta[_CUSTOM] = {**node.meta.get(_CUSTOM, {}), MODULE_ANNOTATION: path}


def module_path(node: fx.Node) -> str | None:
    """The path of the innermost module whose forward computed ``node``; "" for the root."""
    custom = node.meta.get(_CUSTOM)
    if isinstance(custom, dict):
        path = custom.get(MODULE_ANNOTATION)
        if isinstance(path, str):
            return path
    stack = node.meta.get("nn_module_stack")
    if isinstance(stack, dict) and stack:
        entry = list(stack.values())[-1]
        if isinstance(entry, tuple) and entry and isinstance(entry[0], str):
            return _dynamo_path(entry[0])
    return None


def _dynamo_path(path: str) -> str:
    """``L['self'].blocks[0]._modules['attn']`` -> ``blocks.0.attn``."""
    path = re.sub(r"^L\['[^']*'\]", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.lstrip(".")


def mark_copy(copy: fx.Node, of: fx.Node) -> None:
    """Record that backward node ``copy`` computes the same value as forward node ``of``."""
    _update(copy, copy_of=of.name)


def copies_in(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Forward node -> its backward copy, for every copy recorded with ``mark_copy``."""
    by_name = {n.name: n for n in graph.nodes}
    return {by_name[of]: n for n in graph.nodes
            if (of := record(n).copy_of) is not None and of in by_name}


def provenance(node: fx.Node) -> dict[str, Any]:
    """``node``'s torch metadata (stack trace, module path, partitioner tag, ...), for a node
    made in its place: neither fxshard's record nor the value, which the new node has its own of."""
    return {k: v for k, v in node.meta.items() if k not in (KEY, "val")}
