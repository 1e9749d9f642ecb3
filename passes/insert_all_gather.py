"""insert_all_gather_pass: lower ``fxshard.unshard`` markers to all_gather + wait.

::

    before:  shard -> fxshard.unshard(shard, g, N) -> split_with_sizes -> getitem* -> view* -> compute
    after:   shard -> all_gather_into_tensor(shard, N, pg) -> wait_tensor -> split_with_sizes -> ...

With no process group (world size 1) the shard is the whole flat parameter,
so the marker is replaced by the shard itself and no collective is emitted.
A replicated group's ``fxshard.replicate`` marker is replaced by the
parameter itself the same way, at any world size: it is never gathered.
The gather is left where the marker was; schedule_pass places it.

With mixed precision the marker names the dtype to gather in, and the shard
is cast first, so the gather moves that dtype's bytes::

    shard -> convert_element_type(shard, bf16) -> all_gather_into_tensor -> wait_tensor -> ...
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.errors import GraphInvariantError

from .context import PassContext
from .lowering import cast, replace_with_collective


def insert_all_gather_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    found = [m for m in map(P.marker, gm.graph.nodes) if m is not None]
    replicated = [m for m in found if m.kind is P.MarkerKind.REPLICATE]
    for m in replicated:
        m.node.replace_all_uses_with(cast(gm, m.value, m.compute_dtype, m.node, m.group, ctx.unit_of(m.group)))
        gm.graph.erase_node(m.node)
    markers = [m for m in found if m.kind is P.MarkerKind.UNSHARD]
    if not markers:
        if replicated:
            gm.recompile()
        return gm
    shard = ctx.layout.shard
    for m in markers:
        unit = ctx.unit_of(m.group)
        if m.world_size != shard.size:
            raise GraphInvariantError(
                f"{m.node.name}: traced for a shard degree of {m.world_size}, lowering for {shard.size}"
            )
        if shard.name is None:
            m.node.replace_all_uses_with(cast(gm, m.value, m.compute_dtype, m.node, m.group, unit))
            gm.graph.erase_node(m.node)
            continue
        source = cast(gm, m.value, m.compute_dtype, m.node, m.group, unit)  # gather half the bytes
        replace_with_collective(gm, m.node, P.ALL_GATHER, (source, shard.size, shard.name),
                                meta.ALL_GATHER, m.group, unit)
    gm.recompile()
    return gm
