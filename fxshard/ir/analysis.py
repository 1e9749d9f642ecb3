"""Read-only questions about a graph that several passes ask."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.chains import Chain, gather_chains
from fxshard.ir.meta import Direction


def order_of(graph: fx.Graph, start: int = 0) -> dict[fx.Node, int]:
    """Each node's index in graph order (from ``start``): the one graph-order map."""
    return {n: i for i, n in enumerate(graph.nodes, start)}


def aliases(root: fx.Node, order: dict[fx.Node, int] | None = None) -> list[fx.Node]:
    """``root`` and every node that is a view of it, transitively, in graph order."""
    seen = {root: None}
    work = [root]
    while work:
        node = work.pop()
        for user in node.users:
            if user not in seen and P.is_view(user) and user.args and user.args[0] is node:
                seen[user] = None
                work.append(user)
    if len(seen) == 1:
        return [root]
    order = order if order is not None else order_of(root.graph)
    return sorted(seen, key=order.__getitem__)


def gathered_buffers(graph: fx.Graph) -> list[fx.Node]:
    """Every gathered flat buffer in the graph, in graph order: the result of each gather
    chain, and (backward) each buffer kept from forward."""
    return [c.result for c in gather_chains(graph)]


def buffer_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _computed_only_from(node: fx.Node, members: dict[fx.Node, None] | set[fx.Node]) -> bool:
    """A deterministic, pure call whose tensor inputs are all in ``members``."""
    return (
        P.is_call(node)
        and not P.is_random(node)
        and not node.is_impure()
        and bool(node.all_input_nodes)
        and all(a in members for a in node.all_input_nodes)
    )


def parameter_only(graph: fx.Graph) -> dict[fx.Node, None]:
    """Nodes computed from gathered parameters alone (an ordered set).

    The roots are unshard markers and gathered buffers; a deterministic, pure
    node all of whose tensor inputs are parameter-only is parameter-only too:
    a view, a transpose, a cast of a weight. These are what the partitioner
    must never save for backward.
    """
    roots = set(gathered_buffers(graph))
    result: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if P.is_unshard_marker(node) or node in roots:
            result[node] = None
        elif _computed_only_from(node, result):
            result[node] = None
    return result


def source_group(node: fx.Node) -> int | None:
    """The flat group a parameter-only node derives from, following first inputs to its
    marker or its gather chain."""
    while True:
        m = P.marker(node)
        if m is not None and m.kind is P.MarkerKind.UNSHARD:
            return m.group
        info = meta.get_info(node)
        if info is not None and info.chain is not None and info.chain.direction is Direction.GATHER:
            return info.group
        inputs = node.all_input_nodes
        if not inputs:
            return None
        node = inputs[0]


def parameter_chain(buffer: fx.Node, order: dict[fx.Node, int] | None = None) -> list[fx.Node]:
    """Nodes computed from this one gathered buffer alone, in graph order (not ``buffer``).

    Walks users outward in graph order, so it costs the chain's size, not the graph's.
    """
    order = order if order is not None else order_of(buffer.graph)
    members = {buffer}
    chain: list[fx.Node] = []
    frontier = [(order[u], u) for u in buffer.users]
    heapq.heapify(frontier)
    seen = set(buffer.users)
    while frontier:
        _, cur = heapq.heappop(frontier)
        if _computed_only_from(cur, members):
            chain.append(cur)
            members.add(cur)
            for u in cur.users:
                if u not in seen:
                    seen.add(u)
                    heapq.heappush(frontier, (order[u], u))
    return chain


@dataclass
class Window:
    """Where one gathered buffer is issued, first computed with, last used."""

    buffer: fx.Node  # the chain's result: what compute reads
    issue: int  # position of its first collective (of the buffer, for one kept from forward)
    ready: int  # position of its last wait, the buffer's (of the buffer, for one kept from forward)
    first: int  # first node outside its parameter chain that reads it
    last: int  # last node that reads it or any view of it (frees excluded)
    bytes: int
    resident: bool  # does not count toward the in-flight limit (PassContext.counts_in_flight)


@dataclass
class BufferUses:
    """Which nodes read a gathered buffer: fixed while a schedule only moves gathers."""

    chain: Chain
    outside: list[fx.Node]  # first readers outside its parameter chain
    readers: list[fx.Node]  # every node that reads it or a view of it (frees excluded)

    @property
    def buffer(self) -> fx.Node:
        return self.chain.result


def buffer_uses(graph: fx.Graph) -> list[BufferUses]:
    order = order_of(graph)
    result = []
    for chain in gather_chains(graph):
        buf = chain.result
        params = parameter_chain(buf, order)
        inside = {buf, *params, *chain.kept}
        outside = [u for n in inside for u in n.users if u not in inside and not P.is_free(u)]
        views = aliases(buf, order)
        readers = [u for v in views for u in v.users if not P.is_free(u)] + [*params, *views]
        result.append(BufferUses(chain, outside, readers))
    return result


def windows(graph: fx.Graph, counted: dict[int, bool],
            uses: list[BufferUses] | None = None) -> list[Window]:
    """The window of every gathered buffer, sorted by first compute.

    Pass ``uses`` (from ``buffer_uses``) to recompute positions only.
    """
    order = order_of(graph)
    result = []
    for u in uses if uses is not None else buffer_uses(graph):
        buf = u.buffer
        issued = [c for c in u.chain.collectives if c not in u.chain.agreed]  # the gather's
        issue = order[issued[0]] if issued else order[buf]
        ready = order[u.chain.waits[-1]] if u.chain.waits else order[buf]
        first = min((order[n] for n in u.outside), default=order[buf])
        last = max(order[n] for n in u.readers)
        result.append(Window(buf, issue, ready, first, last, buffer_bytes(buf),
                             not counted.get(u.chain.group, True)))
    return sorted(result, key=lambda w: (w.first, w.issue))


def first_use_order(graph: fx.Graph) -> list[int]:
    """Flat-group indices in the order the graph first reads each unit's parameters.

    Works on a traced graph (``fxshard.unshard`` markers) and on a lowered one
    (the gather chains): a use is any non-view user of the gathered buffer or
    of one of its views.
    """
    order = order_of(graph)
    roots: list[tuple[fx.Node, int]] = [(c.result, c.group) for c in gather_chains(graph) if c.gathers]
    for node in graph.nodes:
        m = P.marker(node)
        if m is not None and m.kind is P.MarkerKind.UNSHARD:
            roots.append((node, m.group))
    first: dict[int, int] = {}
    for node, group in roots:
        views = aliases(node, order)
        uses = [order[u] for v in views for u in v.users if u not in views]
        if uses:
            first[group] = min(first.get(group, len(order)), min(uses))
    return sorted(first, key=first.__getitem__)


def gathers_without_overlap(graph: fx.Graph) -> list[fx.Node]:
    """All_gathers whose wait follows with no compute in between (nothing hides the transfer).

    Compute is any call that is not a view, a collective, a wait, a free, or a node that
    issues a gather (its cast).
    """
    nodes = list(graph.nodes)
    where = order_of(graph)
    gathering = [c for c in gather_chains(graph) if c.gathers]
    issuing = {n for c in gathering for n in c.issue}

    def compute(n: fx.Node) -> bool:
        return (P.is_call(n) and n not in issuing and not P.is_view(n)
                and not (P.is_collective(n) or P.is_wait(n) or P.is_free(n)))

    bare = []
    for chain in gathering:
        for gather, wait in zip(chain.collectives, chain.waits):  # the gathers, not an amax all_reduce
            if P.is_all_gather(gather) and not any(compute(n) for n in nodes[where[gather] + 1:where[wait]]):
                bare.append(gather)
    return bare
