"""The planner and the policies: pure functions of the module tree."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn as nn

from fxshard.driver.run.runtime import make_shards
from fxshard.ir.errors import PlanError
from fxshard.ir.plan import ALIGN_BYTES, make_plan
from fxshard.ir.precision import MixedPrecision
from fxshard.policies import by_class, by_predicate, by_size

from models import MLP, Block, FrozenNet, SharedUse, TinyGPT


class Tree(nn.Module):
    """root{ a{ x: 30, y: 30 }, b: 100, w: 7 } (parameter counts)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Module()
        self.a.x = nn.Linear(5, 5)  # 30
        self.a.y = nn.Linear(5, 5)  # 30
        self.b = nn.Linear(9, 10)  # 100
        self.w = nn.Parameter(torch.zeros(7))


def unit_names(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return [u.name for u in plan.units]


def test_by_size_is_bottom_up_like_fsdp_auto_wrap() -> None:
    # x and y alone are below 50; their parent a holds 60 unclaimed -> a is a unit.
    plan = make_plan(Tree(), by_size(50), world_size=2)
    assert unit_names(plan) == ["a", "b", ""]
    assert [s.name for s in plan.groups[plan.unit("a").groups[0]].params] == [
        "a.x.weight", "a.x.bias", "a.y.weight", "a.y.bias"]
    assert [s.name for s in plan.groups[plan.unit("").groups[0]].params] == ["w"]
    # With a threshold of 30 the leaves wrap first and a has nothing left to claim.
    assert unit_names(make_plan(Tree(), by_size(30), world_size=2)) == ["a.x", "a.y", "b", ""]


def test_by_class_by_predicate_and_union() -> None:
    assert unit_names(make_plan(Tree(), by_class(nn.Linear), 1)) == ["a.x", "a.y", "b", ""]
    only_b = by_predicate(lambda name, m: name == "b")
    assert unit_names(make_plan(Tree(), only_b, 1)) == ["b", ""]
    either = only_b | by_size(50)
    assert unit_names(make_plan(Tree(), either, 1)) == ["a", "b", ""]


def test_policies_are_immutable_values_with_readable_repr() -> None:
    p = by_class(Block, nn.Embedding) | by_size(1e6)
    assert repr(p) == "by_class(Block, Embedding) | by_size(1_000_000)"
    assert p == (by_class(Block, nn.Embedding) | by_size(1_000_000))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.policies = ()  # type: ignore[misc]
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        by_class(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        by_size(0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64])
def test_flat_layout_offsets_padding_and_shards(world_size: int) -> None:
    plan = make_plan(MLP(), by_class(nn.Linear), world_size)
    for g in plan.groups:
        offset = 0
        for s in g.params:
            assert s.offset == offset
            offset += s.numel
        assert g.numel == offset
        assert g.padded_numel % world_size == 0
        assert 0 <= g.pad < world_size
        assert g.shard_numel * world_size == g.padded_numel
        assert g.shard_range(world_size - 1)[1] == g.padded_numel
    assert plan.numel == sum(p.numel() for p in MLP().parameters())


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64])
def test_each_ranks_piece_of_a_parameter_is_where_the_flat_layout_puts_it(world_size: int) -> None:
    # The oracle: number every element of the flat layout, cut it into shards by hand.
    plan = make_plan(MLP(), by_class(nn.Linear), world_size, replicate_below=20)
    assert any(g.replicated for g in plan.groups) and any(not g.replicated for g in plan.groups)
    for g in plan.groups:
        layout = torch.arange(g.padded_numel)
        step = g.padded_numel if g.replicated else g.padded_numel // world_size
        for slot in g.params:
            ids = torch.arange(slot.offset, slot.offset + slot.numel)
            held = torch.zeros(slot.numel, dtype=torch.int64)
            for rank in range(world_size):
                shard = layout[0:step] if g.replicated else layout[rank * step:(rank + 1) * step]
                piece = g.piece(slot, rank)
                if piece is None:
                    assert not bool(((ids >= shard[0]) & (ids <= shard[-1])).any())
                    continue
                assert torch.equal(shard[piece.shard], ids[piece.param])
                assert piece.numel == piece.param.stop - piece.param.start > 0
                held[piece.param] += 1
            # sharded: every element on exactly one rank; replicated: on every rank
            assert bool((held == (world_size if g.replicated else 1)).all()), (g.index, slot.name)


class Odd(nn.Module):
    """Odd-sized parameters in float32, bfloat16 and float16, one unit each way."""

    def __init__(self) -> None:
        super().__init__()
        for i, (n, dtype) in enumerate([(5, torch.float32), (9, torch.float32), (3, torch.float32),
                                        (7, torch.bfloat16), (1, torch.bfloat16), (13, torch.bfloat16),
                                        (3, torch.float16), (6, torch.float16), (250, torch.float32),
                                        (2, torch.float32)]):
            setattr(self, f"p{i}", nn.Parameter(torch.randn(n).to(dtype)))
        self.lin = nn.Linear(3, 3)  # 9 and 3 elements


PLANS = {
    "plain": lambda ws: make_plan(Odd(), None, ws),
    "replicated": lambda ws: make_plan(Odd(), None, ws, replicate_below=10),
    "units": lambda ws: make_plan(Odd(), by_class(nn.Linear), ws),
    "bf16 compute": lambda ws: make_plan(Odd(), None, ws, mixed_precision=MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
}


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("how", list(PLANS))
def test_every_parameter_starts_16_bytes_aligned_in_its_flat_group(how: str, world_size: int) -> None:
    plan = PLANS[how](world_size)
    assert {g.dtype for g in plan.groups} == {torch.float32, torch.bfloat16, torch.float16}
    gaps = 0
    for g in plan.groups:
        end = 0
        for s in g.params:
            # in the group's dtype, and in the dtype it is gathered and computed in
            for dtype in (g.dtype, g.compute_dtype):
                assert s.offset * dtype.itemsize % ALIGN_BYTES == 0, (g.index, s.name, s.offset, dtype)
            narrowest = min(g.dtype.itemsize, g.compute_dtype.itemsize)
            assert 0 <= (s.offset - end) * narrowest < ALIGN_BYTES, (g.index, s.name)  # no wider gap
            gaps += s.offset - end
            end = s.offset + s.numel
        assert g.numel == sum(s.numel for s in g.params)  # parameter data only
        assert g.padded_numel == (end if g.replicated else -(-end // world_size) * world_size)
        assert g.pad == g.padded_numel - g.numel
        assert [s for s, _ in g.spans() if s is not None] == list(g.params)
        assert sum(n for _, n in g.spans()) == g.padded_numel
    assert gaps > 0  # the odd sizes do leave gaps
    assert plan.numel == sum(p.numel() for p in Odd().parameters())


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("how", list(PLANS))
def test_ranks_pieces_tile_each_parameter_and_the_gaps_hold_zeros(how: str, world_size: int) -> None:
    torch.manual_seed(0)
    module = Odd()
    plan = PLANS[how](world_size)
    shards = [make_shards(module, plan, rank, torch.device("cpu")) for rank in range(world_size)]
    for g in plan.groups:
        covered = [torch.zeros(g.shard_numel, dtype=torch.bool) for _ in range(world_size)]
        for slot in g.params:
            param = module.get_parameter(slot.name).detach().reshape(-1)
            got = torch.zeros_like(param)
            held = torch.zeros(slot.numel, dtype=torch.int64)
            for rank in range(world_size):
                piece = g.piece(slot, rank)
                if piece is None:
                    continue
                got[piece.param] = shards[rank][g.index].detach()[piece.shard]
                held[piece.param] += 1
                assert not covered[rank][piece.shard].any(), (g.index, slot.name, rank)
                covered[rank][piece.shard] = True
            assert bool((held == (world_size if g.replicated else 1)).all()), (g.index, slot.name)
            assert torch.equal(got, param), (g.index, slot.name)
        for rank in range(world_size):  # gaps and padding: zeros
            rest = shards[rank][g.index].detach()[~covered[rank]]
            assert bool((rest == 0).all()), (g.index, rank)
        if not g.replicated:  # the pieces of all ranks hold every element of the group
            assert int(sum(int(c.sum()) for c in covered)) == g.numel


def test_tied_weights_merge_units_and_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fxshard"):
        plan = make_plan(SharedUse(), by_class(nn.Linear), 2)
    merged = plan.unit("a+b")
    assert merged.modules == ("a", "b")
    (slot,) = plan.groups[merged.groups[0]].params
    assert slot.name == "a.weight" and slot.aliases == ("b.weight",)
    assert "merged" in caplog.text and "a.weight" in caplog.text
    # A tied weight under a unit and the root merges into the root.
    gpt = make_plan(TinyGPT(), by_class(Block, nn.Embedding), 2)
    assert "tok" in gpt.unit("").modules
    assert gpt.group_of("lm_head.weight") is gpt.group_of("tok.weight")


def test_frozen_and_mixed_dtype_parameters_get_their_own_groups() -> None:
    plan = make_plan(FrozenNet(), None, 2)
    (root,) = plan.units
    groups = [plan.groups[i] for i in root.groups]
    assert [(g.requires_grad, len(g.params)) for g in groups] == [(False, 4), (True, 4)]
    model = MLP()
    model.head.half()
    plan = make_plan(model, None, 2)
    assert sorted(str(plan.groups[i].dtype) for i in plan.units[0].groups) == ["torch.float16", "torch.float32"]


def test_policy_matching_nothing_warns_and_uses_the_root_unit() -> None:
    with pytest.warns(UserWarning, match="matched no module"):
        plan = make_plan(MLP(), by_class(nn.Conv2d), 2)
    assert unit_names(plan) == [""]


def test_no_parameters_is_an_error() -> None:
    with pytest.raises(PlanError, match="no parameters"):
        make_plan(nn.ReLU(), None, 2)


def test_first_use_order_reorders_units_not_layout() -> None:
    plan = make_plan(Tree(), by_class(nn.Linear), 2)
    reordered = plan.ordered_by_first_use([2, 0])  # b first, then a.x; a.y and root unused
    assert unit_names(reordered) == ["b", "a.x", "a.y", ""]
    assert reordered.groups == plan.groups


def test_plan_table_and_unit_graph() -> None:
    plan = make_plan(TinyGPT(), by_class(Block), 3)
    text = str(plan)
    assert "world_size=3" in text and "by_class(Block)" in text
    for col in ("unit", "dtype", "numel", "padded", "shard", "params"):
        assert col in text
    assert "blocks.0" in text and "attn.qkv.weight" in text and "<root>" in text
    graph = plan.unit_graph()
    assert list(graph.nodes) == [u.label for u in plan.units]
    kinds = {(a, b): d["kind"] for a, b, d in graph.edges(data=True)}
    assert kinds[("blocks.0", "blocks.1")] == "order"
    assert kinds[("<root>", "blocks.0")] == "contains"


def test_the_printed_plan_shows_a_tied_weight_as_an_alias() -> None:
    plan = make_plan(TinyGPT(), by_class(Block), 3)
    root = next(line for line in str(plan).splitlines() if line.startswith("<root>"))
    assert "tok.weight (= lm_head.weight)" in root, root
