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
    ``str()`` is what the plan prints."""

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

    @property
    def wire(self) -> Wire | None:
        """How the gathers travel (None: in the compute dtype)."""
        return None

    def wire_for(self, param: torch.Tensor, owner: nn.Module) -> Wire | None:
        """How the gathers of ``param`` registered in ``owner`` travel (None: in its compute
        dtype): this policy's ``wire``, unless the parameter is not floating point or is kept
        at full precision."""
        if not param.dtype.is_floating_point or isinstance(owner, self.full_precision_modules):
            return None
        return self.wire

    def refuse(self, groups: Sequence[Group], device: torch.device | None, *, no_shard: bool) -> None:
        """Refuse, with the fix, what this policy cannot do with a plan of ``groups`` on
        ``device`` (None or meta: nothing is probed on it; ``no_shard``: a NO_SHARD mesh):
        a ``param_dtype`` the device cannot multiply in."""
        probed = device if device is not None and device.type != "meta" else None
        if self.param_dtype is not None and probed is not None:
            _refuse_compute_dtype(self.param_dtype, probed)

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

