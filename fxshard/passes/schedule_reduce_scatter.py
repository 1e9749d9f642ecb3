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
from fxshard.ir.chains import reduce_chains
from fxshard.ir.schedule import REDUCE, WAIT, schedule_of

from .context import PassContext

aten = torch.ops.aten


# What AOTAutograd builds a unit's flat gradient from: views, zeros for the padding, a cat.
_FLATTEN_OPS = {aten.cat.default, aten.zeros.default, aten.full.default}


def _flatten_chain(start: list[fx.Node], into: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    """The layout nodes (views, zeros, cat) that only exist to build ``start``, which only
    ``into`` and ``start`` read."""
    chain: dict[fx.Node, None] = {}
    members = {*start, into}
    work = [a for n in start for a in n.all_input_nodes]
    while work:
        node = work.pop()
        if node in chain or node in members or not (P.is_view(node) or node.target in _FLATTEN_OPS):
            continue
        if all(u in members or u in chain for u in node.users):
            chain[node] = None
            work.extend(node.all_input_nodes)
    return sorted(chain, key=order.__getitem__)


def schedule_reduce_scatter_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    # Chains that communicate (one offloaded rank's is a copy to the host alone: it stays put).
    found = [c for c in reduce_chains(gm.graph) if c.collectives]
    if not found:
        return gm
    schedule = schedule_of(gm)
    order = order_of(gm.graph)
    for chain in found:  # issue: after the last gradient it reads
        issue = list(chain.issue)
        nodes = [*_flatten_chain(issue, chain.collectives[0], order), *issue]
        members = set(nodes)
        inputs = [a for n in members for a in n.all_input_nodes if a not in members]
        if inputs:
            schedule.place(nodes, schedule.last(inputs), REDUCE)
    found.sort(key=lambda c: schedule.position(c.collectives[0]))
    output = next(n for n in reversed(gm.graph.nodes) if P.is_output(n))
    # Last chain first: each wait is placed relative to the next chain's collectives, which
    # must be where they go by then (a position is computed from its anchor's when placed).
    for k in reversed(range(len(found))):
        chain = found[k]
        for stage, wait in enumerate(chain.waits):
            # The next reduction at this stage (the next unit's reduce_scatter; HSDP's all_reduce
            # over the replicas has a stage of its own): this one is waited just before it.
            following = next((c.collectives[stage] for c in found[k + 1:]
                              if len(c.collectives) > stage), output)
            waited = [wait]
            if stage + 1 < len(chain.collectives):
                # HSDP: the next collective of the chain is issued as soon as its input is waited.
                schedule.place([wait], following, WAIT)
                schedule.place([chain.collectives[stage + 1]], wait, REDUCE)
                continue
            # The cast of the reduced value to the shard's dtype goes with the last wait.
            waited += [n for n in chain.tail if order[n] > order[wait] and n not in chain.waits]
            schedule.place(waited, following, WAIT)
    return gm
