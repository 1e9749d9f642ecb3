"""assign_groups_pass: collectives in flight together go on different process groups.

Two ``_c10d_functional`` collectives in flight at once on one gloo process
group corrupt the heap (torch 2.13; docs/devices.md). The driver creates one
process group per in-flight slot (``ctx.layout.shard.slots``, the same on every
rank); this pass gives each collective, in graph order, the first slot whose
previous collective has been waited::

    before:  ag0 = all_gather(s0, N, "0"); ag1 = all_gather(s1, N, "0"); w0 = wait(ag0); ...
    after:   ag0 = all_gather(s0, N, "1"); ag1 = all_gather(s1, N, "2"); w0 = wait(ag0); ...

If every slot is busy, the collective that finishes first is waited right
before the new one is issued (moving a wait earlier never changes a value).
Runs last: it reads the final position of every collective and wait.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.errors import GraphInvariantError

from .context import PassContext


def assign_groups_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    collectives = [n for n in gm.graph.nodes if P.is_collective(n)]
    if not collectives:
        return gm
    # Each dimension of the layout (the shard group; HSDP's replicas, hpZ's partition) has
    # slots of its own.
    dims = [d for _, d in ctx.layout.dims]
    if not all(d.slots for d in dims):
        raise GraphInvariantError("assign_groups_pass needs the in-flight slots' process groups "
                                  "(ctx.layout.shard.slots); build_pipeline leaves it out otherwise")
    # Moving a wait earlier changes no other node's relative order: positions
    # stay valid with the moved wait given one just below the new collective's.
    order: dict[fx.Node, float] = dict(order_of(gm.graph))
    busy_of: dict[int, list[fx.Node | None]] = {id(d): [None] * len(d.slots) for d in dims}
    for node in collectives:
        dim = ctx.layout.dimension(P.group_name(node))
        if dim is None:
            raise GraphInvariantError(f"{node.name} runs on group {P.group_name(node)!r}, which is "
                                      "no dimension of the layout")
        slots, busy = dim.slots, busy_of[id(dim)]
        for i, wait in enumerate(busy):
            if wait is not None and order[wait] < order[node]:
                busy[i] = None
        if None not in busy:
            i = min(range(len(busy)), key=lambda k: order[busy[k]])  # type: ignore[index]
            wait = busy[i]
            assert wait is not None
            node.prepend(wait)
            order[wait] = order[node] - 0.5
            busy[i] = None
        slot = busy.index(None)
        P.set_group_name(node, slots[slot])
        (wait,) = node.users
        busy[slot] = wait
    gm.recompile()
    return gm
