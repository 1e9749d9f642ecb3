"""fxshard.rehearse: an N-rank job's step in one process, each collective as long as a
profile's network predicts (fxshard/driver/run/rehearsal.py). On the CPU here: what each
collective computes, the time it is given (from the profile's numbers, by hand), fxshard
and FSDP2 training on it, and auto() choosing on it without keeping its trials alive.
Nothing here times anything.
"""

from __future__ import annotations

import gc
import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxshard
from fxshard.ir.errors import FxShardError
from fxshard.policies import auto, by_class
from tests.dist_utils import run_alone
from tests.models import Block, TinyGPT

# On 2.11 and 2.15 too: c10d calls a Python group's collectives by other names there.
pytestmark = pytest.mark.release("rehearsal_group_methods")

# The profiles' links (fxshard/ir/cost.py, sourced in docs/time.md): latency, bandwidth, per hop.
NVLINK = (10e-6, 0.8 * 450e9, 1e-6)
IB = (20e-6, 0.8 * 50e9, 3e-6)


def _ring(link: tuple[float, float, float], kind: str, input_bytes: int, n: int) -> float:
    """By hand: alpha + (n - 1) hops + ring bus bytes / bandwidth."""
    latency, bandwidth, hop = link
    full = input_bytes * n if kind == "all_gather" else input_bytes
    bus = full * (n - 1) / n * (2 if kind == "all_reduce" else 1)
    return latency + hop * (n - 1) + bus / bandwidth


def _collectives() -> dict[str, Any]:
    rehearsal = fxshard.rehearse(8, "h100-ib")
    try:
        ops = torch.ops._c10d_functional
        name = dist.group.WORLD.group_name
        x = torch.arange(6, dtype=torch.float32)
        gathered = ops.wait_tensor(ops.all_gather_into_tensor(x, 8, name))
        full = torch.arange(48, dtype=torch.float32)
        scattered = ops.wait_tensor(ops.reduce_scatter_tensor(full, "sum", 8, name))
        summed = ops.wait_tensor(ops.all_reduce(torch.ones(3), "sum", name))
        averaged = torch.full((4,), 2.0)
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
        in_place = torch.zeros(48)  # FSDP2's all_gather: its input is this rank's slot of the output
        in_place[:6] = x
        dist.all_gather_into_tensor(in_place, in_place[:6])
        across = dist.new_group([0, 1, 2, 3, 4, 5, 6, 7])  # one node: NVLink
        dist.all_reduce(torch.ones(1000), group=across)
        return {"gathered": gathered, "scattered": scattered, "summed": summed, "averaged": averaged,
                "in_place": in_place, "log": list(rehearsal.log)}
    finally:
        dist.destroy_process_group()


def test_each_collective_computes_what_identical_ranks_would_and_lasts_the_networks_time() -> None:
    r = run_alone(_collectives)
    assert torch.equal(r["gathered"], torch.arange(6.0).repeat(8))
    assert torch.equal(r["scattered"], 8 * torch.arange(6.0))  # rank 0's chunk, summed over 8
    assert torch.equal(r["summed"], torch.full((3,), 8.0))
    assert torch.equal(r["averaged"], torch.full((4,), 2.0))
    assert torch.equal(r["in_place"], torch.arange(6.0).repeat(8))
    log = r["log"]
    assert [(e.kind, e.input_bytes, e.group_size) for e in log] == [
        ("all_gather", 24, 8), ("reduce_scatter", 192, 8), ("all_reduce", 12, 8), ("all_reduce", 16, 8),
        ("all_gather", 24, 8), ("all_reduce", 4000, 8)]
    # h100-ib: 8 ranks per node, so 8 ranks are one node: NVLink's numbers, not InfiniBand's.
    for e in log:
        assert not e.between_nodes
        assert e.seconds == pytest.approx(_ring(NVLINK, e.kind, e.input_bytes, 8))


def _across_nodes() -> list[Any]:
    rehearsal = fxshard.rehearse(16, "h100-ib")
    try:
        dist.all_gather_into_tensor(torch.empty(16 * 1000), torch.ones(1000))  # 16 ranks: two nodes
        pair = dist.new_group([0, 8])  # HSDP's replicas: one rank of each node
        dist.all_reduce(torch.ones(1000), group=pair)
        inside = dist.new_group(list(range(8)))
        dist.all_reduce(torch.ones(1000), group=inside)
        return list(rehearsal.log)
    finally:
        dist.destroy_process_group()


def test_a_group_spanning_nodes_runs_at_the_links_between_them() -> None:
    world, pair, inside = run_alone(_across_nodes)[-3:]
    assert world.between_nodes and world.seconds == pytest.approx(_ring(IB, "all_gather", 4000, 16))
    assert pair.between_nodes and pair.seconds == pytest.approx(_ring(IB, "all_reduce", 4000, 2))
    assert not inside.between_nodes and inside.seconds == pytest.approx(_ring(NVLINK, "all_reduce", 4000, 8))


def _train(system: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rehearsal = fxshard.rehearse(8, "h100-nvlink")
    try:
        torch.manual_seed(0)
        model: nn.Module = TinyGPT()
        x = torch.randint(0, 61, (2, 16))
        out: dict[str, Any] = {}
        if system == "fxshard":
            model = fxshard.compile(model, by_class(Block))
        elif system == "auto":
            from fxshard.driver.compile.compiler import Driver
            from fxshard.driver.run import runtime

            # Without the cyclic collector: what reference counting alone leaves. A trial held in
            # a cycle keeps its shards (on a GPU, device memory) until the collector happens to run.
            gc.collect()
            gc.disable()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = fxshard.compile(model, auto(units=by_class(Block)), example_inputs=x)
                out["drivers"] = sum(isinstance(o, Driver) for o in gc.get_objects())
            finally:
                gc.enable()
            out["checked"] = len(runtime._STEP_CHECKS)
            out["shards"] = len(model._driver.shards)  # type: ignore[union-attr]
        else:
            mesh = init_device_mesh("cpu", (8,))
            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            start = len(rehearsal.log)
            loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.setdefault("losses", []).append(float(loss))
            out["step"] = [(e.kind, e.input_bytes) for e in rehearsal.log[start:]]
        if system != "fsdp2":
            report = model.report()  # type: ignore[operator]
            out["rates"] = report.time.rates
            out["predicted"] = sorted((s.kind, s.bytes) for s in report.time.collectives)
        return out
    finally:
        dist.destroy_process_group()


def test_fxshard_and_fsdp2_train_on_a_rehearsal_and_fxshard_predicts_with_its_network() -> None:
    mine, fsdp2 = run_alone(_train, "fxshard"), run_alone(_train, "fsdp2")
    for r in (mine, fsdp2):
        assert all(math.isfinite(v) for v in r["losses"])
        assert {k for k, _ in r["step"]} == {"all_gather", "reduce_scatter"}
    assert "rehearsed" in mine["rates"] and "NVLink" in mine["rates"]
    # The step's collectives are the ones the report predicted, byte for byte; and the agreement's.
    ran = sorted(mine["step"])
    assert [c for c in ran if c != ("all_gather", 8)] == mine["predicted"]
    assert ran.count(("all_gather", 8)) == 2  # one before the forward, one before the backward


def test_auto_keeps_none_of_its_trials_alive() -> None:
    r = run_alone(_train, "auto")
    assert r["drivers"] == 1  # the model's own: every trial's driver and its shards are gone
    assert r["checked"] == r["shards"]  # no trial's shards wait for an optimizer step


def _hsdp() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    rehearsal = fxshard.rehearse(16, "h100-ib")
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("replicate", "shard"))
        sharded = fxshard.compile(TinyGPT(), by_class(Block), mesh=mesh)
        optimizer = torch.optim.AdamW(sharded.parameters())
        x = torch.randint(0, 61, (2, 16))
        for _ in range(2):
            start = len(rehearsal.log)
            sharded(x).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        step = rehearsal.log[start:]
        time = sharded.report().time
        return {"step": sorted((e.kind, e.input_bytes, e.group_size, e.between_nodes) for e in step),
                "predicted": sorted((c.kind, c.bytes, c.dimension) for c in time.collectives)}
    finally:
        dist.destroy_process_group()


def test_hsdp_across_two_rehearsed_nodes_reduces_its_replicas_over_the_links_between_them() -> None:
    r = run_alone(_hsdp)
    ran = [(kind, size, group, between) for kind, size, group, between in r["step"] if size != 8 or group != 16]
    # Shards of 8 inside a node, replicas of 2 across nodes; the agreement over all 16 (8 bytes).
    assert {(k, g, b) for k, _, g, b in ran} == {("all_gather", 8, False), ("reduce_scatter", 8, False),
                                                 ("all_reduce", 2, True)}
    assert [(k, n) for k, n, _, _ in ran] == [(k, n) for k, n, _ in r["predicted"]]
    assert {(k, d) for k, _, d in r["predicted"]} == {
        ("all_gather", "shard"), ("reduce_scatter", "shard"), ("all_reduce", "replicate")}
    assert sum(1 for k, n, g, b in r["step"] if (k, n, g, b) == ("all_gather", 8, 16, True)) == 2


def _through_the_backend() -> dict[str, Any]:
    rehearsal = fxshard.rehearse(8, "h100-nvlink")
    try:
        torch.manual_seed(0)
        x = torch.randint(0, 61, (2, 16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(TinyGPT(), backend=fxshard.backend(by_class(Block)), dynamic=False)
            optimizer = torch.optim.AdamW(fxshard.parameters(compiled, example_inputs=(x,)))
            losses = []
            for _ in range(2):
                start = len(rehearsal.log)
                loss = compiled(x).float().square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss))
        return {"losses": losses, "step": sorted({e.kind for e in rehearsal.log[start:]})}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # Dynamo's compile: seconds
def test_the_torch_compile_backend_trains_on_a_rehearsal() -> None:
    r = run_alone(_through_the_backend)
    assert all(math.isfinite(v) for v in r["losses"])
    assert r["step"] == ["all_gather", "reduce_scatter"]


def _refused(what: str) -> str:
    try:
        if what == "twice":
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            fxshard.rehearse(8, "h100-nvlink")
        elif what == "hardware":
            fxshard.rehearse(8, "h100-pcie")
        else:
            fxshard.rehearse(0, "h100-nvlink")
    except FxShardError as e:
        return str(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return "not refused"


@pytest.mark.parametrize("what, says", [
    ("twice", "already initialised"), ("hardware", "known are h100-ib, h100-nvlink"), ("size", "an int >= 1")])
def test_bad_rehearsals_are_refused_naming_the_fix(what: str, says: str) -> None:
    assert says in run_alone(_refused, what)
