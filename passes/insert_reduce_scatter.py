"""insert_reduce_scatter_pass: lower ``fxshard.reduce_grad`` to reduce_scatter + wait.

AOTAutograd has already concatenated the unit's parameter gradients (the
backward of the split that unflattened the gathered buffer is a ``cat``)::

    before:  grad_p0, grad_p1, ..., zeros(pad) -> cat -> fxshard.reduce_grad(cat, g, N) -> shard.grad
    after:   ... -> cat -> div_(cat, N) -> reduce_scatter_tensor(cat, "sum", N, pg) -> wait_tensor -> shard.grad

The result is the average over ranks, as DDP computes it. Dividing before
summing is also DDP's order of operations (it divides each gradient by N
before its all-reduce), so fxshard's gradients round the same way DDP's do.
With no process group (world size 1) the concatenated gradient is the
shard's gradient.

A replicated group's ``fxshard.allreduce_grad`` lowers the same way to
``div -> all_reduce(.., "sum") -> wait_tensor``.

HSDP (``ctx.layout.replicate``): the reduced shard is then summed over the
replicas, so only a shard crosses between them; N is every rank of the job::

    ... -> reduce_scatter_tensor(cat, "sum", S, shard) -> wait_tensor
        -> all_reduce(.., "sum", replicate) -> wait_tensor -> shard.grad

Inside ``no_sync`` (``ctx.grad_sync.accumulate``) the gradient is instead
added to its group's unsharded accumulator (a ``get_attr`` of the driver's
buffer) and the shard gets no gradient; the first synced step after reduces
gradient + accumulator and frees the accumulator, for the groups in
``ctx.grad_sync.flush`` (the ones with a sum waiting)::

    accumulate:  cat -> add_(accumulated_g, cat)                      (shard.grad: None)
    flush:       cat -> add(cat, accumulated_g); free(accumulated_g) -> div -> reduce_scatter ...

With mixed precision the marker names the dtype to reduce in and the
shard's dtype; the gradient is cast around the reduction::

    cat(bf16) -> convert(fp32) -> div_ -> reduce_scatter_tensor -> wait_tensor -> shard.grad
    cat(bf16) -> div_ -> reduce_scatter_tensor(bf16) -> wait_tensor -> convert(fp32) -> shard.grad
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.nodes import attribute, call
from fxshard.ir.ops import FREE

from .context import PassContext
from .lowering import CONVERT, cast, collective_after, replace_with_collective

aten = torch.ops.aten


def _no_gradient(marker: fx.Node) -> None:
    """The shard gets no gradient from this step (AOTAutograd's backward may return None)."""
    for user in list(marker.users):
        if not P.is_output(user):
            raise GraphInvariantError(f"{marker.name}: the shard gradient is read by {user.name}")
        outputs = user.args[0]
        assert isinstance(outputs, (tuple, list))
        user.args = (tuple(None if a is marker else a for a in outputs),)


def insert_reduce_scatter_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    markers = [m for m in map(P.marker, gm.graph.nodes) if m is not None and m.kind.is_gradient]
    if not markers:
        return gm
    for m in markers:
        marker, group, out_dtype = m.node, m.group, m.out_dtype
        unit = ctx.unit_of(group)
        grad = cast(gm, m.value, m.reduce_dtype, marker, group, unit)
        sync = ctx.grad_sync
        if sync.accumulate or group in sync.flush:
            with gm.graph.inserting_before(marker):
                acc = attribute(gm, f"fxshard_accumulated_{group}", ctx.accumulators[group], grad)
                if sync.accumulate:  # no_sync: add up unsharded, no collective
                    call(gm.graph, aten.add_.Tensor, (acc, grad))
                else:  # the first synced step after: reduce the sum, release the accumulator
                    grad = call(gm.graph, aten.add.Tensor, (grad, acc))
                    call(gm.graph, FREE, (acc,))
            if sync.accumulate:
                _no_gradient(marker)
                gm.graph.erase_node(marker)
                continue
        shard = ctx.layout.shard
        if shard.name is None:
            marker.replace_all_uses_with(cast(gm, grad, out_dtype, marker, group, unit))
            gm.graph.erase_node(marker)
            continue
        # A cat's result is a fresh buffer read only here: divide it in place,
        # rather than hold a second full-size copy until the reduction is issued.
        fresh = grad.target in (aten.cat.default, CONVERT) and set(grad.users) <= {marker}
        divide = aten.div_.Tensor if fresh else aten.div.Tensor
        with gm.graph.inserting_before(marker):
            scaled = call(gm.graph, divide, (grad, ctx.layout.grad_divisor))
        if m.kind is P.MarkerKind.ALLREDUCE_GRAD:
            wait = replace_with_collective(gm, marker, P.ALL_REDUCE, (scaled, "sum", shard.name),
                                           meta.ALL_REDUCE, group, unit)
        else:
            wait = replace_with_collective(gm, marker, P.REDUCE_SCATTER,
                                           (scaled, "sum", shard.size, shard.name),
                                           meta.REDUCE_SCATTER, group, unit)
        replicate = ctx.layout.replicate
        if replicate is not None:  # HSDP: then over the ranks holding the same shard
            wait = collective_after(gm, wait, P.ALL_REDUCE, (wait, "sum", replicate.name),
                                    meta.ALL_REDUCE, group, unit)
        if out_dtype is not None:  # the reduced gradient in the shard's dtype
            users = list(wait.users)
            converted = cast(gm, wait, out_dtype, wait.next, group, unit)
            for user in users:
                user.replace_input_with(wait, converted)
    gm.recompile()
    return gm
