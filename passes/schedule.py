"""Placing gathers: just in time (place_gathers_pass), then prefetched within the
in-flight limit (prefetch_gathers_pass).

A gathered buffer feeds a chain of parameter-only nodes (split, getitem,
view, and transposes or casts of a weight) before any real compute reads it.
``place_gathers_pass`` moves each gather, its wait and that chain to just
before the first node outside the chain that reads them (just in time)::

    ag0; w0; split0; view0; ag1; w1; split1; view1; mm(x, view0); mm(y, view1)
      -> ag0; w0; split0; view0; mm(x, view0); ag1; w1; split1; view1; mm(y, view1)

Then ``prefetch_gathers_pass`` moves unit k+1's all_gather earlier (its wait stays)::

    "pre":   ag0; w0; view0; ag1; mm(x, view0); ... ; w1; view1; mm(y, view1)
    "post":  ag0; w0; view0; mm(x, view0); [free0]; ag1; ... ; w1; view1; mm(y, view1)

The mode is ``ShardingOptions.prefetch_mode(graph)``: forward uses "pre" when
``forward_prefetch`` is on; backward uses ``backward_prefetch``. Without a
mode the pipeline leaves the pass out. Backward needs no reordering of units: AOTAutograd
emits backward in reverse order of forward, so "next" is the previous unit.

In-flight limit: a prefetch may not make more than ``max_inflight_gathers``
buffers of resharded units (or more than ``max_inflight_bytes``) alive at its
issue point. If it would, the gather is delayed to just after the earliest
last use among the live buffers (where insert_free_pass will free it), and
so on; a gather that cannot move stays just in time. The limit is a property
of the schedule, so no CPU synchronisation enforces it. Buffers of units that
are not resharded (the root, by default) are resident and do not count.

Every decision reads graph order and the plan, which every rank has alike,
so every rank emits the same collective sequence.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir.analysis import (
    Window,
    buffer_uses,
    is_gather_wait,
    issue_nodes,
    order_of,
    parameter_chain,
    windows,
)
from fxshard.ir.errors import GraphInvariantError

from .context import PassContext


def place_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    moves = []
    order = order_of(gm.graph)
    for wait in [n for n in gm.graph.nodes if is_gather_wait(n)]:
        chain = parameter_chain(wait, order)
        inside = {wait, *chain}
        outside = [u for n in inside for u in n.users if u not in inside]
        if outside:
            moves.append((wait, chain, outside))
    for wait, chain, outside in moves:
        order = order_of(gm.graph)
        first = min(outside, key=order.__getitem__)
        assert isinstance(wait.args[0], fx.Node)
        for node in (*issue_nodes(wait.args[0]), wait, *chain):
            first.prepend(node)
    if moves:
        gm.recompile()
    return gm


def _fits(live: list[Window], new: Window, ctx: PassContext) -> bool:
    counted = [w for w in live if not w.resident] + ([] if new.resident else [new])
    if len(counted) > ctx.options.max_inflight_gathers:
        return False
    cap = ctx.options.max_inflight_bytes
    return cap is None or sum(w.bytes for w in counted) <= cap


def prefetch_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    mode = ctx.options.prefetch_mode(ctx.graph)
    if mode is None:
        raise GraphInvariantError(
            f"prefetch_gathers_pass on the {ctx.graph} graph, whose options ask for no prefetch "
            "(build_pipeline leaves it out then)"
        )
    reshards = {g.index: ctx.reshards(g.index) for g in ctx.plan.groups}
    uses = buffer_uses(gm.graph)  # moving gathers changes positions, not readers
    sequence = windows(gm.graph, reshards, uses)
    moved = False
    for j in range(1, len(sequence)):
        current = windows(gm.graph, reshards, uses)  # positions after earlier moves
        by_buffer = {w.buffer: w for w in current}
        target, prev = by_buffer[sequence[j].buffer], by_buffer[sequence[j - 1].buffer]
        if not is_gather_wait(target.buffer):
            continue  # a saved buffer is already there
        point = prev.first if mode == "pre" else prev.last + 1
        earlier = [by_buffer[w.buffer] for w in sequence[:j]]
        while point < target.issue:
            live = [w for w in earlier if w.issue <= point <= w.last]
            if _fits(live, target, ctx):
                break
            blocking = [w.last for w in live if not w.resident]
            if not blocking:  # the buffer alone is over the byte cap: just in time
                point = target.issue
                break
            point = min(blocking) + 1
        if point >= target.issue:
            continue  # stays just in time
        anchor = list(gm.graph.nodes)[point]
        assert isinstance(target.buffer.args[0], fx.Node)
        for node in issue_nodes(target.buffer.args[0]):
            anchor.prepend(node)
        moved = True
    if moved:
        gm.recompile()
    return gm
