"""The default schedule on GPT shapes: the same on every rank whatever its batch, every gather but
each graph's first overlapped with compute, and gathered memory within FSDP2's one-unit lookahead
(fake process group, 2 ranks, through fxshard.explain).

The checks read the emitted graphs' text order only, with their own walk over the nodes: none of
them calls a helper of the scheduling passes.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
import torch.fx as fx

import fxshard
from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.options import ShardingOptions
from fxshard.policies import by_class

from models import Block, TinyGPT

# (dim, layers, vocab, batch): GPT shapes at sequence length 16, from activation-light to a
# large vocabulary (the logits hold the peak) and a large batch (activations do).
SHAPES = {"1": (128, 6, 512, 4), "4": (128, 6, 512, 16), "6": (64, 4, 4096, 4)}
# The fast tier checks the first shape; the slow tier the other two.
SHAPE_PARAMS = ["1", *(pytest.param(s, marks=pytest.mark.slow) for s in ("4", "6"))]


@cache
def _explained(shape: str, batch: int | None = None,
               options: tuple[tuple[str, Any], ...] = ()) -> fxshard.Explanation:
    dim, layers, vocab, default_batch = SHAPES[shape]
    with torch.device("meta"):
        model = TinyGPT(vocab=vocab, dim=dim, heads=4, layers=layers, seq=16)
    x = torch.zeros(batch or default_batch, 16, dtype=torch.long)
    return fxshard.explain(model, x, policy=by_class(Block), world_size=2, **dict(options))


def _is_compute(n: fx.Node) -> bool:
    """Work a gather can overlap: a call that is no collective, wait, free, view or cast."""
    info = meta.get_info(n)
    return (n.op == "call_function" and not (P.is_collective(n) or P.is_wait(n) or P.is_free(n)
                                             or P.is_view(n))
            and not (info is not None and info.role is meta.Role.CAST))


def _schedule(gm: fx.GraphModule) -> list[str]:
    """Each collective, wait and free in order, with its unit and process group. Compute between
    them is left out: a batch of 1 traces other views (size-1 dimensions), and
    sink_allocations_pass moves compute that no collective reads by its size."""
    out = []
    for n in gm.graph.nodes:
        if P.is_collective(n) or P.is_wait(n) or P.is_free(n):
            info = meta.get_info(n)
            out.append(f"{n.target} {info.unit if info else '?'} "
                       f"{[a for a in n.args[1:] if not isinstance(a, fx.Node)]}")
    return out


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_the_schedule_is_the_same_at_every_batch_size(shape: str) -> None:
    """Ranks with different batches (a smaller last batch) must issue the same collectives in the
    same places: fingerprints and positions equal for batches 1, 3 and the shape's own."""
    reference = _explained(shape)
    for batch in (1, 3):
        other = _explained(shape, batch)
        for graph in ("forward", "backward"):
            assert _schedule(other.graphs[graph]) == _schedule(reference.graphs[graph]), (batch, graph)
        phases = [d.steps[-1].phases for d in (other._driver, reference._driver) if d is not None]
        assert len(phases) == 2 and phases[0] == phases[1]  # what the ranks' agreement compares


def _gathers_without_overlap(gm: fx.GraphModule) -> list[str]:
    nodes = list(gm.graph.nodes)
    where = order_of(gm.graph)
    bare = []
    for wait in (n for n in nodes if P.is_wait(n) and P.is_all_gather(n.args[0])):
        gather = wait.args[0]
        assert isinstance(gather, fx.Node)
        if not any(_is_compute(n) for n in nodes[where[gather] + 1:where[wait]]):
            bare.append(gather.name)
    return bare


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.parametrize("options", [(), (("reshard_root", True),)], ids=["default", "reshard_root"])
def test_every_gather_but_the_first_overlaps_compute(shape: str, options: tuple[tuple[str, Any], ...]) -> None:
    # With the root resharded, its tied embedding is read at both ends of forward: it must not
    # take a lookahead slot for the whole forward.
    e = _explained(shape, options=options)
    for graph in ("forward", "backward"):
        bare = _gathers_without_overlap(e.graphs[graph])
        first = next(n for n in e.graphs[graph].graph.nodes if P.is_all_gather(n))
        assert bare in ([], [first.name]), (graph, bare)
    # Just in time, every gather is bare: the check can fail.
    jit = _explained(SHAPES_FIRST, options=(("backward_prefetch", None), ("forward_prefetch", False)))
    assert len(_gathers_without_overlap(jit.graphs["forward"])) > 1


SHAPES_FIRST = sorted(SHAPES)[0]


def _gathered_bytes_alive(gm: fx.GraphModule) -> tuple[int, int]:
    """(most gathered buffers alive at once, their bytes), counting each from its all_gather's
    issue to its free; buffers never freed in the graph (kept for backward) are left out."""
    freed = {n.args[0] for n in gm.graph.nodes if P.is_free(n)}
    alive: dict[fx.Node, int] = {}
    most = (0, 0)
    for n in gm.graph.nodes:
        if P.is_all_gather(n):
            (wait,) = n.users
            if wait in freed:
                val = wait.meta["val"]
                alive[wait] = val.numel() * val.element_size()
        elif P.is_free(n):
            alive.pop(n.args[0], None)
        most = max(most, (len(alive), sum(alive.values())))
    return most


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_gathered_memory_stays_within_fsdp2s_one_unit_lookahead(shape: str) -> None:
    """FSDP2 holds the unit it computes and the one it prefetches: at most two blocks."""
    e = _explained(shape)
    block = max(u.padded_numel for u in e.plan.groups if u.unit.startswith("blocks.")) * 4
    for graph in ("forward", "backward"):
        count, nbytes = _gathered_bytes_alive(e.graphs[graph])
        assert count <= ShardingOptions().max_inflight_gathers == 2, (graph, count)
        assert nbytes <= 2 * block, (graph, nbytes, block)
