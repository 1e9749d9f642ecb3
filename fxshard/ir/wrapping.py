"""Wrapping policies: which modules become FSDP units.

Policies are immutable values that compose with ``|``::

    policy = by_class(Block) | by_size(1_000_000)

The planner walks the module tree bottom-up (post-order), as FSDP's auto-wrap
does, and asks the policy about every module except the root. A module the
policy accepts becomes a unit and claims the parameters under it that no unit
below it has claimed. Whatever is left belongs to the root unit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from fxshard.ir.compat import OpOverloadPacket, op_name


@dataclass(frozen=True)
class WrapQuery:
    """What a policy is told about one candidate module."""

    name: str  # module path, e.g. "layers.3"
    module: nn.Module
    unwrapped_numel: int  # parameters under it that no unit below it claims


class Policy:
    """Base class. Subclasses are frozen dataclasses implementing ``wraps``."""

    def wraps(self, query: WrapQuery) -> bool:
        raise NotImplementedError

    def __or__(self, other: Policy) -> Policy:
        if not isinstance(other, Policy):
            return NotImplemented
        left = self.policies if isinstance(self, AnyOf) else (self,)
        right = other.policies if isinstance(other, AnyOf) else (other,)
        return AnyOf(left + right)


@dataclass(frozen=True)
class BySize(Policy):
    """FSDP's size-based auto-wrap: wrap once ``min_params`` unclaimed parameters are reached."""

    min_params: int

    def __post_init__(self) -> None:
        if self.min_params <= 0:
            raise ValueError(f"by_size(min_params={self.min_params}): min_params must be positive")

    def wraps(self, query: WrapQuery) -> bool:
        return query.unwrapped_numel >= self.min_params

    def __repr__(self) -> str:
        return f"by_size({self.min_params:_})"


@dataclass(frozen=True)
class ByClass(Policy):
    """Layer-class policy: every instance of one of ``classes`` is a unit."""

    classes: tuple[type[nn.Module], ...]

    def __post_init__(self) -> None:
        bad = [c for c in self.classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not self.classes:
            raise TypeError(f"by_class takes nn.Module subclasses, got {bad or 'nothing'}")

    def wraps(self, query: WrapQuery) -> bool:
        return isinstance(query.module, self.classes)

    def __repr__(self) -> str:
        return "by_class(" + ", ".join(c.__name__ for c in self.classes) + ")"


@dataclass(frozen=True)
class ByPredicate(Policy):
    """Wrap where ``fn(name, module)`` is true."""

    fn: Callable[[str, nn.Module], bool]

    def wraps(self, query: WrapQuery) -> bool:
        return bool(self.fn(query.name, query.module))

    def __repr__(self) -> str:
        return f"by_predicate({getattr(self.fn, '__qualname__', repr(self.fn))})"


@dataclass(frozen=True)
class AnyOf(Policy):
    """``a | b``: wrap where any member policy wraps."""

    policies: tuple[Policy, ...]

    def wraps(self, query: WrapQuery) -> bool:
        return any(p.wraps(query) for p in self.policies)

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


@dataclass(frozen=True)
class Auto(Policy):
    """``policy=auto()``: the units, buckets, prefetch depth and resharding that fxshard
    predicts fastest within ``memory_budget``, chosen from a trace of the model
    (``fxshard.driver.compile.plan_auto``). ``units`` pins the unit boundaries: then only buckets,
    prefetch and resharding are chosen. ``extrapolate``: a model most of whose parameters
    are a stack of many identical blocks (a ``ModuleList`` or ``Sequential`` of at least
    ``fxshard.ir.auto.MIN_BLOCKS``) is predicted from its first 3, 4 and 5 blocks and scaled
    to all of them (``fxshard.ir.auto.scaled``): by default (None) where the whole model's
    graph would have more than ``fxshard.ir.auto.MIN_NODES`` nodes, ``True`` wherever such a
    stack is, ``False`` never (every plan predicted from the whole model's graph). Not a
    wrapping rule itself: the driver replaces it with the policy it
    chose before anything is planned."""

    units: Policy | None = None
    extrapolate: bool | None = None

    def __post_init__(self) -> None:
        if self.units is not None and (not isinstance(self.units, Policy) or isinstance(self.units, Auto)):
            raise TypeError(f"auto(units=...) takes a wrapping policy (by_class(Block), by_size(n), ...), "
                            f"got {self.units!r}")
        if self.extrapolate is not None and not isinstance(self.extrapolate, bool):
            raise TypeError(f"auto(extrapolate=...) takes None, True or False, got {self.extrapolate!r}")

    def wraps(self, query: WrapQuery) -> bool:
        raise TypeError("auto() chooses a policy from a trace; it cannot answer for one module "
                        "(fxshard.compile and fxshard.explain resolve it), nor be combined with |")

    def __repr__(self) -> str:
        args = ([] if self.units is None else [f"units={self.units!r}"]) + \
            ([] if self.extrapolate is None else [f"extrapolate={self.extrapolate}"])
        return f"auto({', '.join(args)})"


def auto(units: Policy | None = None, *, extrapolate: bool | None = None) -> Policy:
    """The plan fxshard predicts fastest within ``memory_budget`` (see :class:`Auto`)."""
    return Auto(units, extrapolate)


_aten = torch.ops.aten

# What selective activation checkpointing saves by default: the outputs of
# matmuls, convolutions and attention (torchtitan's and torch's SAC examples
# save these); everything cheaper is recomputed.
SAVE_BY_DEFAULT: tuple[OpOverloadPacket, ...] = (
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
)


@dataclass(frozen=True)
class Selective(Policy):
    """Selective activation checkpointing: in the regions ``policy`` selects,
    the outputs of the ``save`` operators are kept and the rest recomputed."""

    policy: Policy
    save: tuple[OpOverloadPacket, ...] = SAVE_BY_DEFAULT

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise TypeError(f"selective takes a policy (by_class(Block), ...), got {self.policy!r}")
        bad = [op for op in self.save if not isinstance(op, OpOverloadPacket)]
        if bad:
            raise TypeError(f"selective(save=...) takes aten operators such as torch.ops.aten.mm, got {bad}")

    def wraps(self, query: WrapQuery) -> bool:
        return self.policy.wraps(query)

    def __repr__(self) -> str:
        if self.save == SAVE_BY_DEFAULT:
            return f"selective({self.policy!r})"
        return f"selective({self.policy!r}, save=({', '.join(op_name(op) for op in self.save)}))"


def by_size(min_params: int | float) -> Policy:
    if isinstance(min_params, bool) or not isinstance(min_params, (int, float)):
        raise TypeError(f"by_size takes a number of parameters, such as by_size(1e8) or by_size(100_000_000), "
                        f"not {min_params!r} ({type(min_params).__name__})")
    return BySize(int(min_params))


def by_class(*module_classes: type[nn.Module]) -> Policy:
    return ByClass(tuple(module_classes))


def by_predicate(fn: Callable[[str, nn.Module], bool]) -> Policy:
    return ByPredicate(fn)


def selective(policy: Policy, save: tuple[OpOverloadPacket, ...] | None = None) -> Policy:
    """For ``activation_checkpointing=``: recompute the regions ``policy`` selects except
    the outputs of ``save`` (default: matmuls, convolutions, attention)."""
    return Selective(policy, SAVE_BY_DEFAULT if save is None else tuple(save))


def auto_needs_a_batch(who: str, block: str) -> str:
    """Why ``who`` (a front end that shards before its first batch: Lightning's strategy, the
    HF Trainer) refuses ``policy=auto()``, which plans from a trace on example inputs."""
    return (f"policy=auto() chooses its units from a trace of the model on a batch (example_inputs=), which "
            f"{who} shards before any batch: pin a policy (e.g. by_class(<your {block}>)), after "
            "fxshard.explain(model, batch, policy=auto()) shows what auto() chooses")
