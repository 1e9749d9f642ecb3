"""The pass pipeline: which passes run, on which graph, in which order, and why.

``build_pipeline(graph, config)`` is the one place that decides. A pass never
switches itself on or off: the configuration decides here whether it is in
the list (prefetch only with a prefetch mode, explicit frees only when fxshard
itself runs the graphs, anything the user disables by name).

A pass is ``def name_pass(gm, ctx) -> gm``. Its name is its ID, in logs, in
``on_pass`` hooks, in dumps and in ``disable_passes``. It returns ``gm``
unchanged when it has nothing to do and raises GraphInvariantError naming the
node when it meets a graph shape it does not expect. ``verify`` runs after
every pass when ``ctx.verify`` is set, and always on the emitted graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError
from fxshard.ir.options import ShardingOptions
from fxshard.ir.precision import MixedPrecision

from .accumulate_in_place import accumulate_in_place_pass
from .assign_groups import assign_groups_pass
from .batch_agreements import batch_agreements_pass
from .checkpoint_activations import checkpoint_activations_pass
from .context import GraphKind, PassContext
from .eliminate_dead_code import eliminate_dead_code_pass
from .insert_all_gather import insert_all_gather_pass
from .insert_free import insert_free_pass
from .insert_reduce_scatter import insert_reduce_scatter_pass
from .rematerialize_params import rematerialize_params_pass
from .reshard_within import reshard_within_pass
from .scale_in_place import scale_in_place_pass
from .schedule_gathers import place_gathers_pass, prefetch_gathers_pass
from .schedule_reduce_scatter import schedule_reduce_scatter_pass
from .sink_allocations import sink_allocations_pass
from .topological_sort import topological_sort_pass
from .verify import verify

log = logging.getLogger("fxshard")

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]
GRAPH_KINDS: tuple[GraphKind, ...] = ("joint", "forward", "backward", "inference")


@dataclass(frozen=True)
class PassSpec:
    """One position in a pipeline."""

    fn: Pass
    why: str  # why the pass is at this position
    needs: tuple[str, ...] = ()  # passes it relies on having run before it
    # Why the emitted graphs are wrong or cannot run without it; None: optional.
    required: str | None = None

    @property
    def name(self) -> str:
        return self.fn.__name__


_LOWERS_GATHERS = "the emitted graphs would keep fxshard.unshard markers, which raise when run"
_LOWERS_GRADS = "the emitted graphs would keep fxshard.reduce_grad markers, which raise when run"
_PARTITIONS = ("backward would read the whole gathered buffer kept from forward (ZeRO-2's memory), "
               "not hpZ's piece gathered within the partition")
_PLACES = ("every unit would be gathered at the start of the graph, where tracing puts the "
           "markers (the in-flight limit, invariant 8, fails)")
_SORTS = ("the scheduling passes only record positions; without the sort every unit would be "
          "gathered at the start of the graph (invariant 8 fails)")


def _joint(config: CompileConfig) -> list[PassSpec]:
    specs = [
        PassSpec(rematerialize_params_pass,
                 "before partitioning: afterwards the partitioner has already decided to save "
                 "gathered parameters for backward",
                 required="the partitioner would save gathered parameters for backward, "
                          "silently turning ZeRO-3 into DDP (invariant 5)"),
    ]
    if config.activation_checkpointing is not None or config.memory_budget is not None:
        specs.append(PassSpec(checkpoint_activations_pass,
                              "after the parameter copies, whose gathers its recompute reads "
                              "(one gather per unit serves both); before partitioning, which "
                              "then saves only the regions' inputs",
                              needs=("rematerialize_params_pass",)))
    return specs


def _forward(config: CompileConfig, graph: GraphKind) -> list[PassSpec]:
    specs = [
        PassSpec(eliminate_dead_code_pass,
                 "first: dead nodes the partitioner kept would otherwise be lowered, gathered "
                 "and scheduled like live ones"),
        PassSpec(insert_all_gather_pass,
                 "lower markers early: every later pass reasons about real collectives",
                 required=_LOWERS_GATHERS),
    ]
    specs += _partition(config)
    specs += _agreements(config)
    specs.append(PassSpec(place_gathers_pass,
                          "first scheduling constraint: each gather just before its first reader; "
                          "a prefetch is positioned relative to these",
                          needs=("insert_all_gather_pass",), required=_PLACES))
    specs += _prefetch(config, graph)
    specs += _finish(config)
    return specs


def _partition(config: CompileConfig) -> list[PassSpec]:
    if not config.options.partitions:
        return []
    return [PassSpec(reshard_within_pass,
                     "after the gathers are lowered (it cuts a gathered buffer, and adds gathers of "
                     "its own in backward); before placement, which places its gathers like any",
                     needs=("insert_all_gather_pass",), required=_PARTITIONS)]


def _agreements(config: CompileConfig) -> list[PassSpec]:
    wire = config.mixed_precision.wire if config.mixed_precision is not None else None
    return [_AGREEMENTS] if wire is not None and wire.agrees else []


_AGREEMENTS = PassSpec(batch_agreements_pass,
                       "after the gathers are lowered (it joins what their lowerings agree on); "
                       "before placement, which puts the one agreement at the graph's start",
                       needs=("insert_all_gather_pass",))


def _prefetch(config: CompileConfig, graph: GraphKind) -> list[PassSpec]:
    if config.options.prefetch_mode(graph) is None:
        return []
    return [PassSpec(prefetch_gathers_pass,
                     "after just-in-time placement: a prefetch is positioned one unit ahead of "
                     "the placed gather, with edges for the in-flight limit",
                     needs=("place_gathers_pass",))]


def _finish(config: CompileConfig, in_place: Sequence[PassSpec] = ()) -> list[PassSpec]:
    """The one sort, the in-place rewrites, then what reads the final order: frees and
    in-flight group slots."""
    specs = [PassSpec(topological_sort_pass,
                      "after every scheduling constraint: places all the nodes they positioned "
                      "in one stable sort",
                      needs=("place_gathers_pass",), required=_SORTS)]
    specs += in_place
    if config.compute == "eager":
        specs.append(PassSpec(insert_free_pass,
                              "after the sort: frees follow the final position of every use",
                              needs=("insert_all_gather_pass",)))
    specs += _separate(config)
    return specs


def _separate(config: CompileConfig) -> list[PassSpec]:
    if not config.inflight_groups:
        return []
    return [PassSpec(assign_groups_pass,
                     "last: reads the final position of every collective and its wait",
                     required="two collectives in flight on one gloo group corrupt its heap")]


def _backward(config: CompileConfig) -> list[PassSpec]:
    specs = [
        PassSpec(eliminate_dead_code_pass,
                 "first: the partitioner copies dead forward nodes (dropout, and the gathers "
                 "feeding them) into backward"),
        PassSpec(insert_all_gather_pass,
                 "lower markers early: every later pass reasons about real collectives",
                 required=_LOWERS_GATHERS),
        PassSpec(insert_reduce_scatter_pass,
                 "lower gradient markers before scheduling, which moves the reductions",
                 required=_LOWERS_GRADS),
    ]
    specs += _partition(config)
    specs += _agreements(config)
    specs.append(PassSpec(place_gathers_pass,
                          "first scheduling constraint: each gather just before its first reader; "
                          "prefetches and reductions are positioned relative to these",
                          needs=("insert_all_gather_pass",), required=_PLACES))
    specs += _prefetch(config, "backward")
    specs.append(PassSpec(schedule_reduce_scatter_pass,
                          "after the gathers are positioned: positions each reduction after the "
                          "last gradient it reads, and its wait before the next reduction",
                          needs=("insert_reduce_scatter_pass",)))
    specs.append(PassSpec(sink_allocations_pass,
                          "last constraint: reads the positions every collective was given and "
                          "moves only compute that reads no gathered buffer and no collective "
                          "result"))
    specs += _finish(config, in_place=[
        PassSpec(accumulate_in_place_pass,
                 "after the sort: rewrites in place come last, so no pass before reasons "
                 "about writes; gradient sums only, so no gather, free or reduction moves"),
        PassSpec(scale_in_place_pass,
                 "after the sort, with the other rewrite in place: the division keeps its "
                 "place in its reduction's chain"),
    ])
    return specs


def all_pass_names() -> list[str]:
    """Every pass any pipeline can hold, in first-appearance order."""
    everything = CompileConfig(inflight_groups=True, options=ShardingOptions(reshard_after_forward=2),
                               mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), memory_budget=1)
    names: list[str] = []
    for graph in GRAPH_KINDS:
        for spec in _candidates(graph, everything):
            if spec.name == "place_gathers_pass" and _AGREEMENTS.name not in names:
                # Where a wire format that agrees (``Wire.agrees``) puts it; no option named
                # here makes one.
                names.append(_AGREEMENTS.name)
            if spec.name not in names:
                names.append(spec.name)
    return names


def _candidates(graph: GraphKind, config: CompileConfig) -> list[PassSpec]:
    if graph == "joint":
        return _joint(config)
    if graph == "backward":
        return _backward(config)
    return _forward(config, graph)


def build_pipeline(graph: GraphKind, config: CompileConfig) -> tuple[PassSpec, ...]:
    """The ordered passes for ``graph`` under ``config``, less ``config.disable_passes``.

    Raises FxShardError for an unknown pass name, and for disabling a pass that
    is required or that another pass in the list needs, naming what breaks.
    """
    known = all_pass_names()
    unknown = [n for n in config.disable_passes if n not in known]
    if unknown:
        raise FxShardError(f"disable_passes: no pass named {unknown}; the passes are {known}")
    specs = _candidates(graph, config)
    disabled = set(config.disable_passes)
    for spec in specs:
        if spec.name not in disabled:
            continue
        dependents = [s.name for s in specs if spec.name in s.needs and s.name not in disabled]
        problems = []
        if dependents:
            problems.append(f"{', '.join(dependents)} {'needs' if len(dependents) == 1 else 'need'} it")
        if spec.required:
            problems.append(spec.required)
        if problems:
            raise FxShardError(
                f"disable_passes: {spec.name} cannot be disabled on the {graph} graph: "
                + "; and ".join(problems) + "."
            )
    return tuple(s for s in specs if s.name not in disabled)


def build_pipelines(config: CompileConfig) -> dict[str, tuple[PassSpec, ...]]:
    """The pipeline of every graph kind: what a driver runs, checked all at once."""
    return {graph: build_pipeline(graph, config) for graph in GRAPH_KINDS}


def run_passes(
    gm: fx.GraphModule,
    ctx: PassContext,
    passes: Sequence[PassSpec | Pass],
    on_pass: Callable[[str, fx.GraphModule], None] | None = None,
) -> fx.GraphModule:
    """Run ``passes`` over ``gm`` in order, verifying after each when ``ctx.verify``."""
    for p in passes:
        fn = p.fn if isinstance(p, PassSpec) else p
        gm = fn(gm, ctx)
        if log.isEnabledFor(logging.DEBUG):  # .code generates a lazy graph module's code
            log.debug("fxshard: %s on %s graph:\n%s", fn.__name__, ctx.graph, gm.code)
        if ctx.verify:
            verify(gm, ctx)
        if on_pass is not None:
            on_pass(fn.__name__, gm)
    if ctx.graph != "joint":
        verify(gm, ctx, final=True)
    return gm


def describe(config: CompileConfig) -> str:
    """Every graph's pipeline under ``config``, one pass a line with its reason."""
    lines = []
    for graph in GRAPH_KINDS:
        lines.append(f"{graph}:")
        for i, spec in enumerate(build_pipeline(graph, config), start=1):
            lines.append(f"  {i}. {spec.name}: {spec.why}")
    return "\n".join(lines)
