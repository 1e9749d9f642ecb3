"""fxshard as a ``torch.compile`` backend.

The contract is two lines of a plain training script::

    model = torch.compile(model, backend=fxshard.backend(policy=by_class(Block)))
    opt = torch.optim.AdamW(fxshard.parameters(model), lr=3e-4)

``fxshard.parameters(model)`` shards the model eagerly, with the backend's
policy and options: the module keeps meta-device stand-ins, each rank keeps
its flat shards, and those shards are what it returns, so the optimizer state
is sharded too. Dynamo then traces the module with the stand-ins as graph
inputs. For each captured graph the backend maps every stand-in to its slot in
a flat group, and traces the graph again with AOTAutograd with the stand-ins
replaced by views of unsharded shards (the same ``fxshard.unshard`` markers
as ``fxshard.compile``), then runs the same passes. Graph breaks give several
graphs; each gathers the units it reads, and gradients of a unit used by two
graphs add up in its shard's ``.grad``.

Misuse fails loudly:
- calling the compiled model before ``fxshard.parameters(model)``: an error at
  the first call, naming the graph's first parameter input;
- an optimizer built over ``model.parameters()`` (the original parameters,
  which no longer hold the model): an error at its first ``step()``;
- ``model.state_dict()`` and ``load_state_dict()`` (the stand-ins): an error
  naming ``fxshard.get_model_state_dict`` and ``set_model_state_dict``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxshard.api import ShardedModule
from fxshard.driver.compile.compiler import CompiledStep, Driver
from fxshard.driver.compile.trace import (
    TracedStep,
    cast_unit_inputs,
    flatten_outputs,
    parameter_views,
)
from fxshard.driver.report.step_report import Report
from fxshard.driver.run.runtime import agree_on_mesh, refuse_eager_calls
from fxshard.ir import compat
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError
from fxshard.ir.plan import ShardPlan
from fxshard.ir.wrapping import Policy
from fxshard.passes import build_pipelines
from fxshard.passes.context import REDUCE

log = logging.getLogger("fxshard")

class _Sharding:
    """What ``fxshard.parameters`` did to one module: its driver, and where each stand-in sits."""

    def __init__(self, driver: Driver, slots: dict[int, tuple[int, str]]):
        self.driver = driver
        # id(stand-in parameter) -> (flat group, parameter name)
        self.slots = slots


class _CompiledGraph:
    """The callable handed back to Dynamo for one captured graph.

    Dynamo's guards do not see ``no_sync``, so the graph is compiled once per
    kind of training step it runs as (reduce, accumulate, reduce the sums), on
    the first call of that kind, with that call's inputs.
    """

    def __init__(self, driver: Driver, step: _GraphStep, param_positions: set[int], model_name: str):
        self.driver = driver
        self.step = step
        self.param_positions = param_positions
        self.model_name = model_name
        self.key = driver.cache.new_key("dynamo graph")  # in the driver's step cache, with no_sync's kind

    def compiled(self, inputs: Sequence[torch.Tensor]) -> CompiledStep:
        sync = self.driver.state.grad_sync(self.step.groups) if torch.is_grad_enabled() else REDUCE
        return self.driver.cache.step_for((*self.key, sync), lambda: (None, self.driver.compile_step(
            self.step, inputs, model_name=self.model_name, grad_sync=sync, groups=self.step.groups)))

    def __call__(self, *args: Any) -> Any:
        inputs = [a for i, a in enumerate(args) if i not in self.param_positions]
        return self.driver.run(self.compiled(inputs), inputs)


class _GraphStep(TracedStep):
    """One Dynamo graph with its parameter inputs replaced by views of unsharded shards."""

    gm: fx.GraphModule

    def __init__(self, gm: fx.GraphModule, plan: ShardPlan, shards: dict[int, nn.Parameter],
                 param_inputs: dict[int, str], n_inputs: int, device: torch.device | None = None):
        super().__init__()
        object.__setattr__(self, "gm", gm)  # not a submodule: nothing of it is lifted
        self.device = device  # where compute runs, when the shards live elsewhere (offload)
        self.plan = plan
        self.groups = sorted(shards)
        for g in self.groups:
            self.register_parameter(f"shard{g}", shards[g])
        self.param_inputs = param_inputs
        self.n_inputs = n_inputs
        self.output_spec = None
        self.failed_in = None  # read by trace_step's error report
        object.__setattr__(self, "skeleton", gm)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        views = parameter_views(self.plan, {g: getattr(self, f"shard{g}") for g in self.groups}, self.device)
        it = iter(inputs)
        args = [views[self.param_inputs[i]] if i in self.param_inputs else next(it)
                for i in range(self.n_inputs)]
        # Through an Interpreter: each node runs under its own metadata, so the aten nodes
        # traced from it carry Dynamo's module stack (activation checkpointing's regions).
        flat, self.output_spec = flatten_outputs(fx.Interpreter(self.gm).run(*args))
        return tuple(flat)


class FxShardBackend:
    """A ``torch.compile`` backend that shards parameters, gradients and optimizer state.

    Takes the options ``fxshard.compile`` takes (``fxshard.ir.config.CompileConfig``) but
    ``broadcast_buffers`` and ``MixedPrecision(output_dtype=...)``, which it refuses, saying why.
    """

    def __init__(self, policy: Policy | None = None, **options: Any):
        agree_on_mesh(options.get("mesh"), "fxshard.backend")  # before anything reads its groups
        self.config = CompileConfig.build("backend", policy=policy, **options)
        precision = self.config.mixed_precision
        if precision is not None and precision.output_dtype is not None:
            raise TypeError(
                "fxshard.backend does not take MixedPrecision(output_dtype=...): it compiles each "
                "graph Dynamo captured, whose outputs may be activations for the next graph, not "
                "the module's outputs. Cast the model's output yourself, or use fxshard.compile.")
        build_pipelines(self.config)  # a bad disable_passes fails here, not at the first call
        self._modules: list[_Sharding] = []

    @property
    def policy(self) -> Policy | None:
        return self.config.policy

    @property
    def compute(self) -> str:
        return self.config.compute

    def __repr__(self) -> str:
        return f"fxshard.backend(policy={self.policy!r}, compute={self.compute!r})"

    # -- sharding (fxshard.parameters) ----------------------------------------------------

    def shard(self, module: nn.Module, example_inputs: Any = None) -> list[nn.Parameter]:
        for sharding in self._modules:
            if any(id(p) in sharding.slots for p in module.parameters()):
                return sharding.driver.parameters  # already sharded: the same shards again
        driver = Driver(self.config)
        driver.shard(module, example_inputs=example_inputs)
        shards = driver.parameters  # the flat shards, or with use_orig_params their views
        plan = driver.plan
        # Stand-ins on the parameters' device: Dynamo bakes the device of
        # tensors computed from parameters into its graphs.
        driver.strip(module, on_device=True, use="fxshard.parameters(model)",
                     by="torch.compile with the fxshard backend",
                     saves="fxshard.get_model_state_dict(model) (every rank calls it) or "
                           "fxshard.checkpoint.save(path, model)",
                     loads="fxshard.set_model_state_dict(model, state_dict) or fxshard.checkpoint.load(path, model)")
        _refuse_eager_runs(module)
        # In the module, so that Dynamo traces them: its graphs then compute in the dtypes
        # they run with (the stand-ins have param_dtype too).
        cast_unit_inputs(module, plan, self.config.mixed_precision, include_root=True)
        by_name = dict(module.named_parameters(remove_duplicate=False))
        slots = {}
        for group in plan.groups:
            for slot in group.params:
                for name in slot.names:
                    slots[id(by_name[name])] = (group.index, slot.name)
        self._modules.append(_Sharding(driver, slots))
        return shards

    # -- the backend ----------------------------------------------------------------------

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        dynamic = [n.name for n, x in zip(placeholders, example_inputs)
                   if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)]
        if dynamic:
            raise FxShardError(
                f"fxshard backend: Dynamo passed dynamic shapes (inputs {dynamic}); fxshard "
                "compiles one static graph per shape. Use torch.compile(..., dynamic=False)."
            )
        params = [(i, x) for i, x in enumerate(example_inputs) if isinstance(x, nn.Parameter)]
        sharding = next((s for s in self._modules if any(id(x) in s.slots for _, x in params)), None)
        if sharding is None:
            if params:
                name = placeholders[params[0][0]].name
                raise FxShardError(
                    f"fxshard backend: graph input {name!r} is a parameter fxshard has not sharded. "
                    "Call fxshard.parameters(model) on the compiled model, and build the optimizer "
                    "over it, before the first call."
                )
            return gm.forward  # no parameters in this graph: nothing to shard
        missing = [placeholders[i].name for i, x in params if id(x) not in sharding.slots]
        if missing:
            raise FxShardError(f"fxshard backend: parameters {missing} are not part of the sharded "
                               "model (added after fxshard.parameters?)")
        driver = sharding.driver
        param_inputs = {i: sharding.slots[id(x)][1] for i, x in params}
        groups = sorted({sharding.slots[id(x)][0] for _, x in params})
        step = _GraphStep(gm, driver.plan, {g: driver.shards[g] for g in groups}, param_inputs,
                          len(example_inputs), driver.offloaded_to)
        user_inputs = [x for i, x in enumerate(example_inputs) if i not in param_inputs]
        graph = _CompiledGraph(driver, step, set(param_inputs),
                               f"the graph Dynamo captured ({len(gm.graph.nodes)} nodes)")
        graph.compiled(user_inputs)  # now, so that errors surface at compile time
        log.info("fxshard backend: compiled a graph with %d parameter inputs over %d flat groups",
                 len(param_inputs), len(groups))
        return graph

    def steps(self) -> list[CompiledStep]:
        """The compiled step of every graph Dynamo captured, in compile order."""
        return [s for m in self._modules for s in m.driver.steps]

    def reports(self) -> list[Report]:
        """``report()`` of every graph Dynamo captured, in compile order (with a memory
        budget, the planner's choice: made at the first training graph, kept for the rest)."""
        return [m.driver.report(s) for m in self._modules for s in m.driver.steps]

    def graphs(self) -> list[dict[str, fx.GraphModule]]:
        """The emitted graphs of every graph Dynamo captured, in compile order."""
        return [s.graphs for s in self.steps()]

    def plan(self) -> ShardPlan:
        if not self._modules:
            raise FxShardError("nothing sharded yet: call fxshard.parameters(model) first")
        return self._modules[-1].driver.plan


def _refuse_eager_runs(module: nn.Module) -> None:
    """Make a forward that Dynamo did not compile an error, not a silent run on the stand-ins.

    Dynamo runs a frame eagerly when it will not compile it: under an active
    ``TorchDispatchMode``, past its recompile limit, under ``torch._dynamo.disable``
    or ``torch.compiler.set_stance("force_eager")``. The stand-ins then act as
    zero weights and the model trains on nothing. Dynamo inlines module hooks
    into its graphs, where ``is_compiling()`` is a constant True, so the hook
    costs nothing in compiled code.
    """
    refuse_eager_calls(module, lambda mod: (
        f"{type(mod).__name__}.forward ran eagerly, outside the graphs fxshard compiled: "
        "its parameters are fxshard's stand-ins here, and the shards hold the model. "
        "torch.compile runs a frame eagerly when a TorchDispatchMode is active (a memory "
        "or FLOP counter around the forward), past torch._dynamo.config.recompile_limit, "
        "or under torch._dynamo.disable / set_stance('force_eager'). Run the forward "
        "without those (a dispatch mode around backward alone is fine), or use "
        "fxshard.compile, which needs no Dynamo."
    ))


def backend(policy: Policy | None = None, **options: Any) -> FxShardBackend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=fxshard.backend(policy=...))``.

    Takes the options ``fxshard.compile`` takes but ``broadcast_buffers`` and
    ``MixedPrecision(output_dtype=...)``, which it refuses, saying why.
    """
    return FxShardBackend(policy, **options)


def _find_backend(model: nn.Module) -> tuple[FxShardBackend, nn.Module]:
    if not isinstance(model, compat.optimized_module_class()):
        raise FxShardError(
            f"expected a sharded model, got a plain {type(model).__name__}: fxshard.parameters "
            "takes the module torch.compile returned, e.g. "
            "model = torch.compile(model, backend=fxshard.backend(...)); "
            "fxshard.parameters(model). For fxshard without torch.compile use fxshard.compile, "
            "whose ShardedModule the state-dict functions and no_sync also take."
        )
    callback: Any = model.dynamo_ctx.callback
    fn: Any = compat.innermost_backend(callback)
    fn = getattr(fn, "compiler_fn", fn)
    if not isinstance(fn, FxShardBackend):
        raise FxShardError(f"this model was compiled with backend {fn!r}, not fxshard.backend(...)")
    return fn, compat.original_module(model)


def parameters(model: nn.Module, example_inputs: Any = None) -> list[nn.Parameter]:
    """Shard a ``torch.compile``-d model now; returns this rank's flat shards for the optimizer
    (with ``use_orig_params=True``: the original parameters, as views of them, in the model's
    ``named_parameters()`` order). ``example_inputs``: what ``policy=auto()`` chooses the plan
    on, as for ``fxshard.compile``."""
    found, module = _find_backend(model)
    return found.shard(module, example_inputs)


def sharding_of(model: nn.Module) -> tuple[nn.Module, Driver]:
    """The module (skeleton) and the driver of a ``ShardedModule`` or a model compiled with
    the fxshard backend and sharded by ``fxshard.parameters``."""
    if isinstance(model, ShardedModule):
        return model.module, model._driver
    found, module = _find_backend(model)
    params = {id(p) for p in module.parameters()}
    for sharding in found._modules:
        if params & sharding.slots.keys():
            return module, sharding.driver
    raise FxShardError("this model is not sharded yet: call fxshard.parameters(model) first, and "
                       "build the optimizer over what it returns")


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """FSDP2's switch, for a ``torch.compile``-d model (or a ``ShardedModule``): with False,
    backward adds each unit's gradient to an unsharded sum and communicates nothing, until
    a backward with True reduces the sums with its own gradients."""
    sharding_of(model)[1].state.set_requires_gradient_sync(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """``with fxshard.no_sync(model):`` DDP's ``no_sync`` for a ``torch.compile``-d model
    (or a ``ShardedModule``, the same as ``sharded.no_sync()``)."""
    with sharding_of(model)[1].state.no_sync():
        yield


# torch.compile(model, backend="fxshard"): default options (everything in one unit). An install
# names it in the torch_dynamo_backends entry points (pyproject.toml), which Dynamo loads on first
# use (``import fxshard`` imports nothing); registering it here too would make that load fail
# ("duplicate name"), so only a checkout that is not installed registers it, on import of this module.
DEFAULT = FxShardBackend()
if "fxshard" not in importlib.metadata.entry_points(group="torch_dynamo_backends").names:
    compat.register_backend("fxshard", DEFAULT)
