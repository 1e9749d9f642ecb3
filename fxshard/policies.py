"""Wrapping policies, under the name users import them by (``fxshard.policies``).

The definitions live with the rest of the plan's data in ``fxshard.ir.wrapping``.
The same values choose the regions of ``activation_checkpointing=``;
``selective(policy)`` saves matmul and attention outputs there and recomputes the rest.
"""

from fxshard.ir.wrapping import (
    SAVE_BY_DEFAULT,
    AnyOf,
    Auto,
    ByClass,
    ByPredicate,
    BySize,
    Policy,
    Selective,
    WrapQuery,
    auto,
    by_class,
    by_predicate,
    by_size,
    selective,
)

__all__ = ["SAVE_BY_DEFAULT", "AnyOf", "Auto", "ByClass", "ByPredicate", "BySize", "Policy", "Selective",
           "WrapQuery", "auto", "by_class", "by_predicate", "by_size", "selective"]
