"""schedule_reduce_scatter_pass: reduce each unit's gradient as soon as it is complete.

Records positions in the graph's ``Schedule``; ``topological_sort_pass`` moves the nodes.

AOTAutograd flattens the unit's gradients (views, zeros for the padding, cat)
at the very end of backward, after every other gradient. This pass moves that
flatten chain and the reduce-scatter to right after the last gradient it
reads, so the reduction overlaps the rest of backward. The wait moves as late
as the in-flight rule allows: right before the next reduce-scatter is issued
(one reduction in flight, as FSDP2 does), and the last one right before the
graph returns, never later::

    before:  g_a = mm(..); g_b = mm(..); ...; cat_a = cat([view(g_a)..]); rs_a; w_a; cat_b; rs_b; w_b; return
    after:   g_a = mm(..); cat_a; div_a; rs_a; g_b = mm(..); cat_b; div_b; w_a; rs_b; ...; w_b; return

Positions follow graph order, which is the same on every rank.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.schedule import REDUCE, WAIT, schedule_of

from .context import PassContext
from .lowering import CONVERT

aten = torch.ops.aten


# convert_element_type: mixed precision's cast to the reduce dtype.
_FLATTEN_OPS = {aten.cat.default, aten.div.Tensor, aten.div_.Tensor, aten.zeros.default,
                aten.full.default, CONVERT}


def _flatten_chain(rs: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    """The layout nodes (views, zeros, cat, div) that only exist to build this reduction's input."""
    chain: dict[fx.Node, None] = {}
    work = list(rs.all_input_nodes)
    while work:
        node = work.pop()
        if node in chain or not (P.is_view(node) or node.target in _FLATTEN_OPS):
            continue
        if all(u is rs or u in chain for u in node.users):
            chain[node] = None
            work.extend(node.all_input_nodes)
    return sorted(chain, key=order.__getitem__)


def schedule_reduce_scatter_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    reductions = [n for n in gm.graph.nodes if P.is_reduce_scatter(n) or P.is_all_reduce(n)]
    if not reductions:
        return gm
    schedule = schedule_of(gm)
    order = order_of(gm.graph)
    for rs in reductions:
        chain = _flatten_chain(rs, order)
        members = {*chain, rs}
        inputs = [a for n in members for a in n.all_input_nodes if a not in members]
        if inputs:
            schedule.place([*chain, rs], schedule.last(inputs), REDUCE)
    reductions.sort(key=schedule.position)
    output = next(n for n in reversed(gm.graph.nodes) if P.is_output(n))
    for rs, following in zip(reductions, [*reductions[1:], None]):
        (wait,) = rs.users
        # The cast of the reduced gradient to the shard's dtype (mixed precision) goes along.
        casts = [u for u in wait.users if u.target is CONVERT]
        schedule.place([wait, *casts], following or output, WAIT)
    return gm
