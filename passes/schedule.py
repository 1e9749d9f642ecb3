"""schedule_pass: place each gather right before the first use of what it gathers.

::

    before:  ag0 = all_gather(shard0); w0 = wait(ag0); ag1 = ...; w1 = ...; compute(w0); compute(w1)
    after:   ag0; w0; compute(w0); ag1; w1; compute(w1)

The order is a function of graph order alone, so every rank emits the same
collective sequence. Moving a gather later is always legal: its only input is
a graph input and its only user is its wait. Reduce-scatters stay where
lowering put them, right after the unit's gradient is complete.
"""

from __future__ import annotations

import torch.fx as fx

from .analysis import gathered_buffers
from .context import PassContext


def schedule_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    waits = gathered_buffers(gm.graph)
    if not waits:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    moves = []
    for wait in waits:
        users = sorted(wait.users, key=order.__getitem__)
        if users:
            moves.append((wait.args[0], wait, users[0]))
    for gather, wait, first_use in moves:
        first_use.prepend(gather)
        first_use.prepend(wait)
    gm.recompile()
    return gm
