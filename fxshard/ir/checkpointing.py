"""Activation checkpointing: which regions of the model backward recomputes.

``fxshard.compile(model, policy, activation_checkpointing=by_class(Block))``
takes the same policy values as the sharding policy. The planner resolves
the policy against the module tree once, into a ``Checkpointing`` value: the
module paths of the regions (outermost only: a region inside another is
recomputed with it), and for selective checkpointing the operators whose
outputs are saved anyway (matmuls, attention: expensive to recompute, as
torch's selective activation checkpointing saves them).

``checkpoint_activations_pass`` (fxshard/passes/) reads it; like the plan it is
plain data, decided before any graph exists.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.nn as nn

from fxshard.ir.compat import OpOverloadPacket
from fxshard.ir.wrapping import SAVE_BY_DEFAULT, Policy, Selective, WrapQuery


@dataclass(frozen=True)
class Checkpointing:
    regions: tuple[str, ...]  # module paths, outermost regions only, in registration order
    # Regions checkpointed selectively: there the outputs of ``saved_ops``
    # (overload packets) are saved and everything else is recomputed. In the
    # other regions everything is recomputed.
    selective: frozenset[str] = frozenset()
    saved_ops: tuple[OpOverloadPacket, ...] = SAVE_BY_DEFAULT
    policy: str = ""

    def region_of(self, path: str | None) -> str | None:
        """The region a node traced in module ``path`` belongs to, if any."""
        if path is None:
            return None
        for region in self.regions:
            if path == region or path.startswith(region + "."):
                return region
        return None

    def saves(self, target: object, region: str) -> bool:
        """Is the output of ``target`` in ``region`` saved rather than recomputed?"""
        packet = getattr(target, "overloadpacket", None)
        return region in self.selective and packet is not None and packet in self.saved_ops


def plan_checkpointing(module: nn.Module, policy: Policy | None, quiet: bool = False) -> Checkpointing | None:
    """The regions ``policy`` selects in ``module`` (never the root), outermost first wins; a
    policy that selects none warns (``quiet``: not the user's, nothing to warn about).

    Asked like the sharding policy: bottom-up, each module with the number of
    parameters under it that no region below it has claimed.
    """
    if policy is None:
        return None
    if not isinstance(policy, Policy):
        raise TypeError(
            "activation_checkpointing takes a policy built with fxshard.policies (by_class(Block), "
            f"by_size(n), selective(...)), got {policy!r}"
        )
    chosen: list[str] = []

    def visit(path: str, mod: nn.Module) -> int:
        unclaimed = sum(visit(f"{path}.{name}" if path else name, child)
                        for name, child in mod.named_children())
        unclaimed += sum(p.numel() for p in mod.parameters(recurse=False))
        if path and policy.wraps(WrapQuery(path, mod, unclaimed)):
            chosen.append(path)
            return 0
        return unclaimed

    visit("", module)
    if not chosen and not quiet:
        warnings.warn(
            f"activation_checkpointing={policy!r} matched no module of {type(module).__name__} (the root "
            "is never a region): nothing is recomputed, and every activation is saved. Check the "
            "policy's classes or threshold.", stacklevel=3)
    outermost = [p for p in chosen if not any(p.startswith(q + ".") for q in chosen if q != p)]
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    regions = tuple(sorted(outermost, key=order.__getitem__))
    if isinstance(policy, Selective):
        return Checkpointing(regions, frozenset(regions), policy.save, repr(policy))
    return Checkpointing(regions, policy=repr(policy))
