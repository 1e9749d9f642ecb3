"""The emitted per-rank graphs: which collectives, how many, and where.

Compiled in one process against a fake process group of N ranks, so nothing
runs; only graph structure is checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.testing import FileCheck

import fxshard
from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import aliases, order_of, parameter_only
from fxshard.passes import verify
from fxshard.policies import by_class, by_size

from graph_utils import fake_world, is_gather_wait, nodes, normalised_ops, units_of
from models import MLP, Block, FrozenNet, SharedUse, TinyGPT

JIT = dict(forward_prefetch=False, backward_prefetch=None)  # gather just in time
FULL = dict(reshard_root=True)  # every unit resharded, the root too


def compile_mlp(world_size: int, **options: object) -> fxshard.ShardedModule:
    torch.manual_seed(0)
    return fxshard.compile(MLP(), policy=by_class(nn.Linear), example_inputs=torch.randn(6, 12),
                           **options)


@pytest.mark.parametrize("world_size", [2, 3])
def test_mlp_collective_counts_per_unit(world_size: int) -> None:
    with fake_world(world_size):
        sm = compile_mlp(world_size)
        fw, bw = sm.graphs["forward"], sm.graphs["backward"]
    units = ["layers.0", "layers.1", "head"]
    assert [u.name for u in sm.plan.units] == units
    # Forward: one gather, one free per unit, in execution order; no reduction.
    assert units_of(fw, P.is_all_gather) == units
    assert units_of(fw, P.is_free) == units
    assert nodes(fw, P.is_reduce_scatter) == []
    # Backward: units gathered again in reverse order, but only those whose
    # weights backward reads (layers.0's input gradient is not needed, so its
    # weight is not); every unit's gradient reduce-scattered, last unit first.
    assert units_of(bw, P.is_all_gather) == ["head", "layers.1"]
    assert units_of(bw, P.is_free) == ["head", "layers.1"]
    assert units_of(bw, P.is_reduce_scatter) == ["head", "layers.1", "layers.0"]
    for gm in (fw, bw):
        verify(gm)
        for c in nodes(gm, P.is_collective):
            assert c.args[-2] == world_size  # group size


def test_mlp_forward_text_in_order_just_in_time() -> None:
    with fake_world(2):
        sm = compile_mlp(2, **JIT)
    code = sm.graphs["forward"].code
    check = FileCheck()
    for _ in range(3):  # gather, compute with the unit, free; then the next unit
        check = (check.check("_c10d_functional.all_gather_into_tensor")
                 .check("_c10d_functional.wait_tensor").check("aten.addmm")
                 .check("fxshard.free"))
    check.check_not("all_gather_into_tensor").run(code)
    bw_code = sm.graphs["backward"].code
    (FileCheck().check("all_gather_into_tensor").check("aten.mm").check("fxshard.free")
     .check("all_gather_into_tensor").check("aten.mm").check("fxshard.free")
     .check("aten.cat").check("reduce_scatter_tensor").check("wait_tensor").check("aten.div")
     .run(bw_code))


def test_gather_sits_right_before_first_use_and_free_right_after_last() -> None:
    with fake_world(2):
        torch.manual_seed(0)
        sm = fxshard.compile(TinyGPT(), policy=by_class(Block), example_inputs=torch.randint(0, 61, (2, 16)),
                             **JIT, **FULL)
    for gm in (sm.graphs["forward"], sm.graphs["backward"]):
        order = order_of(gm.graph)
        param_only = parameter_only(gm.graph)
        for wait in nodes(gm, is_gather_wait):
            gather = wait.args[0]
            assert order[wait] == order[gather] + 1
            # Between the wait and the first compute there is only this unit's
            # parameter-only chain (split, views, transposes): no other op.
            compute = [u for n in param_only if order[n] >= order[wait]
                       for u in n.users if u not in param_only and not P.is_free(u)]
            first = min(order[u] for u in compute if any(a in param_only for a in u.all_input_nodes)
                        and _reads(u, wait, param_only))
            between = [n for n in gm.graph.nodes if order[wait] < order[n] < first]
            assert all(n in param_only for n in between), [n.name for n in between]
            # The free follows the last use of the buffer or any view of it.
            free = next(u for u in wait.users if P.is_free(u))
            views = aliases(wait)
            last = max(order[u] for v in views for u in v.users if u is not free)
            assert order[free] == last + 1


def _reads(node, wait, param_only) -> bool:  # type: ignore[no-untyped-def]
    """Does ``node`` read (through parameter-only nodes) the buffer of ``wait``?"""
    stack = list(node.all_input_nodes)
    seen = set()
    while stack:
        n = stack.pop()
        if n is wait:
            return True
        if n in param_only and n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def test_no_gathered_parameter_is_saved_for_backward() -> None:
    with fake_world(2):
        torch.manual_seed(0)
        sm = fxshard.compile(TinyGPT(), policy=by_class(Block), example_inputs=torch.randint(0, 61, (2, 16)),
                             **FULL)
    fw, bw = sm.graphs["forward"], sm.graphs["backward"]
    output = next(n for n in fw.graph.nodes if P.is_output(n))
    param_only = parameter_only(fw.graph)
    saved = [a for a in output.args[0][1:] if isinstance(a, torch.fx.Node)]
    assert saved and not [a.name for a in saved if a in param_only]
    # Backward reads its parameters from fresh gathers of the shards instead.
    assert set(units_of(bw, P.is_all_gather)) == {"blocks.0", "blocks.1", ""}
    bw_inputs = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    assert all(g.args[0].name in bw_inputs for g in nodes(bw, P.is_all_gather))


def test_tied_embedding_lives_in_one_unit_and_is_gathered_once_per_pass() -> None:
    with fake_world(2):
        torch.manual_seed(0)
        sm = fxshard.compile(TinyGPT(), policy=by_class(Block, nn.Embedding),
                             example_inputs=torch.randint(0, 61, (2, 16)))
    # tok.weight is also lm_head.weight: tok's unit and the root are merged.
    group = sm.plan.group_of("lm_head.weight")
    assert group is sm.plan.group_of("tok.weight")
    merged = sm.plan.unit(group.unit)
    assert "tok" in merged.modules and "" in merged.modules
    fw = sm.graphs["forward"]
    gathered = units_of(fw, P.is_all_gather)
    assert len(gathered) == len(set(gathered)) == len(sm.plan.units)


def test_frozen_group_is_gathered_but_never_reduced() -> None:
    with fake_world(2):
        torch.manual_seed(0)
        sm = fxshard.compile(FrozenNet(), policy=by_class(nn.Sequential), example_inputs=torch.randn(4, 10))
    frozen = [g for g in sm.plan.groups if not g.requires_grad]
    assert [g.unit for g in frozen] == ["features"]
    assert "features" in units_of(sm.graphs["forward"], P.is_all_gather)
    assert "features" not in units_of(sm.graphs["backward"], P.is_reduce_scatter)
    assert sorted(units_of(sm.graphs["backward"], P.is_reduce_scatter)) == ["head"]


def test_module_used_twice_is_gathered_once() -> None:
    with fake_world(3):
        torch.manual_seed(0)
        sm = fxshard.compile(SharedUse(), policy=by_class(nn.Linear), example_inputs=torch.randn(6, 8))
    fw = sm.graphs["forward"]
    assert units_of(fw, P.is_all_gather).count("twice") == 1
    assert sm.plan.group_of("a.weight") is sm.plan.group_of("b.weight")
    # addmm order: inp, twice, twice, ... The reused unit's buffer is freed
    # after its second use, not its first.
    order = order_of(fw.graph)
    addmms = [n for n in fw.graph.nodes if "addmm" in str(n.target)]
    wait = next(n for n in nodes(fw, is_gather_wait) if meta.get_info(n).unit == "twice")
    free = next(u for u in wait.users if P.is_free(u))
    assert order[addmms[1]] < order[addmms[2]] < order[free] < order[addmms[3]]


def test_inference_graph_has_gathers_and_frees_but_no_backward() -> None:
    with fake_world(2):
        torch.manual_seed(0)
        sm = fxshard.compile(MLP(), policy=by_size(300))
        sm.eval()
        with torch.no_grad():
            sm(torch.randn(6, 12))
    assert "backward" not in sm.graphs
    fw = sm.graphs["forward"]
    assert len(nodes(fw, P.is_all_gather)) == len(sm.plan.units) == len(nodes(fw, P.is_free))
    assert "reduce_scatter" not in " ".join(normalised_ops(fw))


def test_dropout_model_gathers_each_unit_once_in_backward() -> None:
    """AOTAutograd copies the forward's (dead) dropout into backward; it must not cost a gather."""
    from models import Net

    with fake_world(2):
        torch.manual_seed(0)
        sm = fxshard.compile(Net(dropout=True), policy=by_size(20000),
                             example_inputs=torch.randn(4, 1, 28, 28))
    bw = sm.graphs["backward"]
    assert units_of(bw, P.is_all_gather) == ["fc1"]  # the root is resident
    assert not [n for n in bw.graph.nodes if "native_dropout.default" in str(n.target)]
