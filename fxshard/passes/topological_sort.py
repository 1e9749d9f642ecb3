"""topological_sort_pass: the one sort that places every node the scheduling passes positioned.

The scheduling passes before it (``place_gathers_pass``, ``prefetch_gathers_pass``,
``schedule_reduce_scatter_pass``, ``sink_allocations_pass``) only record
positions and edges in the graph's ``Schedule`` (``fxshard.ir.schedule``).
This pass places the nodes once: a stable topological sort over the inputs
and the edges, taking at each step the ready node with the smallest planned
position. Nodes no pass positioned keep their relative order::

    planned:  ag0@before(mm0)  ag1@before(mm0, prefetch)  w1@before(mm1)
    before:   ag0; ag1; w0; w1; mm0; mm1
    after:    ag0; w0; ag1; mm0; w1; mm1

O(N log N) in nodes and edges, so compile time grows linearly with depth.
A contradiction between edges (a cycle) raises GraphInvariantError naming
the nodes that could not be placed.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir.schedule import reorder, take_schedule

from .context import PassContext


def topological_sort_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    schedule = take_schedule(gm)
    if schedule is None:
        return gm
    if reorder(gm.graph, schedule.sorted_nodes()):
        gm.recompile()
    return gm
