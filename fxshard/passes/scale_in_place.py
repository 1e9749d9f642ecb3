"""scale_in_place_pass: divide a fresh gradient in place.

A reduction chain divides the gradient by the ranks it is averaged over: before
reducing it (DDP's order: divide, then sum), or, where the divisor is a power of
two, the reduced shard after its wait (``lowering.divides_exactly``: the same
values). When what it divides is fresh (the ``cat`` AOTAutograd built of the
unit's gradients, the chain's cast to the reduce dtype, or the collective's
result) and nothing else reads it, the division writes into it instead of
holding a second buffer of the same size::

    before:  cat -> div(cat, D) -> reduce_scatter_tensor -> wait_tensor
    after:   cat -> div_(cat, D) -> reduce_scatter_tensor -> wait_tensor
    before:  cat -> reduce_scatter_tensor -> wait_tensor -> div(wait, D)
    after:   cat -> reduce_scatter_tensor -> wait_tensor -> div_(wait, D)

It runs after the sort, with ``accumulate_in_place_pass``: the lowerings emit the
functional ``div`` and no pass before these two sees a write. The new node keeps
the division's place, role and chain.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.meta import Role
from fxshard.ir.nodes import call

from .context import PassContext

aten = torch.ops.aten
_FRESH = (aten.cat.default, torch.ops.prims.convert_element_type.default, P.WAIT)


def _in_place(div: fx.Node) -> bool:
    x = div.args[0]
    return isinstance(x, fx.Node) and x.target in _FRESH and list(x.users) == [div]


def scale_in_place_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    scales = [n for n in graph.nodes if P.is_call(n) and n.target is aten.div.Tensor
              and meta.role_of(n) is Role.SCALE and _in_place(n)]
    if not scales:
        return gm
    # In the order the lowerings made them, so the new nodes are numbered in that order.
    for div in sorted(scales, key=lambda n: _chain_id(n)):
        with graph.inserting_before(div):
            scaled = call(graph, aten.div_.Tensor, div.args, dict(div.kwargs))
        scaled.meta.update({k: v for k, v in div.meta.items() if k != "val"})
        div.replace_all_uses_with(scaled)
        graph.erase_node(div)
    gm.recompile()
    return gm


def _chain_id(node: fx.Node) -> int:
    info = meta.get_info(node)
    assert info is not None and info.chain is not None, f"{node.name}: a division in no chain"
    return info.chain.id
