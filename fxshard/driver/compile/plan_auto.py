"""``policy=auto()``: trace once, emit each candidate's schedule variants, keep the fastest.

The candidates and variants are ``fxshard.ir.auto``'s. The model is traced once, under the
finest units (``FINEST``: every module that owns parameters a unit of its own), and the
trace stops when AOTAutograd hands over the joint graph (:func:`_trace_finest`). Each
candidate is a trial driver of its own (``Driver(runs=False)``, sharing the real driver's
world: no process group is made, nothing runs) that plans and makes meta shards only; the
joint graph is rewritten to its flat groups (``fxshard.passes.regroup``: what the
candidate's own trace would make). Every variant is emitted from that graph
(``GraphCompiler.emit``) and predicted as ``report()`` would: the step's
time from the cost model, on the driver's rates, and its peak from the liveness analysis.
Every rank takes each prediction's largest over the ranks, so all choose alike. Where some
variant is over ``memory_budget``, the budget's ladder (``driver.plan_budget.choose``) lowers the
candidate from every unit kept gathered until it fits (the first units resharded; where even
resharding all does not fit, prefetch limits, recompute, offload), and that is one more trial.
A candidate whose largest unit alone, gathered, is over the budget is not traced at all.

A model most of whose graph is one deep stack of identical blocks (``fxshard.ir.auto``'s
``find_stack``, ``MIN_NODES``) is predicted instead on copies cut to its first 3, 4 and 5
blocks (:func:`_sampled`, :class:`Cuts`), each figure scaled by its step per block
(``fxshard.ir.auto.scaled``); only the candidates that do not scale are predicted from the
whole graph. docs/policies.md says what that changes.

The result is a ``Schedule``: the chosen policy and options in its configuration, with the
``AutoChoice`` that says why. The driver then plans and shards with it and traces the
model once more, with the chosen units.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.nn as nn

from fxshard.driver.compile import plan_budget
from fxshard.driver.compile.codegen import GraphCompiler, Splits
from fxshard.driver.compile.plan_budget import largest_over_ranks
from fxshard.driver.compile.steps import CompiledStep, Schedule, Traced
from fxshard.driver.report import calibrate
from fxshard.driver.report.step_report import Report
from fxshard.driver.run.runtime import World
from fxshard.ir.auto import (
    MIB,
    MIN_NODES,
    SAMPLES,
    TIE,
    AutoChoice,
    Candidate,
    Stack,
    Trial,
    candidates,
    cut_matches,
    fastest,
    find_stack,
    scaled,
    variants,
)
from fxshard.ir.budget import Outpaced
from fxshard.ir.checkpointing import Checkpointing
from fxshard.ir.collectives import step_collectives
from fxshard.ir.compat import pytree
from fxshard.ir.config import CompileConfig
from fxshard.ir.cost import PROFILES, Rates
from fxshard.ir.errors import BudgetError, FxShardError, TraceError
from fxshard.ir.layout import Layout
from fxshard.ir.plan import ShardPlan, make_plan
from fxshard.ir.wrapping import Auto, Policy, by_size
from fxshard.passes.context import REDUCE
from fxshard.passes.regroup import regroup

# The units auto() traces the model under: every module that owns parameters one of its own.
FINEST = by_size(1)


class Driver(Protocol):
    """What this module uses of ``fxshard.driver.compile.compiler.Driver`` (which imports this
    module, so it is not imported here)."""

    config: CompileConfig
    device: torch.device
    world: World
    rates: Rates | None
    layout: Layout
    shards: list[nn.Parameter]
    budget_regions: Checkpointing | None

    @property
    def plan(self) -> ShardPlan: ...

    @property
    def schedule(self) -> Schedule: ...

    @property
    def offloaded_to(self) -> torch.device | None: ...

    def timing(self) -> Rates | None: ...

    def shard(self, module: nn.Module, *, allow_meta: bool = False,
              example_inputs: Any = None) -> list[nn.Parameter]: ...

    def step_of(self, module: nn.Module, shards: Sequence[nn.Parameter], leaves: list[Any],
                spec: pytree.TreeSpec) -> tuple[Any, list[torch.Tensor]]: ...

    def trace_joint(self, step: Any, inputs: Sequence[torch.Tensor], *, model_name: str) -> Traced | None: ...

    def report(self, step: CompiledStep) -> Report: ...


def choose(driver: Driver, module: nn.Module, example_inputs: Any,
           make: Callable[..., Driver]) -> Schedule:
    """The schedule ``auto()`` predicts fastest for ``module`` on ``example_inputs``. ``make``
    builds a trial driver: ``make(config, runs=False, world=driver.world)``."""
    config = driver.config
    spec = config.policy
    assert isinstance(spec, Auto)
    named = [f"{name}=" for name in ("reshard_units", "offload_units") if getattr(config.options, name) is not None]
    if named:
        raise FxShardError(
            f"policy=auto() chooses its units, and which of them reshard after forward or stay on the "
            f"host, so {' and '.join(named)} cannot name units before it has chosen. Drop {' and '.join(named)} "
            "(with memory_budget= auto() reshards, recomputes and offloads where the budget needs it), "
            "or pin the plan (policy=by_class(...)) to name its units")
    rates = driver.timing()
    if rates is None:
        raise FxShardError(
            "policy=auto() chooses by predicted step time, and this explain has no rates to predict "
            f"with: pass hardware= one of {', '.join(sorted(PROFILES))}")
    device_memory = config.memory_budget is None
    if device_memory:  # by default within the device's memory (on the CPU: no limit)
        config = replace(config, memory_budget=memory_of(driver, rates))
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    leaves, tree = pytree.tree_flatten((args, {}))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    input_bytes = sum(x.numel() * x.element_size() for x in tensors)
    def unit_bytes(policy: Policy) -> list[int]:
        plan = make_plan(module, policy, driver.world.size)
        return [plan.unit_bytes(u) for u in plan.units if u.name]

    with warnings.catch_warnings():  # a candidate that matches no module is one unit: no news,
        if spec.units is None:  # but a pin that matches none warns, as the same policy alone does
            warnings.simplefilter("ignore")
        plans = candidates(module, spec.units, unit_bytes)
    sample = Sample(driver, make, config, rates, leaves, tree, input_bytes)
    kept, over = _distinct(sample, plans, module)
    stack = find_stack(module) if spec.extrapolate is not False else None
    found: list[tuple[Trial, Schedule]] = []
    failures: list[BudgetError] = []
    note = ""
    whole = kept
    if stack is not None and kept:
        try:
            found, whole = _sampled(sample, kept, module, stack, force=spec.extrapolate is True)
        except _Uncut as e:
            note = f"predicted from the whole graph: {e}"
        except _Small:
            pass  # the whole graph's path, as for any model
        else:
            note = (f"~: predicted from the first {', '.join(map(str, SAMPLES[:-1]))} and {SAMPLES[-1]} "
                    f"of the {stack.blocks} blocks of {stack.path or 'the model'} (up to "
                    f"{SAMPLES[-1] + EXTRA_SAMPLES} where {SAMPLES[0]} is not yet steady) and scaled to all "
                    f"(recomputing nothing or every region; the budget's ladder only where no such plan fits)")
    traced: list[Traced] = []  # the whole model's, traced where first needed
    outpaced: list[str] = []  # the budget ladders stopped early, one line each

    def predict_whole(plans: Sequence[Candidate]) -> None:
        if plans and not traced:
            traced.append(_trace_finest(driver, module, leaves, tree, make))
        ladders: list[_Ladder] = []
        for candidate in plans:
            mine, ladder = _whole(sample, candidate, module, traced[0])
            found.extend(mine)
            ladders.extend([ladder] if ladder is not None else [])
        # The budget ladders last, the most promising first (the fastest variant: where a
        # ladder starts, or beyond), each with the fastest plan that fits so far to beat.
        for ladder in sorted(ladders, key=lambda lad: min(t.seconds for t, _ in lad.variants)):
            beat = min((t.seconds for t, _ in found if t.fits), default=None)
            mine, failure, stopped = _climb(sample, ladder, beat)
            found.extend(mine)
            failures.extend([failure] if failure is not None else [])
            outpaced.extend([stopped] if stopped is not None else [])

    predict_whole(whole)
    scaled_plans = [c for c in kept if c not in whole]
    if scaled_plans and not any(t.fits for t, _ in found):
        # Nothing fits: the budget's ladder may find finer choices for the scaled plans too.
        found[:] = [(t, s) for t, s in found if not t.scaled]
        predict_whole(scaled_plans)
        note = "predicted from the whole graph: no plan predicted from a few blocks fits"
    traced.clear()
    best = fastest([t for t, _ in found])
    if best is None:
        if failures:
            raise closest(failures)
        if over and not found:
            assert config.memory_budget is not None
            label, nbytes = min(over, key=lambda o: o[1])
            raise BudgetError(
                f"memory_budget {config.memory_budget / MIB:.3f} MiB cannot be met: every plan auto() tries has a unit "
                f"that alone gathers more; the smallest such unit, of {label}, gathers {nbytes / MIB:.3f} MiB. "
                "Pin smaller units (auto(units=by_class(<a smaller module>))) or raise the budget")
        raise BudgetError(f"memory_budget {config.memory_budget} bytes: no plan auto() tried fits")
    chosen = next(s for t, s in found if t == best)
    trials = tuple(sorted((t for t, _ in found), key=lambda t: (not t.fits, t.seconds, t.peak)))
    choice = AutoChoice(best, trials, config.memory_budget, rates.name,
                        device_memory=device_memory and config.memory_budget is not None,
                        sampled=note, over=tuple(over), outpaced=tuple(outpaced))
    policy = next(c.policy for c in plans if c.label == best.plan)
    return replace(chosen, config=replace(chosen.config, policy=policy), auto=choice)


@dataclass
class Sample:
    """What every candidate's trials are made with."""

    driver: Driver
    make: Callable[..., Driver]
    config: CompileConfig  # the driver's, with the budget auto() keeps to
    rates: Rates
    leaves: list[Any]
    tree: pytree.TreeSpec
    input_bytes: int

    def trial(self, candidate: Candidate, module: nn.Module) -> tuple[CompileConfig, Driver]:
        """A trial driver of ``candidate`` with ``module`` planned and sharded (on meta)."""
        options = self.config.options
        if candidate.bucket_bytes:
            options = replace(options, bucket_bytes=candidate.bucket_bytes)
        trial_config = replace(self.config, policy=candidate.policy, options=options, dump_dir=None,
                               on_pass=None, verify=False)
        trial = self.make(trial_config, runs=False, world=self.driver.world)
        trial.rates = self.rates
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial.shard(module, allow_meta=True)
        return trial_config, trial


def _distinct(sample: Sample, plans: Sequence[Candidate], module: nn.Module
              ) -> tuple[list[Candidate], list[tuple[str, int]]]:
    """The candidates that make distinct units, the first of each kept; those whose largest
    unit alone, gathered in its compute dtype, is over the budget left out (no schedule of
    them fits: the unit is whole while it computes), with that unit's bytes."""
    kept: list[Candidate] = []
    over: list[tuple[str, int]] = []
    seen: set[tuple[str, ...]] = set()
    for candidate in plans:
        _, trial = sample.trial(candidate, module)
        plan = trial.plan
        units = tuple(u.name for u in plan.units)
        if units in seen:
            continue
        seen.add(units)
        largest = max(plan.unit_bytes(u, gathered=True) for u in plan.units)
        if sample.config.memory_budget is not None and largest > sample.config.memory_budget:
            over.append((candidate.label, largest))
        else:
            kept.append(candidate)
        del trial
    return kept, over


def _whole(sample: Sample, candidate: Candidate, module: nn.Module, traced: Traced
           ) -> tuple[list[tuple[Trial, Schedule]], _Ladder | None]:
    """``candidate``'s variants predicted from the whole model's graph, and where some is over
    the budget, what its budget ladder needs (``_climb``)."""
    config = sample.config
    trial_config, trial = sample.trial(candidate, module)
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    joint, joint_inputs, kwargs = regroup(traced.joint, traced.inputs, traced.kwargs, traced.plan, trial.plan)
    n = traced.num_fwd_outputs
    mine: list[tuple[Trial, Schedule]] = []
    splits = Splits()  # variants that differ in the prefetch depth alone share one partition
    for name, variant in variants(trial_config.options):
        schedule = Schedule.of(trial_config.with_options(options=variant), trial.schedule.checkpointing)
        mine.append((_trial(trial, schedule, joint, joint_inputs, n, kwargs, sample.input_bytes,
                            buffer_bytes, candidate.label, name, config.memory_budget, splits), schedule))
    if config.memory_budget is None or all(t.fits for t, _ in mine):
        return mine, None
    return mine, _Ladder(candidate, trial_config, trial, joint, joint_inputs, kwargs, n, buffer_bytes, splits,
                         tuple(mine))


@dataclass
class _Ladder:
    """A candidate some of whose variants are over the budget: what its budget ladder needs."""

    candidate: Candidate
    config: CompileConfig
    trial: Driver
    joint: fx.GraphModule
    joint_inputs: Any
    kwargs: dict[str, Any]
    n: int
    buffer_bytes: int
    splits: Splits
    variants: tuple[tuple[Trial, Schedule], ...]


def _climb(sample: Sample, ladder: _Ladder, beat: float | None
           ) -> tuple[list[tuple[Trial, Schedule]], BudgetError | None, str | None]:
    """The budget's ladder's choice for ``ladder``'s candidate: the fewest changes from
    keeping every unit gathered that fit (the first units resharded, the rest kept), between
    its variants; where none of them fits, the only way in. Or why nothing of it fits, or
    where it stopped (one line): ``beat``, the fastest step of a plan found so far that fits,
    and its tie (``TIE``) are a time to beat, and a ladder predicted slower than that cannot
    be chosen (``budget.Outpaced``)."""
    mine = list(ladder.variants)
    trial, joint, joint_inputs, kwargs, n = ladder.trial, ladder.joint, ladder.joint_inputs, ladder.kwargs, ladder.n
    beat = min([t.seconds for t, _ in mine if t.fits] + ([beat] if beat is not None else []), default=None)
    fastest_variant = min(t.seconds for t, _ in mine)
    if beat is not None and fastest_variant > beat * (1 + TIE):
        # The ladder starts from a variant (every unit kept gathered): it would stop there.
        return [], None, f"{ladder.candidate.label}: before it starts, its fastest variant " \
                         f"{fastest_variant * 1e3:.3f} ms > {beat * (1 + TIE) * 1e3:.3f} ms"

    def timing(schedule: Schedule, graphs: dict[str, fx.GraphModule]) -> float:
        return _predicted(trial, schedule, graphs, n, sample.input_bytes, ladder.buffer_bytes)[0]

    try:
        laddered = plan_budget.choose(ladder.config, trial.plan, trial.world, trial.layout, trial.budget_regions,
                                      trial.shards, joint, joint_inputs, n, kwargs, ladder.buffer_bytes,
                                      sample.input_bytes, library_bytes=calibrate.library_bytes(trial.device),
                                      compute_device=trial.offloaded_to,
                                      timing=timing if beat is not None else None,
                                      outpaced_at=None if beat is None else beat * (1 + TIE), splits=ladder.splits)
    except BudgetError as e:
        return [], None if any(t.fits for t, _ in mine) else e, None
    except Outpaced as e:
        return [], None, f"{ladder.candidate.label}: at {e.at.describe()}, {e.seconds * 1e3:.3f} ms " \
                         f"> {e.outpaced_at * 1e3:.3f} ms"
    assert laddered.budget is not None
    return [(_trial(trial, laddered, joint, joint_inputs, n, kwargs, sample.input_bytes, ladder.buffer_bytes,
                    ladder.candidate.label, "memory budget: " + laddered.budget.chosen.describe(),
                    sample.config.memory_budget, ladder.splits), laddered)], None, None


class _Uncut(FxShardError):
    """The model's stack could not be cut to a few blocks and traced."""


class _Small(FxShardError):
    """The whole model's graph is small enough to predict every plan from."""


def _sampled(sample: Sample, plans: Sequence[Candidate], module: nn.Module, stack: Stack, force: bool
             ) -> tuple[list[tuple[Trial, Schedule]], list[Candidate]]:
    """The candidates' trials predicted on the model cut to its stack's first ``SAMPLES``
    blocks and scaled to all of them (``fxshard.ir.auto.scaled``), for those whose plan of
    the cut model is the whole plan's cut (``cut_matches``) and whose figures are affine in the
    blocks; and the candidates that are not, to predict from the whole graph. Variants as
    ``variants``, and where some is over the budget, the resharded ones also recomputing
    every region the budget may recompute (``activation_checkpointing``'s, else every
    unit's). Raises ``_Uncut`` where a cut model does not trace, and unless ``force``,
    ``_Small`` where the whole model's graph would have no more than ``MIN_NODES`` nodes."""
    config = sample.config
    cuts = Cuts(sample, module, stack)
    first, second = (len(cuts.traced(k).joint.graph.nodes) for k in SAMPLES[:2])  # raises _Uncut
    nodes = first + (stack.blocks - SAMPLES[0]) * (second - first)
    if not force and nodes <= MIN_NODES:
        raise _Small(f"the whole graph has about {nodes} nodes")
    found: list[tuple[Trial, Schedule]] = []
    whole: list[Candidate] = []
    for candidate in plans:
        trial_config, trial = sample.trial(candidate, module)
        units = [u.name for u in trial.plan.units]
        schedules = {name: (trial_config.with_options(options=variant), PLAIN)
                     for name, variant in variants(trial_config.options)}
        scaled_trials = _scale(cuts, candidate, schedules, units)
        if scaled_trials is not None and config.memory_budget is not None and trial.budget_regions is not None \
                and not all(t.fits for t in scaled_trials.values()):
            # Keeping units gathered to backward while recomputing is the ladder's to weigh.
            recomputing = {f"{name}, {trial.budget_regions.policy or 'every unit'} recomputed": (c, RECOMPUTE)
                           for name, (c, _) in schedules.items() if c.options.reshard_after_forward is True}
            more = _scale(cuts, candidate, recomputing, units)
            schedules.update(recomputing)
            scaled_trials = None if more is None else {**scaled_trials, **more}
        if scaled_trials is None:
            whole.append(candidate)
            continue
        found += [(t, Schedule.of(schedules[name][0], _regions(trial, schedules[name][1])))
                  for name, t in scaled_trials.items()]
        del trial
    return found, whole


# How many times the sampled depths may move on by a block where the first is not yet steady.
EXTRA_SAMPLES = 2

# What a sampled schedule recomputes: what the candidate's trial would (the user's
# activation_checkpointing, without a budget), or every region the budget may recompute.
PLAIN, RECOMPUTE = "plain", "recompute"


def _regions(trial: Driver, which: str) -> Checkpointing | None:
    return trial.schedule.checkpointing if which == PLAIN else trial.budget_regions


class Cuts:
    """The model cut to a few blocks of its stack, each traced where first needed."""

    def __init__(self, sample: Sample, module: nn.Module, stack: Stack):
        self.sample = sample
        self.module = module
        self.stack = stack
        self.models: dict[int, nn.Module] = {}
        self.traces: dict[int, Traced] = {}

    def model(self, blocks: int) -> nn.Module:
        if blocks not in self.models:
            self.models[blocks] = _cut(self.module, self.stack, blocks)  # raises _Uncut
        return self.models[blocks]

    def traced(self, blocks: int) -> Traced:
        if blocks not in self.traces:
            s = self.sample
            try:
                self.traces[blocks] = _trace_finest(s.driver, self.model(blocks), s.leaves, s.tree, s.make)
            except _Uncut:
                raise
            except Exception as e:  # the forward assumes all its blocks (a loop over a count, ...)
                cause = e.__cause__ if isinstance(e, TraceError) and e.__cause__ is not None else e
                raise _Uncut(
                    f"the model cut to its first {blocks} blocks of {self.stack.path or 'the root'} does not "
                    f"trace ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})") from e
        return self.traces[blocks]


def _scale(cuts: Cuts, candidate: Candidate, schedules: dict[str, tuple[CompileConfig, str]],
           units: list[str]) -> dict[str, Trial] | None:
    """Each of ``schedules`` (a configuration, and ``PLAIN`` or ``RECOMPUTE``) predicted on
    the model cut to ``SAMPLES`` blocks and scaled to the whole stack, or None where a cut
    model's plan is not the whole plan's cut or a figure is not affine. Where the first
    depth is not yet steady (a figure grows by other steps), the depths move on by one
    block, up to ``EXTRA_SAMPLES`` times."""
    sample, stack = cuts.sample, cuts.stack
    per_depth: dict[int, dict[str, Trial]] = {}

    def predict(k: int) -> bool:
        model = cuts.model(k)
        _, trial = sample.trial(candidate, model)
        if not cut_matches(units, [u.name for u in trial.plan.units], stack, k):
            return False
        buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        t = cuts.traced(k)
        joint, joint_inputs, kwargs = regroup(t.joint, t.inputs, t.kwargs, t.plan, trial.plan)
        splits = Splits()
        per_depth[k] = {name: _trial(trial, Schedule.of(config, _regions(trial, which)), joint, joint_inputs,
                                     t.num_fwd_outputs, kwargs, sample.input_bytes, buffer_bytes, candidate.label,
                                     name, sample.config.memory_budget, splits)
                        for name, (config, which) in schedules.items()}
        return True

    depths = list(SAMPLES)
    for _ in range(EXTRA_SAMPLES + 1):
        if not all(predict(k) for k in depths if k not in per_depth):
            return None
        found = {name: scaled([per_depth[k][name] for k in depths], depths, stack.blocks,
                              sample.config.memory_budget) for name in schedules}
        if all(t is not None for t in found.values()):
            return {name: t for name, t in found.items() if t is not None}
        depths = [k + 1 for k in depths]
        if depths[-1] >= stack.blocks:
            return None
    return None


def _cut(module: nn.Module, stack: Stack, blocks: int) -> nn.Module:
    """``module`` with its stack holding only its first ``blocks``: the modules on the path
    to the stack copied (shallow: their children, parameter and buffer dicts new; their
    hooks shared), everything else shared, the model itself unchanged."""
    def copy_of(m: nn.Module) -> nn.Module:
        if "forward" in vars(m):  # a wrapper bound to the module itself: it would run the original
            raise _Uncut(f"{type(m).__name__}'s forward is an attribute of the instance, which a copy "
                         "cut to a few blocks would not run")
        c = copy.copy(m)
        # Dicts of its own: the trace swaps the copy's parameters, not the original's.
        c._modules = dict(m._modules)
        c._parameters = dict(m._parameters)
        c._buffers = dict(m._buffers)
        return c

    path = stack.path.split(".") if stack.path else []
    root = copy_of(module)
    parent = root
    for name in path:
        child = copy_of(parent._modules[name])  # type: ignore[arg-type]
        parent._modules[name] = child
        parent = child
    parent._modules = {k: v for i, (k, v) in enumerate(parent._modules.items()) if i < blocks}
    return root


def memory_of(driver: Driver, rates: Rates) -> int | None:
    """auto()'s budget where ``memory_budget`` is not given: the device's memory. A named
    profile's (``DeviceRates.memory_bytes``: explain); else a CUDA device's, the smallest
    over the ranks; on the CPU, none."""
    if not rates.device.measured and rates.device.memory_bytes is not None:
        return rates.device.memory_bytes
    if driver.device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(driver.device).total_memory
        return -largest_over_ranks(driver.world, [-total])[0]
    return None


def _trace_finest(driver: Driver, module: nn.Module, leaves: list[Any], tree: pytree.TreeSpec,
                  make: Callable[..., Driver]) -> Traced:
    """The joint graph of ``module``'s step under the finest plan: every module that owns
    parameters a unit of its own (``by_size(1)``), so that any candidate's units are unions
    of its units."""
    config = replace(driver.config, policy=FINEST, options=replace(driver.config.options, bucket_bytes=0),
                     dump_dir=None, on_pass=None, verify=False, memory_budget=None)
    trial = make(config, runs=False, world=driver.world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial.shard(module, allow_meta=True)
    with torch.enable_grad():
        step, tensors = trial.step_of(module, trial.shards, leaves, tree)
        traced = trial.trace_joint(step, tensors, model_name=type(module).__name__)
    if traced is not None:
        return traced
    raise FxShardError(
        "policy=auto() needs a training step to plan (a forward whose outputs need gradients): "
        "this step traced no backward. Give a policy for inference, e.g. by_class(<your block>)")


def closest(failures: Sequence[BudgetError]) -> BudgetError:
    """Of the candidates' budget errors, the one whose lowest peak came closest to the budget
    (the first of equals; one without a peak last): what auto() raises when nothing fits."""
    return min(failures, key=lambda e: math.inf if e.peak is None else e.peak)


def _trial(trial: Driver, schedule: Schedule, joint: fx.GraphModule, joint_inputs: Any, n: int,
           kwargs: dict[str, Any], input_bytes: int, buffer_bytes: int, plan: str, name: str,
           memory_budget: int | None, splits: Splits | None = None) -> Trial:
    """``schedule``'s graphs emitted from ``joint`` and predicted as ``report()`` predicts a
    step: the largest over the ranks. ``splits``: this plan's partitions of ``joint`` so far
    (``codegen.Splits``)."""
    compiler = GraphCompiler(trial.plan, trial.world, trial.layout, schedule, grad_sync=REDUCE)
    graphs = (splits or Splits()).emit(compiler, joint, joint_inputs, n, kwargs)
    seconds, exposed_seconds, peak_bytes, collectives = _predicted(trial, schedule, graphs, n, input_bytes,
                                                                   buffer_bytes)
    ns, exposed, peak = largest_over_ranks(trial.world, [round(seconds * 1e9), round(exposed_seconds * 1e9),
                                                         peak_bytes])
    return Trial(plan, name, ns / 1e9, exposed / 1e9, peak, len(trial.plan.units),
                 memory_budget is None or peak <= memory_budget, collectives)


def _predicted(trial: Driver, schedule: Schedule, graphs: dict[str, fx.GraphModule], n: int, input_bytes: int,
               buffer_bytes: int) -> tuple[float, float, int, int]:
    """``schedule``'s emitted ``graphs`` predicted as ``report()`` predicts a step, this rank's:
    its step and exposed seconds, its peak bytes and how many collectives it issues."""
    step = CompiledStep(_nothing, graphs, None, step_collectives(graphs, trial.layout.dimensions()),  # type: ignore[arg-type]
                        n, [], input_bytes, buffer_bytes, schedule=schedule)
    report: Report = trial.report(step)
    assert report.predicted_step_seconds is not None and report.exposed_comm_seconds is not None
    return (report.predicted_step_seconds, report.exposed_comm_seconds, report.predicted_peak_bytes,
            len(step.collectives))


def _nothing(*args: Any) -> Any:
    raise AssertionError("a trial's step runs nothing")
