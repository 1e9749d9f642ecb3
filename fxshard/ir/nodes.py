"""Making nodes: every node a pass creates gets its ``meta["val"]`` by running its
operator under the graph's fake mode, as Inductor's fx passes do when they splice
code in, never by copying a neighbour's value (a cast's dtype differs from its input's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxshard.ir.compat import detect_fake_mode, pytree
from fxshard.ir.errors import GraphInvariantError


def fake_value(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
               like: Any = None) -> Any:
    """What ``target(*args, **kwargs)`` returns, computed on the inputs' fake values; where no
    input holds a fake tensor (a factory: ``aten.ones``, ``aten.arange``), under the fake mode
    of ``like`` (the value of the node it copies)."""
    kwargs = kwargs or {}
    tensors: list[torch.Tensor] = []
    fake_args, fake_kwargs = _values(args, tensors), _values(kwargs, tensors)
    mode = detect_fake_mode(tensors)
    if mode is None and like is not None:
        mode = detect_fake_mode([t for t in pytree.tree_leaves(like) if isinstance(t, torch.Tensor)])
    if mode is None:
        raise GraphInvariantError(
            f"cannot compute meta['val'] of a new {target} node: none of its inputs holds a fake "
            "tensor (was the graph traced under fake tensors?)"
        )
    with mode:
        return target(*fake_args, **fake_kwargs)


def _values(x: Any, tensors: list[torch.Tensor]) -> Any:
    """``x`` with each node replaced by its ``meta["val"]``, the tensors among them collected
    in ``tensors``: plain recursion over the containers an fx argument holds (pytree's
    generic walk was a fifth of a large model's planning time), in a module-level function (a
    nested one that calls itself is a reference cycle, garbage at every call)."""
    if isinstance(x, fx.Node):
        if "val" not in x.meta:
            raise GraphInvariantError(f"{x.name} has no meta['val'] to compute a new node's from")
        value = x.meta["val"]
        tensors.extend(v for v in (value if isinstance(value, (list, tuple)) else (value,))
                       if isinstance(v, torch.Tensor))
        return value
    if type(x) in (list, tuple):
        return type(x)(_values(a, tensors) for a in x)
    if type(x) is dict:
        return {k: _values(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple, dict)):  # a namedtuple or another subclass: pytree's way
        return pytree.tree_map_only(fx.Node, lambda n: _values(n, tensors), x)
    return x


def call(graph: fx.Graph, target: Any, args: tuple[Any, ...],
         kwargs: dict[str, Any] | None = None) -> fx.Node:
    """A new ``call_function`` node at the graph's insertion point, with its ``meta["val"]``."""
    value = fake_value(target, args, kwargs)
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = value
    return node


def refresh_value(node: fx.Node, like: Any = None) -> None:
    """Recompute ``node.meta["val"]`` from its inputs (after its inputs were replaced); a node
    with no tensor input under the fake mode of ``like``, or of its own value before."""
    node.meta["val"] = fake_value(node.target, node.args, node.kwargs,
                                  like if like is not None else node.meta.get("val"))


def attribute(gm: fx.GraphModule, name: str, tensor: torch.Tensor, like: fx.Node) -> fx.Node:
    """A ``get_attr`` node for ``tensor``, registered on ``gm`` as buffer ``name``, at the
    insertion point; its ``meta["val"]`` is a fake tensor of ``like``'s fake mode."""
    mode = detect_fake_mode([like.meta["val"]])
    if mode is None:
        raise GraphInvariantError(f"{like.name} holds no fake tensor")
    gm.register_buffer(name, tensor, persistent=False)
    node = gm.graph.get_attr(name)
    node.meta["val"] = mode.from_tensor(tensor)
    return node
