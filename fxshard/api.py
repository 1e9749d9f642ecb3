"""The public entry point: ``fxshard.compile(model, policy=...) -> ShardedModule``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxshard.codegen import GraphCompiler
from fxshard.collectives import Collective, step_collectives
from fxshard.consistency import check_same_collectives
from fxshard.errors import FxShardError
from fxshard.options import ShardingOptions
from fxshard.passes.analysis import first_use_order
from fxshard.plan import ShardPlan, make_plan
from fxshard.policies import Policy
from fxshard.report import Report, build_report
from fxshard.runtime import (
    World,
    full_parameters,
    load_shards,
    make_shards,
    resolve_world,
    strip_parameters,
)
from fxshard.trace import OutputSpec, StepFunction, trace_step

log = logging.getLogger("fxshard")

PassHook = Callable[[str, str, fx.GraphModule], None]


@dataclass
class CompiledStep:
    """One traced input signature: AOTAutograd's callable and the graphs it runs."""

    fn: Callable[..., Any]
    graphs: dict[str, fx.GraphModule]
    output_spec: OutputSpec
    collectives: list[Collective]
    input_bytes: int
    num_user_outputs: int | None
    checked: bool = False  # ranks have compared their collective sequences


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class ShardedModule(nn.Module):
    """A module whose parameters are this rank's flat shards; steps run as compiled graphs.

    Build it with :func:`fxshard.compile`. ``parameters()`` yields one flat
    shard per unit and (dtype, requires_grad) group, so an optimizer built over
    them keeps sharded state. The wrapped module is kept as a skeleton with its
    parameters on the meta device; its buffers stay real and are updated in
    place, as in eager mode.
    """

    _skeleton: nn.Module

    def __init__(self, module: nn.Module, plan: ShardPlan, world: World, device: torch.device,
                 verify_passes: bool, on_pass: PassHook | None = None,
                 options: ShardingOptions | None = None):
        super().__init__()
        self.flat_params = nn.ParameterList(make_shards(module, plan, world.rank, device))
        # A plain attribute: the skeleton's meta parameters are not ours to expose.
        object.__setattr__(self, "_skeleton", module)
        self._plan = plan
        self._world = world
        self._device = device
        self._verify_passes = verify_passes
        self._on_pass = on_pass
        self._options = options or ShardingOptions()
        # Seconds a rank waits for the others at a step's first run before raising.
        self.check_timeout = 300.0
        self._steps: dict[Any, CompiledStep] = {}
        self._last: CompiledStep | None = None
        self.training = module.training

    # -- inspection -------------------------------------------------------------------------

    @property
    def plan(self) -> ShardPlan:
        """The unit plan, in first-use order once a step has been traced."""
        return self._plan

    @property
    def graphs(self) -> dict[str, fx.GraphModule]:
        """This rank's emitted graphs of the latest step: ``"forward"`` and, when training, ``"backward"``."""
        if self._last is None:
            raise FxShardError("nothing traced yet: call the module once, or pass example_inputs= to compile")
        graphs = self._last.graphs
        result = {"forward": graphs.get("forward", graphs.get("inference"))}
        if "backward" in graphs:
            result["backward"] = graphs["backward"]
        return result  # type: ignore[return-value]

    def report(self) -> Report:
        """Predicted peak memory and communication per step on this rank (see fxshard.report).

        Describes the latest traced training step (or the latest step, if none
        trains). Known before the step first runs: compile with
        ``example_inputs`` to get it without running anything.
        """
        if self._last is None:
            raise FxShardError("nothing traced yet: call the module once, or pass example_inputs= to compile")
        training = [s for s in self._steps.values() if "backward" in s.graphs]
        step = self._last if "backward" in self._last.graphs or not training else training[-1]
        return build_report(self._plan, self._world.rank, step.graphs, step.collectives,
                            list(self.flat_params), list(self._skeleton.buffers()), step.input_bytes,
                            step.num_user_outputs)

    @property
    def options(self) -> ShardingOptions:
        return self._options

    @property
    def world_size(self) -> int:
        return self._world.size

    @property
    def rank(self) -> int:
        return self._world.rank

    @property
    def module(self) -> nn.Module:
        """The original module, as a skeleton: its parameters live in ``flat_params``."""
        return self._skeleton

    # -- modes --------------------------------------------------------------------------------

    def train(self, mode: bool = True) -> ShardedModule:
        super().train(mode)
        self._skeleton.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ShardedModule:
        raise FxShardError(
            "a ShardedModule cannot be moved or cast after compile: move the model with "
            ".to(device / dtype) before fxshard.compile"
        )

    # -- the step -----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        for i, t in enumerate(tensors):
            if t.device != self._device:
                raise FxShardError(
                    f"input tensor {i} (shape {tuple(t.shape)}) is on {t.device}, but this rank's "
                    f"shards are on {self._device}: move inputs with .to({str(self._device)!r})"
                )
        key = self._signature(leaves, spec)
        step = self._steps.get(key)
        if step is None:
            step = self._trace(leaves, spec)
            self._steps[key] = step
        self._last = step
        if not step.checked:
            check_same_collectives(step.collectives, self._world, self.check_timeout)
            step.checked = True
        return step.output_spec.unflatten(step.fn(*tensors))

    def _signature(self, leaves: list[Any], spec: pytree.TreeSpec) -> Any:
        parts: list[Any] = [self.training, torch.is_grad_enabled(), str(spec)]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                parts.append((tuple(x.shape), x.dtype, str(x.device), x.requires_grad))
            else:
                parts.append(repr(x))
        return tuple(parts)

    def _trace(self, leaves: list[Any], spec: pytree.TreeSpec) -> CompiledStep:
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]

        def rebuild(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            it = iter(tensors)
            args, kwargs = pytree.tree_unflatten(
                [next(it) if t else x for t, x in zip(is_tensor, leaves)], spec
            )
            return args, kwargs

        buffers = dict(self._skeleton.named_buffers(remove_duplicate=False))
        step = StepFunction(self._skeleton, self._plan, list(self.flat_params), buffers, rebuild)
        compiler = GraphCompiler(self._plan, self._world.size, self._world.group_name,
                                 self._verify_passes, self._options)
        compiler.on_pass = self._on_pass
        fn = trace_step(
            step,
            [x for x in leaves if isinstance(x, torch.Tensor)],
            partition_fn=compiler.partition,
            fw_compiler=compiler.compile_forward,
            bw_compiler=compiler.compile_backward,
            inference_compiler=compiler.compile_inference,
            model_name=type(self._skeleton).__name__,
        )
        assert step.output_spec is not None
        first = compiler.graphs.get("joint", compiler.graphs.get("inference"))
        order = first_use_order(first.graph) if first is not None else []
        if not self._steps:
            self._plan = self._plan.ordered_by_first_use(order)
        log.info("fxshard: traced %s (%s) on rank %d", type(self._skeleton).__name__,
                 "train" if self.training else "eval", self._world.rank)
        graphs = dict(compiler.graphs)
        input_bytes = sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))
        return CompiledStep(fn, graphs, step.output_spec, step_collectives(graphs),
                            input_bytes, compiler.num_user_outputs)

    # -- checkpoints --------------------------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = False, timeout: float = 300.0) -> dict[str, torch.Tensor]:
        """The unsharded state dict under the original module's names, buffers included.

        A collective: every rank must call it, in the same order relative to
        other collectives. A rank left waiting raises after ``timeout`` seconds
        instead of hanging. With ``rank0_only`` other ranks still take part and
        get an empty dict.
        """
        full = full_parameters(list(self.flat_params), self._plan, self._world, timeout)
        if rank0_only and self._world.rank != 0:
            return {}
        result: dict[str, torch.Tensor] = {}
        for key, value in self._skeleton.state_dict(keep_vars=True).items():
            result[key] = full[key] if key in full else value.detach().clone()
        return result

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`full_state_dict`: every rank passes the full dict, keeps its shard.

        Checks everything before changing anything, so a bad dict leaves the
        model as it was.
        """
        expected = self._skeleton.state_dict(keep_vars=True)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        wrong = [f"{k}: expected {tuple(v.shape)}, got {tuple(state_dict[k].shape)}"
                 for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape]
        if missing or unexpected or wrong:
            raise FxShardError(
                "load_full_state_dict: the state dict does not match the model"
                + (f"; missing keys {missing}" if missing else "")
                + (f"; unexpected keys {unexpected}" if unexpected else "")
                + (f"; wrong shapes {wrong}" if wrong else "")
                + ". Pass a dict from full_state_dict() or the original module's state_dict()."
            )
        load_shards(list(self.flat_params), self._plan, state_dict, self._world.rank)
        params = {n for g in self._plan.groups for s in g.params for n in s.names}
        with torch.no_grad():
            for key, value in expected.items():
                if key not in params:
                    value.copy_(state_dict[key])

    def extra_repr(self) -> str:
        return (f"world_size={self._world.size}, rank={self._world.rank}, "
                f"units={len(self._plan.units)}, policy={self._plan.policy}")


def compile(
    model: nn.Module,
    policy: Policy | None = None,
    process_group: dist.ProcessGroup | None = None,
    example_inputs: Any = None,
    *,
    verify_passes: bool | None = None,
    on_pass: PassHook | None = None,
    _allow_meta: bool = False,
    **options: Any,
) -> ShardedModule:
    """Shard ``model`` across the ranks of ``process_group`` (default: the world).

    Shards eagerly: the returned module's parameters are this rank's flat
    shards, ready for an optimizer. The step is traced at the first call, or
    now when ``example_inputs`` (a tensor or a tuple of positional arguments)
    is given. ``verify_passes`` checks graph invariants after every pass
    (default: the ``FXSHARD_VERIFY`` environment variable). ``on_pass(graph,
    pass_name, gm)`` is called with each graph as traced (pass name
    ``"traced"``) and after every pass, ``graph`` being "joint", "forward",
    "backward" or "inference". Further keyword arguments are scheduling
    options (``fxshard.ShardingOptions``): ``reshard_after_forward``,
    ``reshard_root``, ``forward_prefetch``, ``backward_prefetch``,
    ``max_inflight_gathers``, ``max_inflight_bytes``, ``bucket_bytes``,
    ``replicate_below``.
    """
    sharding_options = ShardingOptions.from_kwargs(**options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxshard.compile takes an nn.Module, got {type(model).__name__}")
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be built with fxshard.policies (by_size, by_class, by_predicate), "
            f"got {policy!r}"
        )
    world = resolve_world(process_group)
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise FxShardError(
            f"the model's parameters are on several devices {sorted(map(str, devices))}: "
            "move the whole model to this rank's device before fxshard.compile"
        )
    if devices == {torch.device("meta")} and not _allow_meta:
        raise FxShardError(
            "the model's parameters are on the meta device: materialise them (to_empty + init) "
            "to train, or use fxshard.explain to inspect the plan, graphs and report"
        )
    plan = make_plan(model, policy, world.size, bucket_bytes=sharding_options.bucket_bytes,
                     replicate_below=sharding_options.replicate_below)
    device = next(iter(devices)) if devices else torch.device("cpu")
    if verify_passes is None:
        verify_passes = _env_flag("FXSHARD_VERIFY")
    sharded = ShardedModule(model, plan, world, device, verify_passes, on_pass,
                            sharding_options)
    if example_inputs is not None:
        # Trace before stripping the model: if tracing fails, the model is untouched.
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        leaves, spec = pytree.tree_flatten((args, {}))
        key = sharded._signature(leaves, spec)
        sharded._steps[key] = sharded._last = sharded._trace(leaves, spec)
    # From here the shards hold the only copy of the parameters
    # (full_state_dict() gathers them back).
    strip_parameters(model)
    return sharded
