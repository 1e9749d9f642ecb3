"""insert_all_gather_pass: lower ``fxshard.unshard`` markers to all_gather + wait.

::

    before:  shard -> fxshard.unshard(shard, g, N) -> split_with_sizes -> getitem* -> view* -> compute
    after:   shard -> all_gather_into_tensor(shard, N, pg) -> wait_tensor -> split_with_sizes -> ...

With no process group (world size 1) the shard is the whole flat parameter,
so the marker is replaced by the shard itself and no collective is emitted.
A replicated group's ``fxshard.replicate`` marker is replaced by the
parameter itself the same way, at any world size: it is never gathered.
The gather is left where the marker was; place_gathers_pass places it. Each
marker is lowered by its row of the lowering table (``lowering.LOWERINGS``),
which tags the nodes it makes as one collective chain (``fxshard.ir.chains``).

With mixed precision the marker names the dtype to gather in, and the shard
is cast first, so the gather moves that dtype's bytes::

    shard -> convert_element_type(shard, bf16) -> all_gather_into_tensor -> wait_tensor -> ...
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir import predicates as P
from fxshard.ir.errors import GraphInvariantError

from .context import PassContext
from .lowering import lower


def insert_all_gather_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    markers = [m for m in map(P.marker, gm.graph.nodes)
               if m is not None and m.kind in (P.MarkerKind.UNSHARD, P.MarkerKind.REPLICATE)]
    if not markers:
        return gm
    for m in markers:
        if m.kind is P.MarkerKind.UNSHARD and m.world_size != ctx.layout.shard.size:
            raise GraphInvariantError(
                f"{m.node.name}: traced for a shard degree of {m.world_size}, lowering for "
                f"{ctx.layout.shard.size}"
            )
        lower(gm, m, ctx)
    gm.recompile()
    return gm
