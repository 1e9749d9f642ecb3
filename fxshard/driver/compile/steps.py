"""Compiled steps, and the one cache of them every front end keeps its steps in."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from fxshard.driver.compile.guards import MAX_VARIANTS, Guards
from fxshard.driver.compile.trace import OutputSpec
from fxshard.driver.report.dump import PassLog
from fxshard.ir.auto import AutoChoice
from fxshard.ir.budget import BudgetChoice
from fxshard.ir.checkpointing import Checkpointing
from fxshard.ir.collectives import Collective, fingerprint
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError
from fxshard.ir.plan import ShardPlan
from fxshard.passes import PassSpec, build_pipelines
from fxshard.passes.context import REDUCE, GradSync

log = logging.getLogger("fxshard")


@dataclass(frozen=True)
class Schedule:
    """What a step's passes run with: the configuration, each graph's pipeline built from it,
    and the regions backward recomputes. Fixed before any trace from what the user asked, or
    returned by a planner from one (``memory_budget``: ``driver.plan_budget.choose``, with its
    ``budget`` choice and the inputs it planned on). Never changed: a plan is a new value."""

    config: CompileConfig
    pipelines: Mapping[str, tuple[PassSpec, ...]]
    checkpointing: Checkpointing | None = None
    budget: BudgetChoice | None = None
    planned_on: str = ""  # the inputs of the step a planner chose it on
    # policy=auto(): its choice (``config.policy`` is then the policy it chose)
    auto: AutoChoice | None = None

    @classmethod
    def of(cls, config: CompileConfig, checkpointing: Checkpointing | None = None,
           budget: BudgetChoice | None = None, planned_on: str = "") -> Schedule:
        """The schedule of ``config``: its pipelines built now (a bad ``disable_passes``
        fails here)."""
        return cls(config, build_pipelines(config), checkpointing, budget, planned_on)


@dataclass(frozen=True)
class Traced:
    """A training step traced to its joint graph, before any pass: what a planner chooses a
    ``Schedule`` from (``Driver.trace_joint``). The pipeline's three values, in order:
    ``Traced`` (trace), ``Schedule`` (plan), ``CompiledStep`` (compile)."""

    plan: ShardPlan  # the units the joint graph's markers name
    joint: fx.GraphModule
    inputs: Any  # AOTAutograd's joint inputs: (primals, tangents)
    num_fwd_outputs: int
    kwargs: dict[str, Any]  # the partitioner's keyword arguments


@dataclass
class CompiledStep:
    """One traced input signature: AOTAutograd's callable and what it was made from."""

    fn: Callable[..., Any]  # over the user's tensor inputs; returns the flat outputs
    graphs: dict[str, fx.GraphModule]  # "joint" (training), "forward", "backward" / "inference"
    output_spec: OutputSpec
    collectives: list[Collective]
    num_user_outputs: int | None
    passes: list[tuple[str, str]]  # (graph, pass name), in the order they ran
    input_bytes: int
    buffer_bytes: int
    pass_log: PassLog | None = None  # the code after every pass, when dumping
    # phase ("forward", "backward") -> (graph, its collectives, their fingerprint),
    # what the ranks agree on before running the phase; computed once.
    phases: dict[str, tuple[str, list[Collective], bytes]] = field(default_factory=dict)
    grad_sync: GradSync = REDUCE  # what its backward does with gradients (no_sync)
    groups: frozenset[int] = frozenset()  # the flat groups it reads
    inputs: str = ""  # its tensor inputs, "float32[4, 12], int64[4]"
    schedule: Schedule | None = None  # what its passes ran with
    # The first step's: the plan with its units in the order this trace first uses them.
    plan: ShardPlan | None = None

    def __post_init__(self) -> None:
        for phase in ("forward", "backward") if self.trains else ("forward",):
            graph = "backward" if phase == "backward" else ("forward" if self.trains else "inference")
            issued = [c for c in self.collectives if c.graph == graph]
            self.phases[phase] = (graph, issued, fingerprint(issued, phase))

    @property
    def trains(self) -> bool:
        return "backward" in self.graphs


class StepCache:
    """The compiled steps of one driver, by key, for every front end.

    ``fxshard.compile`` keys a step by its inputs' signature (shapes, dtypes, train/eval,
    grad mode, no_sync) and guards it by the Python attributes the trace read
    (``driver.guards``): a key holds up to ``MAX_VARIANTS`` steps, one per value seen. The
    backend keys one Dynamo graph by the graph and its no_sync kind (Dynamo guards the rest).
    """

    def __init__(self) -> None:
        self._variants: dict[Any, list[tuple[Guards | None, CompiledStep]]] = {}
        self._keys = itertools.count()

    def __len__(self) -> int:
        """Keys with a step: the input signatures (``fxshard.compile``), the graphs and no_sync
        kinds (the backend)."""
        return len(self._variants)

    def new_key(self, kind: str) -> tuple[str, int]:
        """A key no one else holds (the backend's graphs)."""
        return kind, next(self._keys)

    def step_for(self, key: Any, make: Callable[[], tuple[Guards | None, CompiledStep]]) -> CompiledStep:
        """The step under ``key`` whose guards hold, made by ``make`` now if there is none."""
        variants = self._variants.setdefault(key, [])
        for guards, step in variants:
            if guards is None or guards.hold():
                return step
        if len(variants) >= MAX_VARIANTS:
            changed = sorted({str(g) for guards, _ in variants if guards is not None
                              for g in guards.failed()})
            raise FxShardError(
                f"the forward was traced {len(variants)} times for these inputs because Python "
                f"attributes it reads keep changing: {', '.join(changed)}. A trace bakes such "
                "values in (as torch.compile does), so each new value costs a trace. Pass a value "
                "that changes every step as a tensor input or a buffer instead."
            )
        if variants and variants[-1][0] is not None:
            log.info("fxshard: retracing: %s changed", ", ".join(str(g) for g in variants[-1][0].failed()))
        guards, step = make()
        variants.append((guards, step))
        return step
