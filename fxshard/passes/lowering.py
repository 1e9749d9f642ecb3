"""The lowering table: what each marker becomes, keyed by topology, wire format and placement.

A lowering turns one marker (``predicates.Marker``) into a collective chain:
the nodes that prepare and issue the collectives, the collectives, their
waits, and the node that takes the marker's place. It makes every node with a
``ChainBuilder``, which tags it with the chain (``meta.ChainTag``) and a role,
so later passes read the chain (``fxshard.ir.chains``), never the nodes'
shapes. The two lowering passes look the lowering up in ``LOWERINGS``:

=========  ================  ==========  =========  ==========================================
direction  topology          wire        placement  lowering
=========  ================  ==========  =========  ==========================================
gather     local,            dtype       device     ``keep_whole``: a cast to the compute dtype
           replicated                               at most; no chain (nothing crosses)
gather     sharded           dtype       device     ``all_gather``: cast, all_gather over the
                                                    shard group, wait
gather     partition         dtype       device     ``all_gather_within``: hpZ's kept piece
                                                    gathered over the partition (backward)
gather     local, sharded,   quantized_  device     ``_quantized_tensor``: an amax per parameter,
           hybrid            tensor                 all_reduced (MAX) over the shard group, the
                                                    shard quantized, its bytes gathered (uint8),
                                                    dequantized per parameter
gather     local, sharded,   quantized_  device     ``_quantized_block``: the shard quantized in
           hybrid            block                  blocks with a scale each; data and scales in
                                                    one uint8 gather, dequantized per rank's row
gather     partition         quantized_* device     ``all_gather_within``: hpZ's kept piece of
                                                    the dequantized buffer, as it is
reduce     local             dtype       device     ``keep_local``: the cast back at most
reduce     sharded           dtype       device     ``reduce_scatter``: cast, divide,
                                                    reduce_scatter over the shard group, wait,
                                                    cast back
reduce     hybrid            dtype       device     ``reduce_scatter_all_reduce``: HSDP; the
                                                    reduce_scatter's shard then all_reduced
                                                    over the replicas
reduce     replicated        dtype       device     ``all_reduce``: NO_SHARD; all_reduce over
                                                    the shard group (then the replicas)
reduce     sharded           terms       device     ``all_to_all_sum``: reduce_in_rank_order;
                                                    cast, divide, all_to_all over the shard
                                                    group, wait, the terms added in rank order
reduce     hybrid            terms       device     ``all_to_all_all_gather_sum``: the row's
                                                    terms then all_gathered over the replicas
reduce     replicated        terms       device     ``all_gather_sum``: NO_SHARD's; all_gather
                                                    over the shard group (then the replicas)
=========  ================  ==========  =========  ==========================================

Every row has a twin with placement "cpu" (``offload_policy``): a gather's
lowering wrapped in ``<name>_from_host`` (the shard copied to the device first),
a reduction's in ``<name>_to_host`` (the shard's gradient copied to the host
last); hpZ's backward gather reads a piece kept on the device and is unchanged.

``wire`` is how the bytes travel (a gather's "dtype": the compute dtype, a plain
cast when it differs from the shard's; a reduction's "dtype", summed by the
collective, or "terms", summed in rank order where they land) and
``placement`` where the shard lives ("device": where it computes; "cpu": the
host). A new wire format or placement
is one more row and the option that selects it; docs/architecture.md shows CPU
offload's and the quantized gathers'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.chains import new_chain_id, tag_of
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.meta import ChainTag, Direction, Role
from fxshard.ir.nodes import call

from .context import PassContext

CONVERT = torch.ops.prims.convert_element_type.default
aten = torch.ops.aten


@dataclass(frozen=True)
class LoweringKey:
    direction: Direction
    topology: str  # PassContext.topology(group): "local", "sharded", "hybrid", "replicated"; "partition"
    wire: str = "dtype"
    placement: str = "device"

    def __str__(self) -> str:
        return f"{self.direction.value}/{self.topology}/{self.wire}/{self.placement}"


@dataclass(frozen=True)
class Site:
    """Where a lowering works: the marker (or, for hpZ's backward gather, the saved piece) it
    lowers, the value it gathers or reduces (a ``no_sync`` flush's sum), and the node its
    nodes go before."""

    gm: fx.GraphModule
    marker: P.Marker
    value: fx.Node
    before: fx.Node


class ChainBuilder:
    """Makes the nodes of one chain, each tagged with it, a role, and the provenance (stack
    trace, module path, partitioner tag) of the node it lowers.

    What the chain issues is declared here: the nodes before its first wait, and every node
    made inside ``with builder.issuing():`` (a collective whose result the gather needs
    before it can be issued, its wait, and what reads it up to the gather), which
    scheduling then moves with the gather (``fxshard.ir.chains``). The gather itself is
    made after the block: it reads no wait outside it, so it issues, and its own wait
    starts the tail."""

    def __init__(self, site: Site, direction: Direction, lowering: str, unit: str):
        self.gm, self.like, self.at = site.gm, site.marker.node, site.before
        self.group, self.unit = site.marker.group, unit
        self.tag = ChainTag(new_chain_id(site.gm.graph), direction, lowering)
        self._issuing = False

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        """Nodes made inside are part of the chain's issue, though they read its waits."""
        before, self._issuing = self._issuing, True
        try:
            yield
        finally:
            self._issuing = before

    def tag_node(self, node: fx.Node, role: Role, issues: bool = False) -> fx.Node:
        meta.set_info(node, meta.NodeInfo(role, self.group, self.unit, self.tag,
                                          issues=issues or self._issuing))
        return node

    def add(self, target: Any, args: tuple[Any, ...], role: Role, *, before: fx.Node | None = None,
            after: fx.Node | None = None, op_kwargs: dict[str, Any] | None = None) -> fx.Node:
        where = self.gm.graph.inserting_after(after) if after is not None \
            else self.gm.graph.inserting_before(before or self.at)
        with where:
            node = call(self.gm.graph, target, args, op_kwargs)
        node.meta.update(meta.provenance(self.like))
        return self.tag_node(node, role)

    def cast(self, value: fx.Node, dtype: torch.dtype | None, role: Role = Role.CAST, *,
             before: fx.Node | None = None, after: fx.Node | None = None) -> fx.Node:
        """``value`` converted to ``dtype``; ``value`` itself when it has it or ``dtype`` is None."""
        if dtype is None or value.meta["val"].dtype == dtype:
            return value
        return self.add(CONVERT, (value, dtype), role, before=before, after=after)

    def collective(self, collective: Any, args: tuple[Any, ...], role: Role, *,
                   before: fx.Node | None = None, after: fx.Node | None = None) -> fx.Node:
        """``wait_tensor(collective(*args))``; returns the wait."""
        issued = self.add(collective, args, role, before=before, after=after)
        return self.add(P.WAIT, (issued,), Role.WAIT, after=issued)


def untagged_cast(gm: fx.GraphModule, value: fx.Node, dtype: torch.dtype | None, before: fx.Node,
                  group: int, unit: str) -> fx.Node:
    """A cast that belongs to no chain (a replicated group's parameter, one rank's shard)."""
    if dtype is None or value.meta["val"].dtype == dtype:
        return value
    with gm.graph.inserting_before(before):
        node = call(gm.graph, CONVERT, (value, dtype))
    node.meta.update(meta.provenance(before))
    meta.set_info(node, meta.NodeInfo(Role.CAST, group, unit))
    return node


# A lowering: where it works, and what it is told -> the node that takes the marker's place.
Lowering = Callable[[Site, PassContext], fx.Node]


def keep_whole(site: Site, ctx: PassContext) -> fx.Node:
    m = site.marker
    return untagged_cast(site.gm, site.value, m.compute_dtype, site.before, m.group, ctx.unit_of(m.group))


def all_gather(site: Site, ctx: PassContext) -> fx.Node:
    shard = ctx.layout.shard
    b = ChainBuilder(site, Direction.GATHER, "all_gather", ctx.unit_of(site.marker.group))
    source = b.cast(site.value, site.marker.compute_dtype)  # gather half the bytes
    return b.collective(P.ALL_GATHER, (source, shard.size, shard.name), Role.ALL_GATHER)


def all_gather_within(site: Site, ctx: PassContext) -> fx.Node:
    partition = ctx.layout.partition
    assert partition is not None
    b = ChainBuilder(site, Direction.GATHER, "all_gather_within", ctx.unit_of(site.marker.group))
    return b.collective(P.ALL_GATHER, (site.value, partition.size, partition.name), Role.ALL_GATHER)


def keep_local(site: Site, ctx: PassContext) -> fx.Node:
    """One rank: the gradient is the shard's, rounded to the reduce dtype as a reduction would."""
    m, unit = site.marker, ctx.unit_of(site.marker.group)
    grad = untagged_cast(site.gm, site.value, m.reduce_dtype, site.before, m.group, unit)
    return untagged_cast(site.gm, grad, m.out_dtype, site.before, m.group, unit)


def _scaled(b: ChainBuilder, site: Site, ctx: PassContext) -> fx.Node:
    """The gradient in its reduce dtype, divided by the ranks it is averaged over (DDP's order:
    divide, then sum). ``scale_in_place_pass`` divides a fresh one in place, last."""
    grad = b.cast(site.value, site.marker.reduce_dtype)
    return b.add(aten.div.Tensor, (grad, ctx.layout.grad_divisor), Role.SCALE)


def _reduction(name: str, first: str) -> Lowering:
    def lower(site: Site, ctx: PassContext) -> fx.Node:
        shard, replicate = ctx.layout.shard, ctx.layout.replicate
        b = ChainBuilder(site, Direction.REDUCE, name, ctx.unit_of(site.marker.group))
        scaled = _scaled(b, site, ctx)
        if first == "reduce_scatter":
            wait = b.collective(P.REDUCE_SCATTER, (scaled, "sum", shard.size, shard.name),
                                Role.REDUCE_SCATTER)
        else:
            wait = b.collective(P.ALL_REDUCE, (scaled, "sum", shard.name), Role.ALL_REDUCE)
        if replicate is not None:  # HSDP: then over the ranks holding the same shard
            wait = b.collective(P.ALL_REDUCE, (wait, "sum", replicate.name), Role.ALL_REDUCE,
                                after=wait)
        return b.cast(wait, site.marker.out_dtype, Role.CAST_BACK, after=wait)
    lower.__name__ = name
    return lower


def _summed_in_rank_order(b: ChainBuilder, terms: fx.Node, count: int) -> fx.Node:
    """``terms`` holds ``count`` equal pieces, one per rank in rank order: their sum
    ((t0 + t1) + t2) + ..., one add at a time (a sum over a dimension may pair them in
    another order)."""
    rows = b.add(aten.view.default, (terms, [count, -1]), Role.SUM)
    total = b.add(aten.select.int, (rows, 0, 0), Role.SUM)
    for k in range(1, count):
        total = b.add(aten.add.Tensor, (total, b.add(aten.select.int, (rows, 0, k), Role.SUM)), Role.SUM)
    return total


def _terms(name: str) -> Lowering:
    """reduce_in_rank_order: every rank's term of this rank's part reaches it unsummed, and
    it adds them in rank order. Sharded: an all_to_all over the shard group hands each rank
    the shard group's terms of its shard. Replicated (NO_SHARD): an all_gather of the
    whole gradient. HSDP then gathers those terms over the replicas, so the terms come
    in the mesh's row-major order: the job's rank order for ``init_device_mesh``'s."""
    def lower(site: Site, ctx: PassContext) -> fx.Node:
        shard, replicate = ctx.layout.shard, ctx.layout.replicate
        b = ChainBuilder(site, Direction.REDUCE, name, ctx.unit_of(site.marker.group))
        scaled = _scaled(b, site, ctx)
        numel = scaled.meta["val"].numel()
        if ctx.plan.groups[site.marker.group].replicated:
            terms = b.collective(P.ALL_GATHER, (scaled, shard.size, shard.name), Role.ALL_GATHER)
        else:
            splits = [numel // shard.size] * shard.size
            terms = b.collective(P.ALL_TO_ALL, (scaled, splits, splits, shard.name), Role.ALL_TO_ALL)
        count = shard.size
        if replicate is not None:
            terms = b.collective(P.ALL_GATHER, (terms, replicate.size, replicate.name), Role.ALL_GATHER,
                                 after=terms)
            count *= replicate.size
        total = _summed_in_rank_order(b, terms, count)  # before the marker, so after the waits
        return b.cast(total, site.marker.out_dtype, Role.CAST_BACK)
    lower.__name__ = name
    return lower


reduce_scatter = _reduction("reduce_scatter", "reduce_scatter")
reduce_scatter_all_reduce = _reduction("reduce_scatter_all_reduce", "reduce_scatter")
all_reduce = _reduction("all_reduce", "all_reduce")
all_to_all_sum = _terms("all_to_all_sum")
all_to_all_all_gather_sum = _terms("all_to_all_all_gather_sum")
all_gather_sum = _terms("all_gather_sum")


# -- quantized gathers (MixedPrecision(gather_dtype=...)) ------------------------------------


class _Quantizer:
    """The nodes of one quantized gather, made by ``b`` (one chain), or untagged on one rank."""

    def __init__(self, b: ChainBuilder, site: Site, ctx: PassContext):
        self.b, self.group = b, ctx.plan.groups[site.marker.group]
        assert self.group.quantized is not None
        self.q = self.group.quantized
        self.compute = self.group.compute_dtype

    def op(self, target: Any, *args: Any, role: Role = Role.QUANTIZE) -> fx.Node:
        return self.b.add(target, args, role)

    def scales(self, amax: fx.Node) -> fx.Node:
        """The scales (amax / the dtype's largest value), in the compute dtype: rounded once, and
        then used both to quantize and to dequantize, so both sides agree on them."""
        # A parameter (a block) of zeros: a scale of 1e-12 / max, which bfloat16 holds, not 0.
        scale = self.op(aten.div.Tensor, self.op(aten.clamp_min.default, amax, 1e-12), self.q.max)
        return self.b.cast(scale, self.compute, Role.QUANTIZE)

    def bytes_of(self, value: fx.Node, scale: fx.Node) -> fx.Node:
        """``value`` / ``scale``, rounded into the gather dtype (saturating at its largest
        value), as uint8: what gloo and NCCL both carry."""
        scaled = self.op(aten.div.Tensor, value, self.b.cast(scale, value.meta["val"].dtype, Role.QUANTIZE))
        if self.q.dtype is torch.int8:
            scaled = self.op(aten.round.default, scaled)
        scaled = self.op(aten.clamp.default, scaled, -self.q.max, self.q.max)
        return self.op(aten.view.dtype, self.op(CONVERT, scaled, self.q.dtype), torch.uint8)

    def values(self, data: fx.Node) -> fx.Node:
        """Gathered uint8 bytes back as values of the compute dtype (unscaled)."""
        return self.op(CONVERT, self.op(aten.view.dtype, data, self.q.dtype, role=Role.DEQUANTIZE),
                       self.compute, role=Role.DEQUANTIZE)


def _spans(group: Any, lo: int, hi: int) -> list[tuple[int | None, int, int]]:
    """The parameters (their index in the group, or None for a gap or the padding) of the
    flat layout's range [lo, hi), as (index, start, stop) relative to ``lo``."""
    found, offset = [], 0
    index = {id(slot): i for i, slot in enumerate(group.params)}
    for slot, length in group.spans():
        start, stop = max(lo, offset), min(hi, offset + length)
        if start < stop:
            found.append((None if slot is None else index[id(slot)], start - lo, stop - lo))
        offset += length
    return found


def _quantized_tensor(site: Site, ctx: PassContext) -> fx.Node:
    """torchao's float8 all-gather: a scale per parameter, from its largest magnitude over the
    ranks (an all_reduce, MAX, of this shard's per-parameter maxima), the shard quantized with
    it and its bytes gathered; each parameter's values are dequantized with its scale. The
    all_reduce, its wait and the quantization are declared part of the chain's issue, so
    prefetch moves them ahead with the gather."""
    m, layout = site.marker, ctx.layout
    b = ChainBuilder(site, Direction.GATHER, "all_gather_quantized_tensor", ctx.unit_of(m.group))
    z = _Quantizer(b, site, ctx)
    group, shard = z.group, site.value
    lo, hi = group.shard_range(layout.shard_rank) if layout.communicates else (0, group.padded_numel)
    here = _spans(group, lo, hi)
    with b.issuing():
        magnitude = z.op(aten.abs.default, shard)
        maxima = {i: z.op(aten.amax.default, z.op(aten.slice.Tensor, magnitude, 0, start, stop), [0])
                  for i, start, stop in here if i is not None}
        zero = None
        columns = []
        for k in range(len(group.params)):
            if k not in maxima and zero is None:
                zero = z.op(aten.new_zeros.default, magnitude, [])
            columns.append(maxima.get(k, zero))
        amax = z.op(aten.stack.default, columns)
        if layout.communicates:
            amax = b.collective(P.ALL_REDUCE, (amax, "max", layout.shard.name), Role.ALL_REDUCE)
        scales = z.scales(amax)
        one = z.op(aten.new_ones.default, scales, []) if any(i is None for i, _, _ in here) else None
        per_element = z.op(aten.cat.default, [
            z.op(aten.expand.default, one if i is None else z.op(aten.select.int, scales, 0, i), [stop - start])
            for i, start, stop in here])
        data = z.bytes_of(shard, per_element)
    if layout.communicates:
        data = b.collective(P.ALL_GATHER, (data, layout.shard.size, layout.shard.name), Role.ALL_GATHER)
    values = z.values(data)
    pieces = []
    for i, start, stop in _spans(group, 0, group.padded_numel):
        piece = z.op(aten.slice.Tensor, values, 0, start, stop, role=Role.DEQUANTIZE)
        if i is not None:
            piece = z.op(aten.mul.Tensor, piece, z.op(aten.select.int, scales, 0, i, role=Role.DEQUANTIZE),
                         role=Role.DEQUANTIZE)
        pieces.append(piece)
    return z.op(aten.cat.default, pieces, role=Role.DEQUANTIZE) if len(pieces) > 1 else pieces[0]


def _quantized_block(site: Site, ctx: PassContext) -> fx.Node:
    """ZeRO++'s qwZ: each shard quantized in blocks (``Quantized.block``), each block with
    its own scale; the data and the scales travel in one uint8 gather, so there is no other
    collective. Each rank's row is dequantized with its own scales."""
    m, layout = site.marker, ctx.layout
    b = ChainBuilder(site, Direction.GATHER, "all_gather_quantized_block", ctx.unit_of(m.group))
    z = _Quantizer(b, site, ctx)
    ranks = layout.shard.size if layout.communicates else 1
    length = z.group.shard_numel if layout.communicates else z.group.padded_numel
    block = z.q.block(length)
    blocks = -(-length // block)
    padded = blocks * block
    shard = site.value
    if padded != length:
        shard = z.op(aten.constant_pad_nd.default, shard, [0, padded - length], 0.0)
    rows = z.op(aten.view.default, shard, [blocks, block])
    scales = z.scales(z.op(aten.amax.default, z.op(aten.abs.default, rows), [1], True))
    data = z.op(aten.view.default, z.bytes_of(rows, scales), [padded])
    scale_bytes = z.op(aten.view.default, z.op(aten.view.dtype, scales, torch.uint8), [-1])
    payload = z.op(aten.cat.default, [data, scale_bytes])
    width = payload.meta["val"].numel()
    if layout.communicates:
        payload = b.collective(P.ALL_GATHER, (payload, ranks, layout.shard.name), Role.ALL_GATHER)
    table = z.op(aten.view.default, payload, [ranks, width], role=Role.DEQUANTIZE)
    values = z.values(z.op(aten.slice.Tensor, table, 1, 0, padded, role=Role.DEQUANTIZE))
    values = z.op(aten.view.default, values, [ranks, blocks, block], role=Role.DEQUANTIZE)
    their_scales = z.op(aten.view.dtype, z.op(aten.slice.Tensor, table, 1, padded, width, role=Role.DEQUANTIZE),
                        z.compute, role=Role.DEQUANTIZE)
    their_scales = z.op(aten.view.default, their_scales, [ranks, blocks, 1], role=Role.DEQUANTIZE)
    full = z.op(aten.mul.Tensor, values, their_scales, role=Role.DEQUANTIZE)
    if padded == length:
        return z.op(aten.view.default, full, [ranks * length], role=Role.DEQUANTIZE)
    full = z.op(aten.view.default, full, [ranks, padded], role=Role.DEQUANTIZE)
    trimmed = z.op(aten.slice.Tensor, full, 1, 0, length, role=Role.DEQUANTIZE)
    return z.op(aten.reshape.default, trimmed, [ranks * length], role=Role.DEQUANTIZE)


def _joined(b: ChainBuilder, gm: fx.GraphModule, result: fx.Node) -> None:
    """Make the chain the inner lowering made for ``result`` (if any) part of ``b``'s, and
    ``result`` itself too when it is a node of the lowering's own (a cast out of no chain)."""
    inner = tag_of(result)
    for node in gm.graph.nodes:
        info = meta.get_info(node)
        if info is not None and inner is not None and info.chain == inner:
            b.tag_node(node, info.role, info.issues)
    info = meta.get_info(result)
    if inner is None and info is not None and info.role is Role.CAST:
        b.tag_node(result, Role.CAST)


def _from_host(inner: Lowering, name: str) -> Lowering:
    """Offload (placement "cpu"): the shard is copied from the host to the device it
    computes on, then ``inner`` gathers the copy; the copy is the chain's first node, so
    prefetch moves it ahead with the gather."""
    def lower(site: Site, ctx: PassContext) -> fx.Node:
        m = site.marker
        b = ChainBuilder(site, Direction.GATHER, name, ctx.unit_of(m.group))
        device = m.node.meta["val"].device  # the marker's buffer: where the unit computes
        copy = b.add(aten._to_copy.default, (site.value,), Role.TO_DEVICE,
                     op_kwargs={"device": device, "non_blocking": True})
        result = inner(replace(site, value=copy), ctx)
        _joined(b, site.gm, result)
        return result
    lower.__name__ = name
    return lower


def _to_host(inner: Lowering, name: str) -> Lowering:
    """Offload: ``inner`` reduces the gradient on the device, and the shard's gradient is
    copied to the host, where the shard and the optimizer step are."""
    def lower(site: Site, ctx: PassContext) -> fx.Node:
        m = site.marker
        result = inner(site, ctx)
        b = ChainBuilder(site, Direction.REDUCE, name, ctx.unit_of(m.group))  # a chain number after inner's
        _joined(b, site.gm, result)
        device = torch.device(ctx.placement(m.group))  # "cpu": the host
        return b.add(aten._to_copy.default, (result,), Role.TO_HOST,
                     op_kwargs={"device": device, "non_blocking": True})
    lower.__name__ = name
    return lower


G, R = Direction.GATHER, Direction.REDUCE
LOWERINGS: dict[LoweringKey, Lowering] = {
    LoweringKey(G, "local"): keep_whole,
    LoweringKey(G, "replicated"): keep_whole,
    LoweringKey(G, "sharded"): all_gather,
    LoweringKey(G, "hybrid"): all_gather,  # HSDP gathers within its shard group
    LoweringKey(G, "partition"): all_gather_within,
    # MixedPrecision(gather_dtype=...): quantized weight gathers (on one rank, quantized and
    # dequantized: the same numbers). hpZ's backward gather moves a piece of the dequantized
    # buffer, as it is.
    **{LoweringKey(G, topology, wire=f"quantized_{scaling}"): lowering
       for scaling, lowering in (("tensor", _quantized_tensor), ("block", _quantized_block))
       for topology in ("local", "sharded", "hybrid")},
    LoweringKey(G, "partition", wire="quantized_tensor"): all_gather_within,
    LoweringKey(G, "partition", wire="quantized_block"): all_gather_within,
    LoweringKey(R, "local"): keep_local,
    LoweringKey(R, "sharded"): reduce_scatter,
    LoweringKey(R, "hybrid"): reduce_scatter_all_reduce,
    LoweringKey(R, "replicated"): all_reduce,
    LoweringKey(R, "sharded", wire="terms"): all_to_all_sum,
    LoweringKey(R, "hybrid", wire="terms"): all_to_all_all_gather_sum,
    LoweringKey(R, "replicated", wire="terms"): all_gather_sum,
}
# Offload: every row again with the shard on the host. A gather copies the shard in first;
# a reduction copies the shard's gradient out last. hpZ's backward gather reads the piece
# forward kept on the device: the same lowering.
for _key, _lowering in list(LOWERINGS.items()):
    _host = replace(_key, placement="cpu")
    if _key.topology == "partition":
        LOWERINGS[_host] = _lowering
    elif _key.direction is G:
        LOWERINGS[_host] = _from_host(_lowering, f"{_lowering.__name__}_from_host")
    else:
        LOWERINGS[_host] = _to_host(_lowering, f"{_lowering.__name__}_to_host")


def lowering_for(key: LoweringKey) -> Lowering:
    found = LOWERINGS.get(key)
    if found is None:
        raise GraphInvariantError(f"no lowering for {key}; the table has {sorted(map(str, LOWERINGS))}")
    return found


def key_for(m: P.Marker, ctx: PassContext, topology: str | None = None) -> LoweringKey:
    direction = Direction.REDUCE if m.kind.is_gradient else Direction.GATHER
    return LoweringKey(direction, topology or ctx.topology(m.group),
                       ctx.wire(m.group, direction is Direction.REDUCE), ctx.placement(m.group))


def lower(gm: fx.GraphModule, m: P.Marker, ctx: PassContext, value: fx.Node | None = None) -> fx.Node:
    """Lower marker ``m`` by its table entry (``value``: what it reduces, if not the marker's
    own); its readers read the result, and it is erased."""
    result = lowering_for(key_for(m, ctx))(Site(gm, m, value or m.value, m.node), ctx)
    m.node.replace_all_uses_with(result)
    gm.graph.erase_node(m.node)
    return result
