"""Shared by the lowering passes: replace a marker by a collective and its wait."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.nodes import call

CONVERT = torch.ops.prims.convert_element_type.default


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


def collective_after(gm: fx.GraphModule, value: fx.Node, collective: Any, args: tuple[Any, ...],
                     role: str, group: int, unit: str) -> fx.Node:
    """``wait_tensor(collective(*args))`` right after ``value``, which every other reader of
    ``value`` reads instead; returns the wait. Provenance and ``NodeInfo`` as
    :func:`replace_with_collective` gives them."""
    users = list(value.users)
    with gm.graph.inserting_after(value):
        issued = call(gm.graph, collective, args)
    with gm.graph.inserting_after(issued):
        wait = call(gm.graph, P.WAIT, (issued,))
    provenance = {k: v for k, v in value.meta.items() if k not in (meta.KEY, "val")}
    for new, new_role in ((issued, role), (wait, meta.WAIT)):
        new.meta.update(provenance)
        meta.set_info(new, meta.NodeInfo(new_role, group, unit))
    for user in users:
        user.replace_input_with(value, wait)
    return wait


def cast(gm: fx.GraphModule, value: fx.Node, dtype: Any, before: fx.Node, group: int,
         unit: str) -> fx.Node:
    """``value`` converted to ``dtype`` (mixed precision), inserted before ``before``; ``value``
    itself when it already has that dtype or ``dtype`` is None."""
    if dtype is None or value.meta["val"].dtype == dtype:
        return value
    with gm.graph.inserting_before(before):
        node = call(gm.graph, CONVERT, (value, dtype))
    node.meta.update({k: v for k, v in before.meta.items() if k not in (meta.KEY, "val")})
    meta.set_info(node, meta.NodeInfo(meta.CAST, group, unit))
    return node
