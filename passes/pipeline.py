"""The pass pipeline: which passes run, on which graph, in which order, and why.

A pass is ``def name_pass(gm, ctx) -> gm``. It returns ``gm`` unchanged when it
has nothing to do and raises GraphInvariantError naming the node when it meets
a graph shape it does not expect. ``verify`` runs after every pass when
``ctx.verify`` is set, and always on the emitted graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch.fx as fx

from .accumulate_in_place import accumulate_in_place_pass
from .context import PassContext
from .eliminate_dead_code import eliminate_dead_code_pass
from .insert_all_gather import insert_all_gather_pass
from .insert_free import insert_free_pass
from .insert_reduce_scatter import insert_reduce_scatter_pass
from .rematerialize_params import rematerialize_params_pass
from .schedule import schedule_pass
from .schedule_reduce_scatter import schedule_reduce_scatter_pass
from .sink_allocations import sink_allocations_pass
from .verify import verify

log = logging.getLogger("fxshard")

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

# Joint forward+backward graph, before AOTAutograd partitions it.
JOINT_PASSES: tuple[Pass, ...] = (
    # Must run before partitioning: afterwards the partitioner has already
    # decided to save gathered parameters for backward.
    rematerialize_params_pass,
)

# Forward graph of a training step, and the graph of an inference step.
FORWARD_PASSES: tuple[Pass, ...] = (
    # First: dead nodes the partitioner kept would otherwise be lowered,
    # gathered and scheduled like live ones.
    eliminate_dead_code_pass,
    # Lower markers first: every later pass reasons about real collectives.
    insert_all_gather_pass,
    # Place gathers before freeing: a buffer's window runs from its gather to
    # its last use, so free positions depend on the schedule.
    schedule_pass,
    # Last: frees follow the final position of every use.
    insert_free_pass,
)

# Backward graph: the rematerialized gathers, then gradient reduction.
BACKWARD_PASSES: tuple[Pass, ...] = (
    eliminate_dead_code_pass,
    # Gradient sums only: touches no parameter buffer, so it can run anywhere;
    # first, so later passes see the final readers of every tensor.
    accumulate_in_place_pass,
    insert_all_gather_pass,
    insert_reduce_scatter_pass,
    schedule_pass,
    # After the gathers are placed, before frees: moves only gradient layout
    # nodes and reductions, which no gather window depends on.
    schedule_reduce_scatter_pass,
    insert_free_pass,
    # Last: moves only compute that reads no gathered buffer and no collective
    # result, so no gather window, free or reduction changes.
    sink_allocations_pass,
)

PIPELINES: dict[str, tuple[Pass, ...]] = {
    "joint": JOINT_PASSES,
    "forward": FORWARD_PASSES,
    "inference": FORWARD_PASSES,
    "backward": BACKWARD_PASSES,
}


def run_passes(
    gm: fx.GraphModule,
    ctx: PassContext,
    passes: Sequence[Pass] | None = None,
    on_pass: Callable[[str, fx.GraphModule], None] | None = None,
) -> fx.GraphModule:
    """Run ``passes`` (by default the pipeline for ``ctx.graph``) over ``gm``."""
    for p in PIPELINES[ctx.graph] if passes is None else passes:
        gm = p(gm, ctx)
        log.debug("fxshard: %s on %s graph:\n%s", p.__name__, ctx.graph, gm.code)
        if ctx.verify:
            verify(gm, ctx)
        if on_pass is not None:
            on_pass(p.__name__, gm)
    if ctx.graph != "joint":
        verify(gm, ctx, final=True)
    return gm
