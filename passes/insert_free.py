"""insert_free_pass: free each gathered buffer right after its last use.

::

    before:  w = wait(all_gather(shard)); v = view(split(w)[i]); y = mm(x, v); ...
    after:   w = wait(all_gather(shard)); v = view(split(w)[i]); y = mm(x, v); fxshard.free(w); ...

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
from fxshard.ir.analysis import aliases, buffer_group, gathered_buffers, is_saved_buffer
from fxshard.ir.nodes import call

from .context import PassContext

log = logging.getLogger("fxshard")


def insert_free_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    waits = [n for n in gathered_buffers(graph) if not is_saved_buffer(n)]
    if not waits:
        return gm
    order = {n: i for i, n in enumerate(graph.nodes)}
    plans = []
    for wait in waits:
        views = aliases(wait, order)
        users = {u for v in views for u in v.users if u not in views}
        if any(P.is_output(u) for u in users):
            group = buffer_group(wait)
            if ctx.reshards(group):
                log.warning("fxshard: %s (unit %r) escapes through the graph outputs and is not "
                            "freed", wait.name, ctx.unit_of(group))
            continue  # not resharded: kept for backward, which frees it
        last = max(users | set(views), key=order.__getitem__)
        plans.append((wait, last))
    for wait, last in plans:
        with graph.inserting_after(last):
            node = call(graph, ops.FREE, (wait,))
        info = meta.get_info(wait)
        if info is not None:
            meta.set_info(node, meta.NodeInfo(meta.FREE, info.group, info.unit))
    gm.recompile()
    return gm
