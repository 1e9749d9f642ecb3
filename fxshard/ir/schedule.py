"""Scheduling as data: where each node should go, what it must follow, and the one sort.

The scheduling passes do not move nodes. Each records, in the graph's
``Schedule``, a *position* for the nodes it schedules (just before or just
after another node, in a tier) and *edges* (this node must come after that
one). ``topological_sort_pass`` then places every node in one stable
topological sort: among the nodes whose inputs and edges are placed, the one
with the smallest position goes next. A node nobody positioned keeps its
place relative to its neighbours::

    positions:  ag1 -> before(mm0, PREFETCH)   w1, view1 -> before(mm1, WAIT)
    edges:      ag2 after every reader of unit 0 (the in-flight limit)
    sort:       ag0; w0; view0; ag1; mm0; ...; w1; view1; ag2; mm1; ...

A position is a tuple that ends in 0. A node at graph index i sits at
``(i, 0)``. Placing nodes n_0..n_k before an anchor gives n_s the anchor's
position with its last 0 replaced by ``(tier, rank, s, 0)``, tier < 0 (after
it: tier > 0), where rank orders the groups placed at one anchor and tier (by
default the graph index of n_0): nodes placed together stay together. Tuples compare lexicographically, so a position derived from a
moved anchor moves with it, and nested positions never collide.

Everything here reads graph order and the options, never tensor sizes: the
positions are the same on every rank, whatever each rank's batch.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch.fx as fx

from fxshard.ir.analysis import order_of
from fxshard.ir.errors import GraphInvariantError

Position = tuple[int, ...]

# Tiers of what goes just before a node: an allocation sunk to its reader, a
# just-in-time gather's issue, then the waits and parameter chains its reader
# needs, then the prefetch of the next unit.
SINK, ISSUE, WAIT, PREFETCH = -4, -3, -2, -1
# Tiers of what goes just after a node: a reduction made ready by it, then a
# gather issued once it frees a buffer ("post").
REDUCE, POST = 1, 2

_KEY = "fxshard.schedule"


class Schedule:
    """Positions and edges the scheduling passes record for one graph."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self._index = order_of(graph)
        self._position: dict[fx.Node, Position] = {}
        self._after: dict[fx.Node, dict[fx.Node, None]] = {}

    def position(self, node: fx.Node) -> Position:
        found = self._position.get(node)
        return found if found is not None else (self._index[node], 0)

    def place(self, nodes: Iterable[fx.Node], anchor: fx.Node, tier: int,
              rank: int | None = None) -> None:
        """``nodes``, in the order given, just before (tier < 0) or after (tier > 0) ``anchor``.

        Nodes placed together stay together. Groups placed at one anchor and tier are
        ordered by ``rank``, by default the graph index of their first node (graph order).
        """
        nodes = list(nodes)
        if not nodes:
            return
        base = (*self.position(anchor)[:-1], tier,
                self._index[nodes[0]] if rank is None else rank)
        for seq, node in enumerate(nodes):
            self._position[node] = (*base, seq, 0)

    def require(self, node: fx.Node, after: Iterable[fx.Node]) -> None:
        """``node`` is placed after every node of ``after`` (an edge the sort obeys)."""
        edges = self._after.setdefault(node, {})
        for a in after:
            if a is not node:
                edges[a] = None

    def requirements(self, node: fx.Node) -> list[fx.Node]:
        return list(self._after.get(node, ()))

    def first(self, nodes: Iterable[fx.Node]) -> fx.Node:
        return min(nodes, key=self.position)

    def last(self, nodes: Iterable[fx.Node]) -> fx.Node:
        return max(nodes, key=self.position)

    def sorted_nodes(self) -> list[fx.Node]:
        """Every node, in a topological order of inputs and edges that follows the positions.

        Kahn's algorithm with a heap: O(N log N) in the nodes and edges.
        """
        nodes = list(self.graph.nodes)
        preds: dict[fx.Node, set[fx.Node]] = {}
        succs: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
        for n in nodes:
            p = set(n.all_input_nodes) | set(self._after.get(n, ()))
            preds[n] = p
            for a in p:
                succs[a].append(n)
        waiting = {n: len(p) for n, p in preds.items()}
        ready = [(self.position(n), self._index[n], n) for n in nodes if not waiting[n]]
        heapq.heapify(ready)
        result: list[fx.Node] = []
        while ready:
            _, _, node = heapq.heappop(ready)
            result.append(node)
            for s in succs[node]:
                waiting[s] -= 1
                if not waiting[s]:
                    heapq.heappush(ready, (self.position(s), self._index[s], s))
        if len(result) != len(nodes):
            stuck = [n.name for n in nodes if waiting[n]][:8]
            raise GraphInvariantError(
                f"the schedule's edges form a cycle: {stuck} can never be placed "
                "(a scheduling pass required a node after one of its own readers)"
            )
        return result


def schedule_of(gm: fx.GraphModule) -> Schedule:
    """The graph's schedule, made on first use; ``topological_sort_pass`` consumes it."""
    found = gm.meta.get(_KEY)
    if not isinstance(found, Schedule) or found.graph is not gm.graph:
        found = Schedule(gm.graph)
        gm.meta[_KEY] = found
    return found


def take_schedule(gm: fx.GraphModule) -> Schedule | None:
    found = gm.meta.pop(_KEY, None)
    return found if isinstance(found, Schedule) and found.graph is gm.graph else None


def reorder(graph: fx.Graph, order: list[fx.Node]) -> bool:
    """Put ``graph``'s nodes in ``order`` (a permutation of them); True if anything moved."""
    current = list(graph.nodes)
    if current == order:
        return False
    current[0].prepend(order[0])
    for prev, node in zip(order, order[1:]):
        prev.append(node)
    return True
