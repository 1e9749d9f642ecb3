"""Static memory prediction: a liveness analysis over a step's emitted graphs.

Each node's ``meta["val"]`` gives the size of the storage it allocates. Views
(read from operator schemas: split, view, transpose, wait_tensor...) share
their base's storage. A storage dies after the last use of any tensor that
shares it, unless a graph output keeps it; ``fxshard.free`` releases it at
once. The forward's outputs (user outputs and tensors saved for backward) stay
alive into backward, where they die after their last use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxshard.ir import compat, meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of


def storage_nbytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        try:
            return int(val.untyped_storage().nbytes())
        except (NotImplementedError, RuntimeError):
            return val.numel() * val.element_size()
    return 0


def _aliases_input(node: fx.Node) -> bool:
    """Does the node's result share storage with its first input?"""
    if P.is_view(node):
        return True
    target = node.target
    if isinstance(target, compat.OpOverload):
        return any(r.alias_info is not None for r in compat.schema(target).returns)
    return False


def storage_owners(
    nodes: list[fx.Node], same_storage: dict[fx.Node, fx.Node] | None = None,
) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """For each node, the node that owns the storage its result lives in (itself
    unless it is a view or an aliasing op); and each owner's bytes.

    Placeholders own their storage, except those ``same_storage`` maps to an
    earlier placeholder; a multi-output node owns none (each of its ``getitem``
    results owns its own, unless the op returns views).
    """
    same_storage = same_storage or {}
    storage: dict[fx.Node, fx.Node] = {}
    size: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "placeholder" and node in same_storage:
            storage[node] = storage[same_storage[node]]
        elif node.op == "placeholder":
            storage[node] = node
            size[node] = storage_nbytes(node.meta.get("val"))
        elif node.op == "call_function":
            first = node.args[0] if node.args else None
            if isinstance(first, fx.Node) and first in storage and _aliases_input(node):
                storage[node] = storage[first]
            elif isinstance(node.meta.get("val"), (tuple, list)):
                pass  # multi-output: each getitem owns its storage
            else:
                storage[node] = node
                # Offload: a gradient copied to the host takes no device memory.
                size[node] = 0 if meta.role_of(node) is meta.Role.TO_HOST else storage_nbytes(node.meta.get("val"))
    return storage, size


@dataclass
class Timeline:
    """Live bytes over one graph: ``peak`` and, after the graph returns, ``end``."""

    peak: int
    end: int
    peak_at: str
    curve: list[int]  # live bytes after each node, in graph order
    highs: list[int] = field(default_factory=list)  # live bytes at each node, before its frees
    # At the peak: the bytes of each storage alive there, by the name of the node owning
    # it (the part of ``base`` the graph does not see is not in it).
    at_peak: dict[str, int] = field(default_factory=dict)
    # After the graph returns: the same, for what is still alive.
    at_end: dict[str, int] = field(default_factory=dict)


def simulate(
    gm: fx.GraphModule,
    live_inputs: dict[str, int],
    persistent_inputs: set[str],
    base: int = 0,
    shared: dict[str, str] | None = None,
) -> tuple[Timeline, dict[str, tuple[str, int]]]:
    """Walk ``gm`` in order, tracking live storage bytes on top of ``base``.

    ``live_inputs`` maps placeholder names to the bytes of the storage each
    holds that is counted here (0 for storages already counted in ``base``).
    Placeholders in ``persistent_inputs`` never die (parameters, buffers).
    ``shared`` maps a placeholder to another whose storage it shares (saved
    views of one buffer). Returns the timeline and, for each output whose
    storage is still alive, (name of the node owning the storage, its bytes).
    """
    shared = shared or {}
    nodes = list(gm.graph.nodes)
    order = order_of(gm.graph)
    by_name = {n.name: n for n in nodes}
    storage, size = storage_owners(nodes, {by_name[a]: by_name[b] for a, b in shared.items()})
    for placeholder in (n for n in nodes if n.op == "placeholder"):
        if storage[placeholder] == placeholder:
            size[placeholder] = live_inputs.get(placeholder.name, 0)
    output = next(n for n in nodes if n.op == "output")
    kept = {storage[a] for a in output.all_input_nodes if a in storage}
    last: dict[fx.Node, int] = {}
    for node in nodes:
        owner = storage.get(node)
        if owner is None:
            continue
        uses = [order[u] for u in node.users if u is not output]
        last[owner] = max([last.get(owner, order[node]), order[node], *uses])
    for name in persistent_inputs:
        for n in nodes:
            if n.op == "placeholder" and n.name == name:
                kept.add(n)
    dies_at: dict[int, list[fx.Node]] = {}
    for owner, pos in last.items():
        if owner not in kept:
            dies_at.setdefault(pos, []).append(owner)

    alive = {n: size.get(n, 0) for n in nodes if n.op == "placeholder" and size.get(n, 0)}
    live = base + sum(alive.values())
    peak, peak_at = live, "start"
    at_peak = {n.name: b for n, b in alive.items()}
    freed: set[fx.Node] = set()
    curve: list[int] = []
    highs: list[int] = []
    for i, cur in enumerate(nodes):
        if cur.op == "call_function" and storage.get(cur, None) == cur:
            live += size.get(cur, 0)
            alive[cur] = size.get(cur, 0)
        highs.append(live)
        if live > peak:
            peak, peak_at = live, cur.name
            at_peak = {n.name: b for n, b in alive.items() if b}
        if P.is_free(cur) and cur.args[0] in storage:  # not a get_attr (a no_sync accumulator)
            owner = storage[cur.args[0]]
            if owner not in freed:
                live -= size[owner]
                freed.add(owner)
                alive.pop(owner, None)
        for owner in dies_at.get(i, []):
            if owner not in freed:
                live -= size[owner]
                freed.add(owner)
                alive.pop(owner, None)
        curve.append(live)
    outs = {a.name: (storage[a].name, size[storage[a]]) for a in output.all_input_nodes
            if a in storage and storage[a] not in freed and storage[a].op != "placeholder"}
    at_end = {n.name: b for n, b in alive.items() if b}
    return Timeline(peak, live, peak_at, curve, highs, at_peak, at_end), outs


def graph_timeline(gm: fx.GraphModule, persistent: set[fx.Node]) -> Timeline:
    """Live bytes over ``gm`` alone: its placeholders in ``persistent`` outlive it and are not
    counted; every other one is counted and dies after its last use (a backward's saved
    tensors and tangents, in the boxed calling convention). Placeholders that are views of
    one storage (their values share it) count once."""
    first_of: dict[int, str] = {}
    live: dict[str, int] = {}
    shared: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node in persistent:
            continue
        val = node.meta.get("val")
        try:  # the StorageImpl's address: the same for views of one storage
            key = compat.storage_key(val) if isinstance(val, torch.Tensor) else id(node)
        except (NotImplementedError, RuntimeError):
            key = id(node)
        if key in first_of:
            shared[node.name] = first_of[key]
        else:
            first_of[key] = node.name
            live[node.name] = storage_nbytes(val)
    return simulate(gm, live, {n.name for n in persistent}, shared=shared)[0]
