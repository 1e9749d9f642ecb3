"""schedule_pass: gather each unit right before its first compute.

A gathered buffer feeds a chain of parameter-only nodes (split, getitem,
view, and transposes or casts of a weight) before any real compute reads it.
The pass moves the gather, its wait and that chain to just before the first
node outside the chain that uses them::

    before:  ag0; w0; split0; view0; ag1; w1; split1; view1; mm(x, view0); mm(y, view1)
    after:   ag0; w0; split0; view0; mm(x, view0); ag1; w1; split1; view1; mm(y, view1)

The order is a function of graph order alone, so every rank emits the same
collective sequence. Moving is legal: the gather's only input is a graph
input, and every chain node depends only on the buffer and on earlier chain
nodes, while every outside user comes after the first one. A node that reads
two units' parameters belongs to neither chain. Reduce-scatters stay where
lowering put them, right after the unit's gradient is complete.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard import predicates as P

from .analysis import gathered_buffers
from .context import PassContext


def parameter_chain(wait: fx.Node) -> list[fx.Node]:
    """Nodes computed from this one gathered buffer alone, in graph order (not ``wait``)."""
    chain: dict[fx.Node, None] = {}
    members = {wait}
    for node in _after(wait):
        if (
            P.is_call(node)
            and not P.is_random(node)
            and not node.is_impure()
            and node.all_input_nodes
            and all(a in members for a in node.all_input_nodes)
        ):
            chain[node] = None
            members.add(node)
    return list(chain)


def _after(node: fx.Node) -> list[fx.Node]:
    result = []
    cur = node.next
    while cur.op != "root":
        result.append(cur)
        cur = cur.next
    return result


def schedule_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    waits = gathered_buffers(gm.graph)
    if not waits:
        return gm
    moves = []
    for wait in waits:
        chain = parameter_chain(wait)
        inside = {wait, *chain}
        outside = [u for n in inside for u in n.users if u not in inside]
        if outside:
            moves.append((wait, chain, outside))
    for wait, chain, outside in moves:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = min(outside, key=order.__getitem__)
        for node in (wait.args[0], wait, *chain):
            assert isinstance(node, fx.Node)
            first.prepend(node)
    gm.recompile()
    return gm
