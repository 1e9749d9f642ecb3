"""Other libraries' spellings of fxshard's options, and what to write instead.

A user coming from FSDP1 (``FullyShardedDataParallel``), FSDP2 (``fully_shard``) or
Lightning's ``FSDPStrategy`` writes their names first. Where fxshard means the same thing
under another name, the error names the exact replacement, built from the value given
(``ModuleWrapPolicy({Block})`` becomes ``policy=fxshard.policies.by_class(Block)``).
Where the meaning is the same to the letter, the value is taken as it is: FSDP2's
``MixedPrecisionPolicy`` (``precision_from``) and ``CPUOffloadPolicy`` (``ShardingOptions``).

Nothing here decides anything: each function returns a hint, or None where the name or
value is not one it knows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch import nn

from fxshard.ir import compat
from fxshard.ir.precision import MixedPrecision
from fxshard.ir.wrapping import Policy


class ForeignOption(TypeError):
    """Another library's option given to fxshard: the message names what to write instead."""


# FSDP1's CPU offload, and FSDP2's spelling that fxshard takes.
FSDP1_OFFLOAD = (
    "fxshard takes FSDP2's spelling of CPU offload: replace "
    "cpu_offload=CPUOffload(offload_params=True) with "
    "offload_policy=fxshard.CPUOffloadPolicy() (pin_memory=True by default, as FSDP2's)"
)

_SHARDING_STRATEGY = {
    "FULL_SHARD": "FULL_SHARD is what fxshard.compile does by default: leave sharding_strategy out",
    "SHARD_GRAD_OP": "SHARD_GRAD_OP (ZeRO-2) is reshard_after_forward=False",
    "NO_SHARD": "NO_SHARD is mesh=init_device_mesh(device_type, (world_size, 1)): every parameter "
                "whole on every rank, its gradient all-reduced",
    "HYBRID_SHARD": "HYBRID_SHARD is a 2-D mesh=init_device_mesh(device_type, (replicas, shards)): "
                    "sharded within each row, replicated across rows (docs/launching.md)",
    "_HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2 is a 2-D mesh=init_device_mesh(device_type, "
                           "(replicas, shards)) with reshard_after_forward=False",
}

_RENAMED = {
    "mp_policy": "FSDP2's mp_policy= is fxshard's mixed_precision= (it takes FSDP2's MixedPrecisionPolicy "
                 "as it is, or fxshard.MixedPrecision)",
    "device_mesh": "FSDP1's device_mesh= is fxshard's mesh= (a DeviceMesh: 1-D shards, (R, S) is HSDP, "
                   "(N, 1) is NO_SHARD)",
    "device_id": "fxshard computes on the device the model's parameters are on: move the model there "
                 "before fxshard.compile (model.to(torch.device('cuda', local_rank))), or build it on "
                 "the meta device and give param_init_fn=; then the process group's device is used",
    "limit_all_gathers": "FSDP1's limit_all_gathers=True is fxshard's default, max_inflight_gathers=2 "
                         "(at most two gathered units alive at once); raise max_inflight_gathers for more",
    "activation_checkpointing_policy": "Lightning's activation_checkpointing_policy={Block} is "
                                       "fxshard's activation_checkpointing=fxshard.policies.by_class(Block)",
    "ignored_modules": "fxshard has no ignored modules: every parameter is sharded, or kept whole on "
                       "every rank with replicate=fxshard.policies.by_class(...) (its gradient "
                       "all-reduced); each is trained over the ranks",
}
_RENAMED["ignored_states"] = _RENAMED["ignored_params"] = _RENAMED["ignored_modules"]


# FSDP2's FSDPModule methods, called on a ShardedModule: what fxshard has instead. fxshard
# compiles the whole step's schedule before it runs, so what FSDP2 changes between steps by
# method is an option of fxshard.compile (a new compile to change it).
_COMPILED = "the schedule is compiled into the step's graphs, so it is an option of fxshard.compile"
FSDP2_METHODS = {
    "set_reshard_after_forward": f"{_COMPILED}: reshard_after_forward= (True, False or hpZ's int), "
                                 "or reshard_units= for some units",
    "set_modules_to_forward_prefetch": f"{_COMPILED}: forward_prefetch= and max_inflight_gathers= "
                                       "(prefetch order is the step's own)",
    "set_modules_to_backward_prefetch": f"{_COMPILED}: backward_prefetch= ('pre', 'post' or None) and "
                                        "max_inflight_gathers=",
    "set_reshard_after_backward": "fxshard frees each unit's gathered parameters after its backward "
                                  "always; a memory budget (memory_budget=) chooses what else to keep",
    "set_unshard_in_backward": "fxshard gathers a unit in backward exactly where its graph uses it",
    "unshard": "the gathers are nodes of the step's graphs, issued by the step itself; for the whole "
               "parameters use sharded.full_state_dict() (a collective), and to run the model call it",
    "reshard": "the frees are nodes of the step's graphs: nothing is left gathered between steps",
    "set_is_last_backward": "with sharded.no_sync() (or set_requires_gradient_sync(False)) backward "
                            "accumulates without communication until a backward outside it",
    "set_requires_all_reduce": "fxshard has no switch for HSDP's all-reduce across replicas alone; "
                               "set_requires_gradient_sync(False) skips it and the reduce-scatter, "
                               "accumulating unsharded sums until a backward with True",
    "set_gradient_divide_factor": "fxshard averages gradients over the ranks, as DDP and FSDP do by "
                                  "default; scale the loss for another factor",
    "set_reduce_scatter_divide_factor": "fxshard averages gradients over the ranks, as DDP and FSDP do "
                                        "by default; scale the loss for another factor",
    "set_force_sum_reduction_for_comms": "fxshard averages gradients over the ranks, as DDP and FSDP do "
                                         "by default; reduce_in_rank_order=True fixes the order of the "
                                         "sum (fxshard.compile's option)",
}
_NO_COUNTERPART = ("set_all_reduce_hook", "set_custom_all_gather", "set_custom_reduce_scatter",
                   "set_post_optim_event", "set_allocate_memory_from_process_group_for_comm",
                   "set_reduce_scatter_max_input_buffers", "set_reduce_scatter_unused_params",
                   "set_separate_reduce_scatter_group", "set_symm_mem_for_comm", "reset_iter_state")
FSDP2_METHODS.update(dict.fromkeys(
    _NO_COUNTERPART, "fxshard has no counterpart: its collectives are torch's functional collectives, "
                     "placed and waited on in the compiled step (docs/scheduling.md)"))


def fsdp2_method(name: str) -> str | None:
    """Why a ShardedModule has no FSDP2 method ``name``, and what to use; None: not one."""
    why = FSDP2_METHODS.get(name)
    return None if why is None else f"ShardedModule has no {name}() (FSDP2's FSDPModule method): {why}"


def foreign_option(name: str, value: Any) -> str | None:
    """What fxshard takes for another library's option ``name=value``; None: not one known."""
    if name == "cpu_offload":
        return FSDP1_OFFLOAD
    if name == "auto_wrap_policy":
        found = policy_hint(value)
        return ("FSDP's auto_wrap_policy= is fxshard's policy=: "
                + (found or "by_class(Block) wraps each Block as transformer_auto_wrap_policy and "
                   "ModuleWrapPolicy do, by_size(n) as size_based_auto_wrap_policy(min_num_params=n), "
                   "and fxshard.policies.auto() chooses the units for speed"))
    if name == "sharding_strategy":
        member = getattr(value, "name", value)
        return _SHARDING_STRATEGY.get(member, "fxshard has no sharding_strategy=: " + "; ".join(
            _SHARDING_STRATEGY.values())) if isinstance(member, str) else None
    return _RENAMED.get(name)


def _classes(value: Any) -> list[type[nn.Module]] | None:
    if isinstance(value, type) and issubclass(value, nn.Module):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = list(value)
        if items and all(isinstance(c, type) and issubclass(c, nn.Module) for c in items):
            return items
    return None


def _spelled(classes: list[type[nn.Module]]) -> str:
    return "policy=fxshard.policies.by_class(" + ", ".join(c.__name__ for c in classes) + ")"


def policy_hint(value: Any) -> str | None:
    """fxshard's policy for FSDP1's or Lightning's wrap policy ``value`` (a ``ModuleWrapPolicy``,
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=...)`` or
    ``partial(size_based_auto_wrap_policy, min_num_params=n)``, a module class or a set of them),
    as the text to write; None where ``value`` is none of those."""
    if isinstance(value, Policy):
        return f"policy={value!r}"
    classes = _classes(value) or _classes(compat.wrap_policy_classes(value))
    if classes:
        return _spelled(classes)
    if isinstance(value, functools.partial):
        name = getattr(value.func, "__name__", "")
        if name == "transformer_auto_wrap_policy" and _classes(value.keywords.get("transformer_layer_cls")):
            return _spelled(_classes(value.keywords["transformer_layer_cls"]) or [])
        if name == "size_based_auto_wrap_policy":
            n = value.keywords.get("min_num_params", 100_000_000)  # FSDP1's default
            return f"policy=fxshard.policies.by_size({n})"
    return None


def precision_from(value: Any) -> MixedPrecision | None:
    """fxshard's ``MixedPrecision`` for FSDP2's ``MixedPrecisionPolicy`` ``value``: the same four
    fields with the same meaning (FSDP2 casts inputs in every ``fully_shard`` module, fxshard in
    every unit). None where ``value`` is not one."""
    if type(value).__name__ != "MixedPrecisionPolicy" or not hasattr(value, "cast_forward_inputs"):
        return None
    return MixedPrecision(param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype,
                          output_dtype=value.output_dtype, cast_forward_inputs=bool(value.cast_forward_inputs))


def fsdp1_precision_hint(value: Any) -> str | None:
    """The replacement for FSDP1's ``MixedPrecision`` ``value``, or None where it is not one."""
    if type(value).__name__ != "MixedPrecision" or not hasattr(value, "keep_low_precision_grads"):
        return None
    given = ", ".join(f"{f}={getattr(value, f)}" for f in ("param_dtype", "reduce_dtype")
                      if getattr(value, f) is not None)
    lost = [f"{f}={getattr(value, f)!r}" for f, default in (("buffer_dtype", None), ("keep_low_precision_grads", False))
            if getattr(value, f) != default]
    return (f"fxshard takes FSDP2's mixed precision: replace FSDP1's MixedPrecision(...) with "
            f"fxshard.MixedPrecision({given}) (or FSDP2's MixedPrecisionPolicy); it casts the inputs of "
            "every unit to param_dtype, and full_precision_modules=(...) keeps modules such as batch "
            "norms in their own dtype"
            + (f". {' and '.join(lost)} have no counterpart: buffers keep their dtype and gradients "
               "arrive in the parameters' dtype" if lost else ""))
