"""What changes while a sharded module trains, apart from what its compile decided.

The ``Driver`` compiles: configuration, world, plan, shards, pipelines and the
compiled steps. ``RunState`` holds what running them changes, step by step:

- ``no_sync``: whether backward reduces gradients (``requires_gradient_sync``),
  each flat group's unsharded gradient sum while it does not (``accumulators``),
  the groups whose sum waits to be reduced (``pending``), and each such group's
  shard gradient as the backward that last added to its sum found it (``marks``:
  a ``zero_grad`` since then drops the sum, as it drops DDP's accumulated ``.grad``);
- the buffer broadcast (DDP's ``broadcast_buffers``: before the first forward,
  and after each grad-enabled one) and the module whose buffers it sends;
- the ranks' agreement on each phase's collectives (and on what the driver
  settles with it at a step's forward: ``run``'s ``share``), and ``abandoned``,
  set once a phase of a step leaves by an exception;
- each parameter's and flat shard's ``requires_grad`` when the model was sharded,
  checked before every step.

``run`` runs one compiled step against this state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fxshard.driver.run.consistency import Agreement, Share, describe_step, with_buffer_broadcast
from fxshard.driver.run.orig_params import OrigParams
from fxshard.driver.run.runtime import Abandoned, World, broadcast_buffers, collective_failure
from fxshard.ir import compat
from fxshard.ir.errors import CollectiveMismatchError, FxShardError
from fxshard.ir.plan import ShardPlan
from fxshard.passes.context import GradSync

if TYPE_CHECKING:
    from fxshard.driver.compile.steps import CompiledStep  # the compile's values


class RunState:
    def __init__(self, world: World, compute: str, broadcast: bool):
        self.world = world
        self.compute = compute
        self.broadcast = broadcast
        self.requires_gradient_sync = True
        self.accumulators: dict[int, torch.Tensor] = {}
        self.pending: set[int] = set()
        self.shards: Sequence[nn.Parameter] = ()  # by flat group index
        # use_orig_params: the views an optimizer steps; their gradients are carried into
        # the shards' before anything here reads those
        self.orig: OrigParams | None = None
        # group -> (its shard's .grad's storage, that tensor's version) at the start of the
        # backward that last added to its pending sum. No reference to the gradient: autograd adds into a .grad in place only when
        # nothing else holds it.
        self.marks: dict[int, tuple[int, int]] = {}
        # (what to call it, tensor, requires_grad when planned): checked before every step.
        self.planned_requires_grad: list[tuple[str, torch.Tensor, bool]] = []
        self.module: nn.Module | None = None  # whose buffers broadcast_buffers broadcasts
        self.broadcast_next = True  # DDP's rule: the first forward, and after a grad-enabled one
        self.abandoned = Abandoned()
        self._agreement: Agreement | None = None
        self.abandoned.explain = self.explain  # a graph's failure, explained by the agreement

    # -- no_sync ------------------------------------------------------------------------------

    def grad_sync(self, groups: Iterable[int] | None = None) -> GradSync:
        """What a training step run now does with the gradients of ``groups`` (default: all):
        add them up inside ``no_sync``, else reduce them, with the sums still waiting.

        A group read by several graphs (the backend, with graph breaks) is flushed by
        the first of them to run: ``run`` takes it out of ``pending``.
        """
        self.drop_sums_of_cleared_grads()
        if not self.requires_gradient_sync:
            return GradSync(accumulate=True)
        pending = self.pending if groups is None else self.pending.intersection(groups)
        return GradSync(flush=frozenset(pending))

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.requires_gradient_sync = requires

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    def accumulators_for(self, plan: ShardPlan, device: torch.device) -> dict[int, torch.Tensor]:
        """One unsharded gradient sum per flat group with a gradient, made on first need."""
        if not self.accumulators:
            for g in plan.groups:
                if g.requires_grad:
                    dtype = g.reduce_dtype or g.compute_dtype
                    self.accumulators[g.index] = torch.zeros(g.padded_numel, dtype=dtype, device=device)
        return self.accumulators

    def drop_pending_sums(self, groups: Iterable[int] | None = None) -> None:
        """zero_grad: forget what no_sync has added up and not yet reduced (DDP's semantics:
        those gradients live in ``.grad``, which zero_grad clears)."""
        for g in list(self.pending if groups is None else groups):
            acc = self.accumulators.get(g)
            if acc is not None:  # as after a reduction: track_accumulation makes it anew
                acc.untyped_storage().resize_(0)
            self.pending.discard(g)
            self.marks.pop(g, None)

    def mark(self, g: int) -> None:
        """Group ``g``'s sum grows in the backward starting now: remember its shard's ``.grad``,
        made a zero gradient if there is none, so that an optimizer's ``zero_grad()`` (set to
        None, or zeroed in place) can be seen later. Under DDP those sums live in ``.grad``,
        where ``zero_grad`` drops them; here they live in an accumulator no optimizer knows."""
        shard = self.shards[g] if g < len(self.shards) else None
        if shard is None or not shard.requires_grad:
            return
        if shard.grad is None:
            shard.grad = torch.zeros_like(shard)
        grad = shard.grad
        self.marks[g] = (compat.storage_key(grad), compat.version(grad))

    def cleared(self) -> list[int]:
        """The marked groups whose shard gradient was cleared since their last backward (set to
        None or replaced: ``zero_grad()``; zeroed in place: ``zero_grad(set_to_none=False)``).
        A gradient changed in place to anything but zeros is refused: the sums, kept apart from
        ``.grad``, cannot follow it."""
        if self.orig is not None:
            self.orig.sync()
        cleared = []
        for g, (storage, version) in self.marks.items():
            now = self.shards[g].grad  # a ShardGrad of the same storage after a backward
            if now is None or compat.storage_key(now) != storage:
                cleared.append(g)
            elif compat.version(now) != version:
                if not bool(now.count_nonzero() == 0):
                    raise FxShardError(
                        f"the gradient of flat shard {g} was changed in place while no_sync() was "
                        "adding up gradients for it: those sums are kept apart from .grad until "
                        "the backward that reduces them, so they cannot follow the change. Change "
                        "gradients after that backward (outside no_sync()), or drop the sums with "
                        "zero_grad()."
                    )
                cleared.append(g)
        return cleared

    def drop_sums_of_cleared_grads(self) -> None:
        """Before a step is chosen, or an optimizer steps: drop the pending sums whose shard
        gradient was cleared since they last grew."""
        cleared = self.cleared()
        if cleared:
            self.drop_pending_sums(cleared)

    def at_backward(self, step: CompiledStep) -> None:
        """A training step's backward starts. A sum it reduces whose shard gradient was cleared
        since the sum last grew (a ``zero_grad()`` between this step's forward and backward,
        as DDP would have dropped it) is zeroed, so the graph adds nothing; then each sum it
        adds to is marked."""
        cleared = set(self.cleared())
        for g in step.grad_sync.flush:
            if g in cleared and (acc := self.accumulators.get(g)) is not None:
                acc.zero_()
            self.marks.pop(g, None)
        if step.grad_sync.accumulate:
            for g in sorted(step.groups & self.pending):
                if g in cleared and (acc := self.accumulators.get(g)) is not None:
                    acc.zero_()
                self.mark(g)
            if self.orig is not None:  # the zero gradients mark made
                self.orig.refresh()

    def refuse_step_over_pending_sums(self, optimizer: torch.optim.Optimizer, plan: ShardPlan) -> None:
        """An optimizer step while no_sync's sums wait to be reduced would step over shards
        without those gradients (None, or the previous step's), and the sums would then be
        added into the next step's."""
        self.drop_sums_of_cleared_grads()
        if not self.pending:
            return
        units = sorted({plan.groups[g].unit or "<root>" for g in self.pending})
        raise FxShardError(
            f"{type(optimizer).__name__}.step() ran while the gradients of units {units} are still "
            "being added up inside no_sync(): every backward since the last reduction ran inside "
            "no_sync(), so they were never reduced and the shards have no gradient from them. Run "
            "the last micro-batch's backward outside no_sync() (or after "
            "set_requires_gradient_sync(True)), then step. To drop the sums instead, call "
            "zero_grad() on the sharded module (DDP drops them at zero_grad)."
        )

    def track_accumulation(self, step: CompiledStep) -> None:
        """Before a training step runs: a fresh zero sum for each group it starts
        accumulating, and which sums it reduces (they are released by its backward)."""
        if step.grad_sync.accumulate:
            for g in sorted(step.groups - self.pending):
                acc = self.accumulators.get(g)
                if acc is None:
                    continue  # no gradient: nothing to add up
                acc.untyped_storage().resize_(acc.numel() * acc.element_size())
                acc.zero_()
                self.pending.add(g)
        else:
            self.pending -= step.grad_sync.flush

    # -- running a step -----------------------------------------------------------------------

    def check_requires_grad(self) -> None:
        """Refuse to run when a parameter's ``requires_grad`` changed after sharding: the flat
        groups, and the graphs, were made for the values at that time."""
        for what, tensor, planned in self.planned_requires_grad:
            if tensor.requires_grad != planned:
                raise FxShardError(
                    f"{what} had requires_grad={planned} when fxshard sharded the model and has "
                    f"requires_grad={tensor.requires_grad} now. fxshard groups parameters into flat "
                    "shards by requires_grad and compiles the step for those values, so the change "
                    "cannot take effect. Freeze or unfreeze parameters on the model before sharding "
                    "it (fxshard.compile / fxshard.parameters), and change it back now."
                )

    def run(self, step: CompiledStep, inputs: Sequence[torch.Tensor], share: Share | None = None) -> Any:
        """Run a compiled step. Before its forward, and before its backward, every rank
        checks that all ranks are about to issue the same collectives; ``share``: what this
        rank exchanges with every rank after the forward's check, when some rank asks
        (``consistency.Share``: the driver's timed nodes)."""
        self.abandoned.check(self.world)
        self.check_requires_grad()
        buffers = self.buffers_to_broadcast()
        self.agree(step, "forward", inputs, broadcast=bool(buffers), share=share)
        if buffers:
            broadcast_buffers(buffers, self.world)
        self.broadcast_next = torch.is_grad_enabled()
        if torch.is_grad_enabled() and step.trains:
            self.track_accumulation(step)
        try:
            flat = self.launch(step, inputs)
        except BaseException as e:
            self.abandoned.leave("the forward", e)
            self.explain(e)
            failure = collective_failure(e, self.world, "forward")
            if failure is None:
                raise
            raise failure from e
        if step.trains:
            outputs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                def backward_starts(grads: Any) -> None:
                    self.agree(step, "backward", inputs)
                    self.at_backward(step)

                torch.autograd.graph.register_multi_grad_hook(outputs, backward_starts, mode="any")
        return step.output_spec.unflatten(flat)

    def launch(self, step: CompiledStep, inputs: Sequence[torch.Tensor]) -> Any:
        """The step's device work and nothing else: its compiled forward (the backward runs
        from autograd). This is the seam where a whole-step CUDA graph would replay a capture;
        everything else ``run`` does around it (the checks, the agreement, the buffer
        broadcast, the backward's hook) is per-step host work that stays outside."""
        return step.fn(*inputs)

    @property
    def agreement(self) -> Agreement:
        if self._agreement is None:
            self._agreement = Agreement(self.world)
        return self._agreement

    def explain(self, e: BaseException) -> None:
        """A phase raised ``e`` (a graph's collective failed): when a phase's agreement checked
        on the device has found since that the ranks' steps differ, raise that instead."""
        if self._agreement is None:
            return
        try:
            self._agreement.settle(wait=False)
        except CollectiveMismatchError as mismatch:
            raise mismatch from e

    def agree(self, step: CompiledStep, phase: str, inputs: Sequence[torch.Tensor],
              broadcast: bool = False, share: Share | None = None) -> None:
        graph, collectives, digest = step.phases[phase]
        if broadcast:
            digest = with_buffer_broadcast(digest)
        grad = torch.is_grad_enabled() or phase == "backward"  # a backward runs with grad off
        try:
            self.agreement.agree(
                phase, digest, lambda: describe_step(phase, graph, grad, list(inputs), collectives, broadcast),
                share)
        except CollectiveMismatchError as e:
            if e.groups_unusable:  # a rank went on into a phase's collectives
                self.abandoned.leave(f"the agreement before the {phase}", e)
            raise  # else every rank raised it, after a completed exchange: the groups are fine
        except BaseException as e:
            self.abandoned.leave(f"the agreement before the {phase}", e)
            raise

    def buffers_to_broadcast(self) -> list[torch.Tensor]:
        """The buffers this forward starts by copying from rank 0 (``broadcast_buffers``)."""
        if not (self.broadcast and self.broadcast_next and self.module is not None
                and self.world.job_size > 1):
            return []
        return list(self.module.buffers())
