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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from fxshard.ir.errors import FxShardError

# The dtypes a unit can be gathered and computed in (``param_dtype``).
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class Wire(Protocol):
    """How a flat group's gathers travel when not in its compute dtype: a value an option
    gives each group (``MixedPrecision.wire_for``; ``FlatGroup.wire``). ``key`` is the
    lowering table's wire (``fxshard/passes/lowering.py``), whose rows say what the chain
    computes; ``agrees``: its lowering agrees values over the ranks at the graph's start
    (``NodeInfo.agrees``), which ``batch_agreements_pass`` makes one collective per graph;
    ``str()`` is what the plan prints. The plan groups parameters by their wire, so a wire
    is hashable and equal to another of the same value (a frozen dataclass, as
    ``Quantized``)."""

    @property
    def key(self) -> str: ...

    @property
    def agrees(self) -> bool: ...


class Group(Protocol):
    """What ``MixedPrecision.refuse`` reads of a plan's flat group (``plan.FlatGroup``)."""

    @property
    def wire(self) -> Wire | None: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...


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

    @property
    def key(self) -> str:
        return f"quantized_{self.scaling}"

    @property
    def agrees(self) -> bool:
        """"tensor": each parameter's scale is agreed over the ranks before the gather."""
        return self.scaling == "tensor"

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
            # float8 unscaled: most small values round to 0 (param_dtype: refused at compile, naming
            # what the device computes in)
            if value is not None and value.itemsize == 1 and name != "param_dtype":
                raise TypeError(f"MixedPrecision.{name}={value}: a float8 dtype holds a value only with a scale, "
                                "which a cast does not keep (reduced in float8 unscaled, 39 of a toy's 87 "
                                "gradients became 0). Use torch.bfloat16 or torch.float16; to move weights in "
                                "float8, with scales, set gather_dtype")
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
    def wire(self) -> Wire | None:
        """How the gathers travel (None: in the compute dtype): quantized with ``gather_dtype``,
        ``gather_scaling`` resolved."""
        return None if self.gather_dtype is None else Quantized(self.gather_dtype, self.gather_scaling or "tensor")

    def wire_for(self, param: torch.Tensor, owner: nn.Module) -> Wire | None:
        """How the gathers of ``param`` registered in ``owner`` travel (None: in its compute
        dtype): quantized with ``gather_dtype``, unless the parameter is not floating point
        or is kept at full precision."""
        if not param.dtype.is_floating_point or isinstance(owner, self.full_precision_modules):
            return None
        return self.wire

    def refuse(self, groups: Sequence[Group], device: torch.device | None, *, no_shard: bool) -> None:
        """Refuse, with the fix, what this policy cannot do with a plan of ``groups`` on
        ``device`` (None or meta: nothing is probed on it; ``no_shard``: a NO_SHARD mesh):
        a ``param_dtype`` the device cannot multiply in; quantized gathers where nothing is
        gathered, where the compute dtype cannot hold their scales, or where the device has
        no such dtype."""
        probed = device if device is not None and device.type != "meta" else None
        if self.param_dtype is not None and probed is not None:
            _refuse_compute_dtype(self.param_dtype, probed)
        if self.gather_dtype is not None:
            _refuse_quantized(self.gather_dtype, groups, probed, no_shard)

    def dtypes_for(self, param: torch.Tensor, owner: nn.Module) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(gather/compute dtype, reduce dtype) of ``param`` registered in ``owner``; None: its own."""
        if (self.param_dtype is None and self.reduce_dtype is None) or not param.dtype.is_floating_point \
                or isinstance(owner, self.full_precision_modules):
            return None, None
        compute = self.param_dtype if self.param_dtype not in (None, param.dtype) else None
        reduce = self.reduce_dtype or self.param_dtype
        return compute, (reduce if reduce != (compute or param.dtype) else None)


def _refuse_compute_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a ``param_dtype`` this device cannot multiply in, before anything is sharded."""
    if dtype not in COMPUTE_DTYPES:
        # float8 matmuls on CPU "work" here, then the first gather fails in the backend
        # ("Invalid scalar type" on gloo): float8 training needs scaled matmuls instead.
        raise FxShardError(
            f"MixedPrecision(param_dtype={dtype}) is not supported: fxshard gathers the parameters "
            f"and computes in param_dtype, and {dtype} has no plain matmul and collective path "
            "(float8 training needs scaled matmuls, e.g. torchao's Float8Linear, inside the model). "
            f"Supported: {', '.join(map(str, COMPUTE_DTYPES))}."
        )
    try:
        probe = torch.ones(2, 2, device=device).to(dtype)
        probe @ probe
    except (RuntimeError, NotImplementedError) as e:
        raise FxShardError(
            f"MixedPrecision(param_dtype={dtype}) cannot compute on {device}: a matmul in it "
            f"fails ({type(e).__name__}: {str(e).strip().splitlines()[0]}). Use a dtype the device "
            "computes in (torch.bfloat16 on CPUs and recent GPUs, torch.float16 on older GPUs)."
        ) from None


def _refuse_quantized(dtype: torch.dtype, groups: Sequence[Group], device: torch.device | None,
                      no_shard: bool) -> None:
    """Refuse ``gather_dtype`` where it cannot work: nothing is gathered, a compute dtype whose
    range cannot hold the scales, or a device that has no such dtype."""
    quantized = [g for g in groups if isinstance(g.wire, Quantized)]
    if not quantized:
        why = ("a NO_SHARD mesh (N, 1) keeps every parameter whole on every rank" if no_shard
               else "every floating-point parameter is kept whole on every rank (replicate=, "
                    "replicate_below=) or at full precision (full_precision_modules)")
        raise FxShardError(
            f"MixedPrecision(gather_dtype={dtype}) quantizes the weight gathers, and this "
            f"plan gathers none: {why}. Shard the parameters (a (1, N) or (R, S) mesh), or drop gather_dtype")
    narrow = sorted({str(g.compute_dtype) for g in quantized if g.compute_dtype == torch.float16})
    if narrow:
        raise FxShardError(
            f"MixedPrecision(gather_dtype={dtype}) with a compute dtype of {narrow[0]}: "
            "the scales are kept in the compute dtype, and float16's range (smallest normal 6e-5) "
            "cannot hold the scale of a small weight (its largest magnitude over "
            f"{QUANTIZED_MAX[dtype]:g}). Compute in torch.bfloat16 "
            "(param_dtype=torch.bfloat16) or torch.float32")
    if device is None:
        return
    try:
        torch.ones(2, device=device).to(dtype).view(torch.uint8)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise FxShardError(
            f"MixedPrecision(gather_dtype={dtype}) cannot quantize on {device}: a cast to it "
            f"fails ({type(e).__name__}: {str(e).strip().splitlines()[0]}). Use another gather_dtype "
            f"(one of {[str(d) for d in QUANTIZED_MAX]}), or none") from None
