"""rematerialize_params_pass: gather parameters again in backward (FULL_SHARD).

Runs on the joint forward+backward graph, before partitioning. A backward node
that reads a parameter-only forward value gets its own copy of that value's
chain, starting again from the flat shard::

    before:  shard -> unshard -> split -> view -> t --+--> addmm          (forward)
                                                      +--> mm(grad, t)    (backward: t saved!)
    after:   shard -> unshard -> split -> view -> t ----> addmm           (forward)
             shard -> unshard' -> split' -> view' -> t' -> mm(grad, t')   (backward)

The partitioner then saves only the shard (a graph input) for backward, never
a gathered parameter or a transpose or cast of one: that is the classic way
compiler FSDP silently becomes DDP. Each forward value is copied once, so a
unit is gathered once per backward.

A unit that is not resharded after forward (ZeRO-2, and the root unit by
default) keeps its gathered buffer instead: the copy starts from the forward
``unshard`` itself, so the one tensor saved for backward is the flat buffer,
never a transpose or cast of it::

    after (not resharded):  shard -> unshard --+--> split -> view -> t -> addmm         (forward)
                                               +--> split' -> view' -> t' -> mm(grad)   (backward)
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P

from .context import PassContext
from .copies import BackwardCopies


def rematerialize_params_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    copies = BackwardCopies(graph, ctx)
    # Collect first: (backward user, forward parameter-only inputs it reads).
    todo = [
        (node, [a for a in node.all_input_nodes if a in copies.param_only and not meta.is_backward(a)])
        for node in graph.nodes
        if meta.is_backward(node) and not P.is_output(node)
    ]
    todo = [(node, inputs) for node, inputs in todo if inputs]
    if not todo:
        return gm
    for user, inputs in todo:
        for value in inputs:
            user.replace_input_with(value, copies.parameter(value, user))
    graph.eliminate_dead_code()
    gm.recompile()
    return gm
