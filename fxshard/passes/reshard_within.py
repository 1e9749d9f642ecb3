"""reshard_within_pass: hpZ (``reshard_after_forward=h``), a piece kept in forward and
gathered within a partition in backward.

The joint graph keeps a resharded unit's gathered buffer for backward when the
layout has a partition (``PassContext.keeps_buffer``), as it does for a unit
that is not resharded. On the partitioned graphs this pass then cuts what
crosses to 1/h of the buffer, where ZeRO-3 would keep 1/S and ZeRO-2 all of it.

Forward: the buffer saved for backward becomes this rank's piece of it, rank
``p`` of its partition of h ranks keeping elements ``[p L/h, (p+1) L/h)``,
copied after the buffer's last reader, so insert_free_pass still frees the
buffer right there::

    before:  w = wait(all_gather(shard, S, shard_pg)) ... mm(x, view(w)) ...   output(..., w)
    after:   w = wait(all_gather(shard, S, shard_pg)) ... mm(x, view(w)) ...
             piece = clone(slice(w, 0, p L/h, (p+1) L/h)); free(w) ...             output(..., piece)

Backward: the saved input is that piece; it is gathered within the partition
before its first reader (place_gathers_pass puts it there, the prefetch passes
and the in-flight limit treat it as any gather), and freed after its last::

    before:  w (saved, L) -> split -> view -> mm(grad, t)
    after:   piece (saved, L/h) -> all_gather(piece, h, partition_pg) -> wait -> split -> ...

The backward gather is the lowering table's "partition" row (``all_gather_within``).
Only the piece (1/h) crosses from forward to backward, and backward's gathers
stay inside the partition (a node's ranks, when h is the ranks per node).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import aliases, order_of
from fxshard.ir.chains import chain_of, gather_chains
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.meta import Role
from fxshard.ir.nodes import call

from .context import PassContext
from .lowering import LoweringKey, Site, lowering_for

aten = torch.ops.aten


def reshard_within_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.layout.partition is None:
        return gm
    if ctx.graph == "forward" and ctx.num_user_outputs is not None:
        _keep_pieces(gm, ctx)
    elif ctx.graph == "backward":
        _gather_pieces(gm, ctx)
    gm.recompile()
    return gm


def _piece_bounds(buffer: fx.Node, ctx: PassContext) -> tuple[int, int]:
    assert ctx.layout.partition is not None
    size = ctx.layout.partition.size
    numel = buffer.meta["val"].numel()
    if numel % size:
        raise GraphInvariantError(f"{buffer.name}: {numel} elements do not split into {size} pieces")
    length = numel // size
    return ctx.layout.partition_rank * length, length


def _keep_pieces(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    output = next(n for n in graph.nodes if P.is_output(n))
    outputs = list(output.args[0])
    order = order_of(graph)
    found = [c for c in gather_chains(graph) if c.gathers]
    for i in range(ctx.num_user_outputs or 0, len(outputs)):
        buffer = outputs[i]
        chain = chain_of(buffer, found) if isinstance(buffer, fx.Node) else None
        if chain is None or buffer is not chain.result or not ctx.partitioned(chain.group):
            continue
        views = aliases(buffer, order)
        readers = {u for v in views for u in v.users if u not in views and not P.is_output(u)}
        last = max(readers | set(views), key=order.__getitem__)
        start, length = _piece_bounds(buffer, ctx)
        with graph.inserting_after(last):
            piece = call(graph, aten.slice.Tensor, (buffer, 0, start, start + length))
        with graph.inserting_after(piece):
            kept = call(graph, aten.clone.default, (piece,))
        for node in (piece, kept):  # part of the gather's chain: its kept piece
            node.meta.update(meta.provenance(buffer))
            meta.set_info(node, meta.NodeInfo(Role.PIECE, chain.group, chain.unit, chain.tag))
        outputs[i] = kept
    output.args = (tuple(outputs),)


def _gather_pieces(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    saved = [c for c in gather_chains(graph)
             if c.lowering == "saved" and ctx.partitioned(c.group)]
    if not saved:
        return
    partition = ctx.layout.partition
    assert partition is not None
    first = next(n for n in graph.nodes if not P.is_placeholder(n))
    for chain in saved:
        gather = lowering_for(LoweringKey.of(meta.Direction.GATHER, ctx.holding(chain.group), "partition"))
        buffer = chain.result
        full = buffer.meta["val"]
        _, length = _piece_bounds(buffer, ctx)
        buffer.meta["val"] = full.new_empty(length)  # what forward now saves (fake)
        meta.set_info(buffer, meta.NodeInfo(Role.PIECE, chain.group, chain.unit))  # an input
        readers = list(buffer.users)
        wait = gather(Site(gm, chain.group, buffer, buffer, first), ctx)
        if tuple(wait.meta["val"].shape) != tuple(full.shape):
            raise GraphInvariantError(f"{buffer.name}: gathered back to {tuple(wait.meta['val'].shape)}, "
                                      f"not the {tuple(full.shape)} forward gathered")
        for reader in readers:
            reader.replace_input_with(buffer, wait)
