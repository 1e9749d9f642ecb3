"""Shared by the lowering passes: replace a marker by a collective and its wait."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.nodes import call


def replace_with_collective(gm: fx.GraphModule, marker: fx.Node, collective: Any,
                            args: tuple[Any, ...], role: str, group: int, unit: str) -> fx.Node:
    """``marker`` becomes ``wait_tensor(collective(*args))``; returns the wait.

    Both new nodes keep the marker's provenance (stack trace, module path,
    partitioner tag), get ``meta["val"]`` from running the collective under
    the fake mode, and an fxshard ``NodeInfo`` naming their role, flat group
    and unit.
    """
    with gm.graph.inserting_before(marker):
        issued = call(gm.graph, collective, args)
        wait = call(gm.graph, P.WAIT, (issued,))
    provenance = {k: v for k, v in marker.meta.items() if k not in (meta.KEY, "val")}
    for new, new_role in ((issued, role), (wait, meta.WAIT)):
        new.meta.update(provenance)
        meta.set_info(new, meta.NodeInfo(new_role, group, unit))
    marker.replace_all_uses_with(wait)
    gm.graph.erase_node(marker)
    return wait
