"""verify: check the invariants of passes/README.md on one graph.

Run between passes (tests and debug mode) and once on every emitted graph.
Raises GraphInvariantError naming the offending node.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard import predicates as P
from fxshard.errors import GraphInvariantError

from .analysis import aliases, gathered_buffers, parameter_only
from .context import PassContext


def verify(gm: fx.GraphModule, ctx: PassContext | None = None, *, final: bool = False) -> None:
    graph = gm.graph
    try:
        graph.lint()
    except Exception as e:  # lint raises plain RuntimeErrors
        raise GraphInvariantError(f"graph is malformed: {e}") from e
    order = {n: i for i, n in enumerate(graph.nodes)}

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

    gathered = set(gathered_buffers(graph))
    freed: set[fx.Node] = set()
    for node in graph.nodes:
        if not P.is_free(node):
            continue
        buf = node.args[0]
        if buf not in gathered:
            raise GraphInvariantError(f"{node.name} frees {buf}, which is not a gathered buffer")
        assert isinstance(buf, fx.Node)
        if buf in freed:
            raise GraphInvariantError(f"{node.name} frees {buf.name} a second time")
        freed.add(buf)
        views = aliases(buf)
        late = [u for v in views for u in v.users
                if u is not node and u not in views and order[u] > order[node]]
        late += [v for v in views if order[v] > order[node]]
        if late:
            raise GraphInvariantError(
                f"{buf.name} is used after {node.name} frees it, by {[u.name for u in late]}"
            )

    if ctx is not None and ctx.graph == "forward" and ctx.num_user_outputs is not None:
        _check_nothing_gathered_is_saved(graph, ctx.num_user_outputs)
    if ctx is not None and ctx.graph == "joint":
        _check_joint_saves_no_parameter(graph)


def _check_nothing_gathered_is_saved(graph: fx.Graph, num_user_outputs: int) -> None:
    output = next(n for n in graph.nodes if P.is_output(n))
    saved = [a for a in output.args[0][num_user_outputs:] if isinstance(a, fx.Node)]
    param_only = parameter_only(graph)
    for node in saved:
        if node in param_only:
            raise GraphInvariantError(
                f"{node.name} is computed from gathered parameters alone and is saved for "
                "backward: the full parameter would stay alive between forward and backward"
            )


def _check_joint_saves_no_parameter(graph: fx.Graph) -> None:
    param_only = parameter_only(graph)
    for node in graph.nodes:
        if node.meta.get("partitioner_tag") != "is_backward":
            continue
        for a in node.all_input_nodes:
            if a in param_only and a.meta.get("partitioner_tag") != "is_backward":
                raise GraphInvariantError(
                    f"backward node {node.name} reads forward value {a.name}, computed from "
                    "gathered parameters alone: the partitioner would save it for backward"
                )
