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
    replicated = [n for n in gm.graph.nodes if P.is_replicate_marker(n)]
    for marker in replicated:
        group = marker.args[1]
        assert isinstance(group, int) and isinstance(marker.args[0], fx.Node)
        dtype = marker.args[3] if len(marker.args) > 3 else None
        marker.replace_all_uses_with(cast(gm, marker.args[0], dtype, marker, group, ctx.unit_of(group)))
        gm.graph.erase_node(marker)
    markers = [n for n in gm.graph.nodes if P.is_unshard_marker(n)]
    if not markers:
        if replicated:
            gm.recompile()
        return gm
    for marker in markers:
        shard, group, world_size = marker.args[:3]
        dtype = marker.args[3] if len(marker.args) > 3 else None
        if not isinstance(shard, fx.Node) or not isinstance(group, int):
            raise GraphInvariantError(f"{marker.name}: malformed fxshard.unshard {marker.args}")
        if world_size != ctx.world_size:
            raise GraphInvariantError(
                f"{marker.name}: traced for world size {world_size}, lowering for {ctx.world_size}"
            )
        if ctx.group_name is None:
            if ctx.world_size != 1:
                raise GraphInvariantError("world size > 1 needs a process group to gather over")
            marker.replace_all_uses_with(cast(gm, shard, dtype, marker, group, ctx.unit_of(group)))
            gm.graph.erase_node(marker)
            continue
        source = cast(gm, shard, dtype, marker, group, ctx.unit_of(group))  # gather half the bytes
        replace_with_collective(gm, marker, P.ALL_GATHER, (source, ctx.world_size, ctx.group_name),
                                meta.ALL_GATHER, group, ctx.unit_of(group))
    gm.recompile()
    return gm
