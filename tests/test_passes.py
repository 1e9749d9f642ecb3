"""Each pass alone, on small graphs built by hand; then ``verify`` catching broken graphs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxshard.ir import ops
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import GraphInvariantError
from fxshard.ir.layout import Layout
from fxshard.ir.options import ShardingOptions
from fxshard.ir.plan import make_plan
from fxshard.passes import (
    PassContext,
    PassSpec,
    accumulate_in_place_pass,
    build_pipeline,
    eliminate_dead_code_pass,
    insert_all_gather_pass,
    insert_free_pass,
    insert_reduce_scatter_pass,
    place_gathers_pass,
    rematerialize_params_pass,
    run_passes,
    sink_allocations_pass,
    topological_sort_pass,
    verify,
)
from fxshard.policies import by_class

from graph_utils import normalised_ops

aten = torch.ops.aten


class Builder:
    """Build an fx graph node by node, computing each node's meta['val'] under fake tensors."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()

    def input(self, name: str, *shape: int, tag: str = "is_forward") -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(*shape)
        node.meta["partitioner_tag"] = tag
        return node

    def op(self, target: Any, *args: Any, tag: str = "is_forward") -> fx.Node:
        node = self.graph.call_function(target, args)
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with self.mode:
            node.meta["val"] = target(*vals)
        node.meta["partitioner_tag"] = tag
        return node

    def done(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


JIT = ShardingOptions(forward_prefetch=False, backward_prefetch=None)


def pipeline(c: PassContext, **config: Any) -> tuple[PassSpec, ...]:
    """The pipeline the driver would build for this context's graph and options."""
    return build_pipeline(c.graph, CompileConfig(options=c.options, **config))


def ctx(graph: str = "forward", world_size: int = 2, group: str | None = "pg", **kw: Any) -> PassContext:
    kw.setdefault("options", JIT)
    layers = [torch.nn.Linear(4, 4, bias=False) for _ in range(3)]
    plan = make_plan(torch.nn.Sequential(*layers), by_class(torch.nn.Linear), world_size)
    slots = kw.pop("inflight_groups", ())
    return PassContext(plan, Layout.flat(world_size, group, slots), graph, **kw)  # type: ignore[arg-type]


def two_unit_forward(world_size: int = 2) -> fx.GraphModule:
    """Both units' markers up front, as tracing leaves them; compute afterwards."""
    b = Builder()
    s0, s1 = b.input("shard0", 16 // world_size), b.input("shard1", 16 // world_size)
    x = b.input("x", 3, 4)
    w0 = b.op(aten.view.default, b.op(ops.UNSHARD, s0, 0, world_size), [4, 4])
    w1 = b.op(aten.view.default, b.op(ops.UNSHARD, s1, 1, world_size), [4, 4])
    h = b.op(aten.relu.default, b.op(aten.mm.default, x, w0))
    return b.done(b.op(aten.mm.default, h, w1))


def test_a_layout_separates_shard_degree_from_gradient_divisor_and_refuses_no_group() -> None:
    layout = Layout.flat(4, "pg", ("s0", "s1"))
    assert (layout.shard.size, layout.grad_divisor, layout.world_size, layout.shard.slots) == \
        (4, 4, 4, ("s0", "s1"))
    assert Layout.flat(1, None).communicates is False
    with pytest.raises(ValueError, match="2 ranks need a process group"):
        Layout.flat(2, None)
    with pytest.raises(ValueError, match="at least one rank"):
        Layout.flat(0, "pg")


def test_a_layouts_dimension_names_its_ranks_and_this_ranks_place_and_refuses_a_wrong_one() -> None:
    from fxshard.ir.layout import CommGroup

    hsdp = Layout(CommGroup(2, "row", ("row", "row1"), 1, (2, 3)), CommGroup(2, "column", (), 1, (1, 3)),
                  CommGroup(1, "piece", (), 0, (3,)))
    assert (hsdp.world_size, hsdp.shard_rank, hsdp.partition_rank, hsdp.replicate.groups) == (4, 1, 0, ("column",))
    assert hsdp.describe() == "replica 1 of 2; rank 0 of 1 in its hpZ partition"
    assert hsdp.without_slots().shard.slots == () and hsdp.without_slots().shard.ranks == (2, 3)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        CommGroup(2, "row", rank=2)
    with pytest.raises(ValueError, match="a group of 2 ranks named 3"):
        CommGroup(2, "row", ranks=(0, 1, 2))


def test_a_layout_is_its_named_dimensions_and_a_new_one_is_an_entry_of_the_dimensions_table() -> None:
    from fxshard.ir.layout import DIMENSIONS, CommGroup

    shard, replicate, partition = CommGroup(4, "row", rank=1), CommGroup(2, "column", rank=1), CommGroup(2, "block")
    layout = Layout(shard, replicate, partition)
    assert [name for name, _ in layout.dims] == [d.name for d in DIMENSIONS] == ["shard", "replicate", "partition"]
    assert layout.get("partition") is partition and layout.get("nothing") is None
    assert (layout.world_size, Layout(shard, partition=partition).world_size) == (8, 4)  # a partition cuts the shard
    assert Layout(shard, partition=partition).describe() == "rank 0 of 2 in its hpZ partition"
    with pytest.raises(ValueError, match=r"no layout dimension named \['tensor'\]; the dimensions are \['shard', "):
        Layout(shard, tensor=CommGroup(2, "t"))
    with pytest.raises(ValueError, match="a partition of 3 ranks does not divide a shard group of 4"):
        Layout(shard, partition=CommGroup(3, "block"))


def test_each_flat_groups_holding_is_one_value_and_keys_its_lowering() -> None:
    from fxshard.ir.meta import Direction
    from fxshard.passes.context import Holding
    from fxshard.passes.lowering import LoweringKey

    assert ctx().holding(0) == Holding("sharded", "dtype", "dtype", "device")
    assert ctx(world_size=1, group=None).holding(0) == Holding("local")
    from fxshard import CPUOffloadPolicy

    options = ShardingOptions(reduce_in_rank_order=True, offload_policy=CPUOffloadPolicy(pin_memory=False),
                              offload_units=frozenset({"1"}))
    assert ctx(options=options).holding(0).placement == "device"
    ordered = ctx(options=options).holding(1)
    assert ordered == Holding("sharded", "dtype", "terms", "cpu")
    assert str(LoweringKey.of(Direction.REDUCE, ordered)) == "reduce/sharded/terms/cpu"
    assert str(LoweringKey.of(Direction.GATHER, ordered, "saved")) == "gather/saved/dtype/cpu"


def test_markers_are_read_by_name_and_a_malformed_one_is_named() -> None:
    b = Builder()
    shard, grad = b.input("shard", 8), b.input("grad", 16, tag="is_backward")
    nodes = [b.op(ops.UNSHARD, shard, 3, 2), b.op(ops.REPLICATE, shard, 4, 2, torch.bfloat16, torch.float32),
             b.op(ops.REDUCE_GRAD, grad, 3, 2, torch.float32, torch.bfloat16, tag="is_backward"),
             b.op(ops.ALLREDUCE_GRAD, grad, 4, 2, None, torch.bfloat16, tag="is_backward")]
    read = [P.marker(n) for n in nodes]
    assert [(m.kind, m.value.name, m.group, m.world_size, m.compute_dtype, m.reduce_dtype, m.out_dtype)
            for m in read if m is not None] == [
        (P.MarkerKind.UNSHARD, "shard", 3, 2, None, None, None),
        (P.MarkerKind.REPLICATE, "shard", 4, 2, torch.bfloat16, torch.float32, None),
        (P.MarkerKind.REDUCE_GRAD, "grad", 3, 2, None, torch.float32, torch.bfloat16),
        (P.MarkerKind.ALLREDUCE_GRAD, "grad", 4, 2, None, None, torch.bfloat16),
    ]
    assert P.marker(shard) is None and P.marker(b.op(aten.relu.default, shard)) is None
    bad = b.op(ops.UNSHARD, shard, 3, 2)
    bad.args = (shard, "3", 2)  # a group that is not a flat group's index
    with pytest.raises(GraphInvariantError, match=rf"{bad.name}: malformed fxshard.unshard marker"):
        P.marker(bad)


def test_collectives_are_read_by_schema_name_whether_passed_by_position_or_keyword() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    gather = g.call_function(P.ALL_GATHER, (x, 4, "pg"))
    scatter = g.call_function(P.REDUCE_SCATTER, (x, "sum"), {"group_size": 4, "group_name": "pg"})
    reduce = g.call_function(P.ALL_REDUCE, (x, "sum", "pg"))
    swap = g.call_function(P.ALL_TO_ALL, (x, [2, 2], [2, 2], "pg"))
    read = [P.collective_args(n) for n in (gather, scatter, reduce, swap)]
    assert [(a.kind, a.input, a.group_name, a.group_size, a.reduce_op) for a in read] == [
        ("all_gather", x, "pg", 4, None), ("reduce_scatter", x, "pg", 4, "sum"),
        ("all_reduce", x, "pg", None, "sum"), ("all_to_all", x, "pg", 2, None)]
    P.set_group_name(gather, "s1")
    P.set_group_name(scatter, "s1")
    assert gather.args == (x, 4, "s1") and scatter.kwargs == {"group_size": 4, "group_name": "s1"}
    assert P.group_name(scatter) == "s1"
    with pytest.raises(ValueError, match="is not a lowered collective"):
        P.collective_args(x)


def test_insert_all_gather_lowers_each_marker_to_gather_and_wait() -> None:
    gm = two_unit_forward()
    assert normalised_ops(gm).count("fxshard.unshard") == 2
    gm = insert_all_gather_pass(gm, ctx())
    gm.graph.lint()
    ops_ = normalised_ops(gm)
    assert "fxshard.unshard" not in " ".join(ops_)
    assert ops_.count("_c10d_functional.all_gather_into_tensor") == 2
    assert ops_.count("_c10d_functional.wait_tensor") == 2
    for gather in [n for n in gm.graph.nodes if P.is_all_gather(n)]:
        assert gather.args[1:] == (2, "pg")
        (wait,) = gather.users
        assert P.is_wait(wait) and wait.meta["val"].shape == (16,)
    verify(gm)


def test_insert_all_gather_without_process_group_uses_the_shard_itself() -> None:
    gm = insert_all_gather_pass(two_unit_forward(world_size=1), ctx(world_size=1, group=None))
    assert not [n for n in gm.graph.nodes if P.is_collective(n) or P.is_marker(n)]
    views = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert [v.args[0].name for v in views] == ["shard0", "shard1"]


def test_insert_all_gather_rejects_a_graph_traced_for_another_shard_degree() -> None:
    with pytest.raises(GraphInvariantError, match="unshard.*traced for a shard degree of 2, lowering for 3"):
        insert_all_gather_pass(two_unit_forward(world_size=2), ctx(world_size=3))


def test_schedule_moves_each_gather_to_its_units_first_compute() -> None:
    gm = insert_all_gather_pass(two_unit_forward(), ctx())
    before = gm.code
    gm = place_gathers_pass(gm, ctx())
    assert gm.code == before  # a scheduling pass records positions; the sort moves nodes
    gm = topological_sort_pass(gm, ctx())
    gm.graph.lint()
    placed = gm.code
    assert normalised_ops(gm) == [
        "_c10d_functional.all_gather_into_tensor", "_c10d_functional.wait_tensor", "aten.view",
        "aten.mm", "aten.relu",
        "_c10d_functional.all_gather_into_tensor", "_c10d_functional.wait_tensor", "aten.view",
        "aten.mm",
    ]
    # Idempotent: the pass mutates gm in place, so compare with the text from before.
    assert placed_gathers(gm, ctx()).code == placed


def placed_gathers(gm: fx.GraphModule, c: PassContext) -> fx.GraphModule:
    return topological_sort_pass(place_gathers_pass(gm, c), c)


def sunk(gm: fx.GraphModule, c: PassContext) -> fx.GraphModule:
    return topological_sort_pass(sink_allocations_pass(gm, c), c)


def three_unit_forward() -> fx.GraphModule:
    """x -> mm(w0) -> relu -> mm(w1) -> relu -> mm(w2): three units in a row."""
    b = Builder()
    shards = [b.input(f"shard{i}", 8) for i in range(3)]
    h = b.input("x", 3, 4)
    weights = [b.op(aten.view.default, b.op(ops.UNSHARD, s, i, 2), [4, 4])
               for i, s in enumerate(shards)]
    for w in weights:
        h = b.op(aten.relu.default, b.op(aten.mm.default, h, w))
    return b.done(h)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_forward_prefetch_issues_next_gather_before_current_compute(limit: int) -> None:
    options = ShardingOptions(forward_prefetch=True, max_inflight_gathers=limit)
    c = ctx(options=options)
    gm = run_passes(three_unit_forward(), c, pipeline(c))
    ops_ = [o.split(".")[-1] for o in normalised_ops(gm)]
    ag, w, free = "all_gather_into_tensor", "wait_tensor", "free"
    if limit == 1:  # no room before unit k's mm: the gather waits for unit k's free
        assert ops_ == [ag, w, "view", "mm", free, ag, "relu",
                        w, "view", "mm", free, ag, "relu",
                        w, "view", "mm", free, "relu"]
    else:  # unit k+1's gather goes out before unit k's mm; its wait stays put
        assert ops_ == [ag, w, "view", ag, "mm", free, "relu",
                        w, "view", ag, "mm", free, "relu",
                        w, "view", "mm", free, "relu"]
    verify(gm, c, final=True)  # includes the in-flight check


def test_post_prefetch_issues_next_gather_after_current_unit() -> None:
    options = ShardingOptions(forward_prefetch=False, backward_prefetch="post")
    c = ctx("backward", options=options)
    gm = run_passes(three_unit_forward(), c, pipeline(c))
    ops_ = [o.split(".")[-1] for o in normalised_ops(gm)]
    ag, w, free = "all_gather_into_tensor", "wait_tensor", "free"
    assert ops_ == [ag, w, "view", "mm", free, ag, "relu",
                    w, "view", "mm", free, ag, "relu",
                    w, "view", "mm", free, "relu"]


def test_verify_catches_a_schedule_over_the_in_flight_limit() -> None:
    c = ctx(options=ShardingOptions(max_inflight_gathers=2))
    gm = run_passes(three_unit_forward(), c, pipeline(c))
    gathers = [n for n in gm.graph.nodes if P.is_all_gather(n)]
    gm.graph.find_nodes(op="placeholder")[-1].append(gathers[2])  # hoist the third gather to the top
    gm.graph.find_nodes(op="placeholder")[-1].append(gathers[1])
    with pytest.raises(GraphInvariantError, match="3 gathered buffers in flight.*max_inflight_gathers=2"):
        verify(gm, c, final=True)


def test_insert_free_after_last_use_of_any_view() -> None:
    gm = placed_gathers(insert_all_gather_pass(two_unit_forward(), ctx()), ctx())
    gm = insert_free_pass(gm, ctx())
    ops_ = normalised_ops(gm)
    assert ops_ == [
        "_c10d_functional.all_gather_into_tensor", "_c10d_functional.wait_tensor", "aten.view",
        "aten.mm", "fxshard.free", "aten.relu",
        "_c10d_functional.all_gather_into_tensor", "_c10d_functional.wait_tensor", "aten.view",
        "aten.mm", "fxshard.free",
    ]
    verify(gm)


def test_insert_free_leaves_an_escaping_buffer_alone() -> None:
    b = Builder()
    s = b.input("shard0", 8)
    w = b.op(aten.view.default, b.op(ops.UNSHARD, s, 0, 2), [4, 4])
    gm = insert_all_gather_pass(b.done(w), ctx())  # the graph returns the weight itself
    gm = insert_free_pass(gm, ctx())
    assert not [n for n in gm.graph.nodes if P.is_free(n)]


def _reduced(world_size: int) -> fx.GraphModule:
    b = Builder()
    g0 = b.input("grad_w", 4, 4, tag="is_backward")
    flat = b.op(aten.view.default, g0, [16], tag="is_backward")
    gm = b.done(b.op(ops.REDUCE_GRAD, flat, 0, world_size, tag="is_backward"))
    return insert_reduce_scatter_pass(gm, ctx("backward", world_size=world_size))


def test_insert_reduce_scatter_sums_then_divides_the_shard_by_a_power_of_two() -> None:
    gm = _reduced(2)
    # Sum, then divide the reduced shard (half the bytes): dividing by a power of two rounds
    # nothing, so the values are DDP's (divide, then sum).
    assert normalised_ops(gm) == ["aten.view", "_c10d_functional.reduce_scatter_tensor",
                                  "_c10d_functional.wait_tensor", "aten.div"]
    rs = next(n for n in gm.graph.nodes if P.is_reduce_scatter(n))
    assert rs.args[1:] == ("sum", 2, "pg")
    (div,) = [n for n in gm.graph.nodes if n.target is aten.div.Tensor]
    assert P.is_wait(div.args[0]) and div.args[1] == 2  # the shard, by the world size
    assert div.meta["val"].numel() == 8
    output = next(n for n in gm.graph.nodes if P.is_output(n))
    assert output.args[0][0] is div
    verify(gm)


def test_insert_reduce_scatter_divides_then_sums_by_another_number_as_ddp_does() -> None:
    gm = _reduced(3)  # a division by 3 rounds: it goes where DDP's goes, before the sum
    assert normalised_ops(gm) == ["aten.view", "aten.div", "_c10d_functional.reduce_scatter_tensor",
                                  "_c10d_functional.wait_tensor"]
    rs = next(n for n in gm.graph.nodes if P.is_reduce_scatter(n))
    assert rs.args[0].target is aten.div.Tensor and rs.args[0].args[1] == 3
    verify(gm)


def joint_graph() -> fx.GraphModule:
    """A linear layer's joint graph as AOTAutograd leaves it: the transpose is saved."""
    b = Builder()
    s, x = b.input("primals_1", 8), b.input("primals_2", 3, 4)
    tangent = b.input("tangents_1", 3, 4, tag="is_backward")
    w = b.op(aten.view.default, b.op(ops.UNSHARD, s, 0, 2), [4, 4])
    wt = b.op(aten.t.default, w)
    y = b.op(aten.mm.default, x, wt)
    grad_x = b.op(aten.mm.default, tangent, b.op(aten.t.default, wt, tag="is_backward"), tag="is_backward")
    grad_w = b.op(aten.mm.default, b.op(aten.t.default, tangent, tag="is_backward"), x, tag="is_backward")
    flat = b.op(aten.view.default, grad_w, [16], tag="is_backward")
    return b.done(y, b.op(ops.REDUCE_GRAD, flat, 0, 2, tag="is_backward"), grad_x)


def test_rematerialize_gives_backward_its_own_gather() -> None:
    gm = joint_graph()
    with pytest.raises(GraphInvariantError, match="reads forward value t.*gathered parameters"):
        verify(gm, ctx("joint"))
    n_before = len(gm.graph.nodes)
    gm = rematerialize_params_pass(gm, ctx("joint"))
    verify(gm, ctx("joint"))
    markers = [n for n in gm.graph.nodes if P.is_unshard_marker(n)]
    assert [m.meta["partitioner_tag"] for m in markers] == ["is_forward", "is_backward"]
    assert markers[1].args[0] is markers[0].args[0]  # both read the same shard input
    assert len(gm.graph.nodes) == n_before + 3  # unshard', view', t'


def test_verify_rejects_broken_graphs() -> None:
    good = insert_free_pass(placed_gathers(insert_all_gather_pass(two_unit_forward(), ctx()), ctx()), ctx())
    verify(good)

    # A collective whose result is used without a wait.
    gm = insert_all_gather_pass(two_unit_forward(), ctx())
    wait = next(n for n in gm.graph.nodes if P.is_wait(n))
    wait.replace_all_uses_with(wait.args[0])
    with pytest.raises(GraphInvariantError, match="exactly one user, its wait_tensor"):
        verify(gm)

    # A use after free.
    gm = insert_free_pass(placed_gathers(insert_all_gather_pass(two_unit_forward(), ctx()), ctx()), ctx())
    free = next(n for n in gm.graph.nodes if P.is_free(n))
    free.prev.prepend(free)  # move the free before the mm that reads the buffer
    with pytest.raises(GraphInvariantError, match="used after"):
        verify(gm)

    # A node without meta['val'].
    gm = two_unit_forward()
    next(n for n in gm.graph.nodes if n.op == "call_function").meta.pop("val")
    with pytest.raises(GraphInvariantError, match="no meta\\['val'\\]"):
        verify(gm)

    # A marker left in an emitted graph.
    with pytest.raises(GraphInvariantError, match="never lowered"):
        verify(two_unit_forward(), final=True)

    # A gathered weight saved for backward (returned past the user outputs).
    b = Builder()
    s, x = b.input("shard0", 8), b.input("x", 3, 4)
    w = b.op(aten.view.default, b.op(ops.UNSHARD, s, 0, 2), [4, 4])
    gm = insert_all_gather_pass(b.done(b.op(aten.mm.default, x, w), w), ctx())
    with pytest.raises(GraphInvariantError, match="saved for backward"):
        verify(gm, ctx(num_user_outputs=1))


def test_pipeline_runs_every_pass_in_order_and_verifies_each() -> None:
    seen: list[str] = []
    c = ctx()
    gm = run_passes(two_unit_forward(), c, pipeline(c), on_pass=lambda name, g: seen.append(name))
    assert seen == ["eliminate_dead_code_pass", "insert_all_gather_pass", "place_gathers_pass",
                    "topological_sort_pass", "insert_free_pass"]
    assert normalised_ops(gm).count("fxshard.free") == 2


def test_eliminate_dead_code_drops_dead_random_ops_but_keeps_collectives() -> None:
    b = Builder()
    s, x = b.input("shard0", 8), b.input("x", 3, 4)
    w = b.op(aten.view.default, b.op(ops.UNSHARD, s, 0, 2), [4, 4])
    y = b.op(aten.mm.default, x, w)
    b.op(aten.native_dropout.default, y, 0.5, True)  # dead, as the partitioner leaves it
    gm = b.done(b.op(aten.relu.default, x))
    gm = run_passes(gm, ctx("backward"), pipeline(ctx("backward")))
    assert normalised_ops(gm) == ["aten.relu"]  # the dropout, the mm and the gather are gone
    kept = insert_all_gather_pass(two_unit_forward(), ctx())
    n_before = len(kept.graph.nodes)
    assert len(eliminate_dead_code_pass(kept, ctx()).graph.nodes) == n_before


def test_accumulate_in_place_adds_into_an_operand_that_dies_at_the_add() -> None:
    b = Builder()
    g, x, w = b.input("g", 3, 4, tag="is_backward"), b.input("x", 3, 4), b.input("w", 4, 4)
    head = b.op(aten.mm.default, b.op(aten.t.default, g), x)  # (4, 4), read only by the sum
    emb = b.op(aten.mm.default, b.op(aten.t.default, x), g)  # (4, 4), also returned
    kept = b.op(aten.mm.default, w, w)
    total = b.op(aten.add.Tensor, head, emb)
    other = b.op(aten.add.Tensor, kept, w)  # kept is returned too: not overwritten
    gm = b.done(total, emb, other, kept)
    inputs = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(4, 4)]
    expected = gm(*inputs)
    gm = accumulate_in_place_pass(gm, ctx("backward"))
    ops_now = normalised_ops(gm)
    assert ops_now.count("aten.add_") == 1 and ops_now.count("aten.add") == 1
    acc = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
    assert acc.args[0].name == head.name  # the operand nobody else reads
    for got, want in zip(gm(*inputs), expected):
        assert torch.equal(got, want)


def test_accumulate_in_place_leaves_inputs_views_and_broadcasts_alone() -> None:
    b = Builder()
    x, y = b.input("x", 4, 4), b.input("y", 4)
    view = b.op(aten.t.default, b.op(aten.mm.default, x, x))  # a view: its base may be read elsewhere
    small = b.op(aten.relu.default, y)  # broadcast: the result is larger than this operand
    gm = b.done(b.op(aten.add.Tensor, x, view), b.op(aten.add.Tensor, small, x))
    gm = accumulate_in_place_pass(gm, ctx("backward"))
    assert "aten.add_" not in normalised_ops(gm)


def test_accumulate_in_place_leaves_a_sum_a_lowering_made() -> None:
    from fxshard.ir import meta

    b = Builder()
    x = b.input("x", 4, 4)
    total = b.op(aten.add.Tensor, b.op(aten.mm.default, x, x), x)  # would qualify
    tag = meta.ChainTag(0, meta.Direction.REDUCE, "all_to_all_sum")
    meta.set_info(total, meta.NodeInfo(meta.Role.SUM, 0, "", tag))  # reduce_in_rank_order's
    gm = accumulate_in_place_pass(b.done(total), ctx("backward"))
    assert "aten.add_" not in normalised_ops(gm)


def test_scale_in_place_divides_a_fresh_gradient_in_its_place_and_chain() -> None:
    from fxshard.ir import meta
    from fxshard.passes import scale_in_place_pass

    b = Builder()
    g0, g1 = b.input("g0", 4, 4, tag="is_backward"), b.input("g1", 4, 4, tag="is_backward")
    flat0 = b.op(aten.view.default, g0, [16], tag="is_backward")
    fresh = b.graph.call_function(aten.cat.default, ([flat0],))  # AOTAutograd's flat gradient
    with b.mode:
        fresh.meta["val"] = torch.cat([flat0.meta["val"]])
    fresh.meta["partitioner_tag"] = "is_backward"
    viewed = b.op(aten.view.default, g1, [16], tag="is_backward")  # a view of an input: not fresh
    gm = b.done(b.op(ops.REDUCE_GRAD, fresh, 0, 3, tag="is_backward"),
                b.op(ops.REDUCE_GRAD, viewed, 1, 3, tag="is_backward"))
    gm = insert_reduce_scatter_pass(gm, ctx("backward", world_size=3))  # divided before the sum
    assert normalised_ops(gm).count("aten.div") == 2  # the lowerings divide out of place
    where = [n.args[0] for n in gm.graph.nodes if n.target is aten.div.Tensor].index(fresh)
    place = [i for i, n in enumerate(gm.graph.nodes) if n.target is aten.div.Tensor][where]
    gm = scale_in_place_pass(gm, ctx("backward", world_size=3))
    gm.graph.lint()
    (scaled,) = [n for n in gm.graph.nodes if n.target is aten.div_.Tensor]
    assert list(gm.graph.nodes).index(scaled) == place  # in the division's place
    assert scaled.args == (fresh, 3) and meta.role_of(scaled) is meta.Role.SCALE
    assert P.is_reduce_scatter(next(iter(scaled.users)))
    info = meta.get_info(scaled)
    assert info is not None and info.chain is not None and info.chain.direction is meta.Direction.REDUCE
    assert normalised_ops(gm).count("aten.div") == 1
    verify(gm)
    # Divided after the sum (two ranks): the collective's result is fresh, divided in place.
    gm = scale_in_place_pass(_reduced(2), ctx("backward"))
    (scaled,) = [n for n in gm.graph.nodes if n.target is aten.div_.Tensor]
    assert P.is_wait(scaled.args[0]) and meta.role_of(scaled) is meta.Role.SCALE
    assert "aten.div" not in normalised_ops(gm)
    verify(gm)


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def test_sink_moves_a_large_result_of_small_inputs_to_its_first_reader() -> None:
    b = Builder()
    g, h = b.input("g", 64, 2, tag="is_backward"), b.input("h", 2, 64)
    big = b.op(aten.mm.default, g, h)  # 64x64 from two 64x2 inputs
    view = b.op(aten.t.default, big)
    step = b.op(aten.relu.default, g)  # unrelated work in between
    for _ in range(3):
        step = b.op(aten.relu.default, step)
    gm = b.done(b.op(aten.add.Tensor, view, b.op(aten.mm.default, step, h)))
    inputs = [torch.randn(64, 2), torch.randn(2, 64)]
    expected = gm(*inputs)
    gm = sunk(gm, ctx("backward"))
    names = _names(gm)
    # The mm and its view now sit right before their reader's other operand is done.
    assert names.index(big.name) > names.index(step.name)
    assert names.index(view.name) == names.index(big.name) + 1
    assert torch.equal(gm(*inputs)[0], expected[0])


def test_sink_leaves_results_whose_inputs_are_larger_or_rewritten() -> None:
    def build(rewrite: bool) -> tuple[fx.GraphModule, fx.Node, fx.Node, fx.Node]:
        b = Builder()
        x, y = b.input("x", 64, 64, tag="is_backward"), b.input("y", 64, 64)
        summed = b.op(aten.sum.dim_IntList, x, [0])  # small result of a large input
        fresh = b.op(aten.mul.Tensor, y, 1.0)
        big = b.op(aten.repeat.default, fresh, [2, 1])  # twice its input
        if rewrite:
            b.op(aten.div_.Tensor, fresh, 3.0)
        later = b.op(aten.relu.default, y)
        gm = b.done(b.op(aten.add.Tensor, later, summed), b.op(aten.add.Tensor, big, 1.0), fresh)
        return gm, summed, big, later

    gm, summed, big, later = build(rewrite=False)
    names = _names(sunk(gm, ctx("backward")))
    assert names.index(summed.name) < names.index(later.name)  # would hold x longer: stays
    assert names.index(big.name) > names.index(later.name)  # nothing rewrites its input: moves
    gm, summed, big, later = build(rewrite=True)
    names = _names(sunk(gm, ctx("backward")))
    assert names.index(big.name) < names.index(later.name)  # would read the divided values: stays


def test_sink_never_moves_a_reader_of_a_gathered_buffer() -> None:
    def build(gathered: bool) -> tuple[fx.GraphModule, fx.Node, fx.Node]:
        b = Builder()
        s, g = b.input("shard0", 8), b.input("g", 32, 32, tag="is_backward")
        small = b.op(ops.UNSHARD, s, 0, 2) if gathered else b.input("small", 16)
        big = b.op(aten.repeat.default, b.op(aten.view.default, small, [4, 4]), [8, 8])  # 32x32
        step = b.op(aten.relu.default, g)
        for _ in range(3):
            step = b.op(aten.relu.default, step)
        gm = b.done(b.op(aten.add.Tensor, step, big))
        return insert_all_gather_pass(gm, ctx("backward")), big, step

    plain, big, step = build(gathered=False)
    names = _names(sunk(plain, ctx("backward")))
    assert names.index(big.name) > names.index(step.name)  # moves when free to
    gm, big, step = build(gathered=True)
    names = _names(sunk(gm, ctx("backward")))
    assert names.index(big.name) < names.index(step.name)  # its window is the schedule's


# -- the scheduling passes, each alone on a hand-built graph --------------------------------------


def test_topological_sort_places_positioned_nodes_and_obeys_edges() -> None:
    from fxshard.ir.schedule import PREFETCH, schedule_of

    b = Builder()
    x, s1 = b.input("x", 3, 4), b.input("s1", 12)
    first = b.op(aten.relu.default, x)
    second = b.op(aten.relu.default, first)
    view = b.op(aten.view.default, s1, [3, 4])
    gm = b.done(b.op(aten.add.Tensor, second, view))

    def names() -> list[str]:
        return [n.name for n in gm.graph.nodes if n.op == "call_function"]

    assert names() == ["relu_default", "relu_default_1", "view_default", "add_tensor"]
    schedule_of(gm).place([view], first, PREFETCH)  # a position: just before the first relu
    gm = topological_sort_pass(gm, ctx())
    gm.graph.lint()
    assert names() == ["view_default", "relu_default", "relu_default_1", "add_tensor"]
    schedule = schedule_of(gm)
    schedule.place([view], first, PREFETCH)
    schedule.require(view, [second])  # an edge wins over a position: after the second relu
    gm = topological_sort_pass(gm, ctx())
    assert names() == ["relu_default", "relu_default_1", "view_default", "add_tensor"]
    # Edges that contradict the inputs are a cycle: refused, naming the nodes.
    schedule_of(gm).require(first, [gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)[0]])
    with pytest.raises(GraphInvariantError, match="cycle.*relu_default"):
        topological_sort_pass(gm, ctx())


def two_unit_backward() -> fx.GraphModule:
    """Unit 0's weight gradient is ready first, unit 1's last; AOTAutograd flattens both and
    reduces them at the end."""
    b = Builder()
    t, x, h = (b.input("tangent", 3, 4, tag="is_backward"), b.input("x", 3, 4),
               b.input("h", 3, 4))
    g0 = b.op(aten.mm.default, b.op(aten.t.default, t, tag="is_backward"), x, tag="is_backward")
    dh = b.op(aten.relu.default, t, tag="is_backward")
    g1 = b.op(aten.mm.default, b.op(aten.t.default, dh, tag="is_backward"), h, tag="is_backward")
    flats = [b.op(aten.view.default, g, [16], tag="is_backward") for g in (g0, g1)]
    reduced = [b.op(ops.REDUCE_GRAD, f, i, 2, tag="is_backward") for i, f in enumerate(flats)]
    return b.done(*reduced)


def test_schedule_reduce_scatter_reduces_each_gradient_when_ready_one_in_flight() -> None:
    from fxshard.passes import schedule_reduce_scatter_pass

    c = ctx("backward")
    gm = insert_reduce_scatter_pass(two_unit_backward(), c)
    before = gm.code
    gm = schedule_reduce_scatter_pass(gm, c)
    assert gm.code == before  # positions only
    gm = topological_sort_pass(gm, c)
    gm.graph.lint()
    ops_ = [o.split(".")[-1] for o in normalised_ops(gm)]
    rs, w = "reduce_scatter_tensor", "wait_tensor"
    # Unit 0 reduced right after its gradient, while unit 1's is computed; its wait (and the
    # division of the reduced shard) right before unit 1's reduction; the last wait right
    # before the output.
    assert ops_ == ["t", "mm", "view", rs, "relu", "t", "mm", "view", w, "div", rs, w, "div"]
    verify(gm, c, final=True)


def test_assign_groups_gives_collectives_in_flight_together_different_groups() -> None:
    from fxshard.passes import assign_groups_pass

    gm = insert_all_gather_pass(three_unit_forward(), ctx())
    gathers = [n for n in gm.graph.nodes if P.is_all_gather(n)]
    anchor = gm.graph.find_nodes(op="placeholder")[-1]
    for g in reversed(gathers):  # all three issued before the first wait: in flight together
        anchor.append(g)
    slots = ctx(inflight_groups=("s0", "s1"), options=ShardingOptions(max_inflight_gathers=3))
    gm = assign_groups_pass(gm, slots)
    gm.graph.lint()
    assert [P.group_name(n) for n in gathers] == ["s0", "s1", "s0"]
    order = order_of(gm.graph)
    (first_wait,) = gathers[0].users
    # Both slots busy at the third gather: the one issued first is waited right before it.
    assert order[first_wait] == order[gathers[2]] - 1
    verify(gm, slots, final=True)  # invariant 9
    with pytest.raises(GraphInvariantError, match="in-flight slots"):
        assign_groups_pass(gm, ctx())


def test_checkpoint_activations_recomputes_a_region_in_backward() -> None:
    from fxshard.ir.checkpointing import Checkpointing
    from fxshard.ir.meta import set_module_path
    from fxshard.passes import checkpoint_activations_pass

    b = Builder()
    x, t = b.input("x", 3, 4), b.input("tangent", 3, 4, tag="is_backward")
    inner = b.op(aten.relu.default, x)
    set_module_path(inner, "block")
    out = b.op(aten.sin.default, inner)
    set_module_path(out, "block")
    grad = b.op(aten.mul.Tensor, t, b.op(aten.cos.default, inner, tag="is_backward"), tag="is_backward")
    gm = b.done(out, grad)
    c = ctx("joint", checkpointing=Checkpointing(("block",)))
    n_before = len(gm.graph.nodes)
    gm = checkpoint_activations_pass(gm, c)
    gm.graph.lint()
    cos = next(n for n in gm.graph.nodes if n.target is aten.cos.default)
    copy = cos.args[0]
    # Backward reads a backward copy of relu(x), recomputed from the region's input.
    assert copy is not inner and copy.target is aten.relu.default and copy.args[0] is x
    assert copy.meta["partitioner_tag"] == "is_backward"
    assert len(gm.graph.nodes) == n_before + 1
    # Without a region nothing changes.
    assert checkpoint_activations_pass(gm, ctx("joint")) is gm


def test_a_copied_factory_node_gets_its_value_under_the_original_nodes_fake_mode() -> None:
    """A recomputed region can hold a factory (a causal mask's ``aten.ones``): its backward copy
    has no input to find the fake mode on, so it takes the copied node's (auto() under a
    memory budget recomputed a TinyGPT block's mask and raised GraphInvariantError)."""
    from fxshard.ir.nodes import refresh_value

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(4, 4))
    g = fx.Graph()
    xp = g.placeholder("x")
    xp.meta["val"] = x
    ones = g.call_function(torch.ops.aten.ones.default, ([4, 4],), {"dtype": torch.bool})
    with mode:
        ones.meta["val"] = torch.ops.aten.ones.default([4, 4], dtype=torch.bool)
    g.output(g.call_function(torch.ops.aten.masked_fill.Scalar, (xp, ones, 0.0)))
    copy = g.node_copy(ones)
    copy.meta = {}
    with pytest.raises(GraphInvariantError, match="none of its inputs holds a fake tensor"):
        refresh_value(copy)
    refresh_value(copy, like=ones.meta["val"])
    value = copy.meta["val"]
    assert value.shape == (4, 4) and value.dtype == torch.bool and value.fake_mode is mode
    refresh_value(ones)  # a node refreshed in place: its own value's mode
    assert ones.meta["val"].fake_mode is mode
