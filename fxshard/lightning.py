"""PyTorch Lightning: ``Trainer(strategy=FxShardStrategy(policy=...))``, or ``strategy="fxshard"``.

Install with the ``lightning`` extra. Importing this module registers the name
``"fxshard"`` with Lightning's strategy registry::

    import fxshard.lightning  # noqa: F401   (registers "fxshard")
    trainer = L.Trainer(strategy="fxshard", accelerator="cpu", devices=2)
    trainer = L.Trainer(strategy=FxShardStrategy(policy=by_class(Block), activation_checkpointing=...))

What is sharded: the LightningModule's child module that holds its parameters
(usually ``self.model``), compiled with ``fxshard.compile`` when the strategy
sets up; ``training_step``'s own Python (the loss, ``self.log``) runs around it
as it is. Name it with ``module="..."`` when there are several. Build the model
in ``configure_model`` to build it on the meta device: fxshard then
materialises it one unit at a time (meta init).

Lightning's flags map onto fxshard's, as Lightning's FSDP strategies map them
onto FSDP's:

==========================  ==============================================================
``precision="bf16-mixed"``  ``fxshard.MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``
                            (gathers in bf16; no autocast)
``precision="16-mixed"``    the same in float16, with Lightning's ``GradScaler`` (fxshard makes
                            its inf check agree across ranks)
``"bf16-true"``/``"16-true"``  the module cast before it is sharded, as Lightning casts it
``gradient_clip_val``       the global norm over all ranks' shards (``clip_grad_norm_``)
``accumulate_grad_batches`` ``no_sync`` for the batches that do not step
``trainer.save_checkpoint`` a sharded DCP directory (``fxshard.checkpoint.save``: atomic,
                            checksummed), which ``fit(ckpt_path=...)`` resumes at any world size
==========================  ==============================================================

Any other keyword is an option of ``fxshard.compile`` (``activation_checkpointing``,
``memory_budget``, ``mesh``, ...). ``docs/integrations.md`` has the whole story.
"""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.plugins.precision.double import DoublePrecision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.optim import Optimizer

from fxshard.api import ShardedModule
from fxshard.api import compile as compile_module
from fxshard.checkpoint import get_model_state_dict, get_optimizer_state_dict, load, save
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError
from fxshard.ir.precision import MixedPrecision as FxShardPrecision
from fxshard.ir.wrapping import Auto, Policy, auto_needs_a_batch

__all__ = ["FxShardMixedPrecision", "FxShardStrategy"]

_EXTRA_KEY = "lightning"  # the Lightning checkpoint's own state, inside fxshard's checkpoint


class FxShardMixedPrecision(MixedPrecision):
    """Lightning's ``"bf16-mixed"`` / ``"16-mixed"`` under fxshard: the sharded module
    computes in the low dtype by its ``MixedPrecision`` (the gathers move half the bytes),
    so the forward runs without autocast. The fp16 ``GradScaler`` stays Lightning's."""

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        yield

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16


class FxShardStrategy(ParallelStrategy):
    """Fully sharded data parallel training of a LightningModule by fxshard.

    ``policy`` and ``**options`` are ``fxshard.compile``'s. ``module`` names the
    LightningModule's attribute to shard (default: its one child module that
    holds parameters). ``start_method`` is DDP's: ``"popen"`` runs the script
    once per device, ``"spawn"``/``"fork"`` start processes from this one.
    ``process_group_backend`` defaults to torch's for the device (gloo on CPU,
    nccl on CUDA, xccl on XPU).
    """

    strategy_name = "fxshard"

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        module: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        **options: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        for name in ("process_group", "example_inputs"):
            if name in options:
                raise TypeError(f"FxShardStrategy: {name}= is the strategy's to set; leave it out "
                                "(the process group is Lightning's world)")
        if "mixed_precision" in options:
            raise TypeError("FxShardStrategy: set mixed precision with Trainer(precision=...) "
                            "(\"bf16-mixed\", \"16-mixed\", \"bf16-true\"), not mixed_precision=")
        if isinstance(policy, Auto):
            raise TypeError("FxShardStrategy: " + auto_needs_a_batch("the strategy", "block"))
        CompileConfig.build("compile", policy=policy, **options)  # a bad option fails here, not in setup
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
            timeout = timedelta(seconds=timeout)  # seconds, as fxshard.compile(timeout=) takes them
        elif timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
            raise TypeError(f"FxShardStrategy(timeout={timeout!r}): the process group's timeout is a "
                            "datetime.timedelta or a positive number of seconds, e.g. timedelta(minutes=30), "
                            "over zero")
        self._policy = policy
        self._options = options
        self._module_name = module
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._process_group_timeout = timeout
        self.num_nodes = 1

    # -- the sharded module ------------------------------------------------------------------

    @property
    def sharded(self) -> ShardedModule:
        """The LightningModule's sharded child (after setup)."""
        assert self.lightning_module is not None
        child = getattr(self.lightning_module, self._child_name(self.lightning_module), None)
        if not isinstance(child, ShardedModule):
            raise FxShardError("FxShardStrategy: the model is not sharded yet (the Trainer shards it in setup)")
        return child

    def _child_name(self, lm: pl.LightningModule) -> str:
        if self._module_name is not None:
            if not isinstance(getattr(lm, self._module_name, None), nn.Module):
                raise FxShardError(f"FxShardStrategy(module={self._module_name!r}): {type(lm).__name__} "
                                   f"has no child module {self._module_name!r}")
            return self._module_name
        holders = [name for name, child in lm.named_children()
                   if isinstance(child, ShardedModule) or any(True for _ in child.parameters())]
        if len(holders) != 1:
            found = ", ".join(holders) or "none"
            raise FxShardError(
                f"FxShardStrategy shards one child module of {type(lm).__name__}, the one holding its "
                f"parameters, and found {len(holders)} ({found}). Put the model in one attribute "
                "(self.model = ...) or name the one to shard: FxShardStrategy(module=\"model\")"
            )
        return holders[0]

    def _shard(self, lm: pl.LightningModule) -> None:
        name = self._child_name(lm)
        child = getattr(lm, name)
        own = [n for n, p in lm.named_parameters() if not n.startswith(name + ".") and p.requires_grad]
        if own:
            raise FxShardError(
                f"FxShardStrategy shards {type(lm).__name__}.{name}, but {own} lie outside it and "
                f"would train on each rank alone. Move them into {name}."
            )
        if isinstance(child, ShardedModule):
            return  # sharded by an earlier fit/validate of this Trainer
        options = dict(self._options)
        if isinstance(self.precision_plugin, FxShardMixedPrecision):
            options["mixed_precision"] = FxShardPrecision(param_dtype=self.precision_plugin.param_dtype,
                                                          reduce_dtype=torch.float32)
        on_meta = any(t.is_meta for t in [*child.parameters(), *child.buffers()])
        if not on_meta:
            child.to(self.root_device)
        setattr(lm, name, compile_module(child, self._policy, **options))

    def _map_precision(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) is MixedPrecision:
            self.precision_plugin = FxShardMixedPrecision(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]
        elif not isinstance(plugin, (FxShardMixedPrecision, HalfPrecision, DoublePrecision)) \
                and type(plugin) is not Precision:
            raise FxShardError(
                f"FxShardStrategy does not support the precision plugin {type(plugin).__name__}: use "
                "Trainer(precision=...) with \"32-true\", \"bf16-mixed\", \"16-mixed\", \"bf16-true\" "
                "or \"16-true\""
            )

    # -- Lightning's strategy interface --------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning then gives each rank its part of the data (DistributedSampler)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards and the optimizer must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it, sharded

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                           self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = dist.get_default_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._process_group_timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup(self, trainer: pl.Trainer) -> None:
        if self._layer_sync is not None:  # Trainer(sync_batchnorm=True), which DDP's setup applies
            raise FxShardError(
                "FxShardStrategy does not synchronise BatchNorm's batch statistics over the ranks "
                "(Trainer(sync_batchnorm=True)): each rank would normalise with its own batch's, "
                "unlike Lightning's DDP. Leave sync_batchnorm off (each rank normalising with its own "
                "batch, as DDP without it), or use a normalisation without batch statistics (LayerNorm, "
                "GroupNorm)")
        assert self.model is not None and self.lightning_module is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._map_precision()
        self.model = self.precision_plugin.convert_module(self.model)
        self._shard(self.lightning_module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # after sharding: over the shards
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # the shards are made on the device; the rest moved before sharding (_shard)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        device: Any = torch.device("meta") if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device: fxshard materialises each unit's
        shards alone (``fxshard.compile``'s meta init)."""
        with torch.device("meta"):
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The batches of ``accumulate_grad_batches`` that do not step: fxshard's ``no_sync``."""
        with self.sharded.no_sync():
            yield

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if self.root_device.type != "cpu" and self.root_device.index is not None:
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def teardown(self) -> None:
        # Not Strategy.teardown: it moves the module to the CPU, which a ShardedModule refuses.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints ---------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's pieces (fxshard's sharded state dict), under the LightningModule's names."""
        assert self.lightning_module is not None
        name = self._child_name(self.lightning_module)
        pieces = get_model_state_dict(self.sharded)
        return {f"{name}.{k}": v for k, v in pieces.items()}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return get_optimizer_state_dict(self.sharded, optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint has loaded the shards

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint has loaded the optimizer's shards

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded DCP checkpoint at ``filepath`` (a directory): every rank writes its pieces;
        Lightning's own state (loops, callbacks, schedulers, hyperparameters) is stored in it
        as the checkpoint's ``extra``, so the whole is written atomically and checksummed."""
        if storage_options is not None:
            raise TypeError("FxShardStrategy.save_checkpoint takes no storage_options: it writes with "
                            "torch.distributed.checkpoint, not a CheckpointIO")
        path = Path(self.broadcast(str(filepath)))
        checkpoint = dict(checkpoint)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        extra = {_EXTRA_KEY: base64.b64encode(buffer.getvalue()).decode("ascii")}
        save(path, self.sharded, self.optimizers, extra=extra)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            raise FxShardError(
                f"FxShardStrategy loads the sharded checkpoints it saves (directories); {path} is not one. "
                "For a single-file checkpoint, load its state dict into the model before fit, or "
                "use fxshard.checkpoint.load_safetensors."
            )
        extra = load(path, self.sharded, self.optimizers)
        if not extra or _EXTRA_KEY not in extra:
            raise FxShardError(f"{path} is an fxshard checkpoint without Lightning's state: it was not "
                               "written by trainer.save_checkpoint under FxShardStrategy")
        raw = io.BytesIO(base64.b64decode(extra[_EXTRA_KEY]))
        # As Lightning's own load: None is torch.load's default (weights_only=True).
        loaded: dict[str, Any] = torch.load(raw, map_location="cpu", weights_only=weights_only)
        return loaded

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("fxshard", cls, description="fxshard: FSDP as graph-rewriting passes")


if "fxshard" not in StrategyRegistry:
    FxShardStrategy.register_strategies(StrategyRegistry)

