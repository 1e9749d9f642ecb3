"""offload_policy=fxshard.CPUOffloadPolicy() (FSDP2's): shards, their gradients and the optimizer
step on the host; each gather copies the shard to the device first, each reduction copies the
shard's gradient back.

The copies' chains on a fake process group of 4 ranks and on one rank; the report's host bytes
and device peak; training on 2 gloo ranks against DDP. On CPU compute the host is the device:
offload trains exactly as without it, copies included (docs/memory.md).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.ir import meta
from fxshard.ir.chains import chains
from fxshard.ir.meta import Direction, Role
from fxshard.policies import by_class

from dist_utils import run_ranks
from graph_utils import fake_world
from models import MLP, Block, TinyGPT


def _compiled(**options: Any) -> Any:
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), verify_passes=True, **options)
    F.mse_loss(sharded(torch.randn(2, 12)), torch.randn(2, 5)).backward()
    return sharded


def _roles(sharded: Any, graph: str) -> list[tuple[str, list[str]]]:
    return [(c.lowering, [meta.role_of(n).value for n in c.nodes])  # type: ignore[union-attr]
            for c in chains(sharded.graphs[graph].graph)]


def test_each_gather_copies_the_shard_in_first_and_each_reduction_copies_the_gradient_out() -> None:
    offload = fxshard.CPUOffloadPolicy()
    with fake_world(4):
        sharded = _compiled(offload_policy=offload)
        gather = ("all_gather_from_host", ["to_device", "all_gather", "wait", "free"])
        assert _roles(sharded, "forward") == [gather] * 3
        reduce = ("reduce_scatter_to_host", ["reduce_scatter", "wait", "scale", "to_host"])
        assert _roles(sharded, "backward") == [gather] * 2 + [reduce] * 3
        for graph in ("forward", "backward"):
            for chain in chains(sharded.graphs[graph].graph):
                if chain.direction is Direction.GATHER:
                    copy_in = chain.issue[0]  # issued with its gather: prefetch moves both
                    assert meta.role_of(copy_in) is Role.TO_DEVICE and copy_in.args[0].op == "placeholder"
                    assert list(copy_in.users) == [chain.collectives[0]]
                    assert copy_in.kwargs["non_blocking"] is True
                else:
                    # the reduced shard, divided on the device, then copied out
                    divided = chain.result.args[0]
                    assert meta.role_of(chain.result) is Role.TO_HOST and meta.role_of(divided) is Role.SCALE
                    assert divided.args[0] is chain.waits[-1]
        # Without offload: the same chains, no copies.
        plain = _compiled()
        assert [(lowering.removesuffix("_from_host").removesuffix("_to_host"),
                 [r for r in roles if r not in ("to_device", "to_host")])
                for lowering, roles in _roles(sharded, "backward")] == _roles(plain, "backward")
        # The report: the shards and their gradients on the host, out of the device's peak.
        report, before = sharded.report(), plain.report()
        assert report.host_bytes == report.shard_bytes + report.grad_shard_bytes > 0
        assert before.host_bytes == 0 and "on the host" in str(report)
        assert report.predicted_peak_bytes < before.predicted_peak_bytes
    # One rank: nothing to gather; the copies alone, freed after use like a gathered buffer.
    one = _compiled(offload_policy=offload)
    assert _roles(one, "forward") == [("keep_whole_from_host", ["to_device", "free"])] * 3
    assert _roles(one, "backward")[-3:] == [("keep_local_to_host", ["to_host"])] * 3


def test_explain_offload_lowers_the_device_peak_by_the_shards_and_gradients() -> None:
    """A transformer at world size 8 in bf16, as explain plans it: the parameter and gradient
    shards go to the host, and the device peak drops by at least the parameter shards. (The
    peak is in backward, before most gradients exist: the gradient shards leave the device's
    curve, but the peak only by those already made there.)"""
    def explained(**options: Any) -> Any:
        torch.manual_seed(0)
        return fxshard.explain(TinyGPT(vocab=512, dim=256, heads=4, layers=4, seq=64), torch.randint(0, 512, (2, 64)),
                               by_class(Block), world_size=8,
                               mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16),
                               **options).report
    on_device, offloaded = explained(), explained(offload_policy=fxshard.CPUOffloadPolicy())
    shards = on_device.shard_bytes + on_device.grad_shard_bytes
    assert offloaded.host_bytes == shards
    assert on_device.predicted_peak_bytes - offloaded.predicted_peak_bytes >= on_device.shard_bytes


def test_the_report_says_when_offload_moved_nothing() -> None:
    """On a CPU-only job the host is the device: the report says so beside its lower peak;
    planned for an accelerator (explain on meta) it does not."""
    with fake_world(2, rank=0):
        on_cpu = _compiled(offload_policy=fxshard.CPUOffloadPolicy(pin_memory=False)).report()
    assert on_cpu.host_bytes > 0 and "offload moved nothing" in str(on_cpu)
    with torch.device("meta"):
        model = MLP()
    planned = fxshard.explain(model, torch.randn(2, 12), by_class(nn.Linear), world_size=2,
                              offload_policy=fxshard.CPUOffloadPolicy()).report
    assert planned.host_bytes > 0 and "offload moved nothing" not in str(planned)


def test_offload_chains_on_every_topology() -> None:
    """HSDP and reduce_in_rank_order: each reduction's row wrapped in its copy to the host, each
    gather's in its copy to the device (4 fake ranks); NO_SHARD is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    offload = fxshard.CPUOffloadPolicy()
    with fake_world(4, rank=1):
        sharded = _compiled(mesh=init_device_mesh("cpu", (2, 2)), offload_policy=offload)
        assert {lowering for lowering, _ in _roles(sharded, "forward")} == {"all_gather_from_host"}
        assert [lowering for lowering, _ in _roles(sharded, "backward")][-3:] == \
            ["reduce_scatter_all_reduce_to_host"] * 3
        # Whole parameters (NO_SHARD) are refused, naming what to do instead.
        with pytest.raises(fxshard.FxShardError, match=r"offload_policy with parameters kept whole .*"
                                                       r"NO_SHARD mesh \(N, 1\).*offload_units="):
            _compiled(mesh=init_device_mesh("cpu", (4, 1)), offload_policy=offload)
        in_order = _compiled(offload_policy=offload, reduce_in_rank_order=True)
        lowered = _roles(in_order, "backward")[-3:]
        assert [lowering for lowering, _ in lowered] == ["all_to_all_sum_to_host"] * 3
        assert all(roles[-1] == "to_host" and "all_to_all" in roles for _, roles in lowered)


def _optimizer_step(**options: Any) -> Any:
    """TinyGPT at world size 2 in bf16 with AdamW, on an input small enough that the
    optimizer step (parameter, gradient and state shards) is the peak."""
    torch.manual_seed(0)
    return fxshard.explain(TinyGPT(vocab=512, dim=256, heads=4, layers=4, seq=64), torch.randint(0, 512, (1, 8)),
                           by_class(Block), world_size=2,
                           mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16),
                           **{"optimizer": torch.optim.AdamW, **options}).report


def test_the_optimizer_step_is_a_phase_of_the_peak_and_offload_takes_it_to_the_host() -> None:
    from functools import partial

    on_device, offloaded = _optimizer_step(), _optimizer_step(offload_policy=fxshard.CPUOffloadPolicy())
    params, grads = on_device.shard_bytes, on_device.grad_shard_bytes
    assert on_device.peak_phase == "optimizer step"
    assert on_device.optimizer_state_bytes == 2 * grads  # AdamW: exp_avg and exp_avg_sq
    # A steady-state step: the state is on the device from forward's first node on.
    stateless = _optimizer_step(optimizer=torch.optim.SGD)
    assert on_device.memory_curve["forward"][0] - stateless.memory_curve["forward"][0] == 2 * grads
    # After backward: the shards, their gradients, the state (and the loss and inputs); the
    # step adds foreach's square roots (planned on meta: an accelerator's default), one state.
    backward_end = on_device.memory_curve["backward"][-1]
    assert on_device.predicted_peak_bytes == backward_end + grads >= params + 4 * grads
    assert "optimizer state" in str(on_device) and "AdamW (2 states per parameter)" in str(on_device)
    # Fused: no temporaries, so the step holds what backward leaves; the for-loop one shard's
    # root and quotient at a time.
    fused = _optimizer_step(optimizer=partial(torch.optim.AdamW, fused=True))
    assert fused.memory_curve["optimizer step"] == (backward_end,) and fused.peak_phase != "optimizer step"
    loop = _optimizer_step(optimizer=partial(torch.optim.AdamW, foreach=False))
    largest = max(u.shard_bytes for u in loop.units)
    assert loop.memory_curve["optimizer step"] == (backward_end + 2 * largest,)
    # Some units offloaded: one optimizer over shards on the host and on the device, for which
    # torch's default is the for-loop (foreach only where every tensor is on a device with its
    # kernels), so the device's shards step one at a time, not foreach's root of them all.
    mixed = _optimizer_step(offload_policy=fxshard.CPUOffloadPolicy(), offload_units={"blocks.0"})
    kept = [u.shard_bytes for u in mixed.units if u.name != "blocks.0"]
    assert mixed.memory_curve["optimizer step"] == (mixed.memory_curve["backward"][-1] + 2 * max(kept),)
    assert 2 * max(kept) < sum(kept)
    # Offload: the shards, gradients and state on the host; the device peak drops by at least
    # the parameter and gradient shards (here by the state as well, less what backward holds).
    assert offloaded.host_bytes == params + 3 * grads and offloaded.optimizer_state_bytes == 0
    assert offloaded.peak_phase != "optimizer step"
    assert on_device.predicted_peak_bytes - offloaded.predicted_peak_bytes >= params + grads
    # SGD without momentum keeps no state; with it, one.
    assert _optimizer_step(optimizer=torch.optim.SGD).optimizer_state_bytes == 0
    assert _optimizer_step(optimizer=partial(torch.optim.SGD, momentum=0.9)).optimizer_state_bytes == grads
    with pytest.raises(TypeError, match="optimizer takes a torch.optim class"):
        _optimizer_step(optimizer="adam")


def test_the_budget_offloads_only_the_units_it_needs_largest_first() -> None:
    """One rank: the optimizer step holds every shard, gradient and AdamW state. A budget
    below it is an error naming offload without offload_policy, and with it the planner
    offloads the fewest units, the largest first, and explains each."""
    def planned(budget: int, **options: Any) -> Any:
        torch.manual_seed(0)
        return fxshard.explain(TinyGPT(vocab=512, dim=256, heads=4, layers=4, seq=64),
                               torch.randint(0, 512, (1, 8)), by_class(Block),
                               optimizer=torch.optim.AdamW, memory_budget=budget, **options).report

    free = _optimizer_step_alone = planned(1 << 40)
    assert free.peak_phase == "optimizer step"
    budget = free.predicted_peak_bytes * 3 // 4
    with pytest.raises(fxshard.BudgetError, match=r"the optimizer step alone holds .*The largest part is "
                                                  r"optimizer state: .*pass offload_policy=fxshard.CPUOffload"):
        planned(budget)
    report = planned(budget, offload_policy=fxshard.CPUOffloadPolicy())
    assert report.budget is not None and report.predicted_peak_bytes <= budget
    chosen = report.budget.chosen
    by_size = sorted(report.units, key=lambda u: -u.shard_bytes)  # the root (embeddings) first
    assert 0 < len(chosen.offloaded) < len(report.units)
    assert list(chosen.offloaded) == [u.name for u in by_size[:len(chosen.offloaded)]]
    # The fewest: one unit fewer does not fit the optimizer step. Without offload the step
    # holds every shard, gradient, 2 states and foreach's root of them all; with some units
    # offloaded, their 4 shards' worth is on the host and the rest steps in torch's for-loop
    # (foreach takes no step holding host tensors): the largest kept shard's root and quotient.
    total = sum(u.shard_bytes for u in report.units)
    fewer = sum(u.shard_bytes for u in by_size[:len(chosen.offloaded) - 1])
    step = free.predicted_peak_bytes if not fewer else \
        free.predicted_peak_bytes - total - 4 * fewer + 2 * by_size[len(chosen.offloaded) - 1].shard_bytes
    assert step > budget
    rows = {u.unit: u for u in report.budget.units}
    assert {u for u, row in rows.items() if row.offloaded} == set(chosen.offloaded)
    assert "host" in str(report) and "offloaded: the budget needs" in str(report)
    assert report.host_bytes == 4 * sum(u.shard_bytes for u in report.units if u.name in chosen.offloaded)


def test_fsdp1s_cpu_offload_is_refused_with_the_one_line_change_and_fsdp2s_policy_is_taken() -> None:
    with pytest.raises(TypeError, match=r"replace cpu_offload=CPUOffload\(offload_params=True\) with "
                                        r"offload_policy=fxshard.CPUOffloadPolicy\(\)"):
        fxshard.compile(MLP(), cpu_offload=True)
    with pytest.raises(TypeError, match="offload_policy takes fxshard.CPUOffloadPolicy"):
        fxshard.ShardingOptions(offload_policy="cpu")  # type: ignore[arg-type]
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    assert fxshard.ShardingOptions(offload_policy=CPUOffloadPolicy(pin_memory=False)).offload_policy == \
        fxshard.CPUOffloadPolicy(pin_memory=False)
    assert fxshard.ShardingOptions(offload_policy=OffloadPolicy()).offload_policy is None


def _step_peak(rank: int) -> int:
    """MLP's predicted peak with AdamW's state on the device, on 2 ranks (nothing offloaded)."""
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), optimizer=torch.optim.AdamW)
    F.mse_loss(sharded(torch.randn(6, 12)), torch.randn(6, 5)).backward()
    report = sharded.report()
    assert report.optimizer_state_bytes == 2 * report.grad_shard_bytes
    return report.predicted_peak_bytes


def offload_worker(rank: int, world_size: int, front_end: str) -> dict[str, Any]:
    """AdamW with clipping, through ``front_end`` with offload, and DDP beside it. "budget":
    memory_budget chooses the units to offload; "no_sync": two micro-batches a step, the
    first inside no_sync, beside fxshard without offload (no_sync's sums differ from DDP's
    by rounding: test_recipe)."""
    torch.manual_seed(0)
    model = MLP()
    ddp: Any = DDP(copy.deepcopy(model))
    if front_end == "no_sync":
        ddp = fxshard.compile(copy.deepcopy(model), policy=by_class(nn.Linear))
    options: dict[str, Any] = {"policy": by_class(nn.Linear), "offload_policy": fxshard.CPUOffloadPolicy()}
    if front_end == "budget":
        budget = _step_peak(rank) * 4 // 5
        torch.manual_seed(0)
        model = MLP()
        options.update(memory_budget=budget, optimizer=torch.optim.AdamW)
    if front_end in ("compile", "budget", "no_sync"):
        sharded = fxshard.compile(model, **options)
        params = list(sharded.parameters())
    else:
        sharded = torch.compile(model, backend=fxshard.backend(**options), dynamic=False)
        params = list(fxshard.parameters(sharded))
    opt = torch.optim.AdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + rank)
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for _ in range(3):
        x, y = torch.randn(6, 12, generator=gen), torch.randn(6, 5, generator=gen)
        for module, optimizer, tag in ((sharded, opt, ""), (ddp, ref_opt, "ref_")):
            inputs, targets = x, y
            if front_end == "no_sync":  # a first micro-batch: its gradients summed locally
                with module.no_sync():
                    F.mse_loss(module(x[:3]), y[:3]).backward()
                inputs, targets = x[3:], y[3:]
            loss = F.mse_loss(module(inputs), targets)
            loss.backward()
            out[f"{tag}losses"].append(loss.item())
            # torch's own clipping: over the shards, fxshard makes each norm the global one.
            norm = torch.nn.utils.clip_grad_norm_(list(optimizer.param_groups[0]["params"]), 0.5)
            out[f"{tag}norms"].append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
    out["devices"] = sorted({str(p.device) for p in params} | {str(s.device) for p in params
                                                                 for s in opt.state[p].values()
                                                                 if isinstance(s, torch.Tensor)})
    if front_end == "budget":
        report = sharded.report()
        assert report.budget is not None and report.predicted_peak_bytes <= report.budget.budget
        out["offloaded"] = report.budget.chosen.offloaded
        out["units"] = [u.name for u in report.units]
    out["state"] = fxshard.get_model_state_dict(sharded, options=torch.distributed.checkpoint.state_dict
                                                .StateDictOptions(full_state_dict=True))
    out["ref_state"] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()} \
        if isinstance(ddp, DDP) else fxshard.get_model_state_dict(
            ddp, options=torch.distributed.checkpoint.state_dict.StateDictOptions(full_state_dict=True))
    return out


@pytest.mark.parametrize("front_end", ["compile", "backend", "budget", "no_sync"])
def test_offload_trains_exactly_like_ddp_with_clipping_and_adamw(front_end: str) -> None:
    results = run_ranks(offload_worker, 2, front_end)
    if front_end == "budget":  # every rank chose the same units, some but not all
        assert results[0]["offloaded"] == results[1]["offloaded"]
        assert 0 < len(results[0]["offloaded"]) < len(results[0]["units"])
    for r in results:
        assert r["devices"] == ["cpu"]  # the shards and the optimizer state: the host
        if front_end == "no_sync":  # against fxshard without offload: the same sums, the same order
            assert r["losses"] == r["ref_losses"] and r["norms"] == r["ref_norms"]
            for name, value in r["ref_state"].items():
                assert torch.equal(r["state"][name], value), name
            continue
        # Against DDP: the global norm adds the shards' squares where DDP adds each parameter's,
        # and the clip (0.5) scales every gradient by it, so the numbers after the first clip
        # agree to float32 rounding (docs/devices.md, "Numerics"), not bit for bit.
        assert r["losses"][0] == r["ref_losses"][0]  # before any clip
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        for name, value in r["ref_state"].items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
