"""Wrapping policies, under the name users import them by (``fxshard.policies``).

The definitions live with the rest of the plan's data in ``fxshard.ir.policies``.
"""

from fxshard.ir.policies import (
    AnyOf,
    ByClass,
    ByPredicate,
    BySize,
    Policy,
    WrapQuery,
    by_class,
    by_predicate,
    by_size,
)

__all__ = ["AnyOf", "ByClass", "ByPredicate", "BySize", "Policy", "WrapQuery", "by_class",
           "by_predicate", "by_size"]
