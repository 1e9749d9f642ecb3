"""Where gathers go: just in time (place_gathers_pass), then one unit ahead (prefetch_gathers_pass).

Both passes record positions and edges in the graph's ``Schedule``
(``fxshard.ir.schedule``); ``topological_sort_pass`` moves the nodes.

A gathered buffer feeds a chain of parameter-only nodes (split, getitem,
view, and transposes or casts of a weight) before any real compute reads it.
``place_gathers_pass`` puts each gather, its wait and that chain just before
the first node outside the chain that reads them (just in time)::

    ag0; w0; split0; view0; ag1; w1; split1; view1; mm(x, view0); mm(y, view1)
      -> ag0; w0; split0; view0; mm(x, view0); ag1; w1; split1; view1; mm(y, view1)

``prefetch_gathers_pass`` then issues unit k+1's all_gather one unit ahead
(its wait stays), as FSDP2's one-unit lookahead does::

    "pre":   ag0; w0; view0; ag1; mm(x, view0); ... ; w1; view1; mm(y, view1)
    "post":  ag0; w0; view0; mm(x, view0); [free0]; ag1; ... ; w1; view1; mm(y, view1)

The mode is ``ShardingOptions.prefetch_mode(graph)``: forward uses "pre" when
``forward_prefetch`` is on; backward uses ``backward_prefetch``. Without a
mode the pipeline leaves the pass out. Backward needs no reordering of units:
AOTAutograd emits backward in reverse order of forward, so "next" is the
previous unit.

In-flight limit: at most ``max_inflight_gathers`` buffers of resharded units
(and at most ``max_inflight_bytes``) are alive from a prefetch's issue on. A
prefetch that would exceed it gets an edge: it is issued after every reader
of the buffers that must be freed first. Where those readers come after the
gather's own reader (the model reads more units at once), the gather stays
just in time. Buffers of units that are not resharded, and the root's, do not
count (``PassContext.counts_in_flight``): the root is often read at both ends
of forward (a tied embedding and output head), and FSDP2 keeps it out of its
lookahead too.

Every decision reads graph order, the plan and the options, never a tensor's
size beyond the parameters', so every rank emits the same collectives in the
same places whatever its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fxshard.ir.analysis import buffer_bytes, buffer_uses, order_of, parameter_chain
from fxshard.ir.chains import Chain, gather_chains
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.schedule import ISSUE, POST, PREFETCH, WAIT, Schedule, schedule_of

from .context import PassContext


def place_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    schedule = schedule_of(gm)
    order = order_of(gm.graph)
    found = []
    for gather in [c for c in gather_chains(gm.graph) if c.gathers]:
        params = parameter_chain(gather.result, order)
        inside = {gather.result, *params, *gather.kept}
        outside = [u for n in inside for u in n.users if u not in inside]
        if outside:
            found.append((gather, schedule.first(outside), params))
    # What a chain agrees once (a quantized gather's scales) goes at the graph's start: before
    # the first node that is neither an input nor agreed, taken before anything here moves,
    # in the order the units are first read.
    agreed = {n for gather, _, _ in found for n in gather.agreed}
    if agreed:
        start = next(n for n in gm.graph.nodes if n.op != "placeholder" and n not in agreed)
        found.sort(key=lambda f: schedule.position(f[1]))
        for rank, (gather, _, _) in enumerate(found):
            schedule.place(gather.agreed, start, ISSUE, rank=rank)
    for gather, first, params in found:
        schedule.place(gather.issued_with_gather, first, ISSUE)
        schedule.place([*gather.tail, *params], first, WAIT)
    return gm


@dataclass
class _Window:
    chain: Chain
    first: fx.Node  # first reader outside its parameter chain
    last: fx.Node  # last reader of it or any view of it
    bytes: int
    resident: bool  # not counted in flight (ctx.counts_in_flight): not resharded, or the root


def _windows(gm: fx.GraphModule, schedule: Schedule, ctx: PassContext) -> list[_Window]:
    """Every gathered buffer's planned window, in the order of first compute."""
    result = []
    for use in buffer_uses(gm.graph):
        if not use.outside:
            continue
        result.append(_Window(use.chain, schedule.first(use.outside), schedule.last(use.readers),
                              buffer_bytes(use.buffer), not ctx.counts_in_flight(use.chain.group)))
    return sorted(result, key=lambda w: schedule.position(w.first))


def prefetch_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    mode = ctx.options.prefetch_mode(ctx.graph)
    if mode is None:
        raise GraphInvariantError(
            f"prefetch_gathers_pass on the {ctx.graph} graph, whose options ask for no prefetch "
            "(build_pipeline leaves it out then)"
        )
    schedule = schedule_of(gm)
    windows = _windows(gm, schedule, ctx)
    limit, cap = ctx.options.max_inflight_gathers, ctx.options.max_inflight_bytes
    counted: list[_Window] = []  # resharded windows so far, in order
    done_by: list[fx.Node] = []  # done_by[i]: the last reader of counted[0..i]
    for prev, target in zip([None, *windows], windows):
        must_free = _must_free(target, counted, limit, cap)
        if not target.resident:
            counted.append(target)
            done_by.append(schedule.last([done_by[-1], target.last]) if done_by else target.last)
        if prev is None or not target.chain.gathers or must_free is None:
            continue  # a saved buffer is already there; a buffer over the byte cap: just in time
        blocker = done_by[must_free - 1] if must_free else None
        if blocker is not None and schedule.position(blocker) >= schedule.position(target.chain.result):
            continue  # the model reads the blocking units after this one's first use: just in time
        nodes = list(target.chain.issued_with_gather)
        if mode == "pre":
            schedule.place(nodes, prev.first, PREFETCH)
        else:
            schedule.place(nodes, prev.last, POST)
        if blocker is not None:
            schedule.require(nodes[0], [blocker])
    return gm


def _must_free(target: _Window, counted: list[_Window], limit: int, cap: int | None) -> int | None:
    """How many of the earliest resharded buffers must be freed before ``target`` is issued
    (the newest others stay alive with it, within the count and byte limits); None when
    ``target`` alone is over the byte cap."""
    alive = 0 if target.resident else target.bytes
    keep = min(len(counted), limit if target.resident else limit - 1)
    if cap is not None:
        if alive > cap:
            return None
        kept = 0
        for w in reversed(counted[len(counted) - keep:]):
            if alive + w.bytes > cap:
                break
            alive += w.bytes
            kept += 1
        keep = kept
    return len(counted) - keep
