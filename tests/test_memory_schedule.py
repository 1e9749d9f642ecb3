"""Memory-aware prefetch (``prefetch_within_peak``, limit_prefetch_pass): no prefetched gather
holds its buffer across its graph's peak, prefetch stays where memory allows (fake process
group, 2 ranks, through fxshard.explain)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
import torch.fx as fx

import fxshard
from fxshard.ir import predicates as P
from fxshard.policies import by_class

from models import Block, TinyGPT

# (dim, layers, vocab, batch): issue 13's sweep, at sequence length 16.
# Shape 5 (256 / 12 / 1024 / 8) is measured in docs/scheduling.md, not here: it takes longest
# to trace.
SHAPES = {"1": (128, 6, 512, 4), "2": (256, 6, 512, 4), "4": (128, 6, 512, 16), "6": (64, 4, 4096, 4)}
NO_PREFETCH = dict(forward_prefetch=False, backward_prefetch=None)


def _explain(shape: str, **options: Any) -> fxshard.Explanation:
    return _explained(shape, tuple(sorted(options.items())))


@cache
def _explained(shape: str, options: tuple[tuple[str, Any], ...]) -> fxshard.Explanation:
    dim, layers, vocab, batch = SHAPES[shape]
    with torch.device("meta"):
        model = TinyGPT(vocab=vocab, dim=dim, heads=4, layers=layers, seq=16)
    return fxshard.explain(model, torch.zeros(batch, 16, dtype=torch.long), policy=by_class(Block),
                           world_size=2, **dict(options))


def _prefetched(gm: fx.GraphModule) -> int:
    """Gathers with other nodes between them and their wait: overlapped with compute (just in
    time, a gather is followed by its wait)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    return sum(1 for n in nodes if P.is_wait(n) and isinstance(n.args[0], fx.Node)
               and P.is_all_gather(n.args[0]) and order[n] - order[n.args[0]] > 1)


WITHIN_PEAK = dict(prefetch_within_peak=True)  # the default
LIMIT_ONLY = dict(prefetch_within_peak=False)  # the in-flight limit alone


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_no_prefetched_buffer_is_live_at_its_graphs_peak(shape: str) -> None:
    from fxshard.ir.memory import graph_timeline
    from fxshard.passes.limit_prefetch import _persistent

    e = _explain(shape, **WITHIN_PEAK)
    for graph, gm in e.graphs.items():
        timeline = graph_timeline(gm, _persistent(gm, graph))
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        for wait in (n for n in nodes if P.is_wait(n) and P.is_all_gather(n.args[0])):
            early = range(order[wait.args[0]], order[wait])
            if len(early) <= 1:
                continue  # just in time: its gather is the allocation itself
            assert all(timeline.highs[i] < timeline.peak for i in early), (shape, graph, wait.name)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_memory_aware_prefetch_never_raises_the_peak(shape: str) -> None:
    within = _explain(shape, **WITHIN_PEAK).report.predicted_peak_bytes
    unbounded = _explain(shape, **LIMIT_ONLY).report.predicted_peak_bytes
    just_in_time = _explain(shape, **NO_PREFETCH).report.predicted_peak_bytes
    # Measured: equal to just in time on every shape; the in-flight limit alone was 3% (shape
    # 6) to 11% (shapes 1, 2) above it.
    assert within <= unbounded and within <= just_in_time, (within, unbounded, just_in_time)


def test_the_in_flight_limit_alone_raised_the_peak() -> None:
    # Shape 1 of issue 13: the in-flight limit alone holds an extra gathered unit at the peak.
    assert (_explain("1", **LIMIT_ONLY).report.predicted_peak_bytes
            > 1.05 * _explain("1", **NO_PREFETCH).report.predicted_peak_bytes)


def test_prefetch_is_kept_where_memory_allows() -> None:
    e = _explain("6", **WITHIN_PEAK)  # a large vocabulary: the logits hold the peak
    assert _prefetched(e.graphs["forward"]) + _prefetched(e.graphs["backward"]) > 0
