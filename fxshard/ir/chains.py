"""Collective chains: what each lowering made, read back as one value.

A lowering (``fxshard/passes/lowering.py``) turns one marker into a few nodes: the
nodes that prepare and issue a collective, the collectives, their waits, and
the node compute reads. Every one of them carries the chain's ``ChainTag``
(``NodeInfo.chain``) and a ``Role``; later passes add to the chain (the free
of its buffer, hpZ's kept piece) under the same tag. ``chains(graph)`` reads
them back::

    gather, "all_gather" (FULL_SHARD, mixed precision):
        shard -> [cast] -> [all_gather] -> [wait] -> split -> view -> compute ... [free]
                 issue      collectives     waits = result                        frees
    reduce, "reduce_scatter_all_reduce" (HSDP):
        cat -> [cast] -> [reduce_scatter] -> [wait] -> [all_reduce] -> [wait] -> [div_, cast_back] -> shard.grad
               issue     collectives[0]      waits[0]   collectives[1]  waits[1]  finish = result

Scheduling, freeing, verification and the report read chains, not node
shapes: a lowering that adds a node (a dequantization after the wait, a copy
to the host) keeps every one of them right as long as it tags the node.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.meta import ChainTag, Direction, Role

# A chain's nodes that are its collectives (each result the buffer it fills).
COLLECTIVE_ROLES = frozenset({Role.ALL_GATHER, Role.REDUCE_SCATTER, Role.ALL_REDUCE, Role.ALL_TO_ALL})


@dataclass(frozen=True)
class Chain:
    """One flat group's trip over the network in one graph, as its lowering made it.

    ``issue``: the nodes before the first wait (casts, the division, the collectives
    that read no wait of the chain), and those the lowering declared part of the issue
    though they read a wait (``NodeInfo.issues``: a quantized gather's amax all_reduce,
    its wait and the quantization before the gather), in graph order; scheduling moves
    them together. ``tail``: the rest up to ``result`` (the other waits, collectives
    issued after them, casts back, a dequantization), in graph order. ``result`` is what compute reads (a gathered buffer) or what
    the shard's gradient is (a reduction); a saved or kept buffer is its own chain with
    no collective. ``frees`` release ``result``'s storage; ``kept`` is hpZ's piece of it.
    ``agreed``: the nodes of ``issue`` agreed once at the graph's start (``NodeInfo.agrees``),
    in graph order; scheduling places them there, and the rest of the issue with the gather.
    """

    tag: ChainTag
    group: int
    unit: str
    issue: tuple[fx.Node, ...]
    collectives: tuple[fx.Node, ...]
    waits: tuple[fx.Node, ...]
    tail: tuple[fx.Node, ...]
    result: fx.Node
    frees: tuple[fx.Node, ...] = ()
    kept: tuple[fx.Node, ...] = ()
    agreed: tuple[fx.Node, ...] = ()

    @property
    def issued_with_gather(self) -> tuple[fx.Node, ...]:
        """The issue less what is agreed at the graph's start: what moves with the gather."""
        return tuple(n for n in self.issue if n not in self.agreed) if self.agreed else self.issue

    @property
    def direction(self) -> Direction:
        return self.tag.direction

    @property
    def lowering(self) -> str:
        return self.tag.lowering

    @property
    def gathers(self) -> bool:
        """Parameters come in and are gathered (or, offloaded on one rank, copied from the
        host) here, into a buffer of the chain's own: not a buffer kept from forward."""
        return self.direction is Direction.GATHER and (
            bool(self.collectives) or any(meta.role_of(n) is Role.TO_DEVICE for n in self.issue))

    @property
    def group_names(self) -> tuple[str, ...]:
        """The process group each collective runs on, in order."""
        return tuple(P.group_name(c) for c in self.collectives)

    @property
    def bytes(self) -> int:
        """Bytes of the collectives' inputs (what this rank hands the network)."""
        return sum(_nbytes(P.collective_args(c).input) for c in self.collectives)

    @property
    def device(self) -> torch.device | None:
        val = self.result.meta.get("val")
        return val.device if isinstance(val, torch.Tensor) else None

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return (*self.issue, *self.tail, *self.kept, *self.frees)


def _nbytes(node: object) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def tag_of(node: fx.Node) -> ChainTag | None:
    info = meta.get_info(node)
    return info.chain if info is not None else None


# Per graph, the next chain number to hand out: a lowering asks once per chain, and reading
# every node each time made the lowering passes quadratic (Llama-3-70B's backward: 8000
# chains over 100 000 nodes, a third of auto()'s time).
_NEXT_ID: weakref.WeakKeyDictionary[fx.Graph, int] = weakref.WeakKeyDictionary()


def new_chain_id(graph: fx.Graph) -> int:
    """A chain number no node of ``graph`` uses and no earlier call returned for it. The
    first call on a graph reads its nodes (a graph a partition or a copy made carries its
    source's tags); later ones count on from there."""
    next_id = _NEXT_ID.get(graph)
    if next_id is None:
        next_id = max((t.id for n in graph.nodes if (t := tag_of(n)) is not None), default=-1) + 1
    _NEXT_ID[graph] = next_id + 1
    return next_id


def chains(graph: fx.Graph) -> list[Chain]:
    """Every chain in ``graph``, in the graph order of its first node."""
    members: dict[ChainTag, list[fx.Node]] = {}
    for node in graph.nodes:
        tag = tag_of(node)
        if tag is not None:
            members.setdefault(tag, []).append(node)
    return [_chain(tag, nodes) for tag, nodes in members.items()]


def _chain(tag: ChainTag, nodes: list[fx.Node]) -> Chain:
    info = meta.get_info(nodes[0])
    assert info is not None
    roles = {n: meta.role_of(n) for n in nodes}
    frees = tuple(n for n in nodes if roles[n] is Role.FREE)
    kept = tuple(n for n in nodes if roles[n] is Role.PIECE and not P.is_placeholder(n))
    body = [n for n in nodes if n not in frees and n not in kept]
    waits = tuple(n for n in body if roles[n] is Role.WAIT)
    declared = {n for n in body if _issues(n)}
    # A node after a wait (reads one, directly or through the chain) belongs to the tail,
    # unless its lowering declared it part of the issue.
    after_wait: set[fx.Node] = {w for w in waits if w not in declared}
    for n in body:
        if n not in declared and any(a in after_wait for a in n.all_input_nodes):
            after_wait.add(n)
    for n in declared:
        if any(a in after_wait for a in n.all_input_nodes):
            raise ValueError(f"chain {tag}: {n.name} is declared part of the issue but reads "
                             "its tail (a wait not declared with it)")
    issue = tuple(n for n in body if n not in after_wait)
    tail = tuple(n for n in body if n in after_wait)
    result = _result(body)
    agreed = tuple(n for n in issue if _agrees(n))
    for n in agreed:
        if any(not _agrees(a) and not P.is_placeholder(a) for a in n.all_input_nodes):
            raise ValueError(f"chain {tag}: {n.name} is declared agreed at the graph's start but "
                             "reads a node computed in the step")
    return Chain(tag, info.group, info.unit, issue,
                 tuple(n for n in body if roles[n] in COLLECTIVE_ROLES), waits, tail, result,
                 frees, kept, agreed)


def _issues(node: fx.Node) -> bool:
    info = meta.get_info(node)
    return info is not None and info.issues


def _agrees(node: fx.Node) -> bool:
    info = meta.get_info(node)
    return info is not None and info.agrees


def _result(body: list[fx.Node]) -> fx.Node:
    """The one node of the chain that no other node of it reads: its value leaves the chain."""
    inside = set(body)
    last = [n for n in body if not any(u in inside for u in n.users)]
    if len(last) != 1:
        raise ValueError(f"chain {[n.name for n in body]} ends in {len(last)} nodes, not one")
    return last[0]


def gather_chains(graph: fx.Graph) -> list[Chain]:
    """The chains that bring parameters in: gathers, and buffers kept from forward."""
    return [c for c in chains(graph) if c.direction is Direction.GATHER]


def reduce_chains(graph: fx.Graph) -> list[Chain]:
    return [c for c in chains(graph) if c.direction is Direction.REDUCE]


def chain_of(node: fx.Node, found: list[Chain]) -> Chain | None:
    """The chain of ``found`` that ``node`` belongs to."""
    tag = tag_of(node)
    return next((c for c in found if c.tag == tag), None) if tag is not None else None
