"""Mixed precision, with the semantics of FSDP2's ``MixedPrecisionPolicy``.

The flat shards, and so the optimizer's state, keep the parameters' own dtype
(fp32: the master weights). Each flat group is cast to ``param_dtype`` just
before its all-gather, so the gather moves half the bytes and the unit
computes in ``param_dtype``; its gradient is cast to ``reduce_dtype`` before
the reduce-scatter and the reduced shard gradient back to the shard's dtype.
The casts are nodes of the emitted graphs (insert_all_gather_pass,
insert_reduce_scatter_pass), and the plan records each group's dtypes.

Parameters of modules of the ``full_precision_modules`` classes (norm layers,
say) are kept in their own flat groups, gathered and computed in their own
dtype, as FSDP1's ``_module_classes_to_ignore`` and FSDP2's per-module
policies allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MixedPrecision:
    # The dtype units gather and compute in; None: the parameters' own.
    param_dtype: torch.dtype | None = None
    # The dtype gradients are reduce-scattered in; None: param_dtype.
    reduce_dtype: torch.dtype | None = None
    # Floating-point outputs of the module are cast to it; None: left as computed.
    output_dtype: torch.dtype | None = None
    # Floating-point tensor inputs of the model, and of every unit, are cast to
    # param_dtype on entry (FSDP2: in every fully_shard module; trace.cast_unit_inputs).
    cast_forward_inputs: bool = True
    # Modules of these classes keep their parameters' own dtype.
    full_precision_modules: tuple[type[nn.Module], ...] = ()

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecision.{name} must be a floating-point torch.dtype such as "
                                f"torch.bfloat16, or None; got {value!r}")
        classes = self.full_precision_modules
        if not isinstance(classes, tuple) or not all(isinstance(c, type) for c in classes):
            raise TypeError("MixedPrecision.full_precision_modules must be a tuple of module classes, "
                            f"e.g. (torch.nn.LayerNorm,); got {classes!r}")

    def dtypes_for(self, param: torch.Tensor, owner: nn.Module) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(gather/compute dtype, reduce dtype) of ``param`` registered in ``owner``; None: its own."""
        if (self.param_dtype is None and self.reduce_dtype is None) or not param.dtype.is_floating_point \
                or isinstance(owner, self.full_precision_modules):
            return None, None
        compute = self.param_dtype if self.param_dtype not in (None, param.dtype) else None
        reduce = self.reduce_dtype or self.param_dtype
        return compute, (reduce if reduce != (compute or param.dtype) else None)
