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

It records positions in the graph's ``Schedule`` (reading the positions the
passes before it planned); ``topological_sort_pass`` moves the nodes. It is
the one scheduling pass that reads activation sizes, and it moves only compute
that no collective reads or waits on, so the collectives' order and positions
stay the same on every rank whatever its batch.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.memory import storage_owners
from fxshard.ir.schedule import SINK, Position, Schedule, schedule_of

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
    if P.is_free(node):
        return [a for a in node.args if isinstance(a, fx.Node)]
    if not P.is_call(node):
        return []
    return [a for a in P.written_arguments(node.target, node.args) if isinstance(a, fx.Node)]


class _Liveness:
    """Planned positions, storage owners, last uses and writes, kept current across moves."""

    def __init__(self, graph: fx.Graph, schedule: Schedule):
        nodes = list(graph.nodes)
        self.schedule = schedule
        self.owner, self.size = storage_owners(nodes)
        self.last_use: dict[fx.Node, Position] = {}
        for node in nodes:
            self.read(node)
        # (position, storages written) of every writing node.
        written = {n: _written(n) for n in nodes}
        self.writes = [(schedule.position(n), {self.owner[w] for w in ws if w in self.owner})
                       for n, ws in written.items() if ws]
        # Gathered buffers and every node of a collective chain: no collective moves here.
        protected = [n for n in nodes if (info := meta.get_info(n)) is not None and info.chain is not None]
        self.protected = {self.owner[n] for n in protected if n in self.owner}

    def read(self, node: fx.Node) -> None:
        here = self.schedule.position(node)
        for a in node.all_input_nodes:
            if a in self.owner:
                o = self.owner[a]
                if o not in self.last_use or self.last_use[o] < here:
                    self.last_use[o] = here

    def position(self, node: fx.Node) -> Position:
        return self.schedule.position(node)


def _destination(node: fx.Node, chain: list[fx.Node], live: _Liveness) -> fx.Node | None:
    """The node ``chain`` should move before, or None if it stays."""
    readers = list(chain[-1].users)
    if not readers or any(u.op == "output" for u in readers):
        return None
    first = live.schedule.first(readers)
    here, there = live.position(node), live.position(first)
    inputs = {live.owner[a] for a in node.all_input_nodes if a in live.owner}
    if inputs & live.protected or live.owner.get(node) is not node:
        return None
    if any(here < pos < there and written & inputs for pos, written in live.writes):
        return None
    cost = sum(live.size.get(o, 0) for o in inputs if live.last_use.get(o, here) < there)
    return first if live.size.get(node, 0) > cost else None


def sink_allocations_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    schedule = schedule_of(gm)
    live = _Liveness(gm.graph, schedule)
    # Latest first; of two results sunk to one reader the earlier-made goes nearer to it.
    for moved, node in enumerate(sorted(gm.graph.nodes, key=schedule.position, reverse=True)):
        if not P.allocates(node):
            continue
        chain = _view_chain(node)
        first = _destination(node, chain, live)
        if first is None:
            continue
        schedule.place(chain, first, SINK, rank=moved)
        live.read(node)
    return gm
