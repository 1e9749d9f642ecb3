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
gather     local, sharded,   quantized_  device     ``all_gather_quantized_tensor``: an amax per parameter,
           hybrid            tensor                 all_reduced (MAX) over the shard group, the
                                                    shard quantized, its bytes gathered (uint8),
                                                    dequantized per parameter
gather     local, sharded,   quantized_  device     ``all_gather_quantized_block``: the shard quantized in
           hybrid            block                  blocks with a scale each; data and scales in
                                                    one uint8 gather, dequantized per rank's row
gather     partition         quantized_* device     ``all_gather_within``: hpZ's kept piece of
                                                    the dequantized buffer, as it is
gather     saved             any         any        ``keep_saved``: backward's input of a buffer
                                                    forward kept (a unit not resharded; hpZ's
                                                    piece until ``reshard_within_pass``): a
                                                    chain of the placeholder alone
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
last); hpZ's backward gather and a saved buffer read what forward kept on the
device and are unchanged.

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
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from fxshard.ir import compat, meta
from fxshard.ir import predicates as P
from fxshard.ir.chains import new_chain_id, tag_of
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.meta import ChainTag, Direction, Role
from fxshard.ir.nodes import call
from fxshard.ir.plan import FlatGroup
from fxshard.ir.precision import Quantized

from .context import Holding, PassContext

CONVERT = torch.ops.prims.convert_element_type.default
aten = torch.ops.aten


@dataclass(frozen=True)
class LoweringKey:
    direction: Direction
    topology: str  # Holding.topology: "local", "sharded", "hybrid", "replicated"; a pass's "partition", "saved"
    wire: str = "dtype"
    placement: str = "device"

    def __str__(self) -> str:
        return f"{self.direction.value}/{self.topology}/{self.wire}/{self.placement}"

    @classmethod
    def of(cls, direction: Direction, holding: Holding, topology: str | None = None) -> LoweringKey:
        """The row for moving a group held as ``holding`` in ``direction`` (``topology``: a
        pass's own, "partition" or "saved", in place of the holding's)."""
        return cls(direction, topology or holding.topology, holding.wire(direction is Direction.REDUCE),
                   holding.placement)


@dataclass(frozen=True)
class Site:
    """Where a lowering works and what it is told: the flat group; the node whose place it
    takes and whose provenance its nodes carry (a marker, or for hpZ's backward gather the
    saved piece); the value it gathers or reduces (a ``no_sync`` flush's sum); the node its
    nodes go before; and the dtypes a marker carries (None: no cast)."""

    gm: fx.GraphModule
    group: int
    like: fx.Node
    value: fx.Node
    before: fx.Node
    compute_dtype: torch.dtype | None = None  # a gather's: what the unit computes in
    reduce_dtype: torch.dtype | None = None  # a reduction's: what the gradient is summed in
    out_dtype: torch.dtype | None = None  # a reduction's: the shard gradient's

    @classmethod
    def of(cls, gm: fx.GraphModule, m: P.Marker, value: fx.Node | None = None) -> Site:
        """The site of marker ``m``: its place, its value (or ``value``), its dtypes."""
        return cls(gm, m.group, m.node, value or m.value, m.node, m.compute_dtype, m.reduce_dtype, m.out_dtype)

    @property
    def device(self) -> torch.device:
        """Where the lowered value computes: the device of the node it takes the place of."""
        return self.like.meta["val"].device


# What make_fx records for ``.detach()`` (after a view of another dtype, say): detach on torch
# 2.11 and 2.13, alias on 2.15. Nothing in a lowering needs either: spliced as its input.
_TRACED_NO_OPS = (aten.detach.default, aten.alias.default)


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
        self.gm, self.like, self.at = site.gm, site.like, site.before
        self.group, self.unit = site.group, unit
        self.tag = ChainTag(new_chain_id(site.gm.graph), direction, lowering)
        self._issuing = self._agreeing = False

    @contextlib.contextmanager
    def issuing(self, agreed: bool = False) -> Iterator[None]:
        """Nodes made inside are part of the chain's issue, though they read its waits; with
        ``agreed``, also agreed once at the graph's start (``NodeInfo.agrees``: they must read
        nothing the step computes, only the shard)."""
        before = self._issuing, self._agreeing
        self._issuing, self._agreeing = True, agreed
        try:
            yield
        finally:
            self._issuing, self._agreeing = before

    def tag_node(self, node: fx.Node, role: Role, issues: bool = False, agrees: bool = False) -> fx.Node:
        meta.set_info(node, meta.NodeInfo(role, self.group, self.unit, self.tag,
                                          issues=issues or self._issuing or self._agreeing,
                                          agrees=agrees or self._agreeing))
        return node

    def add(self, target: Any, args: tuple[Any, ...], role: Role, *, before: fx.Node | None = None,
            after: fx.Node | None = None, op_kwargs: dict[str, Any] | None = None) -> fx.Node:
        where = self.gm.graph.inserting_after(after) if after is not None \
            else self.gm.graph.inserting_before(before or self.at)
        with where:
            node = call(self.gm.graph, target, args, op_kwargs)
        node.meta.update(meta.provenance(self.like))
        return self.tag_node(node, role)

    def traced(self, fn: Callable[..., torch.Tensor], *inputs: fx.Node, role: Role,
               **static: Any) -> fx.Node:
        """``fn(*inputs, **static)``, plain torch code on the inputs' tensors, traced under the
        graph's fake mode (``make_fx``) and spliced in before the chain's insertion point:
        every node it makes is a node of this chain with ``role`` and the ``meta["val"]`` its
        trace computed. ``static`` are the Python values it is specialised on (sizes, spans,
        dtypes). Returns the node of its one result."""
        values = [n.meta["val"] for n in inputs]
        traced = compat.make_fx(functools.partial(fn, **static))(*values)
        env: dict[fx.Node, fx.Node] = dict(zip([n for n in traced.graph.nodes if n.op == "placeholder"], inputs))
        result: Any = None
        with self.gm.graph.inserting_before(self.at):
            for node in traced.graph.nodes:
                if node.op == "output":
                    result = fx.map_arg(node.args[0], env.__getitem__)
                elif node.target in _TRACED_NO_OPS:
                    env[node] = env[node.args[0]]
                elif node.op == "call_function":
                    copy = self.gm.graph.node_copy(node, env.__getitem__)
                    copy.meta = {"val": node.meta["val"], **meta.provenance(self.like)}
                    env[node] = self.tag_node(copy, role)
                elif node.op != "placeholder":
                    raise GraphInvariantError(f"{fn.__name__} traced to a {node.op} node ({node.target}): "
                                              "a lowering's function may make no constant tensors")
        if not isinstance(result, fx.Node):
            raise GraphInvariantError(f"{fn.__name__} must return one tensor, not {result!r}")
        # What the trace made that nothing reads (a zero no parameter needed): pure ops, dropped.
        for copy in reversed(list(dict.fromkeys(n for n in env.values() if n not in inputs))):
            if not copy.users and copy is not result:
                self.gm.graph.erase_node(copy)
        return result

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
    return untagged_cast(site.gm, site.value, site.compute_dtype, site.before, site.group, ctx.unit_of(site.group))


def keep_saved(site: Site, ctx: PassContext) -> fx.Node:
    """A buffer forward kept for backward, which backward reads as an input (``site.value``, a
    placeholder): a gather chain of that node alone, with no collective, so the chains,
    frees, verify and the report see backward's use of it as a gather's."""
    return ChainBuilder(site, Direction.GATHER, "saved", ctx.unit_of(site.group)).tag_node(site.value, Role.SAVED)


def all_gather(site: Site, ctx: PassContext) -> fx.Node:
    shard = ctx.layout.shard
    b = ChainBuilder(site, Direction.GATHER, "all_gather", ctx.unit_of(site.group))
    source = b.cast(site.value, site.compute_dtype)  # gather half the bytes
    return b.collective(P.ALL_GATHER, (source, shard.size, shard.name), Role.ALL_GATHER)


def all_gather_within(site: Site, ctx: PassContext) -> fx.Node:
    partition = ctx.layout.partition
    assert partition is not None
    b = ChainBuilder(site, Direction.GATHER, "all_gather_within", ctx.unit_of(site.group))
    return b.collective(P.ALL_GATHER, (site.value, partition.size, partition.name), Role.ALL_GATHER)


def keep_local(site: Site, ctx: PassContext) -> fx.Node:
    """One rank: the gradient is the shard's, rounded to the reduce dtype as a reduction would."""
    unit = ctx.unit_of(site.group)
    grad = untagged_cast(site.gm, site.value, site.reduce_dtype, site.before, site.group, unit)
    return untagged_cast(site.gm, grad, site.out_dtype, site.before, site.group, unit)


def _scaled(b: ChainBuilder, site: Site, ctx: PassContext) -> fx.Node:
    """The gradient in its reduce dtype, divided by the ranks it is averaged over (DDP's order:
    divide, then sum). ``scale_in_place_pass`` divides a fresh one in place, last."""
    grad = b.cast(site.value, site.reduce_dtype)
    return b.add(aten.div.Tensor, (grad, ctx.layout.grad_divisor), Role.SCALE)


def divides_exactly(divisor: int) -> bool:
    """Whether dividing by ``divisor`` commutes with a floating-point sum: a power of two
    scales the exponent alone, so sum-then-divide rounds as DDP's divide-then-sum does
    (apart from values within a factor ``divisor`` of the smallest normal number, about
    1e-38, whose last bits a division rounds away)."""
    return divisor > 0 and divisor & (divisor - 1) == 0


def _reduction(name: str, first: str) -> Lowering:
    """Cast, then divide, sum and (HSDP) sum again over the replicas, then cast back. Where
    the divisor is a power of two (``divides_exactly``) the sum comes first and the division
    reads the reduced shard, 1/N of the bytes: the same values."""
    def lower(site: Site, ctx: PassContext) -> fx.Node:
        shard, replicate = ctx.layout.shard, ctx.layout.replicate
        b = ChainBuilder(site, Direction.REDUCE, name, ctx.unit_of(site.group))
        after = divides_exactly(ctx.layout.grad_divisor)
        source = b.cast(site.value, site.reduce_dtype) if after else _scaled(b, site, ctx)
        if first == "reduce_scatter":
            wait = b.collective(P.REDUCE_SCATTER, (source, "sum", shard.size, shard.name),
                                Role.REDUCE_SCATTER)
        else:
            wait = b.collective(P.ALL_REDUCE, (source, "sum", shard.name), Role.ALL_REDUCE)
        if replicate is not None:  # HSDP: then over the ranks holding the same shard
            wait = b.collective(P.ALL_REDUCE, (wait, "sum", replicate.name), Role.ALL_REDUCE,
                                after=wait)
        if after:
            wait = b.add(aten.div.Tensor, (wait, ctx.layout.grad_divisor), Role.SCALE, after=wait)
        return b.cast(wait, site.out_dtype, Role.CAST_BACK, after=wait)
    lower.__name__ = name
    return lower


def _summed_in_rank_order(terms: torch.Tensor, count: int) -> torch.Tensor:
    """``terms`` holds ``count`` equal pieces, one per rank in rank order: their sum
    ((t0 + t1) + t2) + ..., one add at a time (a sum over a dimension may pair them in
    another order)."""
    rows = terms.view(count, -1)
    total = rows[0]
    for k in range(1, count):
        total = total + rows[k]
    return total


def _terms(name: str) -> Lowering:
    """reduce_in_rank_order: every rank's term of this rank's part reaches it unsummed, and
    it adds them in rank order. Sharded: an all_to_all over the shard group hands each rank
    the shard group's terms of its shard. Replicated (NO_SHARD): an all_gather of the
    whole gradient. HSDP then gathers those terms over the replicas, so the terms come
    in the mesh's row-major order: the job's rank order for ``init_device_mesh``'s."""
    def lower(site: Site, ctx: PassContext) -> fx.Node:
        shard, replicate = ctx.layout.shard, ctx.layout.replicate
        b = ChainBuilder(site, Direction.REDUCE, name, ctx.unit_of(site.group))
        scaled = _scaled(b, site, ctx)
        numel = scaled.meta["val"].numel()
        if ctx.plan.groups[site.group].replicated:
            terms = b.collective(P.ALL_GATHER, (scaled, shard.size, shard.name), Role.ALL_GATHER)
        else:
            splits = [numel // shard.size] * shard.size
            terms = b.collective(P.ALL_TO_ALL, (scaled, splits, splits, shard.name), Role.ALL_TO_ALL)
        count = shard.size
        if replicate is not None:
            terms = b.collective(P.ALL_GATHER, (terms, replicate.size, replicate.name), Role.ALL_GATHER,
                                 after=terms)
            count *= replicate.size
        total = b.traced(_summed_in_rank_order, terms, count=count, role=Role.SUM)  # after the waits
        return b.cast(total, site.out_dtype, Role.CAST_BACK)
    lower.__name__ = name
    return lower


reduce_scatter = _reduction("reduce_scatter", "reduce_scatter")
reduce_scatter_all_reduce = _reduction("reduce_scatter_all_reduce", "reduce_scatter")
all_reduce = _reduction("all_reduce", "all_reduce")
all_to_all_sum = _terms("all_to_all_sum")
all_to_all_all_gather_sum = _terms("all_to_all_all_gather_sum")
all_gather_sum = _terms("all_gather_sum")


# -- quantized gathers (MixedPrecision(gather_dtype=...)) ------------------------------------
#
# What a quantized gather computes is written as plain torch code on tensors below, and
# ChainBuilder.traced splices each function into the graph, traced under the graph's fake mode;
# the lowerings only say where the collectives go between them.


def _scales(amax: torch.Tensor, q: Quantized, compute: torch.dtype) -> torch.Tensor:
    """amax / the dtype's largest value, rounded once to the compute dtype: then used both to
    quantize and to dequantize, so both sides agree on it. A parameter (a block) of zeros
    gets 1e-12 / max, which bfloat16 holds, not 0."""
    return (amax.clamp_min(1e-12) / q.max).to(compute)


def _bytes(values: torch.Tensor, scales: torch.Tensor, q: Quantized) -> torch.Tensor:
    """``values`` / ``scales``, rounded into the gather dtype (saturating at its largest
    value), as uint8: what gloo and NCCL both carry."""
    scaled = values.float() / scales.float()  # in fp32, whatever the shard's dtype: one rounding
    if q.dtype is torch.int8:
        scaled = scaled.round()
    return scaled.clamp(-q.max, q.max).to(q.dtype).view(torch.uint8)


def _values(data: torch.Tensor, q: Quantized, compute: torch.dtype) -> torch.Tensor:
    """Gathered bytes back as values of the compute dtype, unscaled."""
    return data.view(q.dtype).to(compute)


Spans = list[tuple[int | None, int, int]]  # (parameter index or None for a gap, start, stop)


def _spans(group: FlatGroup, lo: int, hi: int) -> Spans:
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


def _amax_per_parameter(shard: torch.Tensor, here: Spans, count: int) -> torch.Tensor:
    """The largest magnitude of each of the group's ``count`` parameters in this shard (0 for
    one it holds none of)."""
    magnitude = shard.abs()
    found = {i: magnitude[start:stop].amax() for i, start, stop in here if i is not None}
    zero = magnitude.new_zeros(())
    return torch.stack([found.get(i, zero) for i in range(count)])


def _quantize_per_parameter(shard: torch.Tensor, scales: torch.Tensor, here: Spans, q: Quantized) -> torch.Tensor:
    """The shard's bytes, each element scaled by its parameter's scale (1 in the gaps)."""
    one = scales.new_ones(())
    pieces = [(one if i is None else scales[i]).expand(stop - start) for i, start, stop in here]
    return _bytes(shard, torch.cat(pieces) if len(pieces) > 1 else pieces[0], q)


def _dequantize_per_parameter(data: torch.Tensor, scales: torch.Tensor, spans: Spans, q: Quantized,
                              compute: torch.dtype) -> torch.Tensor:
    """The gathered flat buffer in the compute dtype, each parameter multiplied by its scale:
    converted span by span, so one span's unscaled values are alive at a time, not the
    whole buffer's."""
    pieces = [_values(data[start:stop], q, compute) if i is None
              else _values(data[start:stop], q, compute) * scales[i] for i, start, stop in spans]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def all_gather_quantized_tensor(site: Site, ctx: PassContext) -> fx.Node:
    """torchao's float8 all-gather: a scale per parameter, from its largest magnitude over the
    ranks (an all_reduce, MAX, of this shard's per-parameter maxima), the shard quantized with
    it and its bytes gathered; each parameter's values are dequantized with its scale. The
    all_reduce, its wait and the quantization are declared part of the chain's issue, so
    prefetch moves them ahead with the gather. Where the shard is the graph's input (not
    offload's copy, made at prefetch), the amax, its all_reduce and the scales are agreed at
    the graph's start (``issuing(agreed=True)``): issued at prefetch, the all_reduce's wait
    would hold compute until the unit before had finished its gather."""
    layout, group = ctx.layout, ctx.plan.groups[site.group]
    q, compute = group.wire, group.compute_dtype
    assert isinstance(q, Quantized)
    b = ChainBuilder(site, Direction.GATHER, "all_gather_quantized_tensor", ctx.unit_of(site.group))
    lo, hi = group.shard_range(layout.shard_rank) if layout.communicates else (0, group.padded_numel)
    here = _spans(group, lo, hi)
    with b.issuing(agreed=P.is_placeholder(site.value)):
        amax = b.traced(_amax_per_parameter, site.value, here=here, count=len(group.params), role=Role.ENCODE)
        if layout.communicates:
            amax = b.collective(P.ALL_REDUCE, (amax, "max", layout.shard.name), Role.ALL_REDUCE)
        scales = b.traced(_scales, amax, q=q, compute=compute, role=Role.ENCODE)
    with b.issuing():
        data = b.traced(_quantize_per_parameter, site.value, scales, here=here, q=q, role=Role.ENCODE)
    if layout.communicates:
        data = b.collective(P.ALL_GATHER, (data, layout.shard.size, layout.shard.name), Role.ALL_GATHER)
    return b.traced(_dequantize_per_parameter, data, scales, spans=_spans(group, 0, group.padded_numel),
                    q=q, compute=compute, role=Role.DECODE)


def _quantize_blocks(shard: torch.Tensor, block: int, q: Quantized, compute: torch.dtype) -> torch.Tensor:
    """The shard padded to whole blocks, each block scaled by its own largest magnitude: its
    bytes, then its scales' bytes, in one uint8 tensor."""
    blocks = -(-shard.numel() // block)
    if blocks * block != shard.numel():
        shard = torch.nn.functional.pad(shard, (0, blocks * block - shard.numel()))
    rows = shard.view(blocks, block)
    scales = _scales(rows.abs().amax(1, keepdim=True), q, compute)
    return torch.cat([_bytes(rows, scales, q).view(-1), scales.view(torch.uint8).view(-1)])


def _dequantize_blocks(payload: torch.Tensor, ranks: int, length: int, block: int, q: Quantized,
                       compute: torch.dtype) -> torch.Tensor:
    """Every rank's row of the gathered bytes: its blocks' values times their scales, trimmed
    to the shard's length, the rows end to end."""
    blocks = -(-length // block)
    table = payload.view(ranks, -1)
    values = _values(table[:, :blocks * block], q, compute).view(ranks, blocks, block)
    scales = table[:, blocks * block:].view(compute).view(ranks, blocks, 1)
    full = (values * scales).view(ranks, blocks * block)
    return full.view(-1) if blocks * block == length else full[:, :length].reshape(-1)


def all_gather_quantized_block(site: Site, ctx: PassContext) -> fx.Node:
    """ZeRO++'s qwZ: each shard quantized in blocks (``Quantized.block``), each block with
    its own scale; the data and the scales travel in one uint8 gather, so there is no other
    collective. Each rank's row is dequantized with its own scales."""
    layout, group = ctx.layout, ctx.plan.groups[site.group]
    q, compute = group.wire, group.compute_dtype
    assert isinstance(q, Quantized)
    b = ChainBuilder(site, Direction.GATHER, "all_gather_quantized_block", ctx.unit_of(site.group))
    ranks = layout.shard.size if layout.communicates else 1
    length = group.shard_numel if layout.communicates else group.padded_numel
    block = q.block(length, compute.itemsize)
    payload = b.traced(_quantize_blocks, site.value, block=block, q=q, compute=compute, role=Role.ENCODE)
    if layout.communicates:
        payload = b.collective(P.ALL_GATHER, (payload, ranks, layout.shard.name), Role.ALL_GATHER)
    return b.traced(_dequantize_blocks, payload, ranks=ranks, length=length, block=block, q=q, compute=compute,
                    role=Role.DECODE)


def _joined(b: ChainBuilder, gm: fx.GraphModule, result: fx.Node) -> None:
    """Make the chain the inner lowering made for ``result`` (if any) part of ``b``'s, and
    ``result`` itself too when it is a node of the lowering's own (a cast out of no chain)."""
    inner = tag_of(result)
    for node in gm.graph.nodes:
        info = meta.get_info(node)
        if info is not None and inner is not None and info.chain == inner:
            b.tag_node(node, info.role, info.issues, info.agrees)
    info = meta.get_info(result)
    if inner is None and info is not None and info.role is Role.CAST:
        b.tag_node(result, Role.CAST)


def _from_host(inner: Lowering, name: str) -> Lowering:
    """Offload (placement "cpu"): the shard is copied from the host to the device it
    computes on, then ``inner`` gathers the copy; the copy is the chain's first node, so
    prefetch moves it ahead with the gather."""
    def lower(site: Site, ctx: PassContext) -> fx.Node:
        b = ChainBuilder(site, Direction.GATHER, name, ctx.unit_of(site.group))
        device = site.device  # the marker's buffer: where the unit computes
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
        result = inner(site, ctx)
        b = ChainBuilder(site, Direction.REDUCE, name, ctx.unit_of(site.group))  # a chain number after inner's
        _joined(b, site.gm, result)
        device = torch.device(ctx.holding(site.group).placement)  # "cpu": the host
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
       for scaling, lowering in (("tensor", all_gather_quantized_tensor), ("block", all_gather_quantized_block))
       for topology in ("local", "sharded", "hybrid")},
    LoweringKey(G, "partition", wire="quantized_tensor"): all_gather_within,
    LoweringKey(G, "partition", wire="quantized_block"): all_gather_within,
    **{LoweringKey(G, "saved", wire=wire): keep_saved for wire in ("dtype", "quantized_tensor", "quantized_block")},
    LoweringKey(R, "local"): keep_local,
    LoweringKey(R, "sharded"): reduce_scatter,
    LoweringKey(R, "hybrid"): reduce_scatter_all_reduce,
    LoweringKey(R, "replicated"): all_reduce,
    LoweringKey(R, "sharded", wire="terms"): all_to_all_sum,
    LoweringKey(R, "hybrid", wire="terms"): all_to_all_all_gather_sum,
    LoweringKey(R, "replicated", wire="terms"): all_gather_sum,
}
# Offload: every row again with the shard on the host. A gather copies the shard in first;
# a reduction copies the shard's gradient out last. hpZ's backward gather and a saved buffer
# read what forward kept on the device: the same lowering.
for _key, _lowering in list(LOWERINGS.items()):
    _host = replace(_key, placement="cpu")
    if _key.topology in ("partition", "saved"):
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
    return LoweringKey.of(direction, ctx.holding(m.group), topology)


def lower(gm: fx.GraphModule, m: P.Marker, ctx: PassContext, value: fx.Node | None = None) -> fx.Node:
    """Lower marker ``m`` by its table entry (``value``: what it reduces, if not the marker's
    own); its readers read the result, and it is erased."""
    result = lowering_for(key_for(m, ctx))(Site.of(gm, m, value), ctx)
    m.node.replace_all_uses_with(result)
    gm.graph.erase_node(m.node)
    return result
