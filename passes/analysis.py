"""Read-only questions about a graph that several passes ask."""

from __future__ import annotations

import torch.fx as fx

from fxshard import meta
from fxshard import predicates as P


def node_args(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def aliases(root: fx.Node) -> list[fx.Node]:
    """``root`` and every node that is a view of it, transitively, in graph order."""
    seen = {root: None}
    work = [root]
    while work:
        node = work.pop()
        for user in node.users:
            if user not in seen and P.is_view(user) and user.args and user.args[0] is node:
                seen[user] = None
                work.append(user)
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def gathered_buffers(graph: fx.Graph) -> list[fx.Node]:
    """The wait nodes that complete an all_gather: each is one gathered flat buffer."""
    return [n for n in graph.nodes if P.is_wait(n) and P.is_all_gather(n.args[0])]


def parameter_only(graph: fx.Graph) -> dict[fx.Node, None]:
    """Nodes computed from gathered parameters alone (an ordered set).

    The roots are unshard markers and gather waits; a deterministic, pure node
    all of whose tensor inputs are parameter-only is parameter-only too: a
    view, a transpose, a cast of a weight. These are what the partitioner must
    never save for backward.
    """
    result: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if P.is_unshard_marker(node) or (P.is_wait(node) and P.is_all_gather(node.args[0])):
            result[node] = None
        elif (
            P.is_call(node)
            and not P.is_random(node)
            and not node.is_impure()
            and node.all_input_nodes
            and all(a in result for a in node.all_input_nodes)
        ):
            result[node] = None
    return result


def first_use_order(graph: fx.Graph) -> list[int]:
    """Flat-group indices in the order the graph first reads each unit's parameters.

    Works on a traced graph (``fxshard.unshard`` markers) and on a lowered one
    (all_gather of each shard): a use is any non-view user of the gathered
    buffer or of one of its views.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    first: dict[int, int] = {}
    for node in graph.nodes:
        if P.is_unshard_marker(node):
            root, group = node, node.args[1]
        elif P.is_wait(node) and P.is_all_gather(node.args[0]):
            info = meta.get_info(node)
            if info is None:
                continue
            root, group = node, info.group
        else:
            continue
        assert isinstance(group, int)
        views = aliases(root)
        uses = [order[u] for v in views for u in v.users if u not in views]
        if uses:
            first[group] = min(first.get(group, len(order)), min(uses))
    return sorted(first, key=first.__getitem__)
