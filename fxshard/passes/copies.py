"""Shared by the joint-graph passes: backward copies of forward values.

``rematerialize_params_pass`` copies parameter-only chains into backward;
``checkpoint_activations_pass`` copies checkpointed regions' activations and
the parameter chains they read. Both go through one ``BackwardCopies``, which
knows the copies already in the graph (``meta.mark_copy``), so a value is
copied into backward once whichever pass asks first: one gather per unit per
backward, serving the gradient and the recompute alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import parameter_only, source_group
from fxshard.ir.nodes import refresh_value

from .context import PassContext


class BackwardCopies:
    def __init__(self, graph: fx.Graph, ctx: PassContext):
        self.graph = graph
        self.ctx = ctx
        self.param_only = parameter_only(graph)
        self.copies = meta.copies_in(graph)

    def copy(self, node: fx.Node, before: fx.Node, input_of: Callable[[fx.Node], fx.Node],
             make: Callable[[], fx.Node] | None = None) -> fx.Node:
        """``node``'s backward copy, made before ``before`` on first request; its inputs are
        ``input_of(input)``. ``make`` builds the copy (with its ``meta["val"]``) instead of
        ``graph.node_copy``."""
        if node not in self.copies:
            inputs = {a: input_of(a) for a in node.all_input_nodes}
            with self.graph.inserting_before(before):
                new = make() if make is not None else self.graph.node_copy(node, lambda a: inputs[a])
            made = new.meta.get("val") if make is not None else None
            new.meta = meta.provenance(node)
            if make is not None:
                new.meta["val"] = made  # ``make`` computed it
            else:
                refresh_value(new, like=node.meta.get("val"))  # a factory copied has no fake input
            meta.tag_backward(new)
            meta.mark_copy(new, node)
            self.copies[node] = new
        copy = self.copies[node]
        if before < copy:  # made for a later reader (by the other pass): move it up
            self._hoist(copy, before)
        return copy

    def _hoist(self, node: fx.Node, before: fx.Node) -> None:
        """Move backward copy ``node``, and the copies it reads that come later, before ``before``."""
        for a in node.all_input_nodes:
            if before < a and meta.is_backward(a):
                self._hoist(a, before)
        before.prepend(node)

    def parameter(self, node: fx.Node, before: fx.Node) -> fx.Node:
        """What backward reads for forward value ``node``: itself unless it is parameter-only,
        else a copy of its chain starting again from the shard (or, for a unit that is not
        resharded, from the forward's gathered buffer)."""
        if node not in self.param_only or meta.is_backward(node):
            return node  # a graph input (the shard) or an existing backward value
        if P.is_unshard_marker(node):
            group = source_group(node)
            assert group is not None, f"{node.name}: marker without a flat group"
            if self.ctx.keeps_buffer(group):
                return node  # not resharded (or hpZ): backward reads the forward buffer
        new = self.copy(node, before, lambda a: self.parameter(a, before))
        group = source_group(node)
        if group is not None and meta.get_info(new) is None:
            meta.set_info(new, meta.NodeInfo(meta.Role.REMAT, group, self.ctx.unit_of(group)))
        return new
