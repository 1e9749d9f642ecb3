"""One agreement per graph: the all_reduces that gather chains agree at the graph's start made one.

A lowering may agree values over the ranks before its gather (a wire format whose
``Wire.agrees``): a quantized "tensor" gather agrees its scales over the shard group, an
all_reduce (MAX) of its shard's per-parameter maxima (``all_gather_quantized_tensor``),
declared agreed at the graph's start (``NodeInfo.agrees``), where
``place_gathers_pass`` puts it. One all_reduce per unit costs the start of every graph
one collective's latency per unit (81 units for Llama-3-70B, each several
milliseconds over 1024 ranks on InfiniBand). This pass makes them one per process
group::

    amax_a -> all_reduce -> wait -> scales_a        amax_a -+
    amax_b -> all_reduce -> wait -> scales_b   ->   amax_b -+-> cat -> all_reduce -> wait -+-> slice_a -> scales_a
                                                                                           +-> slice_b -> scales_b

The maxima, the cat, the all_reduce and its wait join the agreement of the batch's
first chain in graph order; every chain keeps its own slice, scales, quantization and
gather, so each is still one declared chain (``Chain.agreed`` starts at its slice). The
nodes move to just after the graph's inputs, in an order in which each reads only
what comes before it, which is where the schedule puts them anyway.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.chains import Chain, gather_chains
from fxshard.ir.meta import Role
from fxshard.ir.nodes import call

from .context import PassContext

aten = torch.ops.aten


def batch_agreements_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    batches: dict[tuple[str, str | None, torch.dtype], list[tuple[Chain, fx.Node, fx.Node]]] = {}
    for chain in gather_chains(gm.graph):
        for reduce in chain.collectives:
            if reduce in chain.agreed and P.is_all_reduce(reduce):
                args = P.collective_args(reduce)
                (wait,) = [u for u in reduce.users if P.is_wait(u)]
                key = (args.group_name, args.reduce_op, args.input.meta["val"].dtype)
                batches.setdefault(key, []).append((chain, reduce, wait))
    for batch in batches.values():
        if len(batch) > 1:
            _merge(gm, batch)
    return gm


def _merge(gm: fx.GraphModule, batch: list[tuple[Chain, fx.Node, fx.Node]]) -> None:
    graph = gm.graph
    _, reduce0, _ = batch[0]
    owner = meta.get_info(reduce0)
    assert owner is not None
    maxima = [P.collective_args(r).input for _, r, _ in batch]
    before: list[fx.Node] = []  # every chain's nodes up to its maxima, in graph order
    after: list[fx.Node] = []  # every chain's agreed nodes from its wait on
    for chain, reduce, wait in batch:
        upstream = _upstream(P.collective_args(reduce).input, set(chain.agreed))
        for n in chain.agreed:
            if n in upstream:
                info = meta.get_info(n)
                assert info is not None
                meta.set_info(n, dataclasses.replace(info, chain=owner.chain, group=owner.group,
                                                     unit=owner.unit))
                before.append(n)
            elif n is not reduce and n is not wait:
                after.append(n)
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        joined = call(graph, aten.cat.default, (maxima,))
    args = P.collective_args(reduce0)
    with graph.inserting_after(joined):
        reduced = call(graph, reduce0.target, (joined, args.reduce_op, args.group_name))
    with graph.inserting_after(reduced):
        agreed = call(graph, P.WAIT, (reduced,))
    for node, role in ((joined, Role.ENCODE), (reduced, Role.ALL_REDUCE), (agreed, Role.WAIT)):
        node.meta.update(meta.provenance(reduce0))
        meta.set_info(node, dataclasses.replace(owner, role=role))
    cursor, offset, slices = agreed, 0, []
    for (_, reduce, wait), m in zip(batch, maxima):
        count = m.meta["val"].shape[0]
        with graph.inserting_after(cursor):
            piece = call(graph, aten.slice.Tensor, (agreed, 0, offset, offset + count))
        piece.meta.update(meta.provenance(reduce))
        info = meta.get_info(wait)
        assert info is not None
        meta.set_info(piece, dataclasses.replace(info, role=Role.ENCODE))
        wait.replace_all_uses_with(piece)
        graph.erase_node(wait)
        graph.erase_node(reduce)
        cursor, offset = piece, offset + count
        slices.append(piece)
    # Physical order: inputs; every chain's maxima; cat, all_reduce, wait, slices; the rest.
    cursor = last_input
    for n in [*before, joined, reduced, agreed, *slices, *after]:
        cursor.append(n)
        cursor = n


def _upstream(node: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    """``node`` and every node of ``within`` it reads, directly or through others of it."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in within and n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found
