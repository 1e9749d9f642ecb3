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

``gather_dtype`` quantizes the weight gathers (docs/recipe.md): each flat
group's shard is scaled and cast to ``torch.float8_e4m3fn``,
``torch.float8_e5m2`` or ``torch.int8``, its bytes gathered as uint8, and the
gathered buffer dequantized to the compute dtype. ``gather_scaling="tensor"``
is torchao's float8 all-gather: one scale per parameter, from its largest
magnitude agreed over the ranks by one all_reduce (MAX) per unit before the
gather. ``"block"`` is ZeRO++'s qwZ: each shard quantized in blocks of
``QUANTIZE_BLOCK`` elements, each with its own scale, gathered with the data;
no extra collective. The shards, the optimizer and the gradients are
untouched: only what crosses the network, and so what the unit computes with,
is rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

# The largest magnitude each quantized gather dtype holds: a shard is scaled so that its
# (a parameter's, a block's) largest magnitude lands on it.
QUANTIZED_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
    torch.int8: 127.0,  # symmetric: -127..127
}
SCALINGS = ("tensor", "block")
# "block": elements per block, at most (Quantized.block).
QUANTIZE_BLOCK = 256


@dataclass(frozen=True)
class Quantized:
    """How one flat group's gather is quantized: the dtype its bytes travel in, and whether a
    scale covers a parameter ("tensor") or a block of its shard ("block")."""

    dtype: torch.dtype
    scaling: str

    @property
    def max(self) -> float:
        return QUANTIZED_MAX[self.dtype]

    def block(self, shard_numel: int, scale_bytes: int = 4) -> int:
        """The block length for a shard of ``shard_numel`` elements ("block" scaling): as few
        blocks as hold at most ``QUANTIZE_BLOCK`` elements each, as equal as a multiple of
        ``max(4, scale_bytes)`` elements allows (the scales, of that many bytes each, follow
        the data in the gathered bytes and are read in place), so a shard is padded by less
        than that many elements a block."""
        align = max(4, scale_bytes)
        blocks = -(-shard_numel // QUANTIZE_BLOCK)
        per_block = -(-shard_numel // blocks)
        return -(-per_block // align) * align

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}/{self.scaling}"


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
    # The dtype weight gathers travel in, quantized and dequantized to param_dtype (None: not
    # quantized): torch.float8_e4m3fn, torch.float8_e5m2 or torch.int8.
    gather_dtype: torch.dtype | None = None
    # Where a quantized gather's scales come from: "tensor" (per parameter, agreed over the
    # ranks by an all_reduce before the gather: torchao's float8 all-gather) or "block" (per
    # block of each shard, gathered with it: ZeRO++'s qwZ). None: "tensor".
    gather_scaling: str | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecision.{name} must be a floating-point torch.dtype such as "
                                f"torch.bfloat16, or None; got {value!r}")
        if self.gather_dtype is not None and self.gather_dtype not in QUANTIZED_MAX:
            raise TypeError("MixedPrecision.gather_dtype must be one of "
                            f"{[str(d) for d in QUANTIZED_MAX]} (quantized weight gathers), or None; "
                            f"got {self.gather_dtype!r}. To gather in bfloat16, set param_dtype")
        if self.gather_scaling is not None and self.gather_dtype is None:
            raise ValueError(f"MixedPrecision.gather_scaling={self.gather_scaling!r} without gather_dtype: "
                             "nothing is quantized. Set gather_dtype (e.g. torch.float8_e4m3fn) too")
        if self.gather_scaling not in (None, *SCALINGS):
            raise ValueError(f"MixedPrecision.gather_scaling must be one of {SCALINGS}; "
                             f"got {self.gather_scaling!r}")
        classes = self.full_precision_modules
        if not isinstance(classes, tuple) or not all(isinstance(c, type) for c in classes):
            raise TypeError("MixedPrecision.full_precision_modules must be a tuple of module classes, "
                            f"e.g. (torch.nn.LayerNorm,); got {classes!r}")

    @property
    def quantized(self) -> Quantized | None:
        """How the gathers are quantized, ``gather_scaling`` resolved (None: no gather_dtype)."""
        return None if self.gather_dtype is None else Quantized(self.gather_dtype, self.gather_scaling or "tensor")

    def quantized_for(self, param: torch.Tensor, owner: nn.Module) -> Quantized | None:
        """How the gather of ``param`` registered in ``owner`` is quantized (None: it is not:
        no gather_dtype, a parameter that is not floating point, or one kept at full
        precision)."""
        if not param.dtype.is_floating_point or isinstance(owner, self.full_precision_modules):
            return None
        return self.quantized

    def dtypes_for(self, param: torch.Tensor, owner: nn.Module) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(gather/compute dtype, reduce dtype) of ``param`` registered in ``owner``; None: its own."""
        if (self.param_dtype is None and self.reduce_dtype is None) or not param.dtype.is_floating_point \
                or isinstance(owner, self.full_precision_modules):
            return None, None
        compute = self.param_dtype if self.param_dtype not in (None, param.dtype) else None
        reduce = self.reduce_dtype or self.param_dtype
        return compute, (reduce if reduce != (compute or param.dtype) else None)
