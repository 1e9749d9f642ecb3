"""limit_prefetch_pass: no prefetched gather may hold its buffer across the graph's peak.

A prefetch makes a gathered buffer live from its all_gather, earlier than its
wait. Where that early window covers the graph's predicted peak (its liveness
over the final schedule, frees and moved allocations included), the prefetch
raised the peak by the buffer's bytes; the gather is then issued just after
the last peak point inside the window, and the liveness recomputed, until no
early window covers the peak::

    before:  ag1; ...; mm(peak); ...; w1; view1; mm(y, view1)
    after:   ...; mm(peak); ag1; ...; w1; view1; mm(y, view1)

Then the graph's peak is never above the just-in-time schedule's: at the peak
no early window is live, so the live bytes there are the just-in-time
schedule's at the same node. Prefetches away from the peak keep their overlap.
Delaying a gather only shortens its window, so the in-flight limit still holds.
The liveness is the report's (``fxshard.ir.memory``): in forward every input
outlives the graph; in backward the shards do, while saved tensors and
tangents die at their last use.

Every decision reads graph order, the plan and the values' sizes, which every
rank has alike, so every rank emits the same collective sequence.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir import predicates as P
from fxshard.ir.analysis import is_gather_wait, issue_nodes, order_of
from fxshard.ir.memory import graph_timeline

from .context import PassContext


def _persistent(gm: fx.GraphModule, graph: str) -> set[fx.Node]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if graph != "backward":
        return set(placeholders)
    shards = set()
    for wait in (n for n in gm.graph.nodes if is_gather_wait(n)):
        assert isinstance(wait.args[0], fx.Node)
        source = issue_nodes(wait.args[0])[0].args[0]
        if isinstance(source, fx.Node) and source.op == "placeholder":
            shards.add(source)
    return shards


def limit_prefetch_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    persistent = _persistent(gm, ctx.graph)
    waits = [n for n in gm.graph.nodes if is_gather_wait(n)]
    changed = False
    # Each round delays one gather past a peak point, strictly later: at most one round
    # per gather and node (in practice a few per gather, as the peak moves).
    for _ in range(len(waits) * len(gm.graph.nodes)):
        timeline = graph_timeline(gm, persistent)
        nodes = list(gm.graph.nodes)
        order = order_of(gm.graph)
        delay = None
        for wait in waits:
            gather = wait.args[0]
            assert isinstance(gather, fx.Node)
            if order[wait] - order[gather] <= 1:
                continue  # just in time
            early = range(order[gather], order[wait])  # live, not yet waited for
            at_peak = [i for i in early if timeline.highs[i] >= timeline.peak]
            if at_peak:
                after = max(at_peak) + 1
                while P.is_free(nodes[after]):  # a buffer is freed right after its last use
                    after += 1
                delay = (gather, nodes[after])
                break
        if delay is None:
            break
        gather, anchor = delay
        for node in issue_nodes(gather):
            anchor.prepend(node)
        changed = True
    if changed:
        gm.recompile()
    return gm
