"""``fxshard.explain``: the plan, graphs and report of any model at any world size, in one process.

No cluster and no real memory: the model is copied onto the meta device (a
model built on meta is used as it is), or, with ``device=``, into fake tensors
of that device; the process group is torch's ``fake`` backend with N ranks,
and tracing runs under fake tensors. Nothing runs, so
nothing is communicated; the graphs are exactly those rank ``rank`` of a real
N-rank job would emit.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from fxshard.api import shard_module
from fxshard.driver.compile.compiler import Driver
from fxshard.driver.compile.kernels import cuda_kernels
from fxshard.driver.report.dump import PassLog
from fxshard.driver.report.step_report import Report
from fxshard.ir import compat
from fxshard.ir.compat import pytree
from fxshard.ir.config import CompileConfig, from_mesh
from fxshard.ir.cost import Rates
from fxshard.ir.cost import hardware as cost_profile
from fxshard.ir.errors import FxShardError
from fxshard.ir.plan import ShardPlan
from fxshard.ir.wrapping import Policy


@dataclass
class Explanation:
    plan: ShardPlan
    graphs: dict[str, fx.GraphModule]  # "forward" and, when training, "backward"
    report: Report
    passes: PassLog  # the code after each pass; filled only when dumping
    world_size: int
    rank: int
    pass_names: tuple[tuple[str, str], ...] = ()  # (graph, pass) in the order they ran
    _driver: Driver | None = field(default=None, repr=False, compare=False)
    planned_for: str | None = None  # explain(device=): the device and how it was planned for

    def __str__(self) -> str:
        device = f"planned for {self.planned_for}\n" if self.planned_for else ""
        return f"{self.plan}\n\n{device}{self.report}"

    def dump(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write everything to ``directory``; returns the files written."""
        assert self._driver is not None
        return self._driver.dump(self._driver.steps[-1], Path(directory))


def _copy_with(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are ``make(t)`` of its own (no data
    copied); a tensor shared between modules stays shared."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            new = make(t)
            memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    return copy.deepcopy(model, memo)


def _to_meta(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device."""
    return _copy_with(model, lambda t: torch.empty_like(t, device="meta"))


def _create_on(model: nn.Module, device: torch.device) -> None:
    """Make the tensors ``model``'s forward creates without a device (``torch.ones(t, t)``,
    ``torch.arange(n)``) land on ``device``, beside its parameters, as they land beside them
    when the model runs on its own device (CPU, or a default device set by the user)."""
    data = _MetaData() if device.type == "meta" else contextlib.nullcontext()
    cls = type(model)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with device, data:
            return cls.forward(self, *args, **kwargs)

    # A subclass, not a wrapper in the instance: a copy of the model (auto()'s, cut to a few
    # blocks) runs its own forward, where a wrapper would run this instance's.
    model.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                  "__qualname__": cls.__qualname__})


class _MetaData(TorchFunctionMode):
    """``torch.tensor(data)`` and ``torch.as_tensor(data)`` made on the meta device are fake.

    Under fake tensors torch makes them real meta tensors, which the trace then refuses
    beside the fake ones ("Please convert all Tensors to FakeTensors"): a Hugging Face
    model at its default ``use_cache=True`` builds a ``DynamicCache`` whose empty keys are
    made so. A meta tensor holds no data, so an empty one of its shape and dtype, fake under
    the trace, is the same tensor.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.is_meta
                and not isinstance(out, compat.fake_tensor.FakeTensor) and all(out is not a for a in args)):
            return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype,
                                       device=out.device).requires_grad_(out.requires_grad)
        return out


def _planning_device(device: str | torch.device | None,
                     ) -> tuple[torch.device, str | None, contextlib.AbstractContextManager[Any]]:
    """The device ``explain`` traces on, how it plans for ``device`` (for the explanation), and
    the context its trace runs in: meta by default (any machine, the kernels torch picks on
    meta); a device type this machine has, on fake tensors of it, whose kernels and memory
    the plan then counts; CUDA where this machine has none, on meta with CUDA's attention
    kernels (driver/compile/kernels.py)."""
    try:
        target = torch.device("meta") if device is None else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise FxShardError(f"explain(device={device!r}) names no device torch knows ({e}); pass a "
                           "device type such as 'cuda' or 'cpu', or None for the meta device") from e
    if target.type == "meta":
        return target, None, contextlib.nullcontext()
    if target.type == "cpu":
        return target, "cpu (fake tensors)", contextlib.nullcontext()
    try:
        available = bool(torch.get_device_module(target.type).is_available())
    except (RuntimeError, AttributeError):
        available = False
    if available:
        return target, f"{target.type} (fake tensors)", contextlib.nullcontext()
    if target.type == "cuda":
        return torch.device("meta"), ("cuda (no CUDA device here: meta tensors, with the fused attention "
                                      "kernels CUDA would choose)"), cuda_kernels()
    raise FxShardError(
        f"explain(device={str(device)!r}) plans on fake {target.type} tensors, and torch needs a "
        f"{target.type} device on this machine for that: its autograd engine opens a device context "
        "for backward (pytorch#92627). Plan on this machine with device=None (the meta device: the "
        "same units and collectives, with the kernels torch chooses on meta), or device='cuda' "
        f"(CUDA's attention kernels, on meta), or run explain where a {target.type} device is (it "
        "allocates nothing there)"
    )


def embedding_inputs(model: nn.Module, example_inputs: tuple[Any, ...]) -> dict[int, str]:
    """Which of ``example_inputs`` the model gives an ``nn.Embedding`` as its indices, as
    they are or viewed: {input position: the embedding's module path}.

    Runs the forward once on a meta copy of the model (nothing is computed) and
    gives each embedding integer indices of the shape it got, so that the
    forward goes on past it; stops at the forward's first error.
    """
    meta_model = _to_meta(model)
    inputs = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    found: dict[int, str] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...] | None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            indices = args[0]
            for i, x in enumerate(inputs):
                if isinstance(x, torch.Tensor) and (indices is x or indices._base is x):
                    found.setdefault(i, name)
            if indices.is_floating_point():
                return (indices.to(torch.long), *args[1:])
            return None

        return pre_hook

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in meta_model.named_modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    try:
        with torch.no_grad():
            meta_model(*inputs)
    except Exception:
        pass  # what was found before the error stands; tracing reports the error itself
    finally:
        for h in handles:
            h.remove()
    return found


def explain(
    model: nn.Module,
    example_inputs: Any,
    policy: Policy | None = None,
    world_size: int | None = None,
    *,
    mesh_shape: tuple[int, ...] | None = None,
    rank: int = 0,
    train: bool = True,
    device: str | torch.device | None = None,
    hardware: str | Rates | None = None,
    **options: Any,
) -> Explanation:
    """Plan, emitted graphs and report of ``model`` sharded over ``world_size`` ranks, or
    laid out on a device mesh of ``mesh_shape``.

    ``mesh_shape`` follows ``mesh=``'s conventions (FSDP2's): ``(S,)`` shards over
    S ranks, ``(R, S)`` is HSDP (R replicas of S-way shards), ``(N, 1)`` is
    NO_SHARD; ``rank`` is then a rank of the whole mesh (row-major), and the
    report splits the bytes moved inside the shard groups from those moved
    between replicas. ``example_inputs`` is a tensor or a tuple of positional
    arguments (only shapes and dtypes matter; any device). ``model`` is left
    untouched. ``train=False`` explains an inference step. ``device`` is the device
    planned for: by default the meta device, which any machine has; ``device="cuda"``
    traces on fake CUDA tensors, so attention takes the kernel CUDA would (flash
    attention in bf16) and the report counts its memory; it allocates nothing on
    the device. Where this machine has no CUDA device, it traces on meta with the
    fused attention kernels CUDA would choose (driver/compile/kernels.py); other device
    types need the device here. Options are those of
    ``fxshard.compile`` (``dump_dir``, or the ``FXSHARD_DUMP`` environment
    variable, writes the graphs after each pass, a timeline picture and the
    unit graph there), except ``process_group``, ``mesh``, ``timeout``,
    ``param_init_fn`` and ``sync_module_states`` (refused, saying why): explain runs
    nothing, on a fake process group of its own. ``hardware`` (a profile's
    name, ``fxshard.ir.cost.PROFILES``, or ``Rates``) predicts the step's time on it:
    the report's ``predicted_step_seconds``, exposed communication and MFU; ``policy=auto()``
    needs it, to choose by time.
    """
    config = CompileConfig.build("explain", policy=policy, **options)
    rates = hardware if isinstance(hardware, Rates) or hardware is None else cost_profile(hardware)
    if mesh_shape is not None:
        shape = tuple(mesh_shape)
        if not 1 <= len(shape) <= 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise FxShardError(f"explain: mesh_shape takes (S,) or (R, S) with positive sizes, "
                               f"got {mesh_shape!r}")
        ranks = math.prod(shape)
        if world_size not in (None, ranks):
            raise FxShardError(f"explain: world_size={world_size} but mesh_shape={shape} has {ranks} "
                               "ranks; pass one of them")
        world_size = ranks
    world_size = 1 if world_size is None else world_size
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise FxShardError(f"explain: {name} takes a whole number of ranks, not {value!r} "
                               f"({type(value).__name__}): e.g. world_size=8, rank=0")
    if world_size < 1 or not 0 <= rank < world_size:
        raise FxShardError(f"explain: need 0 <= rank < world_size, got rank {rank} of {world_size}")
    if dist.is_initialized():
        raise FxShardError(
            "fxshard.explain runs without a cluster, on a fake process group of its own; a "
            "process group is already initialised here. Call explain before "
            "init_process_group, or in a separate process."
        )
    target, planned_for, kernels = _planning_device(device)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    fake_mode = None if target.type == "meta" else compat.fake_tensor.FakeTensorMode()

    def like(t: torch.Tensor) -> torch.Tensor:
        """``t``'s shape and dtype on the planning device: a meta tensor, or a fake tensor
        of ``fake_mode`` that claims the device and allocates nothing (so the trace takes
        the device's kernels, attention's fused ones for one, and counts their memory)."""
        if fake_mode is None:
            return torch.empty_like(t, device="meta")
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=target)

    meta_model = _copy_with(model, like)
    meta_args = pytree.tree_map(lambda x: like(x) if isinstance(x, torch.Tensor) else x, args)
    meta_model.train(train)
    _create_on(meta_model, target)
    # The fake backend reads nothing from its store: any public store does.
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        if mesh_shape is not None:
            from torch.distributed.device_mesh import init_device_mesh

            process_group, no_shard, hsdp = from_mesh(init_device_mesh("cpu", tuple(mesh_shape)))
            config = replace(config, process_group=process_group, no_shard=no_shard, hsdp=hsdp)
        driver = Driver(config, runs=False)
        driver.rates = rates
        with torch.set_grad_enabled(train), fake_mode or contextlib.nullcontext(), kernels:
            sharded = shard_module(meta_model, driver, meta_args, allow_meta=True)
        step = driver.steps[-1]
        return Explanation(sharded.plan, sharded.graphs, driver.report(step),
                           step.pass_log or PassLog(), world_size, rank, tuple(step.passes), driver,
                           planned_for=planned_for)
    finally:
        dist.destroy_process_group()
