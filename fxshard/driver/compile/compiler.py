"""The driver: one compiler behind ``fxshard.compile``, ``fxshard.backend`` and ``fxshard.explain``.

A front end turns its arguments into a ``CompileConfig`` and hands it to a
``Driver``, which owns the sequence every front end runs::

    Driver(config)                    world (process group), pipelines (built and checked now)
      .shard(module)                  device check, plan, this rank's flat shards
      .strip(module)                  the module keeps stand-ins; the shards hold the parameters
      .compile_step(step, inputs)     per input signature: trace (AOTAutograd), the passes of
                                      each graph, collectives, first-use order of the plan, dump;
                                      returns a CompiledStep (and appends it to .steps). Under a
                                      memory budget not yet chosen: trace, plan, compile, each a
                                      value (.trace_joint: a Traced; plan_budget.choose: a
                                      Schedule; the step traced again and compiled with it)
      .schedule, .plan                read from the steps (a budget's choice, the first-use order)
      .run(step, inputs)              the rank check before a step's first run, then the step
      .report(step)                   predicted memory and communication

The front ends differ only in what they trace: ``fxshard.compile`` the
module's forward (``trace.StepFunction``), the backend each graph Dynamo
captured, ``explain`` a meta copy of the module on a fake process group (with
``runs=False``: nothing will run, so nothing is compiled for running).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from fxshard.driver.compile import plan_auto, plan_budget
from fxshard.driver.compile.codegen import GraphCompiler
from fxshard.driver.compile.guards import Guards, guards_of
from fxshard.driver.compile.inductor import compile_graph
from fxshard.driver.compile.steps import CompiledStep, Schedule, StepCache, Traced
from fxshard.driver.compile.trace import StepFunction, TracedStep, trace_step
from fxshard.driver.report import calibrate
from fxshard.driver.report.dump import PassLog, write_dump
from fxshard.driver.report.step_report import Report, build_report, timed
from fxshard.driver.run import grads, orig_params
from fxshard.driver.run.consistency import AGREEMENT_BYTES, describe_tensors
from fxshard.driver.run.orig_params import OrigParams
from fxshard.driver.run.run_state import RunState
from fxshard.driver.run.runtime import (
    World,
    check_steps,
    comm_device,
    make_shards,
    mark_sharded,
    refuse_compiled,
    refuse_sharded_again,
    refuse_state_dicts_of_stand_ins,
    resolve_world,
    retire,
    strip_parameters,
    with_comm_groups,
)
from fxshard.driver.state.init import broadcast_shards, materialise_shards
from fxshard.ir import compat
from fxshard.ir.analysis import first_use_order
from fxshard.ir.auto import MIB
from fxshard.ir.checkpointing import Checkpointing, plan_checkpointing
from fxshard.ir.collectives import bus_bytes, step_collectives
from fxshard.ir.compat import pytree
from fxshard.ir.config import CompileConfig
from fxshard.ir.cost import Rates, optimizer_seconds, predict_step
from fxshard.ir.errors import BudgetError, FxShardError
from fxshard.ir.options import ShardingOptions
from fxshard.ir.plan import ShardPlan, make_plan
from fxshard.ir.wrapping import Auto, ByPredicate
from fxshard.passes.context import REDUCE, GradSync

log = logging.getLogger("fxshard")


class _Recorder:
    """The on_pass hook the driver installs: pass names, the user's hook, the dump's code."""

    def __init__(self, user: Callable[[str, str, fx.GraphModule], None] | None, dump: bool):
        self.names: list[tuple[str, str]] = []
        self.user = user
        self.log = PassLog() if dump else None

    def __call__(self, graph: str, pass_name: str, gm: fx.GraphModule) -> None:
        if pass_name != "traced":
            self.names.append((graph, pass_name))
        if self.log is not None:
            self.log(graph, pass_name, gm)
        if self.user is not None:
            self.user(graph, pass_name, gm)


class Driver:
    """One sharded module's compile: its configuration, world, plan, shards and steps."""

    def __init__(self, config: CompileConfig, *, runs: bool = True, world: World | None = None):
        """``world``: another driver's (auto()'s trials, which run nothing), so that no
        process group is made again."""
        given = world
        world = given or resolve_world(config.process_group)
        backend = dist.get_backend(world.group) if world.group is not None else None
        # Slots only where collectives really run concurrently: a real group (one
        # rank's too: gloo runs its collectives on worker threads all the same), not
        # a fake one. By default on gloo only (its heap corruption: docs/devices.md).
        separate = config.inflight_groups if config.inflight_groups is not None else backend == "gloo"
        config = config.with_options(inflight_groups=bool(separate) and backend not in (None, "fake"))
        self.config = config  # what the front end was told; a planner's choices are a Schedule
        # What the passes run with, as planned before any trace: this configuration's (its
        # pipelines built now, so a bad disable_passes fails before anything is sharded), the
        # regions to recompute once sharded, auto()'s choice. The memory budget's choice is
        # not written here: it is the schedule of the step it was made for (``schedule``).
        self._planned = Schedule.of(config)
        slots = config.options.max_inflight_gathers + 2 if config.inflight_groups else 1
        hpz = config.options.hpz_size(world.size) if world.size > 1 and not config.no_shard else None
        self.world: World = given or with_comm_groups(world, slots, config.timeout, config.hsdp, hpz)
        # The passes' view of the world (ir/layout.py), built once: the shard group, HSDP's
        # replicas, hpZ's partition, the in-flight slots' groups, this rank's place.
        self.layout = self.world.layout if config.inflight_groups else self.world.layout.without_slots()
        self.runs = runs
        self._plan: ShardPlan | None = None
        self.budget_regions: Checkpointing | None = None  # what memory_budget may recompute
        self.device = torch.device("cpu")  # where compute runs
        self.shard_device = torch.device("cpu")  # where the shards live: the host under offload
        self.shards: list[nn.Parameter] = []
        self.orig: OrigParams | None = None  # use_orig_params: the views the optimizer steps
        self.steps: list[CompiledStep] = []  # every step compiled, in order
        self.cache = StepCache()  # the same steps, by the front end's key
        # What changes while training (no_sync's sums, the buffer broadcast, the agreement,
        # an abandoned step): apart from what the compile decided.
        self.state = RunState(self.world, config.compute, config.broadcast_buffers)
        # The rates report() predicts time with (fxshard.ir.cost). On a live group of several
        # ranks every rank takes them now, together (a measurement the first time on this
        # host, then one all_reduce): report() may be called on one rank alone, and must not
        # communicate. Elsewhere they are this device's, taken when a report first asks.
        self.rates: Rates | None = None
        if runs and self.world.job_size > 1 and backend not in (None, "fake"):
            self.rates = calibrate.calibrate(self.world, comm_device(self.world.comm_group))
        # On the CPU a report times the graphs' matmuls and convolutions on its own rank
        # (calibrate.with_node_times); at a step's first forward every rank settles them
        # together, at the slowest rank's (NodeTimes), so that every rank's report agrees.
        self.settled: set[int] = set()  # the steps (their id()) whose nodes are settled so

    @property
    def plan(self) -> ShardPlan:
        """The plan: its units in first-use order once a step is traced (the first step's)."""
        if self.steps and self.steps[0].plan is not None:
            return self.steps[0].plan
        if self._plan is None:
            raise FxShardError("nothing sharded yet")
        return self._plan

    @property
    def schedule(self) -> Schedule:
        """What the next step compiles with: the memory budget's choice, made at the first
        training trace and recorded in that step, or else the schedule planned before any
        trace. Nothing replaces either: a later step reads the budget's from the step."""
        for step in self.steps:
            if step.schedule is not None and step.schedule.budget is not None:
                return step.schedule
        return self._planned

    # -- plan and shards ----------------------------------------------------------------------

    def shard(self, module: nn.Module, *, allow_meta: bool = False, example_inputs: Any = None) -> list[nn.Parameter]:
        """Plan ``module`` and make this rank's flat shards: copied out of it (the module is
        unchanged), initialised module by module if it is on the meta device
        (``fxshard.driver.state.init``), or broadcast from rank 0 (``sync_module_states``).
        Under ``policy=auto()`` the plan and schedule are first chosen from traces of the
        model on ``example_inputs`` (``fxshard.driver.compile.plan_auto``)."""
        refuse_compiled(module)
        refuse_sharded_again(module)
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise FxShardError(
                f"the model's parameters are on several devices {sorted(map(str, devices))}: "
                "move the whole model to this rank's device before sharding it"
            )
        on_meta = devices == {torch.device("meta")}
        if on_meta and self.world.group is not None:  # becomes real where the group communicates
            self.device = comm_device(self.world.group)
        else:
            self.device = next(iter(devices)) if devices and not on_meta else torch.device("cpu")
        policy = self.config.policy
        if isinstance(policy, Auto):
            if example_inputs is None:
                raise FxShardError(
                    "policy=auto() chooses the units and the schedule from a trace of the model: pass "
                    "example_inputs= (a batch of the shape training uses) to fxshard.compile")
            self._planned = plan_auto.choose(self, module, example_inputs, Driver)
            assert self._planned.auto is not None
            policy = self.schedule.config.policy
        sync = self.config.sync_module_states and self.world.job_size > 1 and self.runs
        options = self.schedule.config.options
        with warnings.catch_warnings():
            if self.schedule.auto is not None:  # a policy auto() chose: its units are what it saw
                warnings.simplefilter("ignore")
            self._plan = make_plan(module, policy, self.world.size,
                                   bucket_bytes=options.bucket_bytes,
                                   replicate_below=options.replicate_below,
                                   mixed_precision=self.config.mixed_precision,
                                   replicate_all=self.config.no_shard,
                                   replicate=self.config.replicate)
        if self.world.layout.replicate is not None:  # HSDP: the plan says how many ranks the job has
            self._plan = replace(self._plan, replicas=self.world.layout.replicate.size)
        if self.config.mixed_precision is not None:
            self.config.mixed_precision.refuse(self._plan.groups, self.device if self.runs else None,
                                               no_shard=self.config.no_shard)
        for name in ("reshard_units", "offload_units"):
            unknown = sorted((getattr(options, name) or frozenset()) - {u.name for u in self._plan.units})
            if unknown:
                raise FxShardError(f"{name} names no unit of the plan: {unknown}; the units are "
                                   f"{[u.name for u in self._plan.units]} ('' is the root)")
        whole = sorted({g.unit or "<root>" for g in self._plan.groups
                        if g.replicated and options.offloads(g.unit)})
        if whole:
            raise FxShardError(
                f"offload_policy with parameters kept whole on every rank (units {whole}: a NO_SHARD "
                "mesh (N, 1), replicate= or replicate_below=): their backward would keep the device "
                "copy from forward, which offload does not rematerialise yet. Shard them (a (1, N) or "
                "(R, S) mesh, no replicate=/replicate_below=), or leave those units on the device "
                "(offload_units= names the ones to offload)")
        if self.config.memory_budget is not None:  # the planner decides what to recompute
            self.budget_regions = plan_checkpointing(
                module, self.config.activation_checkpointing or _unit_modules(self._plan),
                quiet=self.config.activation_checkpointing is None)
        elif self.schedule.auto is None:  # auto()'s choice recomputes what its trial did
            self._planned = replace(self._planned, checkpointing=plan_checkpointing(
                module, self.config.activation_checkpointing))
        if self.runs:
            _check_cast_batch_norms(module, self.config, self.device)
        offload = options.offload_policy
        self.shard_device = torch.device("cpu") if offload is not None and self.device.type != "meta" \
            else self.device
        if sync:
            self.shards = broadcast_shards(module, self._plan, self.world, self.shard_device)
        elif on_meta and self.runs and not allow_meta:
            self.shards = materialise_shards(module, self._plan, self.world, self.device,
                                             self.config.param_init_fn, shard_device=self.shard_device)
        else:
            self.shards = make_shards(module, self._plan, self.world.rank,
                                      torch.device("meta") if on_meta else self.shard_device)
        self.place_shards(self.schedule.config.options)
        self.state.shards = self.shards
        if self.runs:  # a trial (auto()) or explain steps nothing: nothing global may keep it alive
            check_steps(self.shards, self._check_step)
        if self.runs and self.world.comm and self.world.size > 1:  # a real group, more than one rank
            grads.install(self.shards, [not g.replicated for g in self._plan.groups], self.world.comm[0])
        if self.config.use_orig_params:  # after grads.install: the views' gradients follow its
            self.orig = OrigParams(self._plan, self.shards, self.world.rank,
                                   [name for name, _ in module.named_parameters()])
            self.state.orig = self.orig
            check_steps(list(self.orig.views.values()), self._check_orig_step)
        return self.shards

    @property
    def parameters(self) -> list[nn.Parameter]:
        """What an optimizer steps: the flat shards, or with ``use_orig_params`` the views."""
        return list(self.orig.views.values()) if self.orig is not None else list(self.shards)

    def placement(self, options: ShardingOptions) -> list[torch.device]:
        """Where each flat group's shard lives under ``options``: an offloaded unit's on the
        host, the others on the device (by group index)."""
        if self.device.type == "meta" or self.shard_device == self.device:
            return [shard.device for shard in self.shards]
        host = options.offloaded_groups(self.plan.groups)
        return [self.shard_device if g.index in host else self.device for g in self.plan.groups]

    def place_shards(self, options: ShardingOptions) -> None:
        """Move each shard where ``placement`` keeps it under ``options``, pinned on the host
        where the device is an accelerator (the copies then overlap compute). A move keeps the
        ``nn.Parameter`` (an optimizer already built over the shards stays valid)."""
        if self.device.type == "meta" or self.shard_device == self.device:
            return
        offload = options.offload_policy
        pin = offload is not None and offload.pin_memory and self.runs
        for shard, target in zip(self.shards, self.placement(options)):
            if shard.device != target:
                shard.data = shard.data.to(target)
            if pin and target == self.shard_device and not shard.is_pinned():
                shard.data = shard.data.pin_memory()

    @property
    def offloaded_to(self) -> torch.device | None:
        """The device the shards compute on when they live elsewhere (offload): what the
        traced markers carry. None: they compute where they are."""
        return self.device if self.shard_device != self.device else None

    def strip(self, module: nn.Module, *, on_device: bool = False,
              use: str = "sharded.parameters()", by: str = "fxshard.compile",
              saves: str = "sharded.state_dict() (every rank calls it) or fxshard.checkpoint.save(path, sharded)",
              loads: str = "sharded.load_state_dict(state_dict) or fxshard.checkpoint.load(path, sharded)") -> None:
        """From here the shards hold the only copy of ``module``'s parameters; an optimizer
        over the originals raises at its first step, naming ``use``, and sharding ``module``
        again raises, naming ``by`` (the front end that sharded it); the module's own state
        dicts raise, naming ``saves`` and ``loads``. The stand-ins have the dtype their group
        computes in (``param_dtype`` under mixed precision)."""
        retire(list(module.parameters()), use)  # built before compile
        compute = {name: g.compute_dtype for g in self.plan.groups for slot in g.params for name in slot.names}
        dtypes = {id(p): compute[name] for name, p in module.named_parameters(remove_duplicate=False)}
        strip_parameters(module, self.device if on_device else None, dtypes)
        mark_sharded(module, by)
        refuse_state_dicts_of_stand_ins(module, saves, loads)
        retire(list(module.parameters()), use)  # the stand-ins: built after compile
        self.state.module = module
        self.state.planned_requires_grad = [(f"parameter {name!r}", p, p.requires_grad)
                                            for name, p in module.named_parameters()]
        self.state.planned_requires_grad += [
            (f"flat shard {g.index} (unit {g.unit or '<root>'!r})", shard, shard.requires_grad)
            for g, shard in zip(self.plan.groups, self.shards)]
        if self.orig is not None:
            self.state.planned_requires_grad += [
                (f"parameter {name!r} (sharded.named_parameters())", view, view.requires_grad)
                for name, view in self.orig.views.items()]

    # -- steps --------------------------------------------------------------------------------

    def _check_orig_step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.orig is not None
        orig_params.check(optimizer, self.orig)
        self._check_step(optimizer)

    def _check_step(self, optimizer: torch.optim.Optimizer) -> None:
        orig_params.refuse_not_elementwise(optimizer)
        why = orig_params.shape_grouping(
            optimizer, {id(s): g.params for g, s in zip(self.plan.groups, self.shards)}, views=False)
        if why is not None:
            raise FxShardError(why)
        self._refuse_zero_over_shards(optimizer)
        self.state.refuse_step_over_pending_sums(optimizer, self.plan)

    def _refuse_zero_over_shards(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ZeroRedundancyOptimizer (ZeRO-1, FairScale's OSS) steps each parameter on
        one rank and broadcasts it to the others: right for parameters whole on every rank
        (NO_SHARD, replicated groups), and a silent overwrite of every other rank's shard
        for sharded ones."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if not isinstance(optimizer, ZeroRedundancyOptimizer) or self.world.job_size == 1:
            return
        ids = {id(p) for pg in optimizer.param_groups for p in pg["params"]}
        views = self.orig.slot_of if self.orig is not None else {}
        sharded = sorted({g.unit or "<root>" for g, shard in zip(self.plan.groups, self.shards)
                          if id(shard) in ids and not g.replicated}
                         | {g.unit or "<root>" for i, (g, _) in views.items() if i in ids and not g.replicated})
        if sharded:
            raise FxShardError(
                f"ZeroRedundancyOptimizer.step() over the sharded flat groups of units {sharded}: it "
                "steps each parameter on one rank and broadcasts the result to the others, which "
                "would overwrite every other rank's different shard. Sharded groups already shard "
                "their optimizer state with the parameters: use a plain optimizer. For ZeRO-1 "
                "(parameters and gradients whole, optimizer state sharded), compile with a "
                "(world, 1) mesh (NO_SHARD) and wrap the optimizer in ZeroRedundancyOptimizer."
            )

    def trace_module(self, module: nn.Module, shards: Sequence[nn.Parameter], leaves: list[Any],
                     spec: pytree.TreeSpec) -> tuple[Guards, CompiledStep]:
        """The step of ``module`` (the skeleton, or the model before it is stripped) on the
        inputs ``leaves`` (flattened by ``spec``), traced and compiled over ``shards``, with
        the guards of the attributes the trace read."""
        step, tensors = self.step_of(module, shards, leaves, spec)
        buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        compiled = self.compile_step(step, tensors, model_name=type(module).__name__, buffer_bytes=buffer_bytes,
                                     grad_sync=self.state.grad_sync() if torch.is_grad_enabled() else REDUCE)
        return guards_of(module, step.reads), compiled

    def step_of(self, module: nn.Module, shards: Sequence[nn.Parameter], leaves: list[Any],
                spec: pytree.TreeSpec) -> tuple[StepFunction, list[torch.Tensor]]:
        """The step ``trace_module`` traces, and its tensor inputs."""
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]

        def rebuild(args: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            it = iter(args)
            rebuilt, kwargs = pytree.tree_unflatten([next(it) if t else x for t, x in zip(is_tensor, leaves)], spec)
            return rebuilt, kwargs

        buffers = dict(module.named_buffers(remove_duplicate=False))
        step = StepFunction(module, self.plan, list(shards), buffers, rebuild,
                            self.config.mixed_precision, self.offloaded_to)
        return step, tensors

    def compile_step(self, step: TracedStep, inputs: Sequence[torch.Tensor], *, model_name: str,
                     buffer_bytes: int = 0, grad_sync: GradSync = REDUCE,
                     groups: Iterable[int] | None = None) -> CompiledStep:
        """Trace ``step`` on ``inputs`` and run every graph's passes; nothing runs yet."""
        recorder = _Recorder(self.config.on_pass, dump=self.config.dump_dir is not None)
        inductor = self.config.compute == "inductor"
        accumulators = self.state.accumulators_for(self.plan, self.device) if grad_sync != REDUCE else None
        schedule = self.schedule
        if self.config.memory_budget is not None and schedule.budget is None and schedule.auto is None \
                and torch.is_grad_enabled():
            # The memory budget: trace, choose, compile. The first training step is traced to its
            # joint graph, the budget's schedule chosen from it, and the step traced again and
            # compiled with that schedule (an inference step plans nothing: under no_grad it is
            # not traced for the planner at all).
            traced = self.trace_joint(step, inputs, model_name=model_name)
            if traced is not None:
                # Inputs are real by then: the trace refuses symbolic sizes.
                schedule = self._plan_budget(traced, buffer_bytes, sum(x.numel() * x.element_size() for x in inputs),
                                             describe_tensors(inputs), grad_sync, accumulators)
        compiler = GraphCompiler(self.plan, self.world, self.layout, schedule, on_pass=recorder,
                                 finish=_inductor_finish if inductor and self.runs else None,
                                 grad_sync=grad_sync, accumulators=accumulators,
                                 abandoned=self.state.abandoned)
        partition: Callable[..., Any] = compiler.partition
        if inductor:
            partition = _with_inductor_joint_passes(compiler.partition)
        fn = trace_step(step, inputs, partition_fn=partition,
                        fw_compiler=compiler.compile_forward, bw_compiler=compiler.compile_backward,
                        inference_compiler=compiler.compile_inference, model_name=model_name,
                        decompositions=_inductor_decompositions() if inductor else None)
        assert step.output_spec is not None
        graphs = dict(compiler.graphs)
        plan = None
        if not self.steps:  # the first step orders the units by first use, for every later one
            first = graphs.get("joint", graphs.get("inference"))
            if first is not None:
                plan = self.plan.ordered_by_first_use(first_use_order(first.graph))
        compiled = CompiledStep(
            fn, graphs, step.output_spec,
            step_collectives(graphs, self.layout.dimensions()),
            compiler.num_user_outputs,
            recorder.names, sum(x.numel() * x.element_size() for x in inputs), buffer_bytes,
            recorder.log, grad_sync=grad_sync if "backward" in graphs else REDUCE,
            groups=frozenset(range(len(self.plan.groups)) if groups is None else groups),
            inputs=describe_tensors(inputs), schedule=compiler.schedule, plan=plan,
        )
        self.steps.append(compiled)  # a budget's choice is its schedule, for every later step
        auto = self.schedule.auto
        if auto is not None and auto.chosen.scaled and auto.budget is not None and compiled.trains:
            # auto() chose from a few blocks, scaled: the whole graph, traced now, has the word.
            peak = self.report(compiled).predicted_peak_bytes
            if peak > auto.budget:
                raise BudgetError(
                    f"auto() chose {auto.chosen.describe()} predicting a peak of {auto.chosen.peak / MIB:.3f} MiB "
                    f"from the model's first blocks, scaled; the whole model's graph predicts {peak / MIB:.3f} MiB, "
                    f"over the budget of {auto.budget / MIB:.3f} MiB: its peak grows faster past the blocks "
                    "sampled. Pass policy=auto(extrapolate=False) to plan from the whole graph")
        log.info("fxshard: traced %s (%s) on rank %d", model_name,
                 "train" if compiled.trains else "inference", self.world.rank)
        if self.config.dump_dir is not None:
            self.dump(compiled, self.dump_directory(len(self.steps) - 1))
        return compiled

    def trace_joint(self, step: TracedStep, inputs: Sequence[torch.Tensor], *, model_name: str) -> Traced | None:
        """``step`` traced on ``inputs`` to its joint graph, before any pass, and nothing
        compiled: what a planner chooses from (the memory budget, ``auto()``). None where the
        step trains nothing (AOTAutograd traces it for inference, with no joint graph)."""
        def capture(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any) -> Any:
            raise _Captured(Traced(self.plan, joint, joint_inputs, num_fwd_outputs, dict(kwargs)))

        def inference(gm: fx.GraphModule, example_inputs: Any) -> Any:
            raise _Captured(None)

        inductor = self.config.compute == "inductor"
        try:
            trace_step(step, inputs, partition_fn=_with_inductor_joint_passes(capture) if inductor else capture,
                       fw_compiler=_not_compiled, bw_compiler=_not_compiled, inference_compiler=inference,
                       model_name=model_name, decompositions=_inductor_decompositions() if inductor else None)
        except _Captured as e:
            return e.traced
        raise AssertionError("AOTAutograd compiled a step without partitioning it or compiling it for inference")

    def _plan_budget(self, traced: Traced, buffer_bytes: int, input_bytes: int, inputs: str,
                     grad_sync: GradSync, accumulators: dict[int, torch.Tensor] | None) -> Schedule:
        """memory_budget: the schedule chosen from the first training step's joint graph
        (fxshard.ir.budget), kept for every later step. The units it offloads move to the host
        now, before the step is traced again with it: that trace reads them where they live."""
        schedule = plan_budget.choose(
            self.config, traced.plan, self.world, self.layout, self.budget_regions, self.shards, traced.joint,
            traced.inputs, traced.num_fwd_outputs, traced.kwargs, buffer_bytes, input_bytes, grad_sync,
            accumulators, planned_on=inputs, library_bytes=calibrate.library_bytes(self.device),
            compute_device=self.offloaded_to)
        assert schedule.budget is not None
        log.info("fxshard: memory budget on rank %d:\n%s", self.world.rank, schedule.budget.table())
        self.place_shards(schedule.config.options)
        return schedule

    def run(self, step: CompiledStep, inputs: Sequence[torch.Tensor]) -> Any:
        """Run a compiled step (``RunState.run``)."""
        return self.state.run(step, inputs, self.node_times(step))

    # -- what a step will do --------------------------------------------------------------------

    def report(self, step: CompiledStep) -> Report:
        schedule = step.schedule or self.schedule
        phases = 2 if step.trains else 1  # an agreement before forward and before backward
        agreement = phases * bus_bytes("all_gather", AGREEMENT_BYTES, self.world.job_size)
        # A training step's forward starts by broadcasting (DDP's rule, steady state).
        broadcast = step.buffer_bytes if (self.config.broadcast_buffers and step.trains
                                          and self.world.job_size > 1) else 0
        report = build_report(self.plan, self.world.rank, step.graphs, step.collectives,
                            list(self.shards), step.buffer_bytes, step.input_bytes,
                            step.num_user_outputs, agreement, broadcast,
                            accumulator_bytes=sum(a.numel() * a.element_size()
                                                  for a in self.state.accumulators.values())
                            if step.grad_sync != REDUCE else 0,
                            host_groups=schedule.config.options.offloaded_groups(self.plan.groups),
                            optimizer=self.config.optimizer,
                            library_bytes=calibrate.library_bytes(self.device), compute_device=self.offloaded_to)
        report = replace(report, step=("train step (forward and backward)" if step.trains
                                       else "inference step") + f" on inputs {step.inputs or 'none'}",
                         topology=self.world.topology(),
                         compute_device=self.device.type if self.runs else "")
        rates = self.timing()
        if rates is not None:
            # On the CPU, each matmul and convolution timed here once (calibrate.with_node_times).
            rates = self.rates = calibrate.with_node_times(rates, emitted_graphs(step.graphs), self.device)
            time = predict_step(emitted_graphs(step.graphs), rates, dimensions=self.layout.dimensions(),
                                units=[u.name for u in self.plan.units],
                                agreement=(AGREEMENT_BYTES, self.world.job_size)
                                if self.world.job_size > 1 else None, memory=report.memory_curve)
            optimizer = self.config.optimizer
            report = timed(report, time, optimizer_seconds(
                optimizer, [s.numel() * s.element_size() for s in self.shards if s.requires_grad],
                rates.device) if optimizer is not None and step.trains else 0.0)
        if schedule.auto is not None:
            auto = schedule.auto
            if auto.chosen.scaled:  # what the whole graph predicts for it, beside
                auto = replace(auto, whole=(report.predicted_peak_bytes, report.predicted_step_seconds))
            report = replace(report, auto=auto)
        if schedule.budget is None:
            return report
        return replace(report, budget=schedule.budget, budget_inputs=schedule.planned_on)

    def node_times(self, step: CompiledStep) -> NodeTimes | None:
        """What this rank exchanges at ``step``'s forward agreement: its timed nodes, where
        its rates time them (the CPU's measured rates; a profile's are its figures)."""
        if self.rates is None or not self.rates.device.measured or self.device.type != "cpu":
            return None
        return NodeTimes(self, step)

    def timing(self) -> Rates | None:
        """The rates report() predicts with: the job's, calibrated when the driver was built;
        else, for a step that runs, this device's: on one rank with a process group, with its
        collectives' calls timed on it (nothing to agree on, so taken when a report first asks);
        elsewhere collectives free (no group, or torch's fake group); None for explain, unless
        a profile was set."""
        if self.rates is None and self.runs and self.device.type != "meta":
            self.rates = (calibrate.calibrate(self.world, self.device) if self.world.job_size == 1
                          else calibrate.local_rates(self.device))
        return self.rates

    def dump_directory(self, index: int) -> Path:
        """Step 0 dumps into ``dump_dir``, step k > 0 into ``dump_dir/step-k``."""
        assert self.config.dump_dir is not None
        root = Path(self.config.dump_dir)
        return root if index == 0 else root / f"step-{index}"

    def dump(self, step: CompiledStep, directory: Path) -> list[Path]:
        written = write_dump(directory, plan=self.plan, graphs=emitted_graphs(step.graphs),
                             report=self.report(step), passes=step.pass_log or PassLog(),
                             world_size=self.world.size, rank=self.world.rank)
        log.info("fxshard: wrote %d files to %s", len(written), directory)
        return written


class _Captured(FxShardError):
    """Ends ``Driver.trace_joint``'s trace once AOTAutograd hands over the joint graph (an
    ``FxShardError``, so the trace lets it through); ``traced`` is None for a step traced for
    inference."""

    def __init__(self, traced: Traced | None):
        super().__init__("the joint graph was captured")
        self.traced = traced


def _not_compiled(gm: fx.GraphModule, example_inputs: Any) -> Any:
    raise AssertionError("trace_joint compiles nothing")


def _check_cast_batch_norms(module: nn.Module, config: CompileConfig, device: torch.device | None) -> None:
    """Refuse BatchNorm layers that mixed precision casts where this device cannot run them.

    A cast BatchNorm normalises ``param_dtype`` activations with ``param_dtype``
    weights against its running statistics, which are buffers and keep their
    dtype (fp32). CPU kernels refuse that mix (``expected scalar type BFloat16
    but found Float`` at the first step); with the layer in
    ``full_precision_modules`` its weights match its statistics and the mix of
    a reduced-precision input with fp32 weights is accepted. Probed on the
    device, as ``MixedPrecision.refuse`` probes a matmul.
    """
    precision = config.mixed_precision
    if precision is None or precision.param_dtype is None or device is None or device.type == "meta":
        return
    failing: list[tuple[str, nn.Module]] = []
    errors: list[str] = []
    probed: dict[tuple[torch.dtype, torch.dtype], str | None] = {}
    for name, mod in module.named_modules():
        if not isinstance(mod, compat.BatchNorm) or mod.weight is None \
                or mod.running_mean is None:
            continue
        compute = precision.dtypes_for(mod.weight, mod)[0]
        if compute is None:
            continue
        key = (compute, mod.running_mean.dtype)
        if key not in probed:
            probed[key] = _batch_norm_fails(device, *key)
        error = probed[key]
        if error is not None:
            failing.append((name, mod))
            if error not in errors:
                errors.append(error)
    if not failing:
        return
    layers = ", ".join(f"{name or '<root>'!r} ({type(mod).__name__})" for name, mod in failing)
    classes = list(dict.fromkeys(_class_reference(type(mod)) for _, mod in failing))
    spelled = ", ".join(classes) + ("," if len(classes) == 1 else "")
    raise FxShardError(
        f"MixedPrecision(param_dtype={precision.param_dtype}) cannot run BatchNorm on {device}: "
        f"{layers} would normalise with {precision.param_dtype} weights against running statistics "
        f"in {failing[0][1].running_mean.dtype}, and batch_norm on {device} fails so "
        f"({'; '.join(errors)}). Keep them in their own dtype: "
        f"fxshard.MixedPrecision(..., full_precision_modules=({spelled}))."
    )


def _batch_norm_fails(device: torch.device, compute: torch.dtype, stats: torch.dtype) -> str | None:
    """Why a batch_norm of ``compute`` input and weights with ``stats`` running statistics
    fails on ``device``, in training and in eval mode; None if it runs."""
    try:
        x = torch.ones(2, 1, 2, device=device, dtype=compute)
        weight = torch.ones(1, device=device, dtype=compute)
        for training in (True, False):
            mean = torch.zeros(1, device=device, dtype=stats)
            var = torch.ones(1, device=device, dtype=stats)
            torch.nn.functional.batch_norm(x, mean, var, weight, torch.zeros_like(weight), training)
    except (RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return None


def _class_reference(cls: type) -> str:
    """How a user names ``cls`` in code: ``nn.BatchNorm2d`` for torch.nn's classes."""
    if getattr(nn, cls.__name__, None) is cls:
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


class NodeTimes:
    """A step's timed nodes, settled over the ranks at its first forward
    (``consistency.Share``): each rank times those it has not (``calibrate.with_node_times``,
    cached on its host), every rank sends its times, and each takes the largest of every
    node's (``calibrate.with_slowest_node_times``). Wanted until the step is settled; a rank
    that settled its own step before still sends that one's."""

    def __init__(self, driver: Driver, step: CompiledStep):
        self.driver, self.step = driver, step

    @property
    def wanted(self) -> bool:
        return id(self.step) not in self.driver.settled

    def payload(self) -> dict[str, tuple[float, float | None]]:
        d, graphs = self.driver, emitted_graphs(self.step.graphs)
        assert d.rates is not None
        # Inside the user's step: the nodes timed as the graphs run them, not as the user's
        # autocast or dispatch modes (a memory tracker, a FLOP counter) would.
        with torch.no_grad(), torch.autocast(d.device.type, enabled=False), compat.without_dispatch_modes():
            d.rates = calibrate.with_node_times(d.rates, graphs, d.device)
        return calibrate.node_times(d.rates, graphs)

    def receive(self, everyone: list[Any]) -> None:
        d = self.driver
        assert d.rates is not None
        d.rates = calibrate.with_slowest_node_times(d.rates, everyone)
        d.settled.add(id(self.step))


def emitted_graphs(graphs: dict[str, fx.GraphModule]) -> dict[str, fx.GraphModule]:
    """"forward" (the inference graph for an inference step) and, when training, "backward"."""
    forward = graphs.get("forward", graphs.get("inference"))
    assert forward is not None
    result = {"forward": forward}
    if "backward" in graphs:
        result["backward"] = graphs["backward"]
    return result


# -- compute="inductor" -------------------------------------------------------------------------


def _inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    return compat.inductor_decompositions()


def _with_inductor_joint_passes(partition: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's joint-graph passes, then fxshard's partitioning.

    Inductor prepares the joint graph for its lowering (``replace_random``
    turns ``native_dropout`` into the random ops it can compile); its
    ``partition_fn`` runs them and hands the graph to the override.
    """
    def run(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        vals = [n.meta.get("val") for n in joint.graph.nodes if n.op == "placeholder"]
        # The passes read the fake mode from Inductor's virtualized state.
        with compat.inductor_set_fake_mode(compat.detect_fake_mode(vals)):
            return compat.inductor_partition_fn(joint, joint_inputs, partitioner_fn_override=partition,
                                                **kwargs)

    return run


def _inductor_finish(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    return compile_graph(gm, example_inputs)  # through torch's FX graph cache


def _unit_modules(plan: ShardPlan) -> ByPredicate:
    """The regions memory_budget may recompute by default: the modules of the units."""
    modules = frozenset(m for u in plan.units if u.name for m in u.modules)
    return ByPredicate(lambda name, module: name in modules)
