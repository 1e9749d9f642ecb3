"""verify: check the invariants of fxshard/passes/README.md on one graph.

Run between passes (tests and debug mode) and once on every emitted graph.
Raises GraphInvariantError naming the offending node.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import (
    aliases,
    gathered_buffers,
    order_of,
    parameter_only,
    source_group,
    windows,
)
from fxshard.ir.chains import Chain, chains
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.meta import Direction, Role

from .context import PassContext


def verify(gm: fx.GraphModule, ctx: PassContext | None = None, *, final: bool = False) -> None:
    graph = gm.graph
    try:
        graph.lint()
    except Exception as e:  # lint raises plain RuntimeErrors
        raise GraphInvariantError(f"graph is malformed: {e}") from e
    order = order_of(graph)

    for node in graph.nodes:
        if (P.is_call(node) or P.is_placeholder(node)) and "val" not in node.meta:
            raise GraphInvariantError(f"{node.name} ({node.target}) has no meta['val']")
        if P.is_collective(node):
            users = list(node.users)
            if len(users) != 1 or not P.is_wait(users[0]):
                raise GraphInvariantError(
                    f"collective {node.name} must have exactly one user, its wait_tensor; "
                    f"has {[u.name for u in users]}"
                )
        if P.is_wait(node) and not (isinstance(node.args[0], fx.Node) and P.is_collective(node.args[0])):
            raise GraphInvariantError(f"{node.name} waits on {node.args[0]}, which is no collective")
        if final and P.is_marker(node):
            raise GraphInvariantError(f"{node.name}: marker {node.target} was never lowered")

    found = _check_chains(graph)
    if final:
        seen: dict[int, str] = {}
        for chain in found:
            if not chain.gathers:
                continue
            if chain.group in seen:
                raise GraphInvariantError(
                    f"flat group {chain.group} is gathered twice in one graph ({seen[chain.group]} "
                    f"and {chain.result.name}): one gather per unit per pass"
                )
            seen[chain.group] = chain.result.name

    gathered = set(gathered_buffers(graph))
    freed: set[fx.Node] = set()
    for node in graph.nodes:
        if not P.is_free(node):
            continue
        buf = node.args[0]
        if meta.role_of(node) is Role.ACCUMULATE:
            continue  # a no_sync gradient accumulator, released after its last read
        if buf not in gathered:
            raise GraphInvariantError(f"{node.name} frees {buf}, which is not a gathered buffer")
        assert isinstance(buf, fx.Node)
        if buf in freed:
            raise GraphInvariantError(f"{node.name} frees {buf.name} a second time")
        freed.add(buf)
        views = aliases(buf, order)
        late = [u for v in views for u in v.users
                if u is not node and u not in views and order[u] > order[node]]
        late += [v for v in views if order[v] > order[node]]
        if late:
            raise GraphInvariantError(
                f"{buf.name} is used after {node.name} frees it, by {[u.name for u in late]}"
            )

    if ctx is None:
        return
    if ctx.graph == "forward" and ctx.num_user_outputs is not None:
        _check_nothing_gathered_is_saved(graph, ctx)
    if ctx.graph == "joint":
        _check_joint_saves_no_parameter(graph, ctx)
    if final and ctx.graph != "joint":
        _check_windows(graph, ctx)
    if final and ctx.layout.shard.slots:
        _check_groups_in_flight(graph)


def _check_groups_in_flight(graph: fx.Graph) -> None:
    """Invariant 9: no two collectives in flight at once share a process group."""
    in_flight: dict[str, fx.Node] = {}  # group name -> collective not yet waited
    for node in graph.nodes:
        if P.is_wait(node):
            issued = node.args[0]
            in_flight = {g: c for g, c in in_flight.items() if c is not issued}
        elif P.is_collective(node):
            group = P.group_name(node)
            if group in in_flight:
                raise GraphInvariantError(
                    f"{node.name} is issued on group {group!r} while {in_flight[group].name} is "
                    "still in flight there (invariant 9)"
                )
            in_flight[group] = node


def _check_chains(graph: fx.Graph) -> list[Chain]:
    """Invariant 10: every collective, wait and free of a lowered graph belongs to a collective
    chain, each chain ends in one result, and each collective's wait is in its chain."""
    try:
        found = chains(graph)
    except ValueError as e:
        raise GraphInvariantError(f"a collective chain is malformed: {e}") from e
    for node in graph.nodes:
        info = meta.get_info(node)
        if (P.is_collective(node) or P.is_wait(node) or P.is_free(node)) and (
                info is None or (info.chain is None and info.role is not Role.ACCUMULATE)):
            raise GraphInvariantError(f"{node.name} ({node.target}) belongs to no collective chain: "
                                      "a lowering must make it with a ChainBuilder (fxshard/passes/lowering.py)")
    for chain in found:
        for collective in chain.collectives:
            (wait,) = collective.users  # invariant 3, checked above
            if wait not in chain.waits:
                raise GraphInvariantError(f"{collective.name} of chain {chain.tag} is waited by "
                                          f"{wait.name}, which is not in the chain")
    return found


def _kept(node: fx.Node, ctx: PassContext) -> bool:
    """A unit's whole gathered buffer, for a unit that is not resharded, or hpZ's piece of it:
    allowed to cross. (hpZ's whole buffer crosses until ``reshard_within_pass`` cuts it.)"""
    info = meta.get_info(node)
    if info is not None and info.role is Role.PIECE:
        return True
    gathered = info is not None and info.chain is not None and info.chain.direction is Direction.GATHER
    if P.is_unshard_marker(node) or gathered:
        group = source_group(node)
        return group is not None and ctx.keeps_buffer(group)
    return False


def _check_nothing_gathered_is_saved(graph: fx.Graph, ctx: PassContext) -> None:
    output = next(n for n in graph.nodes if P.is_output(n))
    saved = [a for a in output.args[0][ctx.num_user_outputs:] if isinstance(a, fx.Node)]
    param_only = parameter_only(graph)
    for node in saved:
        if node in param_only and not _kept(node, ctx):
            raise GraphInvariantError(
                f"{node.name} is computed from gathered parameters alone and is saved for "
                "backward: the full parameter would stay alive between forward and backward"
            )


def _check_joint_saves_no_parameter(graph: fx.Graph, ctx: PassContext) -> None:
    param_only = parameter_only(graph)
    for node in graph.nodes:
        if not meta.is_backward(node):
            continue
        for a in node.all_input_nodes:
            if (a in param_only and not meta.is_backward(a)
                    and not _kept(a, ctx)):
                raise GraphInvariantError(
                    f"backward node {node.name} reads forward value {a.name}, computed from "
                    "gathered parameters alone: the partitioner would save it for backward"
                )


def _check_windows(graph: fx.Graph, ctx: PassContext) -> None:
    """Every freed buffer is freed right after its last use, and the in-flight limit holds.

    The limit binds prefetches only: where the model itself reads more units at
    once than the limit (overlapping windows), that many must be alive.
    """
    reshards = {g.index: ctx.counts_in_flight(g.index) for g in ctx.plan.groups}
    spans = windows(graph, reshards)
    order = order_of(graph)
    nodes = list(graph.nodes)
    for w in spans:
        frees = [u for u in w.buffer.users if P.is_free(u)]
        if not frees:
            continue
        between = nodes[w.last + 1:order[frees[0]]]
        if any(not P.is_free(n) for n in between):
            raise GraphInvariantError(
                f"{w.buffer.name} outlives its window: freed at {frees[0].name}, "
                f"{[n.name for n in between if not P.is_free(n)]} run after its last use"
            )
    counted = [w for w in spans if not w.resident]
    limit = ctx.options.max_inflight_gathers
    cap = ctx.options.max_inflight_bytes
    for point in range(len(nodes)):
        live = [w for w in counted if w.issue <= point <= w.last]
        # Gathering just in time (issue, then wait at once) is always allowed.
        needed = [w for w in counted if w.ready - 1 <= point <= w.last]
        if len(live) > max(limit, len(needed)):
            raise GraphInvariantError(
                f"{len(live)} gathered buffers in flight at {nodes[point].name} "
                f"({[w.buffer.name for w in live]}), over max_inflight_gathers={limit}"
            )
        if cap is not None and sum(w.bytes for w in live) > max(cap, sum(w.bytes for w in needed)):
            raise GraphInvariantError(
                f"{sum(w.bytes for w in live)} gathered bytes in flight at {nodes[point].name}, "
                f"over max_inflight_bytes={cap}"
            )
