"""checkpoint_activations_pass: backward recomputes the checkpointed regions' activations.

Runs on the joint forward+backward graph, after ``rematerialize_params_pass``
and before partitioning. Every backward node that reads a forward value
computed inside a checkpointed region (``ctx.checkpointing``: module paths,
from ``activation_checkpointing=``) reads a backward copy of it instead,
copied with the region's other values it needs, back to the region's inputs::

    before:  x --> ln --> mm --> gelu --> mm --> y                 (forward, region "blocks.0")
                   |      |      |                                 saved for backward: ln, mm, gelu
             backward: ... mm(grad, gelu) ... gelu_backward(grad, mm) ...
    after:   x --> ln --> mm --> gelu --> mm --> y                 (forward: saves x only)
             x --> ln' --> mm' --> gelu' --> mm(grad, gelu') ...   (backward, before its first reader)

The partitioner then saves only the regions' inputs. A copied node that reads
a parameter reads the parameter's backward copy (``BackwardCopies``), the one
the gradient reads too: each resharded unit is still gathered once per
backward (verify's invariant 7 checks it on the emitted graph).

Random operators in a region (dropout) run under ``run_and_save_rng_state``
in forward; their copy runs under ``run_with_rng_state`` with that state, so
backward draws the same mask and leaves the generator where it was: the same
numbers as without checkpointing (``fxshard.ir.ops``; under Inductor, torch's
higher-order operators of the same names)::

    forward:   pair = run_and_save_rng_state(native_dropout, h, p, True); state = pair[0]
    backward:  run_with_rng_state(state, native_dropout, h', p, True)

In a region checkpointed selectively (``Checkpointing.selective``) the copying
stops at the outputs of ``Checkpointing.saved_ops`` (matmuls, attention): they
are saved as they would be without checkpointing, and only the cheap
operators around them are recomputed.

A region's outputs (values read by forward nodes outside it, or returned)
are not recomputed: as with ``torch.utils.checkpoint``, the region saves its
inputs and whatever reads its outputs saves them if backward needs them (a
block's output is the next block's input, saved anyway). Recomputing them
would rerun the whole region early in backward, wherever the first reader of
the output sits.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fxshard.ir import compat, meta, ops
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.compat import detect_fake_mode, pytree, rng_prims
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.nodes import fake_value

from .context import PassContext
from .copies import BackwardCopies


def checkpoint_activations_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    checkpointing = ctx.checkpointing
    if checkpointing is None or not checkpointing.regions:
        return gm
    graph = gm.graph
    copies = BackwardCopies(graph, ctx)
    output = next(n for n in graph.nodes if P.is_output(n))
    region = {n: checkpointing.region_of(meta.module_path(n)) for n in graph.nodes}
    kept = {n for n in output.all_input_nodes if not meta.is_backward(n)}
    rng = _INDUCTOR_RNG if ctx.compute == "inductor" else _EAGER_RNG
    for node in list(graph.nodes):
        name = region[node]
        # A random operator whose output is saved anyway (attention in a selective region)
        # or that mutates is not recomputed, so it needs no generator state.
        if (name is not None and _is_random(node) and not meta.is_backward(node)
                and not checkpointing.saves(node.target, name) and not _mutates(node)):
            region.update(_save_rng_state(graph, node, name, rng[0]))

    def recomputed(node: fx.Node) -> bool:
        """Does backward recompute ``node`` rather than read it from forward?"""
        name = region[node]
        if (name is None or not P.is_call(node) or meta.is_backward(node)
                or node in copies.param_only or node in kept or P.is_marker(node)
                or any(not meta.is_backward(u) and region[u] != name for u in node.users)
                or checkpointing.saves(node.target, name) or _mutates(node)):
            return False
        if node.target is operator.getitem:
            source = node.args[0]
            assert isinstance(source, fx.Node)
            if _is_rng_pair(source):
                return _is_rng_result(node)  # the result [1]; the generator state [0] is saved
            return recomputed(source)
        return True

    position = order_of(graph)

    def backward_value(node: fx.Node, before: fx.Node) -> fx.Node:
        if not recomputed(node):
            return copies.parameter(node, before)  # itself, or a parameter chain's copy
        # The region's nodes ``node`` needs that have no copy yet, found without recursion
        # (a region can be a long chain), then copied in forward order.
        needed, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in needed or n in copies.copies or not recomputed(n):
                continue
            needed.add(n)
            pair = n.args[0] if _is_rng_result(n) else n  # a replay reads the random op's inputs
            assert isinstance(pair, fx.Node)
            stack.extend(pair.all_input_nodes)
        for n in sorted(needed, key=position.__getitem__):
            if _is_rng_result(n):
                _replay(graph, copies, n, before, backward_value, rng[1])
            else:
                copies.copy(n, before, lambda a: backward_value(a, before))
        return copies.copy(node, before, lambda a: backward_value(a, before))

    changed = False
    for user in [n for n in graph.nodes if meta.is_backward(n) and not P.is_output(n)]:
        for value in list(dict.fromkeys(user.all_input_nodes)):
            if recomputed(value):
                user.replace_input_with(value, backward_value(value, user))
                changed = True
    if not changed:
        return gm
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _is_random(node: fx.Node) -> bool:
    target = node.target
    return (P.is_call(node) and isinstance(target, compat.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags)


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, compat.OpOverload) and compat.schema(target).is_mutable


# (save in forward, replay in backward): fxshard's plain functions for graphs that run
# eagerly (dispatch modes see the random operator inside), torch's higher-order
# operators of the same meaning for Inductor, which lowers them.
_EAGER_RNG: tuple[Any, Any] = (ops.run_and_save_rng_state, ops.run_with_rng_state)
_INDUCTOR_RNG: tuple[Any, Any] = (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state)
_SAVES_RNG = (_EAGER_RNG[0], _INDUCTOR_RNG[0])


def _is_rng_pair(node: object) -> bool:
    return isinstance(node, fx.Node) and node.target in _SAVES_RNG


def _is_rng_result(node: fx.Node) -> bool:
    """``pair[1]``: a random operator's result, replayed in backward."""
    return bool(node.target is operator.getitem and _is_rng_pair(node.args[0]) and node.args[1] == 1)


def _save_rng_state(graph: fx.Graph, node: fx.Node, region: str, save: Any) -> dict[fx.Node, str]:
    """Forward random ``node`` becomes ``run_and_save_rng_state(op, ...)``: its result is
    ``pair[1]``, the generator state it drew from ``pair[0]``. Returns the new nodes' regions."""
    value = node.meta["val"]
    results = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    mode = detect_fake_mode(results)
    if mode is None:
        raise GraphInvariantError(f"{node.name}: random operator without a fake tensor result")
    # The generator of the device it draws on: its result's (torch.rand has no tensor input).
    state = mode.from_tensor(ops.generator_state(results[0].device))  # meta (explain): cpu-sized
    provenance = meta.provenance(node)
    with graph.inserting_before(node):
        op: Any = node.target
        pair = graph.call_function(save, (op, *node.args), dict(node.kwargs))
        saved = graph.call_function(operator.getitem, (pair, 0))
        result = graph.call_function(operator.getitem, (pair, 1))
    for new, val in ((pair, (state, value)), (saved, state), (result, value)):
        new.meta.update(provenance)
        new.meta["val"] = val
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return {pair: region, saved: region, result: region}


def _replay(graph: fx.Graph, copies: BackwardCopies, result: fx.Node, before: fx.Node,
            backward_value: Callable[[fx.Node, fx.Node], fx.Node], replay: Any) -> fx.Node:
    """The backward copy of a random operator's result ``pair[1]``: the operator again,
    under the generator state ``pair[0]`` saved in forward."""
    pair = result.args[0]
    assert isinstance(pair, fx.Node)
    state = next(u for u in pair.users if u.target is operator.getitem and u.args[1] == 0)
    op, *args = pair.args

    def make() -> fx.Node:
        mapped = [backward_value(a, before) if isinstance(a, fx.Node) else a for a in args]
        kwargs = {k: backward_value(v, before) if isinstance(v, fx.Node) else v
                  for k, v in pair.kwargs.items()}
        new = graph.call_function(replay, (state, op, *mapped), kwargs)
        new.meta["val"] = fake_value(op, tuple(mapped), kwargs)
        return new

    return copies.copy(result, before, lambda a: a, make=make)
