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


class ShardGrad(torch.Tensor):
    """A flat shard's gradient; ``fxshard_group`` is the process group it is sharded over."""

    fxshard_group: dist.ProcessGroup

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func is torch.linalg.vector_norm and kwargs.get("dim", args[2] if len(args) > 2 else None) is None:
            return _global_norms([args[0]], [result], _ord(args, kwargs))[0]
        if func is torch._foreach_norm:
            return _global_norms(list(args[0]), list(result), _ord(args, kwargs))
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
        local = torch.stack([norms[i] for i in indices]).to(torch.float32)
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
            result[i] = combined[k].to(norms[i].dtype)
    return result


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
