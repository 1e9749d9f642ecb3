"""Gradients of flat shards whose norms are the norms of the whole gradient.

``torch.nn.utils.clip_grad_norm_(sharded.parameters(), max_norm)`` is what
every recipe calls (HF Trainer, Lightning, torchtitan). On plain tensors it
would compute each rank's local norm and clip each rank by a different factor.
FSDP2 gets it right because its shards are DTensors; fxshard's shards are plain
flat tensors, so instead each shard's ``.grad`` is a ``ShardGrad``: the same
storage, with a ``__torch_function__`` that answers the two norm functions
torch's clipping calls, ``torch.linalg.vector_norm`` (one tensor) and
``torch._foreach_norm`` (a list), with the norm of the unsharded gradient:
each rank's local norms are combined across the ranks by one all_reduce per
call (the sum of p-th powers, or the max for the inf-norm). Everything else
torch computes itself, so ``error_if_nonfinite``, ``foreach`` and the clip
coefficient behave exactly as in torch. Any other operation on a ShardGrad
runs as on a plain tensor and returns plain tensors.

The shard's padding is zero in every gradient, so it adds nothing to a norm.
``torch.amp.GradScaler`` (fp16) is made correct the same way: its
``unscale_`` calls ``torch._amp_foreach_non_finite_check_and_unscale_`` on
the gradients, and on ShardGrads the ``found_inf`` flag it sets is then the
maximum over the ranks, so an inf in one rank's shard skips the step on every
rank, and every rank lowers the scale alike.

Replicated groups (``replicate_below``) hold the whole gradient on every rank
and keep plain gradients.

A norm of a shard gradient is a collective: every rank must compute it
(clip on every rank, as with DDP and FSDP).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxshard.driver.run.runtime import comm_device
from fxshard.ir import compat


class ShardGrad(torch.Tensor):
    """A flat shard's gradient; ``fxshard_group`` is the process group it is sharded over."""

    fxshard_group: dist.ProcessGroup

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        with compat.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func is torch.linalg.vector_norm and kwargs.get("dim", args[2] if len(args) > 2 else None) is None:
            return _global_norms([args[0]], [result], _ord(args, kwargs))[0]
        if func is compat.foreach_norm:
            return _global_norms(list(args[0]), list(result), _ord(args, kwargs))
        if func is compat.amp_foreach_non_finite_check_and_unscale_:
            _agree_on_inf(list(args[0]), args[1] if len(args) > 1 else kwargs["found_inf"])
        return result


def _ord(args: Sequence[Any], kwargs: dict[str, Any]) -> float:
    return float(kwargs.get("ord", args[1] if len(args) > 1 else 2.0))


def _global_norms(tensors: list[torch.Tensor], norms: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """``norms`` of ``tensors`` (this rank's part), with each ShardGrad's made global."""
    result = list(norms)
    by_group: dict[str, list[int]] = {}
    groups: dict[str, dist.ProcessGroup] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, ShardGrad):
            group = t.fxshard_group
            by_group.setdefault(group.group_name, []).append(i)
            groups[group.group_name] = group
    for name, indices in by_group.items():
        # Offloaded shards' norms are on the host: the reduction runs where the group
        # communicates (nccl reduces device tensors only).
        local = torch.stack([norms[i] for i in indices]).to(comm_device(groups[name]), torch.float32)
        if math.isinf(p):
            op = dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN
            dist.all_reduce(local, op=op, group=groups[name])
            combined = local
        elif p == 0:  # the number of nonzero elements
            dist.all_reduce(local, group=groups[name])
            combined = local
        else:
            powers = local.pow(p)
            dist.all_reduce(powers, group=groups[name])
            combined = powers.pow(1.0 / p)
        for k, i in enumerate(indices):
            result[i] = combined[k].to(norms[i].device, norms[i].dtype)
    return result


def _agree_on_inf(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """torch.amp.GradScaler's check found an inf or NaN in this rank's shards: every rank skips
    the step (the max over the ranks), or none does."""
    groups = {g.fxshard_group.group_name: g.fxshard_group for g in grads if isinstance(g, ShardGrad)}
    for group in groups.values():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def install(shards: Sequence[nn.Parameter], sharded: Sequence[bool], group: dist.ProcessGroup) -> None:
    """Make the ``.grad`` of every shard with ``sharded[i]`` a ShardGrad, after each backward."""

    def wrap(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and not isinstance(grad, ShardGrad):
            wrapped = grad.as_subclass(ShardGrad)
            wrapped.fxshard_group = group
            param.grad = wrapped

    for shard, is_sharded in zip(shards, sharded):
        if is_sharded and shard.requires_grad:
            shard.register_post_accumulate_grad_hook(wrap)
