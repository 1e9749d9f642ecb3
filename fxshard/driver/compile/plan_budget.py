"""The memory budget planner's trials: a candidate's predicted peak, nothing run.

``fxshard.ir.budget.search`` walks the ladder of candidates; this module
answers its one question, "what would this candidate's peak be?", the way
``report()`` answers it for the schedule that runs: the candidate's passes on
a copy of the traced joint graph (``GraphCompiler.emit``), then the liveness
analysis of the emitted forward and backward graphs. The trace itself
(AOTAutograd's, ``Driver.trace_joint``) happens once, for every candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from fxshard.driver.compile.codegen import GraphCompiler, Splits
from fxshard.driver.compile.steps import Schedule
from fxshard.driver.report.step_report import Report, build_report
from fxshard.driver.run.runtime import World, comm_device
from fxshard.ir import compat, meta
from fxshard.ir.budget import MIB, Candidate, Prediction, search
from fxshard.ir.checkpointing import Checkpointing
from fxshard.ir.config import CompileConfig
from fxshard.ir.layout import Layout
from fxshard.ir.meta import Direction, Role
from fxshard.ir.plan import ShardPlan
from fxshard.passes.context import REDUCE, GradSync

PARAMS = "parameter shards, buffers and inputs"
GATHERED = "gathered parameters"
GRADS = "gradients"
ACTIVATIONS = "activations and temporaries"
STATE = "optimizer state"


def choose(config: CompileConfig, plan: ShardPlan, world: World, layout: Layout, regions: Checkpointing | None,
           shards: Sequence[torch.Tensor], joint: fx.GraphModule, joint_inputs: Any,
           num_fwd_outputs: int, partition_kwargs: dict[str, Any], buffer_bytes: int,
           input_bytes: int, grad_sync: GradSync = REDUCE,
           accumulators: Mapping[int, torch.Tensor] | None = None,
           planned_on: str = "", library_bytes: int = 0, compute_device: torch.device | None = None,
           timing: Callable[[Schedule, dict[str, fx.GraphModule]], float] | None = None,
           outpaced_at: float | None = None, splits: Splits | None = None) -> Schedule:
    """The cheapest schedule within ``config.memory_budget``: its configuration, pipelines
    and checkpointing, with the budget's choice (planned on inputs ``planned_on``).
    ``regions``: the regions recomputing may use;
    ``grad_sync`` and ``accumulators``: the traced step's (a step inside no_sync keeps
    full-size gradient sums); ``library_bytes``: the compute device's
    (``calibrate.library_bytes``); ``compute_device``: where the shards compute when the driver
    holds them elsewhere (``Driver.offloaded_to``: under offload, all on the host until
    placed); None: on their own device. Every rank takes each candidate's largest peak over the
    ranks, so all choose the same schedule (their inputs may differ in size).
    ``timing`` and ``outpaced_at`` (auto()): a schedule's predicted step seconds from its
    emitted graphs, and a time to beat, past which the ladder stops (``budget.Outpaced``,
    raised); ``splits``: partitions of ``joint`` already made under this plan, shared."""
    accumulator_bytes = (sum(a.numel() * a.element_size() for a in (accumulators or {}).values())
                         if grad_sync != REDUCE else 0)
    assert config.memory_budget is not None
    unit_bytes = {u.name: plan.unit_bytes(u, gathered=True) for u in plan.units}  # what a gather holds

    def configured(c: Candidate) -> tuple[CompileConfig, Checkpointing | None]:
        return config.with_options(options=c.options(config.options)), c.checkpointing(regions)

    splits = splits or Splits()  # schedules that differ in the prefetch limit alone share one partition

    def evaluate(c: Candidate) -> Prediction:
        trial_config, checkpointing = configured(c)
        # Checked once on the emitted graphs (always); after every pass only for the
        # schedule that runs (FXSHARD_VERIFY), not for each trial.
        trial_config = trial_config.with_options(verify=False)
        schedule = Schedule.of(trial_config, checkpointing)
        trial = GraphCompiler(plan, world, layout, schedule, grad_sync=grad_sync, accumulators=accumulators)
        graphs = splits.emit(trial, joint, joint_inputs, num_fwd_outputs, partition_kwargs)
        report = build_report(plan, world.rank, graphs, [], list(shards), buffer_bytes, input_bytes,
                              num_fwd_outputs, accumulator_bytes=accumulator_bytes,
                              host_groups=trial_config.options.offloaded_groups(plan.groups),
                              optimizer=config.optimizer,
                              library_bytes=library_bytes, compute_device=compute_device)
        prediction = _prediction(report, graphs, plan, unit_bytes, config)
        ns = -1 if timing is None else round(timing(schedule, graphs) * 1e9)
        peak, step, ns = largest_over_ranks(world, [prediction.peak, prediction.step_peak, ns])
        return replace(prediction, peak=peak, step_peak=step, seconds=None if ns < 0 else ns / 1e9)

    choice = search(config.memory_budget, evaluate, [u.name for u in plan.units],
                    list(regions.regions) if regions is not None else [],
                    config.options.max_inflight_gathers, unit_bytes, _offloadable(config, plan, shards),
                    alike=_computations(joint, regions), outpaced_at=outpaced_at)
    chosen_config, checkpointing = configured(choice.chosen)
    return Schedule.of(chosen_config, checkpointing, choice, planned_on)


def _computations(joint: fx.GraphModule, regions: Checkpointing | None) -> dict[str, Hashable]:
    """Each region's forward computation as the search compares regions (``alike``): its
    operators in order, with their outputs' shapes and dtypes."""
    if regions is None:
        return {}
    ops: dict[str, list[Hashable]] = {}
    for node in joint.graph.nodes:
        region = regions.region_of(meta.module_path(node)) if node.op == "call_function" else None
        if region is not None and not meta.is_backward(node):
            ops.setdefault(region, []).append((str(node.target), _shapes(node.meta.get("val"))))
    return {r: tuple(v) for r, v in ops.items()}


def _shapes(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, (tuple, list)):
        return tuple(_shapes(v) for v in value)
    return type(value).__name__


def _offloadable(config: CompileConfig, plan: ShardPlan, shards: Sequence[torch.Tensor]) -> list[str]:
    """The units offload may move to the host, the largest shards first (the fewest units,
    so the fewest copies, for the bytes): all with offload_policy= and no offload_units=
    of the user's; none otherwise."""
    if config.options.offload_policy is None or config.options.offload_units is not None:
        return []
    nbytes = {u.name: sum(shards[g].numel() * shards[g].element_size() for g in u.groups) for u in plan.units}
    return sorted(nbytes, key=lambda u: -nbytes[u])  # stable: ties in plan order


def _prediction(report: Report, graphs: dict[str, fx.GraphModule], plan: ShardPlan,
                unit_bytes: dict[str, int], config: CompileConfig) -> Prediction:
    """The peak, and what is alive there by kind (for the error of a budget that cannot be met)."""
    kind, _, _ = report.peak_phase.partition(":")
    nodes = {n.name: n for n in graphs[kind].graph.nodes} if kind in graphs else {}
    step = report.memory_curve.get("optimizer step", (0,))[0]
    resident = report.shard_bytes - report.offloaded_shard_bytes + report.buffer_bytes + report.input_bytes
    parts = {PARAMS: resident, GATHERED: 0, GRADS: 0}
    if report.optimizer_state_bytes:  # on the device through the whole step
        parts[STATE] = report.optimizer_state_bytes
    if kind == "optimizer step" and config.optimizer is not None and config.optimizer.states:
        parts[GRADS] = report.optimizer_state_bytes // config.optimizer.states  # the device's shards'
    for name, nbytes in report.at_peak.items():
        info = meta.get_info(nodes[name]) if name in nodes else None
        role = info.role if info is not None else None
        chain = info.chain if info is not None else None
        if role is Role.REMAT or (chain is not None and chain.direction is Direction.GATHER):
            parts[GATHERED] += nbytes
        elif chain is not None and chain.direction is Direction.REDUCE:
            parts[GRADS] += nbytes
    parts[ACTIVATIONS] = max(0, report.predicted_peak_bytes - sum(parts.values()))
    largest = max(plan.units, key=lambda u: unit_bytes[u.name])
    offload = ("only offload lowers it: pass offload_policy=fxshard.CPUOffloadPolicy() with the budget, "
               "and the planner moves as few units' shards, gradients and optimizer state to the host "
               "as fit" if config.options.offload_policy is None else
               "every unit offload may move is on the host already")
    hints = {
        PARAMS: "no schedule lowers it: shard over more ranks, keep the parameters in a smaller dtype, "
                "or " + offload.replace("only offload lowers it: ", ""),
        STATE: f"the optimizer's state ({config.optimizer}): {offload}, or shard over more ranks",
        GATHERED: f"the largest unit, {largest.label}, gathers {unit_bytes[largest.name] / MIB:.3f} MiB "
                  "at once: a finer wrapping policy (smaller units) gathers less at a time",
        GRADS: "gradients of every parameter until the optimizer step: shard over more ranks, or "
               + offload.replace("only offload lowers it: ", ""),
        ACTIVATIONS: "use a smaller batch or sequence, or recompute finer regions "
                     "(activation_checkpointing= a policy of smaller modules)",
    }
    return Prediction(report.predicted_peak_bytes, report.peak_phase, parts, hints, step)


def largest_over_ranks(world: World, nbytes: list[int]) -> list[int]:
    """Each of ``nbytes``' largest over the ranks (a MAX all_reduce on fxshard's group)."""
    if world.group is None or world.job_size == 1 or dist.get_backend(world.group) == "fake":
        return nbytes
    group = world.job_group
    # Real tensors, also for a caller inside a fake mode (the planners read a Traced, outside
    # any), where a collective over fake tensors would communicate nothing.
    with compat.fake_tensor.unset_fake_temporarily():
        value = torch.tensor(nbytes, dtype=torch.int64, device=comm_device(group))
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in value.tolist()]
