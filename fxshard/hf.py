"""The Hugging Face ``Trainer`` with fxshard: ``FxShardTrainer(model, args, ..., policy=...)``.

Accelerate's distributed types are a closed enum, so fxshard enters the
Trainer as a subclass (as optimum-neuron's ``NeuronTrainer`` does), at the
Trainer's own override points. Where each step of its loop meets fxshard::

    Trainer (transformers 5)              FxShardTrainer
    _wrap_model, create_optimizer    ->   fxshard.compile(model) once; the optimizer over its shards
    accelerator.prepare(model)       ->   skipped: the wrapped model is not ``self.model``
    accelerator.no_sync(model)       ->   ShardedModule.no_sync (accelerate calls model.no_sync)
    accelerator.clip_grad_norm_      ->   torch's clip_grad_norm_ on the shards: the global norm
    model.zero_grad()                ->   ShardedModule.zero_grad (drops no_sync's pending sums)
    save_model                       ->   full state dict gathered to rank 0, model.save_pretrained
    optimizer.pt in checkpoints      ->   full optimizer state keyed by parameter name
    resume, load_best_model_at_end   ->   each rank loads its slices (load_safetensors,
                                          set_optimizer_state_dict)

``self.model`` stays the Hugging Face model (a skeleton once compiled: its
config, generation config and ``save_pretrained`` still work, its forward
refuses), and ``self.model_wrapped`` is the ``ShardedModule``, as the Trainer
keeps DDP's wrapper there.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer_optimizer import is_optimizer_factory

from fxshard.api import ShardedModule
from fxshard.api import compile as compile_module
from fxshard.checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_safetensors,
    set_optimizer_state_dict,
)
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError
from fxshard.ir.precision import MixedPrecision
from fxshard.ir.wrapping import Auto, Policy, auto_needs_a_batch, by_class

__all__ = ["FxShardTrainer", "default_policy"]

OPTIMIZER_NAME = "optimizer.pt"  # the Trainer's names, inside a checkpoint-N directory
SCHEDULER_NAME = "scheduler.pt"


def default_policy(model: nn.Module) -> Policy | None:
    """One unit per module of the classes the model names in ``_no_split_modules`` (its
    decoder layers), as Accelerate's FSDP plugin wraps by default; None if it names none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = list(dict.fromkeys(type(m) for m in model.modules() if type(m).__name__ in names))
    return by_class(*classes) if classes else None


def refusals(args: TrainingArguments | None, model: Any = None, optimizers: Any = (None, None)) -> list[str]:
    """What FxShardTrainer cannot honour in these arguments, each with its fix."""
    problems: list[str] = []
    if isinstance(model, ShardedModule):
        problems.append("model is a ShardedModule: pass the unsharded model, FxShardTrainer "
                        "compiles it (policy=, fxshard_options=)")
    if any(o is not None for o in (optimizers or (None, None))):
        problems.append("optimizers=(optimizer, scheduler): an optimizer built before fxshard.compile "
                        "steps the model's original parameters, not its shards; pass "
                        "optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}) instead, or override "
                        "create_optimizer / create_scheduler")
    if args is None:
        return problems
    if args.fsdp:
        problems.append("fsdp= asks Accelerate for torch FSDP; FxShardTrainer shards the model with "
                        "fxshard: remove fsdp= and fsdp_config=")
    if args.deepspeed:
        problems.append("deepspeed= asks for DeepSpeed; FxShardTrainer shards the model with fxshard: "
                        "remove deepspeed=")
    if getattr(args, "parallelism_config", None) is not None:
        problems.append("parallelism_config= (tensor, context or sequence parallelism) is not supported "
                        "by FxShardTrainer: remove it")
    if args.torch_compile:
        problems.append("torch_compile=True (or torch_compile_backend/mode) wraps the model in "
                        "torch.compile; fxshard compiles the step itself: remove it, and pass "
                        "fxshard_options={'compute': 'inductor'} to have Inductor compile fxshard's graphs")
    if args.fp16:
        problems.append("fp16=True is not supported by FxShardTrainer: use bf16=True (fxshard's "
                        "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))")
    if args.fp16_full_eval or args.bf16_full_eval:
        problems.append("fp16_full_eval / bf16_full_eval cast the model for evaluation, which a "
                        "ShardedModule cannot be: remove them (bf16=True computes in bf16 throughout)")
    if args.activation_checkpointing:
        problems.append("activation_checkpointing=True (gradient_checkpointing) wraps layers in "
                        "torch.utils.checkpoint; fxshard recomputes by policy: remove it and pass "
                        "fxshard_options={'activation_checkpointing': by_class(DecoderLayer)}")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size=True re-wraps the model after an out-of-memory error, "
                        "which a ShardedModule cannot be: set per_device_train_batch_size yourself "
                        "(fxshard's report() predicts a step's peak memory)")
    if args.label_smoothing_factor:
        problems.append("label_smoothing_factor>0: the Trainer decides whether to shift labels from the "
                        "wrapped model's class, which is ShardedModule here: compute the smoothed loss "
                        "with compute_loss_func= instead")
    return problems


def compile_options(args: TrainingArguments | None, policy: Policy | None,
                    fxshard_options: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``fxshard.compile``'s keyword arguments for these Trainer arguments, checked now (before
    any process group exists), and what is wrong with them."""
    options = dict(fxshard_options)
    problems: list[str] = []
    # The Trainer's two optimizer groups (weight decay, and none for biases and norm weights)
    # are chosen by parameter name: the original parameters, as views of the shards.
    options.setdefault("use_orig_params", True)
    if args is not None and args.weight_decay and not options["use_orig_params"]:
        problems.append(f"weight_decay={args.weight_decay} with fxshard_options use_orig_params=False: "
                        "the Trainer exempts biases and norm weights from weight decay by name, which "
                        "flat shards do not have. Leave use_orig_params at its default (True)")
    if "policy" in options:
        problems.append("fxshard_options names 'policy': pass it as FxShardTrainer(policy=...)")
        options.pop("policy")
    if isinstance(policy, Auto):
        problems.append(auto_needs_a_batch("the Trainer", "decoder layer"))
    if args is not None and args.ddp_broadcast_buffers is not None:  # DDP's broadcast_buffers, as the Trainer's DDP
        chosen = options.setdefault("broadcast_buffers", bool(args.ddp_broadcast_buffers))
        if chosen != bool(args.ddp_broadcast_buffers):
            problems.append(f"ddp_broadcast_buffers={args.ddp_broadcast_buffers}, but fxshard_options names "
                            f"broadcast_buffers={chosen}: drop one")
    if args is not None and args.bf16:
        precision = options.setdefault(
            "mixed_precision", MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        if getattr(precision, "param_dtype", None) is not torch.bfloat16:
            problems.append(f"bf16=True, but fxshard_options names mixed_precision={precision!r}: set "
                            "its param_dtype=torch.bfloat16, or drop bf16=True")
    try:
        CompileConfig.build("compile", policy=policy, **options)
    except (TypeError, ValueError) as e:
        problems.append(f"fxshard_options: {e}")
    return options, problems


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise FxShardError("FxShardTrainer cannot run with these arguments:\n  - " + "\n  - ".join(problems))


class FxShardTrainer(Trainer):
    """A ``transformers.Trainer`` that trains the model sharded by ``fxshard.compile``.

    Takes the Trainer's arguments, and:

    - ``policy``: the units (``fxshard.policies``); default: one per module of the
      classes in the model's ``_no_split_modules`` (its decoder layers).
    - ``fxshard_options``: the other keyword arguments of ``fxshard.compile``
      (``reshard_after_forward``, ``mixed_precision``, ``activation_checkpointing``,
      ``memory_budget``, ...).

    ``bf16=True`` is ``mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)`` unless ``fxshard_options`` names one. The model
    is compiled at the first ``train()``, ``evaluate()`` or ``create_optimizer()``,
    on the device the Trainer placed it on. Arguments it cannot honour raise an
    ``FxShardError`` that lists each with its fix.
    """

    def __init__(self, *args: Any, policy: Policy | None = None,
                 fxshard_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        given = inspect.signature(Trainer.__init__).bind_partial(self, *args, **kwargs).arguments
        training_args = given.get("args")
        problems = refusals(training_args, given.get("model"), given.get("optimizers", (None, None)))
        options, more = compile_options(training_args, policy, fxshard_options or {})
        _raise_if(problems + more)
        self.fxshard_policy = policy
        self.fxshard_options = options
        super().__init__(*args, **kwargs)
        problems = []
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            problems.append("Accelerate was configured for FSDP or DeepSpeed (accelerate launch's "
                            "config, or ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED): launch with "
                            "torchrun, or an Accelerate config without them")
        if self.args.n_gpu > 1:
            problems.append(f"this process sees {self.args.n_gpu} GPUs, which the Trainer would drive with "
                            "nn.DataParallel: launch one process per GPU (torchrun --nproc-per-node)")
        _raise_if(problems)

    # -- the model and its optimizer -------------------------------------------------------------

    @property
    def sharded(self) -> ShardedModule | None:
        """The compiled model, once compiled (``self.model_wrapped``)."""
        wrapped = self.model_wrapped
        return wrapped if isinstance(wrapped, ShardedModule) else None

    def _shard(self) -> ShardedModule:
        """``self.model`` compiled, once; ``self.model_wrapped`` holds it."""
        if self.sharded is not None:
            return self.sharded
        model = self.model
        if model is None:
            raise FxShardError("FxShardTrainer has no model to compile: pass model= or model_init=")
        policy = self.fxshard_policy if self.fxshard_policy is not None else default_policy(model)
        sharded = compile_module(model, policy=policy, **self.fxshard_options)
        self.model_wrapped = sharded
        return sharded

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # The Trainer passes model_wrapped (training) or model (evaluation): either way, the shards.
        return self._shard()

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (``optim=``, ``optimizer_cls_and_kwargs=``) in the Trainer's two
        groups: ``args.weight_decay`` for the parameters ``get_decay_parameter_names`` names, none
        for the rest (biases, norm weights), over the original parameters as views of the shards
        (``use_orig_params``, FxShardTrainer's default). With ``use_orig_params=False``: one
        group over the flat shards, ``args.weight_decay`` then 0."""
        sharded = self._shard()
        if self.optimizer is None:
            if self.optimizer_cls_and_kwargs is not None:
                optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
            else:
                optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(
                    self.args, self.model if isinstance(self.model, PreTrainedModel) else None)
            per_module = sorted({"params", "model", "optimizer_dict"} & set(optimizer_kwargs))
            if per_module or is_optimizer_factory(optimizer_cls):
                raise FxShardError(
                    f"optim={self.args.optim!r} builds its optimizer from the model's modules, which "
                    "a ShardedModule does not have: use an element-wise optimizer (adamw_torch, "
                    "adamw_torch_fused, sgd, adafactor, ...)"
                )
            named = [(n, p) for n, p in sharded.named_parameters() if p.requires_grad]
            if sharded._driver.orig is not None:  # the Trainer's own rule, by the original names
                assert self.model is not None  # _shard compiled it
                decay = set(self.get_decay_parameter_names(self.model))
                groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                          {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            else:
                groups = [{"params": [p for _, p in named], "weight_decay": self.args.weight_decay}]
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    # -- saving ---------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``from_pretrained``-ready weights: every rank gathers the full state dict under the
        model's own names (a collective), rank 0 writes it with the model's ``save_pretrained``
        (``model.safetensors``, ``config.json``), as the Trainer does for DDP."""
        sharded = self.sharded
        if sharded is None:  # not compiled yet: the model still holds its weights
            super().save_model(output_dir, _internal_call)
            return
        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self._save(output_dir, state_dict=full)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        assert opt is not None
        return opt

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The Trainer saves rank 0's optimizer.state_dict(): here that would be rank 0's shard
        # state only. Save the full state, keyed by parameter name, which loads at any world size.
        sharded = self.sharded
        if sharded is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        full = get_optimizer_state_dict(sharded, self._torch_optimizer(),
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            torch.save(full, os.path.join(output_dir, OPTIMIZER_NAME))
            if self.lr_scheduler is not None:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        sharded = self.sharded
        if checkpoint is None or sharded is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer_file = os.path.join(checkpoint, OPTIMIZER_NAME)
        if not os.path.isfile(optimizer_file):
            raise FxShardError(f"resuming from {checkpoint}: it holds no {OPTIMIZER_NAME} (saved with "
                               "save_only_model=True?): resume from a checkpoint saved with it")
        full = torch.load(optimizer_file, map_location="cpu", weights_only=True)
        set_optimizer_state_dict(sharded, self._torch_optimizer(), full)  # each rank keeps its slice
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME),
                                                         weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        sharded = self.sharded
        if sharded is None:  # the first train(): the weights load into the model, compiled after
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        load_safetensors(sharded, resume_from_checkpoint)  # each rank reads its pieces

    def _load_best_model(self) -> None:
        # The Trainer loads into self.model, whose parameters are meta stand-ins once compiled.
        sharded, best = self.sharded, self.state.best_model_checkpoint
        if sharded is None or best is None:
            super()._load_best_model()
            return
        load_safetensors(sharded, best)
