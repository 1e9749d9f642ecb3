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
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fxshard import meta, ops
from fxshard import predicates as P

from .analysis import aliases, buffer_group, gathered_buffers, is_saved_buffer
from .context import PassContext

log = logging.getLogger("fxshard")


def insert_free_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    waits = [n for n in gathered_buffers(graph) if not is_saved_buffer(n)]
    if not waits or not ctx.emit_free:
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
            node = graph.call_function(ops.FREE, (wait,))
        node.meta["val"] = None
        info = meta.get_info(wait)
        if info is not None:
            meta.set_info(node, meta.NodeInfo(meta.FREE, info.group, info.unit))
    gm.recompile()
    return gm
