"""insert_reduce_scatter_pass: lower ``fxshard.reduce_grad`` to reduce_scatter + wait.

AOTAutograd has already concatenated the unit's parameter gradients (the
backward of the split that unflattened the gathered buffer is a ``cat``)::

    before:  grad_p0, grad_p1, ..., zeros(pad) -> cat -> fxshard.reduce_grad(cat, g, N) -> shard.grad
    after:   ... -> cat -> div(cat, N) -> reduce_scatter_tensor(div, "sum", N, pg) -> wait_tensor -> shard.grad

The result is the average over ranks, as DDP computes it. Dividing before
summing is also DDP's order of operations (it divides each gradient by N
before its all-reduce), so fxshard's gradients round the same way DDP's do.
With no process group (world size 1) the concatenated gradient is the
shard's gradient.

A replicated group's ``fxshard.allreduce_grad`` lowers the same way to
``div -> all_reduce(.., "sum") -> wait_tensor``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard import meta
from fxshard import predicates as P
from fxshard.errors import GraphInvariantError

from .context import PassContext

aten = torch.ops.aten


def insert_reduce_scatter_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    markers = [n for n in gm.graph.nodes
               if P.is_reduce_grad_marker(n) or P.is_allreduce_grad_marker(n)]
    if not markers:
        return gm
    for marker in markers:
        grad, group, _world_size = marker.args
        if not isinstance(grad, fx.Node) or not isinstance(group, int):
            raise GraphInvariantError(f"{marker.name}: malformed fxshard.reduce_grad {marker.args}")
        if ctx.group_name is None:
            marker.replace_all_uses_with(grad)
            gm.graph.erase_node(marker)
            continue
        unit = ctx.unit_of(group)
        with gm.graph.inserting_before(marker):
            scaled = gm.graph.call_function(aten.div.Tensor, (grad, ctx.world_size))
            if P.is_allreduce_grad_marker(marker):
                reduce = gm.graph.call_function(P.ALL_REDUCE, (scaled, "sum", ctx.group_name))
            else:
                reduce = gm.graph.call_function(
                    P.REDUCE_SCATTER, (scaled, "sum", ctx.world_size, ctx.group_name)
                )
            wait = gm.graph.call_function(P.WAIT, (reduce,))
        scaled.meta["val"] = grad.meta["val"]
        kind = meta.ALL_REDUCE if P.is_allreduce_grad_marker(marker) else meta.REDUCE_SCATTER
        for new, role in ((reduce, kind), (wait, meta.WAIT)):
            new.meta.update({k: v for k, v in marker.meta.items() if k != meta.KEY})
            meta.set_info(new, meta.NodeInfo(role, group, unit))
        marker.replace_all_uses_with(wait)
        gm.graph.erase_node(marker)
    gm.recompile()
    return gm
