"""Planning for a device this machine lacks: the kernels it would take, traced on meta.

``explain(device="cuda")`` traces on fake CUDA tensors where torch sees a CUDA
device. Where it sees none, fake CUDA tensors cannot be traced through
backward (the autograd engine needs the device's context, pytorch#92627), so
explain traces on meta tensors instead, inside ``cuda_kernels()``: the one
kernel choice that changes a step's memory, attention's, is made the way
CUDA makes it. On meta, ``scaled_dot_product_attention`` takes the math
kernel, which keeps the (sequence x sequence) score matrix for backward, in
fp32; CUDA takes a fused kernel, which keeps the output and one log-sum-exp
per row. Everything else a plan counts (shapes, dtypes, the collectives, the
optimizer's default implementation, which meta shares with the accelerators)
does not depend on the device.

CUDA's choice (``sdp_utils.cpp``, sm80 and newer): the first of cuDNN,
flash and memory-efficient attention whose constraints hold, else math. cuDNN
and flash attention keep the same tensors for backward (the output and a
log-sum-exp of the query's rows), so flash attention stands for both; where
neither applies (an fp32 query, a head size flash attention refuses), the
memory-efficient kernel, which keeps the same two; with an explicit
``attn_mask`` the math kernel, as on meta (a planning approximation: CUDA
would take the memory-efficient kernel, and keep less).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor | None:
    """The output of the fused kernel CUDA would run for these arguments, on meta; None
    where it would run the math kernel (or where this emulation does not model it)."""
    tensors = (query, key, value)
    if attn_mask is not None or any(t.dim() != 4 or t.device.type != "meta" for t in tensors):
        return None
    head, value_head = query.size(-1), value.size(-1)
    if key.size(-1) != head or query.size(0) != key.size(0) or key.size(-2) != value.size(-2):
        return None
    if query.size(1) != key.size(1) and not (enable_gqa and query.size(1) % key.size(1) == 0):
        return None
    causal_square = not is_causal or query.size(-2) == key.size(-2)
    if query.dtype in _HALF and head == value_head and head <= 256 and head % 8 == 0 and causal_square:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                        scale=scale)[0]
    if query.size(1) != key.size(1):  # grouped-query attention: flash attention only
        return None
    alignment = 8 if query.dtype in _HALF else 4
    if head % alignment == 0 and value_head % alignment == 0:
        compute_log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return aten._scaled_dot_product_efficient_attention(query, key, value, None, compute_log_sumexp,
                                                            dropout_p, is_causal, scale=scale)[0]
    return None


class cuda_kernels(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` on meta tensors runs the fused
    kernel CUDA would choose (its meta kernel, and in backward its backward's)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _fused_attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
