"""Shared by the lowering passes: replace a marker by a collective and its wait."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from fxshard import meta
from fxshard import predicates as P


def replace_with_collective(gm: fx.GraphModule, marker: fx.Node, collective: Any,
                            args: tuple[Any, ...], role: str, group: int, unit: str) -> fx.Node:
    """``marker`` becomes ``wait_tensor(collective(*args))``; returns the wait.

    Both new nodes take the marker's metadata (``meta["val"]``: same shape)
    and an fxshard ``NodeInfo`` naming their role, flat group and unit.
    """
    with gm.graph.inserting_before(marker):
        issued = gm.graph.call_function(collective, args)
        wait = gm.graph.call_function(P.WAIT, (issued,))
    for new, new_role in ((issued, role), (wait, meta.WAIT)):
        new.meta.update({k: v for k, v in marker.meta.items() if k != meta.KEY})
        meta.set_info(new, meta.NodeInfo(new_role, group, unit))
    marker.replace_all_uses_with(wait)
    gm.graph.erase_node(marker)
    return wait
