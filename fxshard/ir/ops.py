"""fxshard's ``torch.library`` namespace.

``unshard`` and ``reduce_grad`` are trace-time markers: they stand for "this
flat shard becomes the full flat parameter" and "this full flat gradient
becomes the shard's gradient". They carry shape (fake) and autograd rules so
that AOTAutograd traces through them, and the rewriting passes lower them to
``torch.ops._c10d_functional`` collectives. Running one unlowered is a bug, so
their eager kernels raise.

``replicate`` and ``allreduce_grad`` are the same pair for parameters kept
whole on every rank (``replicate_below``): no gather; the gradient is
all-reduced.

``free`` releases a gathered buffer's storage. It is declared as mutating its
argument, so ``fx`` treats it as impure and dead-code elimination keeps it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


@torch.library.custom_op("fxshard::unshard", mutates_args=())
def unshard(shard: Tensor, group: int, world_size: int) -> Tensor:
    raise RuntimeError(
        "fxshard::unshard is a trace-time marker and must be lowered by "
        "insert_all_gather_pass before the graph runs"
    )


@unshard.register_fake
def _unshard_fake(shard: Tensor, group: int, world_size: int) -> Tensor:
    return shard.new_empty(shard.numel() * world_size)


@torch.library.custom_op("fxshard::reduce_grad", mutates_args=())
def reduce_grad(grad: Tensor, group: int, world_size: int) -> Tensor:
    raise RuntimeError(
        "fxshard::reduce_grad is a trace-time marker and must be lowered by "
        "insert_reduce_scatter_pass before the graph runs"
    )


@reduce_grad.register_fake
def _reduce_grad_fake(grad: Tensor, group: int, world_size: int) -> Tensor:
    return grad.new_empty(grad.numel() // world_size)


def _unshard_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.group, ctx.world_size = inputs[1], inputs[2]


def _unshard_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    return torch.ops.fxshard.reduce_grad(grad, ctx.group, ctx.world_size), None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


@torch.library.custom_op("fxshard::replicate", mutates_args=())
def replicate(param: Tensor, group: int, world_size: int) -> Tensor:
    raise RuntimeError(
        "fxshard::replicate is a trace-time marker and must be lowered by "
        "insert_all_gather_pass before the graph runs"
    )


@replicate.register_fake
def _replicate_fake(param: Tensor, group: int, world_size: int) -> Tensor:
    return torch.empty_like(param)


@torch.library.custom_op("fxshard::allreduce_grad", mutates_args=())
def allreduce_grad(grad: Tensor, group: int, world_size: int) -> Tensor:
    raise RuntimeError(
        "fxshard::allreduce_grad is a trace-time marker and must be lowered by "
        "insert_reduce_scatter_pass before the graph runs"
    )


@allreduce_grad.register_fake
def _allreduce_grad_fake(grad: Tensor, group: int, world_size: int) -> Tensor:
    return torch.empty_like(grad)


def _replicate_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    return torch.ops.fxshard.allreduce_grad(grad, ctx.group, ctx.world_size), None, None


replicate.register_autograd(_replicate_backward, setup_context=_unshard_setup)


@torch.library.custom_op("fxshard::free", mutates_args=("buf",))
def free(buf: Tensor) -> None:
    # Views share the storage, so this releases the gathered buffer for all of them.
    buf.untyped_storage().resize_(0)


@free.register_fake
def _free_fake(buf: Tensor) -> None:
    return None


UNSHARD = torch.ops.fxshard.unshard.default
REDUCE_GRAD = torch.ops.fxshard.reduce_grad.default
REPLICATE = torch.ops.fxshard.replicate.default
ALLREDUCE_GRAD = torch.ops.fxshard.allreduce_grad.default
FREE = torch.ops.fxshard.free.default
