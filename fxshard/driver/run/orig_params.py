"""The original parameters as views of this rank's flat shards (``use_orig_params=True``).

FSDP1's option of the same name. Each of the model's parameters becomes an
``nn.Parameter`` under its original name, holding the part of it this rank's
flat shard holds: a 1-D view of the shard's storage (empty where this rank
holds none of it). An optimizer built over them steps the shards in place, so
the recipe's per-parameter groups work as under DDP: weight decay by name
(the HF Trainer's, nanoGPT's), a learning rate per group. ``p.full_shape``
is the parameter's unsharded shape.

Gradients stay the flat shards' own (the compiled backward writes them), and
each view's ``.grad`` is the matching view of its shard's gradient, made
again after every backward. What the optimizer does to the views' gradients
is carried back into the shard's gradient before the next backward and
before no_sync's bookkeeping reads it (:meth:`OrigParams.sync`), FSDP1's
rule: a view whose gradient is None has its range zeroed (all of them None:
the shard's gradient is dropped), and a gradient assigned to a view is copied
into the range.

A rule that reads shapes cannot see the original ones (``p.dim()`` is 1 for
every view): groups that look chosen that way are refused at the first step
(:func:`shape_grouping`), naming ``p.full_shape`` and the grouping by name; so are
such groups over the flat shards, naming ``use_orig_params=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn

from fxshard.driver.run.grads import ShardGrad
from fxshard.ir.errors import FxShardError
from fxshard.ir.plan import FlatGroup, ParamSlot, ShardPlan


class OrigParams:
    """The views of one model's flat shards, by original name."""

    def __init__(self, plan: ShardPlan, shards: Sequence[nn.Parameter], rank: int, order: Sequence[str]):
        """``order``: the model's parameter names as its ``named_parameters()`` yields them,
        the order the views are given in."""
        self.shards = shards
        views_by_name: dict[str, nn.Parameter] = {}
        # id(view) -> (flat group, slot): how optimizer state is named and assembled
        self.slot_of: dict[int, tuple[FlatGroup, ParamSlot]] = {}
        # per flat group: its views and their ranges in the shard
        self.ranges: list[list[tuple[nn.Parameter, slice]]] = []
        for group, shard in zip(plan.groups, shards):
            views = []
            for slot in group.params:
                piece = group.piece(slot, rank)
                where = piece.shard if piece is not None else slice(0, 0)
                view = nn.Parameter(shard.data[where], requires_grad=group.requires_grad)
                view.full_shape = torch.Size(slot.shape)  # type: ignore[attr-defined]
                views_by_name[slot.name] = view
                self.slot_of[id(view)] = (group, slot)
                views.append((view, where))
            self.ranges.append(views)
            if shard.requires_grad:
                shard.register_post_accumulate_grad_hook(
                    lambda s, g=group.index: self.refresh([g]))
        self.views: dict[str, nn.Parameter] = {name: views_by_name[name] for name in order}

    def refresh(self, groups: Sequence[int] | None = None) -> None:
        """Each view's ``.grad``: the view of its shard's gradient (a ShardGrad where that
        is one, so norms over the views are global), or None."""
        for g in range(len(self.shards)) if groups is None else groups:
            grad = self.shards[g].grad
            for view, where in self.ranges[g]:
                view.grad = None if grad is None else _slice(grad, where)

    def sync(self) -> None:
        """Carry what was done to the views' gradients into the shards' gradients (FSDP1's
        rule, see the module's docstring)."""
        for g, shard in enumerate(self.shards):
            if not shard.requires_grad:
                continue
            grad = shard.grad
            live = [(v, w) for v, w in self.ranges[g] if w.stop > w.start]
            if not live:
                continue
            if all(v.grad is None for v, _ in live):
                shard.grad = None
                continue
            for view, where in live:
                if view.grad is None:
                    if grad is not None:
                        _plain(grad)[where].zero_()
                elif grad is None or not _is_view_of(view.grad, grad, where):
                    if grad is None:
                        grad = shard.grad = torch.zeros_like(shard)
                    _plain(grad)[where].copy_(view.grad)
            self.refresh([g])


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, ShardGrad) else t


def _slice(grad: torch.Tensor, where: slice) -> torch.Tensor:
    part = _plain(grad)[where]
    if isinstance(grad, ShardGrad):
        wrapped = part.as_subclass(ShardGrad)
        wrapped.fxshard_group = grad.fxshard_group
        return wrapped
    return part


def _is_view_of(t: torch.Tensor, grad: torch.Tensor, where: slice) -> bool:
    return (t.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
            and t.storage_offset() == grad.storage_offset() + where.start
            and t.numel() == where.stop - where.start)


def shape_grouping(optimizer: torch.optim.Optimizer, slots: Mapping[int, Sequence[ParamSlot]],
                   views: bool) -> str | None:
    """Why ``optimizer``'s groups look chosen by a rule that cannot see the original
    parameters, or None. ``slots``: id(parameter) -> the original parameters it holds.

    nanoGPT chooses weight decay by ``p.dim() >= 2``, which is 1 for every flat shard and
    every view; HF's rule by name finds no bias among ``flat_params.N``, a layer-wise
    learning rate no head. Over flat shards (``views`` False) any groups that differ in a
    setting, one of them empty, are refused: no rule by name or shape sees the original
    parameters there. Over the views, groups by ``p.dim()``: one empty, and another, with a
    different ``weight_decay``, holding matrices and vectors (biases, norm weights) alike."""
    groups = optimizer.param_groups
    if len(groups) < 2 or all(pg["params"] for pg in groups) or not any(pg["params"] for pg in groups):
        return None
    differ = sorted(k for k in {k for pg in groups for k in pg} - {"params"}
                    if len({repr(pg.get(k)) for pg in groups}) > 1)
    if not differ:
        return None
    empty = ", ".join(str(i) for i, pg in enumerate(groups) if not pg["params"])
    if differ == ["weight_decay"]:
        # The Hugging Face Trainer's groups: no decay for vectors, empty where a model has none.
        # Empty where the others hold vectors too: the rule by p.dim() or by name saw no vector.
        held = [pg for pg in groups if {len(slot.shape) >= 2 for p in pg["params"]
                                        for slot in slots.get(id(p), ())} == {True, False}]
        if not held:
            return None
        if views:
            return (f"{type(optimizer).__name__}'s param_groups look chosen by p.dim(): one is "
                    f"empty, and one (weight_decay={held[0].get('weight_decay')}) holds both matrices "
                    "and vectors. With use_orig_params=True each parameter is a 1-D view of this "
                    "rank's shard, so p.dim() is 1 for all of them. Choose by the original shape, "
                    "len(p.full_shape) >= 2, or by name from sharded.named_parameters().")
    elif views:
        return None  # groups by the model's own names: an empty one is the user's own rule
    return (f"{type(optimizer).__name__}'s param_groups differ in {', '.join(differ)}, and group {empty} "
            f"of {len(groups)} is empty: it holds flat shards (sharded.parameters() without "
            "use_orig_params, named flat_params.N, each 1-D and holding a unit's parameters together), "
            "where a rule by name or by p.dim() cannot find the original parameters, so they would "
            "step with another group's settings. Compile with use_orig_params=True and choose the "
            "groups from sharded.named_parameters(), by name or by len(p.full_shape) >= 2.")


# Optimizers that read more of a parameter than each element (by class name: torch's, and the
# Hugging Face, apex and DeepSpeed ones of the same names), and what they read. fxshard steps
# flat shards, or 1-D views of them, each rank its own piece of each parameter.
NOT_ELEMENTWISE = {
    "Adafactor": "its second moments are factored over each parameter's rows and columns, and it "
                 "scales each step by the parameter's root mean square",
    "LBFGS": "its line search takes dot products over every parameter at once",
    "Muon": "it orthogonalises each matrix's whole update",
    "Shampoo": "its preconditioners are each parameter's row and column statistics",
    "DistributedShampoo": "its preconditioners are each parameter's row and column statistics",
    **dict.fromkeys(("LAMB", "Lamb", "FusedLAMB", "LARS", "Lars", "FusedLARS"),
                    "it scales each parameter's update by that parameter's norm"),
}


def refuse_not_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer whose update of an element reads other elements of its parameter (a
    factored moment, a norm, a line search) computes something else on a shard, silently."""
    for cls in type(optimizer).__mro__:
        why = NOT_ELEMENTWISE.get(cls.__name__)
        if why is not None:
            raise FxShardError(
                f"{type(optimizer).__name__} is not element-wise: {why}. fxshard steps flat shards "
                "(or, with use_orig_params=True, 1-D views of them), each rank its own piece of "
                "each parameter, so it would train something else than on the whole parameters. "
                "Use an element-wise optimizer (torch.optim.AdamW, Adam, SGD, RMSprop, Adagrad, ...).")


def refuse_mixed(optimizer: torch.optim.Optimizer, orig: OrigParams) -> None:
    """An optimizer over both the views and the flat shards would step each element twice."""
    shards = {id(s) for s in orig.shards}
    params = [p for pg in optimizer.param_groups for p in pg["params"]]
    if any(id(p) in shards for p in params) and any(id(p) in orig.slot_of for p in params):
        raise FxShardError(
            f"{type(optimizer).__name__} steps both flat shards (sharded.flat_params) and the "
            "original parameters' views (use_orig_params=True): each element would be stepped "
            "twice. Build it over sharded.parameters() (the views) only.")


def check(optimizer: torch.optim.Optimizer, orig: OrigParams) -> None:
    """Before an optimizer step over the views."""
    refuse_mixed(optimizer, orig)
    why = shape_grouping(optimizer, {i: (slot,) for i, (_, slot) in orig.slot_of.items()}, views=True)
    if why is not None:
        raise FxShardError(why)
