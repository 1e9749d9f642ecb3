"""fxshard's node metadata: one key, ``node.meta["fxshard"]``, typed accessors.

The module path of a traced node is recorded while tracing with
``torch.fx.traceback.annotate`` and lands in ``node.meta["custom"]``;
``module_path`` reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

KEY = "fxshard"
MODULE_ANNOTATION = "fxshard.module"

# Roles a pass gives the nodes it creates.
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
WAIT = "wait"
FREE = "free"
REMAT = "remat"  # backward copy of a parameter-only computation
SAVED = "saved_buffer"  # backward input: a gathered buffer kept from forward (not resharded)


@dataclass(frozen=True)
class NodeInfo:
    role: str
    group: int  # index of the flat group (ShardPlan.groups) the node works on
    unit: str  # name of the FSDP unit that owns that group


def set_info(node: fx.Node, info: NodeInfo) -> None:
    node.meta[KEY] = info


def get_info(node: fx.Node) -> NodeInfo | None:
    info = node.meta.get(KEY)
    return info if isinstance(info, NodeInfo) else None


def module_path(node: fx.Node) -> str | None:
    custom = node.meta.get("custom")
    if isinstance(custom, dict):
        path = custom.get(MODULE_ANNOTATION)
        return path if isinstance(path, str) else None
    return None
