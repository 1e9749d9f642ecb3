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

With mixed precision the markers carry dtypes: ``unshard(shard, g, N,
dtype, reduce_dtype)`` is the full buffer in ``dtype``, and its gradient
``reduce_grad(grad, g, N, reduce_dtype, out_dtype)`` is reduced in
``reduce_dtype`` and returned in ``out_dtype`` (the shard's). None: no cast.

With offload the shard lives on the host and computes on a device: ``unshard``
and ``replicate`` then carry the ``device`` the full buffer is on, and their
gradient markers the ``out_device`` the shard's gradient goes back to. None:
the input's device.

``free`` releases a gathered buffer's storage. It is declared as mutating its
argument, so ``fx`` treats it as impure and dead-code elimination keeps it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


@torch.library.custom_op("fxshard::unshard", mutates_args=())
def unshard(shard: Tensor, group: int, world_size: int, dtype: torch.dtype | None = None,
            reduce_dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    raise RuntimeError(
        "fxshard::unshard is a trace-time marker and must be lowered by "
        "insert_all_gather_pass before the graph runs"
    )


@unshard.register_fake
def _unshard_fake(shard: Tensor, group: int, world_size: int, dtype: torch.dtype | None = None,
                  reduce_dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    return shard.new_empty(shard.numel() * world_size, dtype=dtype or shard.dtype,
                           device=device or shard.device)


@torch.library.custom_op("fxshard::reduce_grad", mutates_args=())
def reduce_grad(grad: Tensor, group: int, world_size: int, reduce_dtype: torch.dtype | None = None,
                out_dtype: torch.dtype | None = None, out_device: torch.device | None = None) -> Tensor:
    raise RuntimeError(
        "fxshard::reduce_grad is a trace-time marker and must be lowered by "
        "insert_reduce_scatter_pass before the graph runs"
    )


@reduce_grad.register_fake
def _reduce_grad_fake(grad: Tensor, group: int, world_size: int, reduce_dtype: torch.dtype | None = None,
                      out_dtype: torch.dtype | None = None, out_device: torch.device | None = None) -> Tensor:
    return grad.new_empty(grad.numel() // world_size, dtype=out_dtype or reduce_dtype or grad.dtype,
                          device=out_device or grad.device)


def _unshard_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.group, ctx.world_size = inputs[1], inputs[2]
    ctx.reduce_dtype = inputs[4] if len(inputs) > 4 else None
    ctx.shard_dtype = inputs[0].dtype
    # Offload: the full buffer on another device than the shard; its gradient goes back.
    ctx.out_device = inputs[0].device if len(inputs) > 5 and inputs[5] is not None else None


def _unshard_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    # The gradient of the shard is in the shard's dtype, reduced in reduce_dtype.
    out = ctx.shard_dtype if ctx.shard_dtype != (ctx.reduce_dtype or grad.dtype) else None
    return (torch.ops.fxshard.reduce_grad(grad, ctx.group, ctx.world_size, ctx.reduce_dtype, out,
                                          ctx.out_device),
            None, None, None, None, None)


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


@torch.library.custom_op("fxshard::replicate", mutates_args=())
def replicate(param: Tensor, group: int, world_size: int, dtype: torch.dtype | None = None,
              reduce_dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    raise RuntimeError(
        "fxshard::replicate is a trace-time marker and must be lowered by "
        "insert_all_gather_pass before the graph runs"
    )


@replicate.register_fake
def _replicate_fake(param: Tensor, group: int, world_size: int, dtype: torch.dtype | None = None,
                    reduce_dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    return torch.empty_like(param, dtype=dtype or param.dtype, device=device or param.device)


@torch.library.custom_op("fxshard::allreduce_grad", mutates_args=())
def allreduce_grad(grad: Tensor, group: int, world_size: int, reduce_dtype: torch.dtype | None = None,
                   out_dtype: torch.dtype | None = None, out_device: torch.device | None = None) -> Tensor:
    raise RuntimeError(
        "fxshard::allreduce_grad is a trace-time marker and must be lowered by "
        "insert_reduce_scatter_pass before the graph runs"
    )


@allreduce_grad.register_fake
def _allreduce_grad_fake(grad: Tensor, group: int, world_size: int, reduce_dtype: torch.dtype | None = None,
                         out_dtype: torch.dtype | None = None, out_device: torch.device | None = None) -> Tensor:
    return torch.empty_like(grad, dtype=out_dtype or reduce_dtype or grad.dtype, device=out_device or grad.device)


def _replicate_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    out = ctx.shard_dtype if ctx.shard_dtype != (ctx.reduce_dtype or grad.dtype) else None
    return (torch.ops.fxshard.allreduce_grad(grad, ctx.group, ctx.world_size, ctx.reduce_dtype, out,
                                             ctx.out_device),
            None, None, None, None, None)


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


# -- random operators replayed in backward (activation checkpointing) -----------------------
#
# Plain Python functions, not operators: the random operator inside runs
# through the dispatcher like any other, so a TorchDispatchMode active around
# the step (MemTracker, FlopCounterMode) sees it. torch's own higher-order
# operators of the same meaning (torch._prims.rng_prims) refuse modes that do
# not declare support for them; Inductor, which lowers those, gets them
# instead (checkpoint_activations_pass picks).


def generator_state(device: torch.device) -> Tensor:
    """The state of ``device``'s default generator (a CPU uint8 tensor); an accelerator's
    through its device module (torch.cuda, torch.xpu, ...). Meta (explain) has none: the CPU's."""
    if device.type in ("cpu", "meta"):
        return torch.get_rng_state()
    state: Tensor = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _set_generator_state(device: torch.device, state: Tensor) -> None:
    if device.type in ("cpu", "meta"):
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Where a random operator draws: its ``device=`` (torch.rand), else its first tensor's."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    return next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))


def run_and_save_rng_state(op: Any, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
    """``(state, op(*args))``: the generator state ``op`` draws from, and its result."""
    return generator_state(_device_of(args, kwargs)), op(*args, **kwargs)


def run_with_rng_state(state: Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args)`` drawing from generator ``state``; the generator is left as it was."""
    device = _device_of(args, kwargs)
    current = generator_state(device)
    _set_generator_state(device, state)
    try:
        return op(*args, **kwargs)
    finally:
        _set_generator_state(device, current)
