"""Regroup: a joint graph traced under one plan, rewritten to another plan's flat groups.

``policy=auto()`` compares plans that differ in their units. Tracing the model once per
plan costs AOTAutograd's capture each time (about 50 s for Llama-3-70B), so auto() traces
once, under the *finest* plan (every module that owns parameters a unit of its own,
``fxshard.driver.compile.plan_auto.FINEST``), and rewrites that joint graph to each candidate's groups
here. Every unit of any policy is a union of the finest plan's units, so every parameter
of a candidate's group is a slot of one of the traced groups.

A traced group enters the joint graph, and its gradient leaves it, as::

    primals_g -> unshard(g) -> split_with_sizes(spans of g) -> getitem per slot -> view ...
    ... grad per slot, zeros per gap -> cat -> reduce_grad(g) -> output

(``replicate`` / ``allreduce_grad`` for a group kept whole). For each group G of the
other plan this makes the same shape from G's own spans: a new shard input, one marker,
one split whose pieces replace the traced getitems of G's slots, and one cat of the
traced gradient pieces of those slots (zeros of G's own gaps) into one gradient marker,
placed where the last of the traced groups' gradient markers was. The traced markers,
splits, cats and gap zeros go. What the model computes is untouched, so the result is the
joint graph the other plan's own trace makes, up to node names and the casts the
finest plan's units add at their inputs under mixed precision (``cast_forward_inputs``).

A pure function of its arguments: it returns a new graph module and its inputs and
partition arguments; ``joint`` is not changed.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxshard.ir import compat, ops
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.nodes import call
from fxshard.ir.plan import FlatGroup, ShardPlan


def regroup(joint: fx.GraphModule, joint_inputs: Sequence[Sequence[Any]], kwargs: dict[str, Any],
            traced: ShardPlan, plan: ShardPlan) -> tuple[fx.GraphModule, list[list[Any]], dict[str, Any]]:
    """``joint`` (traced under ``traced``) as ``plan``'s trace would make it: the graph, its
    ``joint_inputs`` ([primals, tangents]) and the partitioner's ``kwargs``."""
    primals, tangents = list(joint_inputs[0]), list(joint_inputs[1])
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    k = len(traced.groups)
    shard_inputs = placeholders[:k]
    planned = {slot.name for g in plan.groups for slot in g.params}
    missing = [s.name for g in traced.groups for s in g.params if s.name not in planned]
    if missing:
        raise GraphInvariantError(f"regroup: parameters {missing} of the traced plan are in no group of the new one")

    # The traced graph's parameter markers and gradient markers, by traced group.
    forward: dict[int, P.Marker] = {}
    backward: dict[int, P.Marker] = {}
    for node in joint.graph.nodes:
        m = P.marker(node)
        if m is None:
            continue
        (backward if m.kind.is_gradient else forward)[m.group] = m
    for index, m in forward.items():  # a group the step never reads has no marker left
        if m.value is not shard_inputs[index]:
            raise GraphInvariantError(f"regroup: traced group {index} does not enter through primal {index}")

    # Each traced slot's forward piece (the getitem), and its gradient piece (the cat's input).
    piece: dict[str, fx.Node] = {}
    grad_piece: dict[str, fx.Node] = {}
    dropped: set[fx.Node] = set()
    for g in traced.groups:
        if g.index not in forward:
            continue
        m = forward[g.index]
        split = _only_split(m.node)
        spans = g.spans()
        dropped.update((m.node, split, m.value))
        for item in split.users:
            at = item.args[1] if item.target is operator.getitem else None
            if not isinstance(at, int) or spans[at][0] is None:
                raise GraphInvariantError(f"regroup: {item.name} reads group {g.index}'s padding or is no getitem")
            slot = spans[at][0]
            assert slot is not None
            piece[slot.name] = item
            dropped.add(item)
        grad = backward.get(g.index)
        if grad is None:
            continue
        cat = grad.value
        parts = cat.args[0] if cat.target is torch.ops.aten.cat.default else None
        if not isinstance(parts, (list, tuple)) or len(parts) != len(spans) or len(cat.users) != 1:
            raise GraphInvariantError(f"regroup: group {g.index}'s gradient is not one cat of its spans ({cat.name})")
        dropped.update((grad.node, cat))
        for (slot, _), part in zip(spans, parts):
            assert isinstance(part, fx.Node)
            if slot is not None:
                grad_piece[slot.name] = part
            elif len(part.users) == 1:  # a gap's zeros, read by this cat alone
                dropped.add(part)

    # Where each new group's chains go: its parameter marker at the first traced marker of
    # its slots, its gradient marker at the last traced one.
    traced_group = {slot.name: g.index for g in traced.groups for slot in g.params}
    members = {g.index: sorted({traced_group[s.name] for s in g.params}) for g in plan.groups}
    order = order_of(joint.graph)
    read = {g.index: sorted((i for i in members[g.index] if i in forward), key=lambda i: order[forward[i].node])
            for g in plan.groups}  # in graph order
    last_grad: dict[int, fx.Node] = {}
    for g in plan.groups:
        markers = [backward[i].node for i in members[g.index] if i in backward]
        if markers:  # a traced group without one computed no gradient: zeros, as a trace fills in
            last_grad[g.index] = max(markers, key=order.__getitem__)
    emit_forward: dict[fx.Node, list[FlatGroup]] = {}
    for g in plan.groups:
        if read[g.index]:
            emit_forward.setdefault(forward[read[g.index][0]].node, []).append(g)
    emit_backward: dict[fx.Node, list[FlatGroup]] = {}
    for index, node in last_grad.items():
        emit_backward.setdefault(node, []).append(plan.groups[index])

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    new_piece: dict[str, fx.Node] = {}
    new_grads: dict[int, fx.Node] = {}
    shard_values = []
    new_shards = []
    for g in plan.groups:  # the new shards come first, as the traced ones did
        value = shard_inputs[members[g.index][0]].meta["val"]
        with compat.fake_tensor.unset_fake_temporarily(), value.fake_mode:
            fake = torch.empty(g.shard_numel, dtype=g.dtype, device=value.device)
        fake.requires_grad_(value.requires_grad)
        node = graph.placeholder(f"primals_{g.index + 1}")
        node.meta["val"] = fake
        shard_values.append(fake)
        new_shards.append(node)
    for i, node in enumerate(placeholders[k:]):  # the other primals renumbered; the tangents
        new = graph.placeholder(f"primals_{len(plan.groups) + i + 1}" if i < len(primals) - k else node.name)
        new.meta = dict(node.meta)
        env[node] = new
    slot_of = {n: s for s, n in piece.items()}

    def arg(node: fx.Node) -> fx.Node:
        if node not in env:
            raise GraphInvariantError(f"regroup: {node.name} was dropped but is still read")
        return env[node]

    for node in joint.graph.nodes:
        if node.op == "placeholder":
            continue
        for group in emit_forward.get(node, ()):
            _emit_parameter(graph, group, new_shards[group.index], forward[read[group.index][0]], piece, new_piece)
        if node in slot_of:
            env[node] = new_piece[slot_of[node]]
        elif node.op == "output":
            outputs = list(node.args[0])
            n = len(outputs) - len(primals)
            grads: list[fx.Node | None] = [new_grads.get(g.index) for g in plan.groups]
            kept = [env[x] if isinstance(x, fx.Node) else x for x in outputs[n + k:]]
            fw = [env[x] if isinstance(x, fx.Node) else x for x in outputs[:n]]
            graph.output([*fw, *grads, *kept]).meta = dict(node.meta)
        elif node not in dropped:
            env[node] = graph.node_copy(node, arg)
        for group in emit_backward.get(node, ()):
            traced_marker = next(backward[i] for i in members[group.index] if i in backward)
            new_grads[group.index] = _emit_gradient(graph, group, grad_piece, env, traced_marker)

    new_primals = [*shard_values, *primals[k:]]
    # The new graph keeps fx's flat calling convention (placeholders in order, a list out), not
    # AOTAutograd's (primals, tangents) pytree: the partitioner reads only its nodes.
    gm = compat.make_graph_module(joint, graph)
    new_kwargs = dict(kwargs)
    static = kwargs.get("static_lifetime_input_indices")
    if static:  # the shards are static if the traced ones were; the rest move with the count
        shift = len(plan.groups) - k
        shards = range(len(plan.groups)) if any(i < k for i in static) else range(0)
        new_kwargs["static_lifetime_input_indices"] = [*shards, *(i + shift for i in static if i >= k)]
    return gm, [new_primals, tangents], new_kwargs


def _only_split(node: fx.Node) -> fx.Node:
    users = list(node.users)
    if len(users) != 1 or users[0].target is not torch.ops.aten.split_with_sizes.default:
        raise GraphInvariantError(f"regroup: {node.name} should have one split_with_sizes user, "
                                  f"has {[u.name for u in users]}")
    return users[0]


def _emit_parameter(graph: fx.Graph, group: FlatGroup, shard: fx.Node, traced: P.Marker,
                    piece: dict[str, fx.Node], new_piece: dict[str, fx.Node]) -> None:
    """``group``'s marker on ``shard``, split into its spans: the piece of each slot the step
    reads (those with a traced ``piece``)."""
    target = ops.REPLICATE if group.replicated else ops.UNSHARD
    full = call(graph, target, (shard, group.index, group.world_size, traced.compute_dtype, traced.reduce_dtype,
                                traced.device))
    spans = group.spans()
    split = call(graph, torch.ops.aten.split_with_sizes.default, (full, [n for _, n in spans]))
    for i, (slot, _) in enumerate(spans):
        if slot is not None and slot.name in piece:
            new_piece[slot.name] = call(graph, operator.getitem, (split, i))


def _emit_gradient(graph: fx.Graph, group: FlatGroup, grad_piece: dict[str, fx.Node], env: dict[fx.Node, fx.Node],
                   traced: P.Marker) -> fx.Node:
    """The cat of ``group``'s slots' gradient pieces (zeros in its gaps), and its marker."""
    parts: list[fx.Node] = []
    value = next(env[grad_piece[s.name]] for s in group.params if s.name in grad_piece).meta["val"]
    for slot, numel in group.spans():
        if slot is not None and slot.name in grad_piece:
            parts.append(env[grad_piece[slot.name]])
        else:  # a gap, or a parameter no gradient reached
            kwargs = {"dtype": value.dtype, "layout": torch.strided, "device": value.device}
            zeros = graph.call_function(torch.ops.aten.zeros.default, ([numel],), kwargs)
            with value.fake_mode:
                zeros.meta["val"] = torch.zeros(numel, dtype=value.dtype, device=value.device)
            parts.append(zeros)
    cat = call(graph, torch.ops.aten.cat.default, (parts,))
    target = ops.ALLREDUCE_GRAD if group.replicated else ops.REDUCE_GRAD
    return call(graph, target, (cat, group.index, group.world_size, traced.reduce_dtype, traced.out_dtype,
                                traced.device))
