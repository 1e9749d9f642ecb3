"""Scheduling options, pipeline level: the emitted graphs of real models under each option."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of, windows

from graph_utils import fake_world, is_gather_wait, nodes, units_of
from models import MLP, Block, TinyGPT

ag, wait = P.is_all_gather, is_gather_wait


def compile_with(model_cls: type[nn.Module], policy, world_size: int = 2, **options):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = model_cls()
    x = torch.randint(0, 61, (2, 16)) if model_cls is TinyGPT else torch.randn(6, 12)
    with fake_world(world_size):
        return fxshard.compile(model, policy=policy, example_inputs=x, **options)


def first_compute(gm, buffer) -> int:  # type: ignore[no-untyped-def]
    reshards = {g: True for g in range(64)}
    (w,) = [w for w in windows(gm.graph, reshards) if w.buffer is buffer]
    return w.first


def test_forward_prefetch_distance_is_one_unit() -> None:
    sm = compile_with(MLP, fxshard.policies.by_class(nn.Linear))
    fw = sm.graphs["forward"]
    order = order_of(fw.graph)
    waits = nodes(fw, wait)
    for k in range(len(waits) - 1):
        nxt = waits[k + 1].args[0]
        # unit k+1's gather: after unit k's wait, before unit k's first compute
        assert order[waits[k]] < order[nxt] < first_compute(fw, waits[k])
        # and its wait right before unit k+1's own first compute chain
        assert order[waits[k + 1]] > first_compute(fw, waits[k])


def test_prefetch_off_gathers_just_in_time() -> None:
    sm = compile_with(MLP, fxshard.policies.by_class(nn.Linear), forward_prefetch=False, backward_prefetch=None)
    for gm in (sm.graphs["forward"], sm.graphs["backward"]):
        order = order_of(gm.graph)
        for w in nodes(gm, wait):
            assert order[w] == order[w.args[0]] + 1


@pytest.mark.parametrize("mode", ["pre", "post", None])
def test_backward_gathers_run_in_reverse_unit_order(mode: str | None) -> None:
    sm = compile_with(TinyGPT, fxshard.policies.by_class(Block), reshard_root=True, backward_prefetch=mode)
    fw_units = units_of(sm.graphs["forward"], ag)
    bw_units = units_of(sm.graphs["backward"], ag)
    assert fw_units == ["", "blocks.0", "blocks.1"]
    assert bw_units == ["", "blocks.1", "blocks.0"]  # root first: lm_head is tied to it
    bw = sm.graphs["backward"]
    order = order_of(bw.graph)
    gathers, waits = nodes(bw, ag), nodes(bw, wait)
    if mode is None:
        assert all(order[w] == order[g] + 1 for g, w in zip(gathers, waits))
    else:  # each next gather is issued before the previous unit's wait... is done computing
        for k in range(1, len(gathers)):
            prev_first = first_compute(bw, waits[k - 1])
            if mode == "pre":
                assert order[gathers[k]] < prev_first
            else:
                assert order[gathers[k]] > prev_first


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_in_flight_limit_holds_at_every_point(limit: int) -> None:
    sm = compile_with(TinyGPT, fxshard.policies.by_class(Block, nn.Linear, nn.LayerNorm),
                      max_inflight_gathers=limit)
    for gm in (sm.graphs["forward"], sm.graphs["backward"]):
        reshards = {g.index: g.unit != "" for g in sm.plan.groups}
        spans = [w for w in windows(gm.graph, reshards) if not w.resident]
        assert len(spans) > 3
        worst = 0
        for point in range(len(gm.graph.nodes)):
            live = sum(1 for w in spans if w.issue <= point <= w.last)
            needed = sum(1 for w in spans if order_of(gm.graph)[w.buffer] - 1 <= point <= w.last)
            assert live <= max(limit, needed)
            worst = max(worst, live)
        assert worst == limit or limit > 1 and worst >= 2  # the limit is used, not just respected


def test_byte_cap_limits_prefetch() -> None:
    policy = fxshard.policies.by_class(nn.Linear)
    # Buffers: layers.0 1248 B, layers.1 2400 B, head 504 B. A cap of the largest
    # one leaves no room for two: each prefetch waits for the previous unit's free.
    capped = compile_with(MLP, policy, max_inflight_bytes=2400).graphs["forward"]
    for g in nodes(capped, ag)[1:]:
        assert P.is_free(g.prev), f"{g.name} should be issued right after a free"
    # Under a cap smaller than any buffer, every gather is just in time.
    tiny = compile_with(MLP, policy, max_inflight_bytes=1).graphs["forward"]
    assert all(P.is_wait(g.next) for g in nodes(tiny, ag))
    # Uncapped, the default limit of two buffers lets each gather go before the previous compute.
    free = compile_with(MLP, policy).graphs["forward"]
    assert not any(P.is_free(g.prev) for g in nodes(free, ag))


def test_zero2_keeps_parameters_and_never_gathers_in_backward() -> None:
    sm = compile_with(TinyGPT, fxshard.policies.by_class(Block), reshard_after_forward=False)
    fw, bw = sm.graphs["forward"], sm.graphs["backward"]
    assert nodes(bw, ag) == []
    assert nodes(fw, P.is_free) == []  # every buffer crosses to backward
    saved = [n for n in bw.graph.nodes if n.op == "placeholder" and meta.get_info(n)]
    assert sorted(meta.get_info(n).unit for n in saved) == ["", "blocks.0", "blocks.1"]
    # No explicit free of a kept buffer in backward: it dies by reference count
    # after its last use (boxed call), and a free would break retain_graph=True
    # (tests/test_saved_tensors.py; tests/test_report.py measures the memory).
    assert units_of(bw, P.is_free) == []
    assert len(nodes(bw, P.is_reduce_scatter)) == 3


def test_root_is_resident_by_default_like_fsdp2() -> None:
    sm = compile_with(TinyGPT, fxshard.policies.by_class(Block))
    fw, bw = sm.graphs["forward"], sm.graphs["backward"]
    assert "" not in units_of(fw, P.is_free) and "" not in units_of(bw, ag)
    assert units_of(bw, ag) == ["blocks.1", "blocks.0"]
    # The root's buffer crosses to backward and dies there by reference count.
    assert "" not in units_of(bw, P.is_free)
    assert any(n.op == "placeholder" and (i := meta.get_info(n)) is not None and i.unit == ""
               for n in bw.graph.nodes)


def test_reduce_scatter_issued_when_gradients_complete_and_waited_before_the_next() -> None:
    sm = compile_with(MLP, fxshard.policies.by_class(nn.Linear))
    bw = sm.graphs["backward"]
    order = order_of(bw.graph)
    scatters = nodes(bw, P.is_reduce_scatter)
    assert [meta.get_info(n).unit for n in scatters] == ["head", "layers.1", "layers.0"]
    # head's gradient is ready long before backward ends: its reduction is issued before
    # any of layers.1's gradient compute (its gather's first compute)
    l1_wait = next(w for w in nodes(bw, wait) if meta.get_info(w).unit == "layers.1")
    assert order[scatters[0]] < first_compute(bw, l1_wait)
    for rs, nxt in zip(scatters, scatters[1:]):
        (w,) = rs.users
        assert order[rs] < order[w] < order[nxt]
    (last_wait,) = scatters[-1].users
    output = next(n for n in bw.graph.nodes if n.op == "output")
    # The last wait right before the output, then the division of its reduced shard.
    assert order[last_wait] == order[output] - 2
    (divide,) = last_wait.users
    assert divide.target is torch.ops.aten.div_.Tensor and order[divide] == order[output] - 1


def test_bucketing_merges_adjacent_small_units_and_nothing_else() -> None:
    # MLP units: layers.0 1248 B, layers.1 2400 B, head 504 B (float32, world size 2).
    sm = compile_with(MLP, fxshard.policies.by_class(nn.Linear), bucket_bytes=3000)
    assert [u.name for u in sm.plan.units] == ["layers.0", "layers.1+head"]
    assert units_of(sm.graphs["forward"], ag) == ["layers.0", "layers.1+head"]
    # A threshold below every unit merges nothing.
    sm = compile_with(MLP, fxshard.policies.by_class(nn.Linear), bucket_bytes=500)
    assert [u.name for u in sm.plan.units] == ["layers.0", "layers.1", "head"]
    # The root is never bucketed.
    sm = compile_with(TinyGPT, fxshard.policies.by_class(Block, nn.LayerNorm), bucket_bytes=1 << 20)
    names = [u.name for u in sm.plan.units]
    assert "" in names and all("+" not in n or "" not in n.split("+") for n in names)
    assert len(units_of(sm.graphs["forward"], ag)) == len(sm.plan.units)


def test_small_parameters_are_replicated_and_all_reduced() -> None:
    sm = compile_with(TinyGPT, fxshard.policies.by_class(Block), replicate_below=100)
    replicated = [g for g in sm.plan.groups if g.replicated]
    assert replicated and all(s.numel < 100 for g in replicated for s in g.params)
    assert all(s.numel >= 100 for g in sm.plan.groups if not g.replicated for s in g.params)
    fw, bw = sm.graphs["forward"], sm.graphs["backward"]
    gathered = {meta.get_info(n).group for n in nodes(fw, ag)} | {meta.get_info(n).group for n in nodes(bw, ag)}
    reduced = [meta.get_info(n).group for n in nodes(bw, P.is_all_reduce)]
    scattered = [meta.get_info(n).group for n in nodes(bw, P.is_reduce_scatter)]
    assert sorted(reduced) == sorted(g.index for g in replicated)
    assert not gathered & set(reduced) and not set(scattered) & set(reduced)
    # Each rank holds a replicated group whole.
    assert all(g.shard_numel == g.numel for g in replicated)
    assert "(replicated)" in str(sm.plan)


def test_tied_head_gradient_is_made_where_it_is_summed() -> None:
    # Few tokens, wide vocabulary: the output projection's weight gradient
    # (512x64) is 8x the logits' gradient it is computed from, so
    # sink_allocations_pass makes it at the end of backward, where the
    # embedding's gradient is added to it, instead of holding it throughout.
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=64, layers=2, seq=8)
    idx = torch.randint(0, 512, (1, 8))
    with fake_world(2):
        sm = fxshard.compile(copy.deepcopy(model), policy=fxshard.policies.by_class(Block), example_inputs=idx)
    bw = sm.graphs["backward"]
    order = order_of(bw.graph)
    (acc,) = [n for n in bw.graph.nodes if n.target is torch.ops.aten.add_.Tensor
              and tuple(n.meta["val"].shape) == (512, 64)]
    chain = [acc]
    while not P.is_call(chain[-1]) or chain[-1].target is not torch.ops.aten.mm.default:
        chain.append(next(a for a in chain[-1].all_input_nodes if P.is_view(a) or a.target is torch.ops.aten.mm.default))
    positions = [order[n] for n in reversed(chain)]
    assert positions == list(range(positions[0], positions[0] + len(chain)))  # mm, views, add_
    assert positions[0] > max(order[w] for w in nodes(bw, wait))  # after every gathered unit

    # Same numbers as eager (world size 1: no collectives, the same passes):
    # one SGD step at lr 1 moves each parameter by its gradient.
    sharded = fxshard.compile(copy.deepcopy(model), policy=fxshard.policies.by_class(Block))
    for m, params in ((model, model.parameters()), (sharded, sharded.parameters())):
        opt = torch.optim.SGD(params, lr=1.0)
        m(idx).square().mean().backward()
        opt.step()
    after = sharded.full_state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(after[name], p.detach(), rtol=1e-5, atol=1e-6)
