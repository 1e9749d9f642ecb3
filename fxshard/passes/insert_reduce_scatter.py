"""insert_reduce_scatter_pass: lower ``fxshard.reduce_grad`` to reduce_scatter + wait.

AOTAutograd has already concatenated the unit's parameter gradients (the
backward of the split that unflattened the gathered buffer is a ``cat``)::

    before:  grad_p0, grad_p1, ..., zeros(pad) -> cat -> fxshard.reduce_grad(cat, g, N) -> shard.grad
    after:   ... -> cat -> reduce_scatter_tensor(cat, "sum", N, pg) -> wait_tensor -> div_(.., N) -> shard.grad

The result is the average over ranks, as DDP computes it. DDP divides each
gradient by N before its all-reduce; where N is a power of two the division
moves only the exponent, so dividing the reduced shard after the sum (1/N of the
bytes) rounds the same way (``lowering.divides_exactly``). Any other N divides
first, in DDP's order: ``cat -> div_(cat, N) -> reduce_scatter_tensor -> ...``.
With no process group (world size 1) the concatenated gradient is the
shard's gradient.

A replicated group's ``fxshard.allreduce_grad`` lowers the same way to
``all_reduce(.., "sum") -> wait_tensor -> div``.

HSDP (``ctx.layout.replicate``): the reduced shard is then summed over the
replicas, so only a shard crosses between them; N is every rank of the job::

    ... -> reduce_scatter_tensor(cat, "sum", S, shard) -> wait_tensor
        -> all_reduce(.., "sum", replicate) -> wait_tensor -> div_(.., N) -> shard.grad

Inside ``no_sync`` (``ctx.grad_sync.accumulate``) the gradient is instead
added to its group's unsharded accumulator (a ``get_attr`` of the driver's
buffer) and the shard gets no gradient; the first synced step after reduces
gradient + accumulator and frees the accumulator, for the groups in
``ctx.grad_sync.flush`` (the ones with a sum waiting)::

    accumulate:  cat -> add_(accumulated_g, cat)                      (shard.grad: None)
    flush:       cat -> add(cat, accumulated_g); free(accumulated_g) -> reduce_scatter ...

With mixed precision the marker names the dtype to reduce in and the
shard's dtype; the gradient is cast around the reduction::

    cat(bf16) -> convert(fp32) -> reduce_scatter_tensor -> wait_tensor -> div_ -> shard.grad
    cat(bf16) -> reduce_scatter_tensor(bf16) -> wait_tensor -> div_ -> convert(fp32) -> shard.grad

Each marker is lowered by its row of the lowering table (``lowering.LOWERINGS``:
"reduce_scatter", "reduce_scatter_all_reduce" under HSDP, "all_reduce" for a
replicated group), which tags the nodes it makes as one collective chain.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.meta import Role
from fxshard.ir.nodes import attribute, call
from fxshard.ir.ops import FREE

from .context import PassContext
from .lowering import lower, untagged_cast

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
    sync = ctx.grad_sync
    for m in markers:
        value = m.value
        if sync.accumulate or m.group in sync.flush:
            unit = ctx.unit_of(m.group)
            grad = untagged_cast(gm, m.value, m.reduce_dtype, m.node, m.group, unit)
            with gm.graph.inserting_before(m.node):
                acc = attribute(gm, f"fxshard_accumulated_{m.group}", ctx.accumulators[m.group], grad)
                if sync.accumulate:  # no_sync: add up unsharded, no collective
                    added = call(gm.graph, aten.add_.Tensor, (acc, grad))
                    done = [added]
                else:  # the first synced step after: reduce the sum, release the accumulator
                    value = call(gm.graph, aten.add.Tensor, (grad, acc))
                    done = [value, call(gm.graph, FREE, (acc,))]
            for node in done:
                meta.set_info(node, meta.NodeInfo(Role.ACCUMULATE, m.group, unit))
            if sync.accumulate:
                _no_gradient(m.node)
                gm.graph.erase_node(m.node)
                continue
        lower(gm, m, ctx, value)
    gm.recompile()
    return gm
