"""Collective chains and the lowering table (fxshard/ir/chains.py, fxshard/passes/lowering.py).

Each lowering records what it made as one chain; scheduling, freeing, verify
and the report read chains. Graph structure on a fake process group of 4
ranks (in this process).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard.ir import analysis, meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.chains import Chain, chains
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.meta import Direction, Role
from fxshard.ir.nodes import call
from fxshard.passes import lowering
from fxshard.passes.lowering import LOWERINGS, ChainBuilder, LoweringKey, Site, lowering_for
from fxshard.passes.verify import verify
from fxshard.policies import by_class

from graph_utils import fake_world
from models import MLP


def _compiled(**kw: Any) -> Any:
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), verify_passes=True, **kw)
    F.mse_loss(sharded(torch.randn(2, 12)).float(), torch.randn(2, 5)).backward()
    return sharded


def _roles(found: tuple[fx.Node, ...]) -> tuple[Role | None, ...]:
    return tuple(meta.role_of(n) for n in found)


def _by_graph(sharded: Any) -> dict[str, list[Chain]]:
    return {kind: chains(gm.graph) for kind, gm in sharded.graphs.items() if kind != "joint"}


def _dimension(sharded: Any, chain: Chain) -> list[str]:
    driver = sharded._driver
    dims = driver.layout.dimensions()
    return [dims[name][0] for name in chain.group_names]


def test_full_shard_with_mixed_precision_records_cast_gather_wait_free_and_cast_divide_scatter() -> None:
    with fake_world(4):
        sharded = _compiled(mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32))
        found = _by_graph(sharded)
        plan = sharded.plan
        gathers = [c for c in found["forward"] if c.direction is Direction.GATHER]
        assert len(gathers) == len(plan.groups)
        for c in gathers:
            assert c.lowering == "all_gather" and c.unit == plan.groups[c.group].unit
            assert _roles(c.issue) == (Role.CAST, Role.ALL_GATHER)
            assert _roles(c.tail) == (Role.WAIT,) and c.result is c.waits[0]
            assert c.issue[0].meta["val"].dtype == torch.bfloat16  # the gather moves bf16 bytes
            assert c.bytes == plan.groups[c.group].shard_numel * 2
            (free,) = c.frees
            assert free.args[0] is c.result and P.is_free(free)
            assert _dimension(sharded, c) == ["shard"]
        # Backward: the units whose weights the input gradients read are gathered again (not
        # the first: the input needs no gradient); every gradient is cast to fp32, scattered and
        # its shard divided (by 4: a power of two, so after the sum).
        again = [c for c in found["backward"] if c.direction is Direction.GATHER]
        assert {c.group for c in again} == {1, 2} and all(c.lowering == "all_gather" for c in again)
        reductions = [c for c in found["backward"] if c.direction is Direction.REDUCE]
        assert len(reductions) == len(plan.groups)
        output = next(n for n in sharded.graphs["backward"].graph.nodes if P.is_output(n))
        for c in reductions:
            assert c.lowering == "reduce_scatter"
            assert _roles(c.issue) == (Role.CAST, Role.REDUCE_SCATTER)
            assert _roles(c.tail) == (Role.WAIT, Role.SCALE)
            assert c.tail[1].args[1] == 4  # averaged over the 4 ranks
            assert c.result in output.args[0]  # the shard's gradient
            assert c.bytes == plan.groups[c.group].padded_numel * 4  # fp32, the whole flat gradient


def test_hsdp_no_shard_hpz_and_kept_buffers_each_record_their_lowering() -> None:
    with fake_world(4, rank=1):
        # Not resharded (ZeRO-2): each buffer kept from forward is a chain with no collective.
        kept_whole = _by_graph(_compiled(reshard_after_forward=False))
        saved = [c for c in kept_whole["backward"] if c.direction is Direction.GATHER]
        assert len(saved) == 2 and all(c.lowering == "saved" and c.collectives == () and not c.frees
                                       and P.is_placeholder(c.result) for c in saved)

        hsdp = _by_graph(_compiled(mesh=init_device_mesh("cpu", (2, 2)),
                                   mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16,
                                                                          reduce_dtype=torch.bfloat16)))
        sharded = _compiled(mesh=init_device_mesh("cpu", (2, 2)))
        for c in [c for c in _by_graph(sharded)["backward"] if c.direction is Direction.REDUCE]:
            assert c.lowering == "reduce_scatter_all_reduce"
            assert _roles(c.issue) == (Role.REDUCE_SCATTER,)
            assert _roles(c.tail) == (Role.WAIT, Role.ALL_REDUCE, Role.WAIT, Role.SCALE)
            assert _dimension(sharded, c) == ["shard", "replicate"]
        # Reduced in bf16 and cast back to the fp32 shard after the replicas' sum.
        reduced = [c for c in hsdp["backward"] if c.direction is Direction.REDUCE]
        assert reduced and all(_roles(c.tail) == (Role.WAIT, Role.ALL_REDUCE, Role.WAIT, Role.SCALE,
                                                  Role.CAST_BACK)
                               and c.result.meta["val"].dtype == torch.float32 for c in reduced)

        no_shard = _by_graph(_compiled(mesh=init_device_mesh("cpu", (4, 1))))
        assert not [c for c in no_shard["forward"] if c.gathers]
        reduce = [c for c in no_shard["backward"] if c.direction is Direction.REDUCE]
        assert reduce and all(c.lowering == "all_reduce" and _roles(c.issue) == (Role.ALL_REDUCE,)
                              and _roles(c.tail) == (Role.WAIT, Role.SCALE) for c in reduce)

        hpz = _compiled(reshard_after_forward=2)
        found = _by_graph(hpz)
        kept = [c for c in found["forward"] if c.kept]
        assert kept and all(_roles(c.kept) == (Role.PIECE, Role.PIECE) for c in kept)
        within = [c for c in found["backward"] if c.lowering == "all_gather_within"]
        assert {c.group for c in within} == {c.group for c in kept}
        assert all(_dimension(hpz, c) == ["partition"] and c.frees for c in within)


def _gather_then_scale(site: Site, ctx: Any) -> fx.Node:
    """A lowering with one node more than "all_gather" after the wait: a stand-in for an fp8
    gather's dequantization (a multiply by the scale)."""
    shard = ctx.layout.shard
    b = ChainBuilder(site, Direction.GATHER, "gather_then_scale", ctx.unit_of(site.group))
    source = b.cast(site.value, site.compute_dtype)
    wait = b.collective(P.ALL_GATHER, (source, shard.size, shard.name), Role.ALL_GATHER)
    return b.add(torch.ops.aten.mul.Tensor, (wait, 1.0), Role.CAST_BACK, after=wait)


def test_a_lowering_with_a_node_more_is_one_row_and_every_pass_follows_its_chain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the table's sharded gather: placement, prefetch, frees, the in-flight limit
    (verify, after every pass) and the report follow the chain, not the node shapes."""
    with fake_world(4):
        plain = _compiled(forward_prefetch=True)
        monkeypatch.setitem(LOWERINGS, LoweringKey(Direction.GATHER, "sharded"), _gather_then_scale)
        scaled = _compiled(forward_prefetch=True)
    for kind in ("forward", "backward"):
        gm = scaled.graphs[kind]
        order = order_of(gm.graph)
        gathered = [c for c in chains(gm.graph) if c.gathers]
        assert gathered and all(c.lowering == "gather_then_scale" for c in gathered)
        for c in gathered:
            (scale,) = [n for n in c.tail if n.target is torch.ops.aten.mul.Tensor]
            assert c.result is scale
            # The free releases what compute reads, after its last reader.
            (free,) = c.frees
            assert free.args[0] is scale
            readers = [u for u in scale.users if u is not free]
            assert readers and order[free] > max(order[u] for u in readers)
            # Placed with its wait: nothing but the chain runs between the wait and the scale.
            assert order[scale] == order[c.waits[0]] + 1
    # The same collectives, in the same order, as the plain lowering: the report reads chains.
    assert plain.report().comm_bytes_per_step == scaled.report().comm_bytes_per_step
    def volume(units: Any) -> list[tuple[Any, ...]]:  # the bytes; its time has the extra node's
        return [(u.name, u.padded_bytes, u.shard_bytes, u.gathers, u.comm_bytes) for u in units]

    assert volume(plain.report().units) == volume(scaled.report().units)
    assert ([(c.kind, c.unit, c.shape) for c in plain._driver.steps[0].collectives]
            == [(c.kind, c.unit, c.shape) for c in scaled._driver.steps[0].collectives])


def _agree_then_gather(site: Site, ctx: Any) -> fx.Node:
    """A gather that needs a collective's result before it can be issued: the ranks agree on
    the largest magnitude of the shard (an all_reduce), divide by it, gather, and multiply
    back after the wait (a stand-in for a quantized gather's amax, quantization and
    dequantization). The lowering declares the agreement part of the chain's issue."""
    shard = ctx.layout.shard
    b = ChainBuilder(site, Direction.GATHER, "agree_then_gather", ctx.unit_of(site.group))
    source = b.cast(site.value, site.compute_dtype)
    with b.issuing():
        amax = b.add(torch.ops.aten.amax.default, (b.add(torch.ops.aten.abs.default, (source,), Role.CAST), [0]),
                     Role.CAST)
        agreed = b.collective(P.ALL_REDUCE, (amax, "max", shard.name), Role.ALL_REDUCE)
        scaled = b.add(torch.ops.aten.div.Tensor, (source, agreed), Role.CAST)
    wait = b.collective(P.ALL_GATHER, (scaled, shard.size, shard.name), Role.ALL_GATHER)
    return b.add(torch.ops.aten.mul.Tensor, (wait, agreed), Role.CAST_BACK, after=wait)


def test_a_collective_the_gather_waits_for_is_issued_and_prefetched_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain whose gather needs an all_reduce's result first keeps all of it in its issue:
    prefetch moves the all_reduce, its wait and the gather one unit ahead together, so the
    gathers overlap compute exactly as the plain lowering's do."""
    with fake_world(4):
        plain = _compiled(forward_prefetch=True)
        monkeypatch.setitem(LOWERINGS, LoweringKey(Direction.GATHER, "sharded"), _agree_then_gather)
        agreed = _compiled(forward_prefetch=True)
    for kind in ("forward", "backward"):
        found = [c for c in chains(agreed.graphs[kind].graph) if c.gathers]
        assert found and all(c.lowering == "agree_then_gather" for c in found)
        for c in found:
            assert [r for r in _roles(c.issue) if r is not Role.CAST] == \
                [Role.ALL_REDUCE, Role.WAIT, Role.ALL_GATHER]
            assert _roles(c.tail) == (Role.WAIT, Role.CAST_BACK) and c.result is c.tail[-1]

        def bare(sharded: Any, kind: str = kind) -> list[str]:  # the units whose gather no compute overlaps
            return [meta.get_info(n).unit for n in analysis.gathers_without_overlap(sharded.graphs[kind].graph)
                    if P.is_all_gather(n)]

        def overlapped(sharded: Any, kind: str = kind) -> list[int]:  # nodes between each gather and its wait
            gm = sharded.graphs[kind]
            order = order_of(gm.graph)
            return [order[w] - order[g] for c in chains(gm.graph) if c.gathers
                    for g, w in zip(c.collectives, c.waits) if P.is_all_gather(g)]

        assert bare(agreed) == bare(plain)
        hidden = [d > 1 for d in overlapped(plain)]  # something runs between gather and wait
        assert any(hidden) and [d > 1 for d in overlapped(agreed)] == hidden


def test_a_collective_outside_any_chain_is_refused_by_verify() -> None:
    with fake_world(4):
        sharded = _compiled()
        gm = sharded.graphs["forward"]
        verify(gm)
        chain = next(c for c in chains(gm.graph) if c.gathers)
        with gm.graph.inserting_after(chain.result):
            stray = call(gm.graph, P.ALL_GATHER, (chain.issue[-1].args[0], 4, P.group_name(chain.collectives[0])))
        with gm.graph.inserting_after(stray):
            call(gm.graph, P.WAIT, (stray,))
        with pytest.raises(GraphInvariantError, match="belongs to no collective chain"):
            verify(gm)


def test_a_buffer_kept_for_backward_is_the_saved_row_of_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not resharded: backward reads each unit's gathered buffer as an input, and the table's
    # "saved" row (not the driver) declares its chain. A stand-in row sees every one, with the
    # group's wire and placement in its key.
    seen: list[tuple[int, str]] = []

    def recorded(site: Site, ctx: Any) -> fx.Node:
        seen.append((site.group, site.value.op))
        return lowering.keep_saved(site, ctx)

    for placement in ("device", "cpu"):
        monkeypatch.setitem(LOWERINGS, LoweringKey(Direction.GATHER, "saved", "dtype", placement), recorded)
    with fake_world(4, rank=1):
        sharded = _compiled(reshard_after_forward=False)
    saved = [c for c in _by_graph(sharded)["backward"] if c.lowering == "saved"]
    assert sorted(seen) == sorted((c.group, "placeholder") for c in saved) and len(saved) == 2
    assert str(LoweringKey(Direction.GATHER, "saved", "quantized_block", "cpu")) in {str(k) for k in LOWERINGS}


def test_the_table_names_each_row_and_refuses_a_missing_one() -> None:
    assert {str(k) for k in LOWERINGS} >= {"gather/sharded/dtype/device", "reduce/hybrid/dtype/device",
                                           "gather/partition/dtype/device", "reduce/replicated/dtype/device"}
    assert lowering_for(LoweringKey(Direction.REDUCE, "hybrid")) is lowering.reduce_scatter_all_reduce
    with pytest.raises(GraphInvariantError, match="no lowering for gather/sharded/fp8/device; the table has"):
        lowering_for(LoweringKey(Direction.GATHER, "sharded", wire="fp8"))


def test_hsdp_with_hpz_inside_gathers_in_the_row_keeps_a_piece_per_partition_and_reduces_over_both() -> None:
    """An (R, S) = (2, 4) mesh with reshard_after_forward=2, rank 5 of 8: forward gathers over
    its row of the mesh (ranks 4-7), keeps its piece for its partition (ranks 4 and 5),
    backward gathers within that partition, and each gradient is reduce-scattered over the
    row and its shard all_reduced over the column (ranks 1 and 5)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    def ranks(chain: Chain) -> list[list[int]]:
        return [dist.get_process_group_ranks(_resolve_process_group(name)) for name in chain.group_names]

    with fake_world(8, rank=5):
        sharded = _compiled(mesh=init_device_mesh("cpu", (2, 4)), reshard_after_forward=2)
        found = _by_graph(sharded)
        gathers = [c for c in found["forward"] if c.gathers]
        assert gathers and all(c.lowering == "all_gather" and _dimension(sharded, c) == ["shard"]
                               and ranks(c) == [[4, 5, 6, 7]] for c in gathers)
        for c in gathers:
            (gather,) = c.collectives
            assert P.collective_args(gather).group_size == 4
        # What backward reads (not the first layer's weights: the input needs no gradient):
        # a piece of the gathered buffer kept per partition of 2, half of it, gathered again
        # within the partition.
        kept = [c for c in gathers if c.kept]
        assert [c.unit for c in kept] == ["layers.1", "head"]
        assert all(c.kept[-1].meta["val"].numel() == sharded.plan.groups[c.group].padded_numel // 2 for c in kept)
        within = [c for c in found["backward"] if c.lowering == "all_gather_within"]
        assert sorted(c.group for c in within) == sorted(c.group for c in kept)
        assert all(_dimension(sharded, c) == ["partition"] and ranks(c) == [[4, 5]] for c in within)
        reductions = [c for c in found["backward"] if c.direction is Direction.REDUCE]
        assert reductions and all(c.lowering == "reduce_scatter_all_reduce"
                                  and _dimension(sharded, c) == ["shard", "replicate"]
                                  and ranks(c) == [[4, 5, 6, 7], [1, 5]] for c in reductions)


def _gather_then_traced(site: Site, ctx: Any) -> fx.Node:
    """A lowering whose dequantization is plain torch code, spliced in by ChainBuilder.traced."""
    shard = ctx.layout.shard
    b = ChainBuilder(site, Direction.GATHER, "gather_then_traced", ctx.unit_of(site.group))
    wait = b.collective(P.ALL_GATHER, (b.cast(site.value, site.compute_dtype), shard.size, shard.name),
                        Role.ALL_GATHER)
    return b.traced(_SPLICED, wait, factor=2.0, role=Role.DECODE)


def _doubled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return (x * factor).view(-1).detach()


def _with_a_constant(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * torch.tensor([factor])


_SPLICED = _doubled


@pytest.mark.release  # make_fx records .detach() as detach on 2.11 and 2.13, alias on 2.15
def test_a_traced_function_is_spliced_in_as_the_chains_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """ChainBuilder.traced: the function's ops become chain nodes with their role and fake
    values (make_fx's detach is dropped); a function that makes a constant tensor is refused."""
    monkeypatch.setitem(LOWERINGS, LoweringKey(Direction.GATHER, "sharded"), _gather_then_traced)
    with fake_world(4):
        sharded = _compiled()
        for c in [c for c in chains(sharded.graphs["forward"].graph) if c.gathers]:
            spliced = [n for n in c.tail if meta.role_of(n) is Role.DECODE]
            assert [n.target for n in spliced] == [torch.ops.aten.mul.Tensor, torch.ops.aten.view.default]
            assert c.result is spliced[-1] and all(isinstance(n.meta["val"], torch.Tensor) for n in spliced)
        monkeypatch.setattr(sys.modules[__name__], "_SPLICED", _with_a_constant)
        with pytest.raises(Exception, match="may make no constant tensors"):
            _compiled()
