"""The public entry point: ``fxshard.compile(model, policy=...) -> ShardedModule``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from fxshard.driver.compile.compiler import CompiledStep, Driver, emitted_graphs
from fxshard.driver.compile.guards import Guards
from fxshard.driver.report.step_report import Report
from fxshard.driver.run.runtime import (
    agree_on_mesh,
    refuse_ddp,
    refuse_eager_calls,
    refuse_fully_shard,
    refuse_move,
)
from fxshard.driver.state import state_dicts as state
from fxshard.ir import compat
from fxshard.ir.compat import DDP_IGNORED, IncompatibleKeys, pytree
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError
from fxshard.ir.options import ShardingOptions
from fxshard.ir.plan import ShardPlan
from fxshard.ir.spellings import fsdp2_method
from fxshard.ir.wrapping import Policy

log = logging.getLogger("fxshard")


def _autocast_state(device: torch.device) -> tuple[Any, ...]:
    """What ``torch.autocast`` does to a forward on ``device``: traced into the graph, so a
    step traced under one autocast state is not run under another."""
    return tuple((kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else (kind, None)
                 for kind in dict.fromkeys((device.type, "cpu")))


class ShardedModule(nn.Module):
    """A module whose parameters are this rank's flat shards; steps run as compiled graphs.

    Build it with :func:`fxshard.compile`. ``parameters()`` yields one flat
    shard per unit and (dtype, requires_grad) group, so an optimizer built over
    them keeps sharded state; with ``use_orig_params=True`` it yields the
    original parameters by name instead, as views of those shards, for
    per-parameter optimizer groups. The wrapped module is kept as a skeleton with its
    parameters on the meta device; its buffers stay real and are updated in
    place, as in eager mode. Everything else is the driver's
    (``fxshard.driver.compile.compiler.Driver``), which all front ends share.
    """

    _skeleton: nn.Module

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # FSDP2's fully_shard(sharded) swaps the module's class for a subclass of it and
        # FSDPModule: it would shard each rank's (different) flat shard again and gather the
        # pieces of different shards into one parameter, corrupting the model without an error.
        # Refused here, when it makes that class (after it has made the parameters DTensors).
        if any(base.__name__ == "FSDPModule" for base in cls.__mro__):
            refuse_fully_shard(cls)
        super().__init_subclass__(**kwargs)

    def __init__(self, module: nn.Module, driver: Driver):
        super().__init__()
        if driver.orig is None:
            self.flat_params = nn.ParameterList(driver.shards)
        else:  # use_orig_params: the views are the parameters, under the original names
            object.__setattr__(self, "flat_params", nn.ParameterList(driver.shards))
            self._register_views(driver.orig.views)
        # A plain attribute: the skeleton's meta parameters are not ours to expose.
        object.__setattr__(self, "_skeleton", module)
        self._driver = driver
        self._last: CompiledStep | None = None
        self.training = module.training

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            hint = fsdp2_method(name)  # FSDP2's methods, called as on a fully_shard module
            if hint is None:
                raise
            raise AttributeError(hint) from None

    def _register_views(self, views: Mapping[str, nn.Parameter]) -> None:
        """Each view under its original name, in modules named as the original's, so that
        ``named_parameters()`` of this module, and of any module holding it (a
        LightningModule), gives the original names. Registered past ``register_module``'s
        checks: a submodule may share a name with one of this class's attributes, which
        attribute access then still finds."""
        for name, view in views.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = owner._modules[part] = nn.Module()
                assert child is not None
                owner = child
            try:
                owner.register_parameter(leaf, view)
            except KeyError as e:  # a root parameter named like an attribute of this class
                raise FxShardError(
                    f"use_orig_params=True cannot give parameter {name!r} its name here: "
                    f"ShardedModule has an attribute {leaf!r}. Rename the parameter, or compile "
                    "without use_orig_params (the optimizer then steps the flat shards)") from e

    # -- inspection -------------------------------------------------------------------------

    @property
    def plan(self) -> ShardPlan:
        """The unit plan, in first-use order once a step has been traced."""
        return self._driver.plan

    @property
    def graphs(self) -> dict[str, fx.GraphModule]:
        """This rank's emitted graphs of the latest step: ``"forward"`` and, when training, ``"backward"``."""
        if self._last is None:
            raise FxShardError("nothing traced yet: call the module once, or pass example_inputs= to compile")
        return emitted_graphs(self._last.graphs)

    def report(self) -> Report:
        """Predicted peak memory and communication per step on this rank (see fxshard.driver.report.step_report).

        Describes the latest traced training step (or the latest step, if none
        trains). Known before the step first runs: compile with
        ``example_inputs`` to get it without running anything.
        """
        if self._last is None:
            raise FxShardError("nothing traced yet: call the module once, or pass example_inputs= to compile")
        training = [s for s in self._driver.steps if s.trains]
        step = self._last if self._last.trains or not training else training[-1]
        return self._driver.report(step)

    @property
    def config(self) -> CompileConfig:
        return self._driver.config

    @property
    def options(self) -> ShardingOptions:
        """The scheduling options the steps run with: the ones compile was given, or once
        ``memory_budget`` has planned (at the first training step), the ones it chose."""
        return self._driver.schedule.config.options


    @property
    def world_size(self) -> int:
        return self._driver.world.size

    @property
    def rank(self) -> int:
        return self._driver.world.rank

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
        refuse_move(self)  # naming fxshard's strategy or trainer where Lightning's or HF's moves it

    # -- the step -----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if compat.under_dynamo():
            raise FxShardError(
                "a ShardedModule was called inside torch.compile (torch.compile(sharded), "
                "sharded.compile(), or a compiled function that calls it): fxshard compiles the step "
                "itself, and Dynamo cannot trace its shards. For Inductor's kernels pass "
                "compute='inductor' to fxshard.compile; or compile the unsharded model with "
                "torch.compile(model, backend=fxshard.backend(policy=...)) (docs/backend.md)"
            )
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        device = self._driver.device
        for i, t in enumerate(tensors):
            if t.device != device:
                raise FxShardError(
                    f"input tensor {i} (shape {tuple(t.shape)}) is on {t.device}, but this rank's "
                    f"shards are on {device}: move inputs with .to({str(device)!r})"
                )
        step = self._step(leaves, spec)
        self._last = step
        return self._driver.run(step, tensors)

    def _step(self, leaves: list[Any], spec: pytree.TreeSpec) -> CompiledStep:
        """The compiled step for these inputs whose guards hold, traced now if there is none."""
        return self._driver.cache.step_for(self._signature(leaves, spec),
                                           lambda: self._trace(leaves, spec))

    def _signature(self, leaves: list[Any], spec: pytree.TreeSpec) -> Any:
        parts: list[Any] = [self.training, torch.is_grad_enabled(), str(spec),
                            self._driver.state.grad_sync() if torch.is_grad_enabled() else None,
                            _autocast_state(self._driver.device)]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                parts.append((tuple(x.shape), x.dtype, str(x.device), x.requires_grad))
            else:
                parts.append(repr(x))
        return tuple(parts)

    def _trace(self, leaves: list[Any], spec: pytree.TreeSpec) -> tuple[Guards, CompiledStep]:
        return self._driver.trace_module(self._skeleton, list(self.flat_params), leaves, spec)

    # -- training ---------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the gradients by their total norm over all ranks; returns that norm (FSDP1's name).

        The same as ``torch.nn.utils.clip_grad_norm_(sharded.parameters(), ...)``,
        which is correct on fxshard's shards too (``fxshard.driver.run.grads``). A
        collective: every rank must call it.
        """
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication (DDP's and FSDP1's name).

        Inside, backward reduces nothing: each unit's gradient is added to an
        unsharded sum (one full-size gradient per flat group, the memory DDP's
        gradients take), and the shards get no gradient. The first backward
        after the block reduces that sum together with its own gradient, so the
        shards' gradients equal DDP's after the same ``no_sync`` loop.
        """
        with self._driver.state.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the shards' gradients and drop what ``no_sync`` has added up and not yet
        reduced, as DDP's ``zero_grad`` drops the gradients it accumulated.

        An optimizer's ``zero_grad()`` drops them too: it clears the shards' gradients,
        which fxshard notices before the next step (``RunState.drop_sums_of_cleared_grads``).
        """
        super().zero_grad(set_to_none)
        if self._driver.orig is not None:  # the views' gradients are dropped: the shards' too
            self._driver.orig.sync()
        self._driver.state.drop_pending_sums()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's name for the same switch: False until the step whose backward should reduce."""
        self._driver.state.set_requires_gradient_sync(requires_gradient_sync)

    # -- checkpoints --------------------------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = False, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """What the unsharded module's own ``state_dict()`` returns: full tensors, its names,
        its state-dict hooks applied (a module that fuses or renames parameters there
        gets its own keys), buffers included.

        A collective: every rank must call it, in the same order relative to
        other collectives. A rank left waiting raises after ``timeout`` seconds
        (default: ``fxshard.compile``'s ``timeout``, else 300) instead of hanging.
        With ``rank0_only`` other ranks still take part and get an empty dict. The
        values are copies: training on does not change them.
        """
        return state.full_model_state(self._skeleton, self._driver, rank0_only, timeout)

    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                             timeout: float | None = None) -> IncompatibleKeys:
        """Inverse of :meth:`full_state_dict`: every rank passes the full dict, keeps its shard.

        Loads through the module's own ``load_state_dict``, so its load hooks run
        (a checkpoint with split q/k/v loads into a fused parameter). Everything
        is checked before anything changes: a bad dict leaves the model as it
        was. ``strict=False`` loads the keys that match and returns the ones it
        skipped, as ``nn.Module.load_state_dict`` does; it gathers the current
        parameters first, so then it is a collective.
        """
        return state.load_full_model_state(self._skeleton, self._driver, state_dict, strict, timeout)

    # -- the standard nn.Module API, made safe -------------------------------------------------

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> dict[str, Any]:
        """The full (unsharded) state dict under the original module's names.

        A collective, as FSDP1's default (FULL_STATE_DICT): every rank must
        call it. This rank's flat shards are ``sharded.parameters()``; never
        save them as a model.
        """
        if len(args) > 3:
            raise TypeError(f"state_dict takes (destination, prefix, keep_vars), as nn.Module's, got {len(args)} "
                            "positional arguments")
        given: list[Any] = [*args, *(destination, prefix, keep_vars)[len(args):]]
        destination, prefix, keep_vars = given
        if keep_vars:
            raise TypeError("state_dict(keep_vars=True) asks for the module's own Parameter objects; a sharded "
                            "module's full tensors are gathered copies. Use sharded.parameters() for this "
                            "rank's shards, or state_dict() for the full values")
        full = self.full_state_dict()
        result = destination if destination is not None else {}
        for key, value in full.items():
            result[prefix + key] = value
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> IncompatibleKeys:
        """Load a full state dict under the original names (every rank passes it).

        The same as :meth:`load_full_state_dict`: ``strict=False`` loads the keys
        that match and returns the ones it skipped (``missing_keys``,
        ``unexpected_keys``), as ``nn.Module`` does; a key whose shape differs is
        an error either way.
        """
        if assign:
            raise FxShardError("load_state_dict(assign=True) is not supported by a ShardedModule: "
                               "its parameters are flat shards; load values with assign=False")
        return self.load_full_state_dict(state_dict, strict=strict)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise FxShardError(
            "a ShardedModule cannot be pickled (torch.save(sharded), pickle, multiprocessing): it "
            "holds this rank's shards and a process group. Save its state instead: "
            "torch.save(sharded.state_dict(), path) (a collective: call it on every rank), or "
            "sharded.full_state_dict(rank0_only=True) on every rank and save on rank 0."
        )

    def __deepcopy__(self, memo: Any) -> Any:
        raise FxShardError(
            "a ShardedModule cannot be deep-copied: it holds this rank's shards and a process "
            "group. Copy the model before fxshard.compile, or rebuild it and load "
            "sharded.state_dict() into the copy."
        )

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, rank={self.rank}, "
                f"units={len(self.plan.units)}, policy={self.plan.policy}")


# DistributedDataParallel(sharded) reads this first, before it broadcasts anything: it raises.
setattr(ShardedModule, DDP_IGNORED, property(refuse_ddp))


def compile(
    model: nn.Module,
    policy: Policy | None = None,
    process_group: dist.ProcessGroup | None = None,
    example_inputs: Any = None,
    *,
    _allow_meta: bool = False,
    **options: Any,
) -> ShardedModule:
    """Shard ``model`` across the ranks of ``process_group`` (default: the world).

    Shards eagerly: the returned module's parameters are this rank's flat
    shards, ready for an optimizer. The step is traced at the first call, or
    now when ``example_inputs`` (a tensor or a tuple of positional arguments)
    is given.

    Options (the same for ``fxshard.backend`` and ``fxshard.explain``, but for those
    each refuses, saying why: ``fxshard.ir.config._NOT_FOR``; see
    ``fxshard.ir.config.CompileConfig``): ``compute`` ("eager" or "inductor"),
    ``verify_passes`` (check graph invariants after every pass; default: the
    ``FXSHARD_VERIFY`` environment variable), ``on_pass(graph, pass_name,
    gm)`` (called with each graph as traced, pass name ``"traced"``, and after
    every pass; ``graph`` is "joint", "forward", "backward" or "inference"),
    ``mesh`` (a ``DeviceMesh`` instead of ``process_group``, with FSDP2's
    conventions: 1-D shards over its ranks, ``(R, S)`` is HSDP: S-way shards
    replicated R times, ``(N, 1)`` is NO_SHARD: every parameter whole on every
    rank and its gradient all-reduced),
    ``replicate`` (a policy: the units it selects are NO_SHARD, whole on every rank),
    ``use_orig_params`` (FSDP1's: ``parameters()`` and ``named_parameters()`` are the
    original parameters by name, views of the shards, for per-parameter optimizer groups),
    ``timeout`` (seconds, or a ``datetime.timedelta``, any collective of a step, and a
    full state dict's gathers, waits for the other ranks; default: the process group's), ``dump_dir`` (default: ``FXSHARD_DUMP``),
    ``disable_passes`` (pass names), and the scheduling options of
    ``fxshard.ShardingOptions``: ``reshard_after_forward``, ``reshard_root``,
    ``forward_prefetch``, ``backward_prefetch``, ``max_inflight_gathers``,
    ``max_inflight_bytes``, ``bucket_bytes``, ``replicate_below``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxshard.compile takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModule):
        raise FxShardError(
            "fxshard.compile was given a ShardedModule, which is sharded already: use it as it "
            "is. To change the policy or options, build the model again (or load "
            "sharded.state_dict() into a fresh one) and compile that."
        )
    agree_on_mesh(options.get("mesh"))  # before any group is made from it
    config = CompileConfig.build("compile", policy=policy, process_group=process_group, **options)
    return shard_module(model, Driver(config), example_inputs, allow_meta=_allow_meta)


def shard_module(model: nn.Module, driver: Driver, example_inputs: Any = None, *,
                 allow_meta: bool = False) -> ShardedModule:
    """``model`` sharded by ``driver``; traced now when ``example_inputs`` is given."""
    driver.shard(model, allow_meta=allow_meta, example_inputs=example_inputs)
    sharded = ShardedModule(model, driver)
    if example_inputs is not None:
        # Trace before stripping the model: if tracing fails, the model is untouched.
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        leaves, spec = pytree.tree_flatten((args, {}))
        sharded._last = sharded._step(leaves, spec)
    # From here the shards hold the only copy of the parameters
    # (full_state_dict() gathers them back).
    driver.strip(model)
    refuse_eager_calls(model, lambda mod: (
        f"{type(mod).__name__}.forward was called on the module passed to fxshard.compile: its "
        "parameters moved into the ShardedModule that compile returned, and only stand-ins on "
        "the meta device are left here. Call what compile returned: sharded = "
        "fxshard.compile(model, ...); sharded(inputs) (a common slip: `fxshard.compile(model)` "
        "without keeping its result, or `model = ...` shadowed by another name)."
    ))
    return sharded
