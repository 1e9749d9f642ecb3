"""insert_free_pass: free each gathered buffer right after its last use.

::

    before:  w = wait(all_gather(shard)); v = view(split(w)[i]); y = mm(x, v); ...
    after:   w = wait(all_gather(shard)); v = view(split(w)[i]); y = mm(x, v); fxshard.free(w); ...

The buffer is each gather chain's result (``fxshard.ir.chains``), whatever its
lowering put between the wait and compute; the free joins the chain.

"Last use" counts every user of the buffer and of its views. ``free``
releases the storage shared by all those views, so the gathered parameters
occupy memory only inside their unit's window.

A buffer kept from forward (a unit that is not resharded) gets no ``free`` in
backward: backward runs in the boxed calling convention (codegen._boxed), so
it dies by reference counting after its last use there, and an explicit
free would break ``backward(retain_graph=True)``, which runs backward again
over the same saved buffer.
A buffer that escapes through the graph's outputs is not freed: in forward
that is a unit kept for backward (expected), or a model that returns a
parameter (logged).

Not in the pipeline when Inductor compiles the emitted graphs: it frees every
buffer after its last use itself, and may reorder a read of a buffer's views
past an explicit free.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fxshard.ir import meta, ops
from fxshard.ir import predicates as P
from fxshard.ir.analysis import aliases, order_of
from fxshard.ir.chains import gather_chains
from fxshard.ir.meta import Role
from fxshard.ir.nodes import call

from .context import PassContext

log = logging.getLogger("fxshard")


def insert_free_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    gathers = [c for c in gather_chains(graph) if c.gathers]
    if not gathers:
        return gm
    order = order_of(graph)
    plans = []
    for chain in gathers:
        buffer = chain.result
        views = aliases(buffer, order)
        users = {u for v in views for u in v.users if u not in views}
        if any(P.is_output(u) for u in users):
            if ctx.reshards(chain.group):
                log.warning("fxshard: %s (unit %r) escapes through the graph outputs and is not "
                            "freed", buffer.name, chain.unit)
            continue  # not resharded: kept for backward, which frees it
        last = max(users | set(views), key=order.__getitem__)
        plans.append((chain, last))
    for chain, last in plans:
        with graph.inserting_after(last):
            node = call(graph, ops.FREE, (chain.result,))
        meta.set_info(node, meta.NodeInfo(Role.FREE, chain.group, chain.unit, chain.tag))
    gm.recompile()
    return gm
