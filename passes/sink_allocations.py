"""sink_allocations_pass: compute a large result just before it is read, when its inputs are small.

AOTAutograd emits backward in the order autograd would run it, so a result
can be made long before anything reads it. The tied embedding of a GPT is the
large case: the output projection's weight gradient (vocab x width) is made
at the very start of backward and read at the very end, where the input
embedding's gradient is added to it. Eager autograd holds it all that time
too. Its inputs (the logits' gradient and the last hidden state) are a
quarter of its size, so computing it at the end holds less::

    before:  g = mm(t(dlogits), h); ...whole backward...; s = add_(emb_grad, t(g))
    after:   ...whole backward...; g = mm(t(dlogits), h); s = add_(emb_grad, t(g))

A node moves, with the chain of views that is its only reader, to just
before its first other reader when the bytes it allocates exceed the bytes
of the input storages it keeps alive longer. It must be a pure, non-random
aten op that allocates; none of its inputs may alias a gathered buffer or a
collective's result (their windows are the schedule's), and nothing between
the two positions may write to an input it reads. Values are unchanged: the
same op runs on the same inputs.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.ir import predicates as P
from fxshard.ir.analysis import is_gather_wait, is_saved_buffer
from fxshard.ir.memory import storage_owners

from .context import PassContext


def _view_chain(node: fx.Node) -> list[fx.Node]:
    """``node`` and the views that are, one after another, the only reader of the last."""
    chain = [node]
    while len(chain[-1].users) == 1:
        (user,) = chain[-1].users
        if not (P.is_view(user) and user.all_input_nodes == [chain[-1]]):
            break
        chain.append(user)
    return chain


def _written(node: fx.Node) -> list[fx.Node]:
    """Nodes whose storage ``node`` writes (mutable schema arguments, ``fxshard.free``)."""
    target = node.target
    if P.is_free(node):
        return [a for a in node.args if isinstance(a, fx.Node)]
    if not (P.is_call(node) and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable):
        return []
    written = []
    for arg, value in zip(target._schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            written.append(value)
    return written


class _Liveness:
    """Positions, storage owners, last uses and writes, kept current across moves.

    Positions are floats so a move renumbers only the moved nodes: every
    question the pass asks compares positions, never counts them.
    """

    def __init__(self, graph: fx.Graph):
        nodes = list(graph.nodes)
        self.order: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(nodes)}
        self.owner, self.size = storage_owners(nodes)
        self.last_use: dict[fx.Node, float] = {}
        for node in nodes:
            for a in node.all_input_nodes:
                if a in self.owner:
                    o = self.owner[a]
                    self.last_use[o] = max(self.last_use.get(o, 0.0), self.order[node])
        # (position, storages written) of every writing node, in order.
        written = {n: _written(n) for n in nodes}
        self.writes = [(self.order[n], {self.owner[w] for w in ws if w in self.owner})
                       for n, ws in written.items() if ws]
        protected = [n for n in nodes if is_gather_wait(n) or is_saved_buffer(n)
                     or P.is_collective(n) or P.is_wait(n)]
        self.protected = {self.owner[n] for n in protected if n in self.owner}

    def moved(self, chain: list[fx.Node]) -> None:
        """``chain`` now sits, in order, between two nodes whose positions are unchanged."""
        low, high = self.order[chain[0].prev], self.order[chain[-1].next]
        for i, member in enumerate(chain, start=1):
            self.order[member] = low + (high - low) * i / (len(chain) + 1)
        there = self.order[chain[0]]
        for a in chain[0].all_input_nodes:
            if a in self.owner:
                o = self.owner[a]
                self.last_use[o] = max(self.last_use.get(o, 0.0), there)


def _destination(node: fx.Node, chain: list[fx.Node], live: _Liveness) -> fx.Node | None:
    """The node ``chain`` should move before, or None if it stays."""
    readers = list(chain[-1].users)
    if not readers or any(u.op == "output" for u in readers):
        return None
    first = min(readers, key=live.order.__getitem__)
    if first is chain[-1].next:
        return None  # already there
    here, there = live.order[node], live.order[first]
    inputs = {live.owner[a] for a in node.all_input_nodes if a in live.owner}
    if inputs & live.protected or live.owner.get(node) is not node:
        return None
    if any(here < pos < there and written & inputs for pos, written in live.writes):
        return None
    cost = sum(live.size.get(o, 0) for o in inputs if live.last_use.get(o, 0.0) < there)
    return first if live.size.get(node, 0) > cost else None


def sink_allocations_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    live = _Liveness(graph)
    moved = False
    for node in reversed(list(graph.nodes)):
        if not P.allocates(node):
            continue
        chain = _view_chain(node)
        first = _destination(node, chain, live)
        if first is None:
            continue
        for member in chain:
            first.prepend(member)
        live.moved(chain)
        moved = True
    if moved:
        gm.recompile()
    return gm
