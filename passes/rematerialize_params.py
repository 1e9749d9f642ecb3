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
from fxshard.ir.analysis import parameter_only, source_group
from fxshard.ir.nodes import refresh_value

from .context import PassContext


def rematerialize_params_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    param_only = parameter_only(graph)
    # Collect first: (backward user, forward parameter-only inputs it reads).
    todo = [
        (node, [a for a in node.all_input_nodes if a in param_only and not meta.is_backward(a)])
        for node in graph.nodes
        if meta.is_backward(node) and not P.is_output(node)
    ]
    todo = [(node, inputs) for node, inputs in todo if inputs]
    if not todo:
        return gm

    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in param_only or meta.is_backward(node):
            return node  # a graph input (the shard) or an existing backward value
        if P.is_unshard_marker(node) and not ctx.reshards(_group_of(node)):
            return node  # not resharded: backward reads the forward buffer
        if node not in copies:
            inputs = {a: copy_of(a, before) for a in node.all_input_nodes}
            with graph.inserting_before(before):
                new = graph.node_copy(node, lambda a: inputs[a])
            new.meta = {k: v for k, v in node.meta.items() if k != meta.KEY}
            refresh_value(new)
            meta.tag_backward(new)
            unit_group = source_group(node)
            if unit_group is not None:
                meta.set_info(new, meta.NodeInfo(meta.REMAT, unit_group, ctx.unit_of(unit_group)))
            copies[node] = new
        return copies[node]

    for user, inputs in todo:
        for value in inputs:
            user.replace_input_with(value, copy_of(value, user))
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _group_of(node: fx.Node) -> int:
    group = source_group(node)
    assert group is not None, f"{node.name}: marker without a flat group"
    return group
