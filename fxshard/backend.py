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
  which no longer hold the model): an error at its first ``step()``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from fxshard.codegen import GraphCompiler
from fxshard.collectives import Collective, step_collectives
from fxshard.consistency import check_same_collectives
from fxshard.errors import FxShardError
from fxshard.options import ShardingOptions
from fxshard.plan import ShardPlan, make_plan
from fxshard.policies import Policy
from fxshard.runtime import World, make_shards, resolve_world, strip_parameters
from fxshard.trace import flatten_outputs, parameter_views, trace_step

log = logging.getLogger("fxshard")

# Parameters fxshard took the data out of: an optimizer over them is a mistake.
_RETIRED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # by identity: tensors have no truth value
_HOOK: Any = None


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in _RETIRED:
                raise FxShardError(
                    f"{type(optimizer).__name__} was built over a parameter of shape "
                    f"{tuple(p.shape)} that fxshard has sharded: it no longer holds the model. "
                    "Build the optimizer over fxshard.parameters(model), e.g. "
                    "torch.optim.AdamW(fxshard.parameters(model), lr=...)."
                )


@dataclass
class _Sharding:
    """What ``fxshard.parameters`` did to one module."""

    plan: ShardPlan
    world: World
    shards: list[nn.Parameter]
    # id(stand-in parameter) -> (flat group, parameter name)
    slots: dict[int, tuple[int, str]]
    graphs: list[dict[str, fx.GraphModule]] = field(default_factory=list)


class _CompiledGraph:
    """The callable handed back to Dynamo for one captured graph."""

    def __init__(self, fn: Callable[..., Any], param_positions: set[int], output_spec: Any,
                 collectives: list[Collective], world: World):
        self.fn = fn
        self.param_positions = param_positions
        self.output_spec = output_spec
        self.collectives = collectives
        self.world = world
        self.checked = False

    def __call__(self, *args: Any) -> Any:
        if not self.checked:
            check_same_collectives(self.collectives, self.world, 300.0)
            self.checked = True
        inputs = [a for i, a in enumerate(args) if i not in self.param_positions]
        return self.output_spec.unflatten(self.fn(*inputs))


class _GraphStep(nn.Module):
    """One Dynamo graph with its parameter inputs replaced by views of unsharded shards."""

    gm: fx.GraphModule

    def __init__(self, gm: fx.GraphModule, plan: ShardPlan, shards: dict[int, nn.Parameter],
                 param_inputs: dict[int, str], n_inputs: int):
        super().__init__()
        object.__setattr__(self, "gm", gm)  # not a submodule: nothing of it is lifted
        self.plan = plan
        self.groups = sorted(shards)
        for g in self.groups:
            self.register_parameter(f"shard{g}", shards[g])
        self.param_inputs = param_inputs
        self.n_inputs = n_inputs
        self.output_spec: Any = None
        self.failed_in: str | None = None  # read by trace_step's error report
        object.__setattr__(self, "skeleton", gm)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        views = parameter_views(self.plan, {g: getattr(self, f"shard{g}") for g in self.groups})
        it = iter(inputs)
        args = [views[self.param_inputs[i]] if i in self.param_inputs else next(it)
                for i in range(self.n_inputs)]
        flat, self.output_spec = flatten_outputs(self.gm(*args))
        return tuple(flat)


class FxShardBackend:
    """A ``torch.compile`` backend that shards parameters, gradients and optimizer state."""

    def __init__(self, policy: Policy | None = None, *, process_group: dist.ProcessGroup | None = None,
                 compute: str = "eager", verify_passes: bool = False, **options: Any):
        if compute not in ("eager", "inductor"):
            raise ValueError(f"compute must be 'eager' or 'inductor', got {compute!r}")
        self.policy = policy
        self.process_group = process_group
        self.compute = compute
        self.verify_passes = verify_passes
        self.options = ShardingOptions.from_kwargs(**options)
        self._modules: list[_Sharding] = []

    def __repr__(self) -> str:
        return f"fxshard.backend(policy={self.policy!r}, compute={self.compute!r})"

    # -- sharding (fxshard.parameters) ----------------------------------------------------

    def shard(self, module: nn.Module) -> list[nn.Parameter]:
        global _HOOK
        for sharding in self._modules:
            if any(id(p) in sharding.slots for p in module.parameters()):
                return sharding.shards  # already sharded: the same shards again
        world = resolve_world(self.process_group)
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1 or devices == {torch.device("meta")}:
            raise FxShardError(f"fxshard.parameters: the model's parameters must be on one real "
                               f"device before sharding, found {sorted(map(str, devices))}")
        plan = make_plan(module, self.policy, world.size, bucket_bytes=self.options.bucket_bytes,
                         replicate_below=self.options.replicate_below)
        shards = make_shards(module, plan, world.rank, next(iter(devices)))
        originals = list(module.parameters())
        strip_parameters(module, on_device=True)
        for p in originals:
            _RETIRED[p] = True
        if _HOOK is None:
            _HOOK = register_optimizer_step_pre_hook(_check_optimizer)
        by_name = dict(module.named_parameters(remove_duplicate=False))
        slots = {}
        for group in plan.groups:
            for slot in group.params:
                for name in slot.names:
                    slots[id(by_name[name])] = (group.index, slot.name)
        self._modules.append(_Sharding(plan, world, shards, slots))
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
        param_inputs = {i: sharding.slots[id(x)][1] for i, x in params}
        groups = sorted({sharding.slots[id(x)][0] for _, x in params})
        step = _GraphStep(gm, sharding.plan, {g: sharding.shards[g] for g in groups}, param_inputs,
                          len(example_inputs))
        compiler = GraphCompiler(sharding.plan, sharding.world.size, sharding.world.group_name,
                                 self.verify_passes, self.options)
        if self.compute == "inductor":
            compiler.finish = _inductor_finish
            compiler.emit_free = False  # Inductor frees buffers after their last use itself
        user_inputs = [x for i, x in enumerate(example_inputs) if i not in param_inputs]
        decompositions = None
        if self.compute == "inductor":
            # Load the lowerings the decomposition table consults (a plain
            # `import torch._inductor...` here would make `torch` a local name).
            importlib.import_module("torch._inductor.compile_fx")
            from torch._inductor.decomposition import select_decomp_table

            decompositions = select_decomp_table()
        partition: Callable[..., Any] = compiler.partition
        if self.compute == "inductor":
            partition = _with_inductor_joint_passes(compiler.partition)
        fn = trace_step(step, user_inputs, partition_fn=partition,
                        fw_compiler=compiler.compile_forward, bw_compiler=compiler.compile_backward,
                        inference_compiler=compiler.compile_inference,
                        model_name=f"the graph Dynamo captured ({len(gm.graph.nodes)} nodes)",
                        decompositions=decompositions)
        graphs = dict(compiler.graphs)
        sharding.graphs.append(graphs)
        log.info("fxshard backend: compiled a graph with %d parameter inputs over %d flat groups",
                 len(param_inputs), len(groups))
        return _CompiledGraph(fn, set(param_inputs), step.output_spec, step_collectives(graphs),
                              sharding.world)

    def graphs(self) -> list[dict[str, fx.GraphModule]]:
        """The emitted graphs of every graph Dynamo captured, in compile order."""
        return [g for s in self._modules for g in s.graphs]

    def plan(self) -> ShardPlan:
        if not self._modules:
            raise FxShardError("nothing sharded yet: call fxshard.parameters(model) first")
        return self._modules[-1].plan


def _with_inductor_joint_passes(partition: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's joint-graph passes, then fxshard's partitioning.

    Inductor prepares the joint graph for its lowering (``replace_random``
    turns ``native_dropout`` into the random ops it can compile); its
    ``partition_fn`` runs them and hands the graph to the override.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.virtualized import V

    def run(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        vals = [n.meta.get("val") for n in joint.graph.nodes if n.op == "placeholder"]
        # The passes read the fake mode from Inductor's virtualized state.
        with V.set_fake_mode(detect_fake_mode(vals)):
            return partition_fn(joint, joint_inputs, partitioner_fn_override=partition, **kwargs)

    return run


def _inductor_finish(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs)


def backend(policy: Policy | None = None, **options: Any) -> FxShardBackend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=fxshard.backend(policy=...))``."""
    return FxShardBackend(policy, **options)


def _find_backend(model: nn.Module) -> tuple[FxShardBackend, nn.Module]:
    from torch._dynamo.eval_frame import OptimizedModule, innermost_backend

    if not isinstance(model, OptimizedModule):
        raise FxShardError(
            "fxshard.parameters takes the module torch.compile returned, e.g. "
            "model = torch.compile(model, backend=fxshard.backend(...)); "
            "fxshard.parameters(model). For fxshard without torch.compile use fxshard.compile."
        )
    callback: Any = model.dynamo_ctx.callback
    fn: Any = innermost_backend(callback)
    fn = getattr(fn, "compiler_fn", fn)
    if not isinstance(fn, FxShardBackend):
        raise FxShardError(f"this model was compiled with backend {fn!r}, not fxshard.backend(...)")
    return fn, model._orig_mod


def parameters(model: nn.Module) -> list[nn.Parameter]:
    """Shard a ``torch.compile``-d model now; returns this rank's flat shards for the optimizer."""
    found, module = _find_backend(model)
    return found.shard(module)


# torch.compile(model, backend="fxshard"): default options (everything in one unit).
DEFAULT = FxShardBackend()
torch._dynamo.register_backend(name="fxshard")(DEFAULT)
