"""Time (fxshard/ir/cost.py, fxshard/driver/report/calibrate.py): a node's and a collective's cost
under given rates, the simulated streams against schedules computed by hand, and the report
of a real 2-rank step under injected rates (nothing here times anything).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.collectives import bus_bytes
from fxshard.ir.cost import (
    DeviceRates,
    Link,
    Network,
    Rates,
    flops,
    fresh_pages,
    hardware,
    node_cost,
    predict_step,
)
from fxshard.ir.errors import FxShardError
from fxshard.ir.meta import ChainTag, Direction, NodeInfo, Role
from fxshard.ir.nodes import call

from dist_utils import run_ranks

GFLOP = 1e9


def _device(fp32: float = GFLOP, bf16: float = 2 * GFLOP, bandwidth: float = 1e18, overhead: float = 0.0,
            view: float = 0.0) -> DeviceRates:
    return DeviceRates("test device", {"float32": fp32, "bfloat16": bf16}, bandwidth, overhead, view)


class Builder:
    """A graph built by hand, every node with its fake ``meta["val"]``."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode()
        self.gm = fx.GraphModule({}, fx.Graph())
        self.g = self.gm.graph
        self.chains = 0

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> fx.Node:
        node = self.g.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def op(self, target: Any, *args: Any) -> fx.Node:
        return call(self.g, target, args)

    def gather(self, shard: fx.Node, unit: str, group: str, ranks: int = 2) -> fx.Node:
        """all_gather over ``ranks`` ranks on ``group``, tagged as one chain of ``unit`` (as a
        lowering tags it); returns the collective (``wait`` waits it)."""
        tag = ChainTag(self.chains, Direction.GATHER, "all_gather")
        self.chains += 1
        node = self.op(P.ALL_GATHER, shard, ranks, group)
        meta.set_info(node, NodeInfo(Role.ALL_GATHER, 0, unit, tag))
        return node

    def wait(self, collective: fx.Node) -> fx.Node:
        node = self.op(P.WAIT, collective)
        info = meta.get_info(collective)
        assert info is not None
        meta.set_info(node, NodeInfo(Role.WAIT, 0, info.unit, info.chain))
        return node

    def done(self, *outputs: fx.Node) -> fx.GraphModule:
        self.g.output(outputs)
        self.g.lint()
        return self.gm


# -- one node -------------------------------------------------------------------------------------


def test_a_matmul_costs_its_flops_at_its_dtypes_rate_or_its_bytes_at_the_bandwidth() -> None:
    b = Builder()
    x, w = b.input("x", 64, 128), b.input("w", 128, 32)
    mm = b.op(torch.ops.aten.mm.default, x, w)
    xb, wb = b.input("xb", 64, 128, dtype=torch.bfloat16), b.input("wb", 128, 32, dtype=torch.bfloat16)
    mm16 = b.op(torch.ops.aten.mm.default, xb, wb)
    t = b.op(torch.ops.aten.t.default, w)
    add = b.op(torch.ops.aten.add.Tensor, mm, mm)
    work = 2 * 64 * 128 * 32
    moved = (64 * 128 + 128 * 32 + 64 * 32) * 4
    assert flops(mm) == work and flops(add) == 0

    compute_bound = _device(fp32=GFLOP, bandwidth=1e12, overhead=1e-6, view=3e-7)
    cost = node_cost(mm, compute_bound)
    assert (cost.flops, cost.bytes) == (work, moved)
    assert cost.seconds == pytest.approx(work / GFLOP + 1e-6)
    assert node_cost(mm16, compute_bound).seconds == pytest.approx(work / (2 * GFLOP) + 1e-6)  # bf16's rate
    assert node_cost(t, compute_bound).seconds == pytest.approx(3e-7)  # a view: dispatch only
    assert node_cost(t, compute_bound).bytes == 0

    memory_bound = _device(fp32=1e18, bf16=1e18, bandwidth=1e9, overhead=1e-6)
    assert node_cost(mm, memory_bound).seconds == pytest.approx(moved / 1e9 + 1e-6)
    assert node_cost(mm16, memory_bound).seconds == pytest.approx(moved / 2 / 1e9 + 1e-6)  # half the bytes
    assert node_cost(add, memory_bound).seconds == pytest.approx(3 * 64 * 32 * 4 / 1e9 + 1e-6)


def test_a_small_matmul_runs_at_the_measured_rate_for_its_size() -> None:
    """The curve calibration measures (FLOPs of a square matmul, FLOP/s), read in log-log."""
    device = DeviceRates("curved", {"float32": 1e10}, 1e18, 0.0,
                         matmul_curve={"float32": ((1e6, 1e9), (1e8, 1e10))})
    assert device.flop_rate(torch.float32, 1e7) == pytest.approx(10 ** 9.5)  # halfway in log-log
    assert device.flop_rate(torch.float32, 1e3) == 1e9 and device.flop_rate(torch.float32, 1e12) == 1e10
    assert device.flop_rate(torch.float32) == 1e10  # no size: the peak
    # Utilisation is against the highest rate measured, wherever on the curve it fell.
    bumpy = replace(device, matmul_curve={"float32": ((1e6, 1e9), (1e7, 1.2e10), (1e8, 1e10))})
    assert bumpy.peak_rate(torch.float32) == 1.2e10 and bumpy.peak_rate(torch.bfloat16) == 1.2e10
    assert replace(bumpy, peak_flops={"float32": 5e10}).peak_rate(torch.float32) == 5e10
    assert device.flop_rate(torch.bfloat16, 1e7) == pytest.approx(10 ** 9.5)  # no bf16 of its own: fp32's
    b = Builder()
    mm = b.op(torch.ops.aten.mm.default, b.input("x", 100, 100), b.input("w", 100, 100))  # 2 MFLOP
    # 2 MFLOP: log10(2) / 2 = 0.15 of the way from 1e6 to 1e8 in log-log: 10^9.15 FLOP/s (by hand).
    assert node_cost(mm, device).seconds == pytest.approx(2e6 / 10 ** (9 + math.log10(2) / 2))


def test_an_operator_slower_than_its_bytes_costs_its_measured_seconds_per_element() -> None:
    b = Builder()
    x = b.input("x", 1000)
    tanh, neg = b.op(torch.ops.aten.tanh.default, x), b.op(torch.ops.aten.neg.default, x)
    device = DeviceRates("per element", {"float32": GFLOP}, 8e9, 1e-6, per_element={"tanh": 2e-9})
    assert node_cost(tanh, device).seconds == pytest.approx(1000 * 2e-9 + 1e-6)  # 2 us > 8 kB at 8 GB/s
    assert node_cost(neg, device).seconds == pytest.approx(8000 / 8e9 + 1e-6)  # not in the table: its bytes
    fast = DeviceRates("fast tanh", {"float32": GFLOP}, 8e9, 1e-6, per_element={"tanh": 1e-12})
    assert node_cost(tanh, fast).seconds == pytest.approx(8000 / 8e9 + 1e-6)  # the larger of the two


def test_dropouts_backward_costs_its_measured_seconds_per_element() -> None:
    """Its mask is bool: a cast and two multiplies, about 4x an add of as many elements on the
    project's CPU, where the Net's backward spent 1.9 ms in it against 0.3 predicted from its
    bytes."""
    from fxshard.driver.report.calibrate import _per_element_ops
    from fxshard.ir.cost import PER_ELEMENT

    assert "native_dropout_backward" in PER_ELEMENT
    measured = _per_element_ops(torch.device("cpu"))  # what calibration times, unrun
    assert set(measured) == set(PER_ELEMENT)
    back_op, numel = measured["native_dropout_backward"]
    assert numel == 1 << 20 and back_op().shape == (numel,)
    b = Builder()
    grad, mask = b.input("grad", 1000), b.input("mask", 1000, dtype=torch.bool)
    back = b.op(torch.ops.aten.native_dropout_backward.default, grad, mask, 1 / 0.9)
    device = DeviceRates("dropout", {"float32": GFLOP}, 9e9, 1e-6, per_element={"native_dropout_backward": 2e-9})
    assert node_cost(back, device).seconds == pytest.approx(1000 * 2e-9 + 1e-6)  # 9 kB at 9 GB/s: 1 us


@pytest.mark.parametrize("slow", ["first pass", "second pass", "both passes"])
def test_a_slow_moment_during_the_device_measurement_leaves_the_rates_of_the_pass_it_missed(
        monkeypatch: pytest.MonkeyPatch, slow: str) -> None:
    from fxshard.driver.report import calibrate

    device = torch.device("cpu")
    # Every call _seconds times, in one pass: the matmul curve of each dtype, the bandwidth, the
    # overhead and the view, the per-element operators.
    per_pass = len(calibrate.DTYPES) * len(calibrate.matmul_sizes(device)) + 3 + len(
        calibrate._per_element_ops(device))
    timed: list[Any] = []

    def seconds(fn: Any, device: torch.device, *args: Any, **kwargs: Any) -> float:
        timed.append(fn)
        first = len(timed) <= per_pass
        hit = slow == "both passes" or (slow == "first pass") == first
        return 3e-3 if hit else 1e-3  # a host three times slower for a moment

    monkeypatch.setattr(calibrate, "_seconds", seconds)
    monkeypatch.setattr(calibrate, "measure_fresh", lambda device: (None, 0.0))
    rates = calibrate.measure_device(device)
    took = 3e-3 if slow == "both passes" else 1e-3  # a slower device is slower in every pass
    for name in calibrate.DTYPES:
        assert [rate for _, rate in rates.matmul_curve[name]] == [
            pytest.approx(2.0 * n ** 3 / took) for n in calibrate.matmul_sizes(device)]
        assert rates.matmul_flops[name] == pytest.approx(2.0 * 512 ** 3 / took)
    assert rates.bandwidth == pytest.approx(3 * (1 << 22) * 4 / took)
    assert (rates.overhead, rates.view_overhead) == (pytest.approx(took / 100), pytest.approx(took / 100))
    assert rates.per_element == {name: pytest.approx(took / count)
                                 for name, (_, count) in calibrate._per_element_ops(device).items()}


def test_dropout_costs_its_measured_seconds_per_element_at_its_own_probability() -> None:
    """The CPU kernel's branch per element makes p matter: the Net's dropout at p = 0.25 took
    4.5-4.7 ms a step in the step and was charged 3.1 from the rate timed at p = 0.1."""
    from fxshard.driver.report.calibrate import _per_element_ops

    measured = _per_element_ops(torch.device("cpu"))
    assert [k for k in measured if k.startswith("native_dropout ")] == ["native_dropout p=0.25", "native_dropout p=0.5"]
    for key, p in (("native_dropout", 0.1), ("native_dropout p=0.25", 0.25), ("native_dropout p=0.5", 0.5)):
        run, numel = measured[key]
        torch.manual_seed(0)
        out, mask = run()
        assert numel == 1 << 20 and mask.shape == (numel,)
        assert abs(1 - mask.float().mean().item() - p) < 0.01  # timed at its own p
    device = DeviceRates("dropout", {"float32": GFLOP}, 1e15, 0.0, per_element={
        "native_dropout": 5e-9, "native_dropout p=0.25": 8e-9, "native_dropout p=0.5": 11e-9})
    b = Builder()
    x = b.input("x", 1000)

    def seconds(p: float) -> float:
        return node_cost(b.op(torch.ops.aten.native_dropout.default, x, p, True), device).seconds

    assert seconds(0.5) == pytest.approx(1000 * 11e-9)
    assert seconds(0.25) == pytest.approx(1000 * 8e-9) and seconds(0.75) == pytest.approx(1000 * 8e-9)
    assert seconds(0.4) == pytest.approx(1000 * 9.8e-9)  # 0.15 / 0.25 of the way from 8 to 11 ns
    assert seconds(0.9) == pytest.approx(1000 * 5e-9) and seconds(0.01) == pytest.approx(1000 * 5e-9)  # held
    only_one = DeviceRates("older", {"float32": GFLOP}, 1e15, 0.0, per_element={"native_dropout": 5e-9})
    assert node_cost(b.op(torch.ops.aten.native_dropout.default, x, 0.5, True), only_one).seconds == \
        pytest.approx(1000 * 5e-9)


def test_a_collective_costs_latency_plus_its_ring_bus_bytes_over_bandwidth() -> None:
    inside, between = Link(10e-6, 1e9, 1e-6), Link(50e-6, 1e8)
    net = Network("test", {"all_gather": inside, "reduce_scatter": inside, "all_reduce": inside},
                  {"all_gather": between, "reduce_scatter": between}, ranks_per_node=8)
    n = 4
    # all_gather's input is one shard: each rank receives the other n - 1.
    assert net.seconds("all_gather", 1000, n) == pytest.approx(10e-6 + 3e-6 + 3 * 1000 / 1e9)
    # reduce_scatter's is the full buffer: (n - 1) / n of it; all_reduce twice that.
    assert net.seconds("reduce_scatter", 4000, n) == pytest.approx(10e-6 + 3e-6 + 3000 / 1e9)
    assert net.seconds("all_reduce", 4000, n) == pytest.approx(10e-6 + 3e-6 + 6000 / 1e9)
    # Past a node, and between replicas, the wire between nodes.
    assert net.seconds("all_gather", 1000, 16) == pytest.approx(50e-6 + 15 * 1000 / 1e8)
    assert net.seconds("reduce_scatter", 4000, 4, "replicate") == pytest.approx(50e-6 + 3000 / 1e8)
    assert net.seconds("all_to_all", 4000, 4, "replicate") == pytest.approx(50e-6 + 3000 / 1e8)
    assert net.seconds("all_gather", 1000, 1) == 0.0  # one rank: nothing moves
    assert Network.free().seconds("all_reduce", 1 << 30, 8) == 0.0


def test_a_broadcast_moves_its_buffer_once_and_the_agreement_is_an_all_gather() -> None:
    """A broadcast's input is the whole buffer, which every link carries once (NCCL's bus
    bandwidth for it, the report's broadcast bytes); the agreement's input is each rank's
    own few bytes, gathered from every other rank."""
    link = Link(ALPHA, BETA)
    net = Network("n", {"all_gather": link})
    assert net.seconds("broadcast", 1000, 8) == pytest.approx(ALPHA + 1000 / BETA)
    assert net.seconds("agreement", 8, 8) == pytest.approx(ALPHA + 7 * 8 / BETA)


def test_calibration_fits_latency_and_bandwidth_by_least_squares() -> None:
    from fxshard.driver.report.calibrate import fit

    on_a_line = [(b, 3e-4 + b / 2e9) for b in (1e4, 1e6, 4e6)]
    link = fit(on_a_line)
    assert (link.latency, link.bandwidth) == pytest.approx((3e-4, 2e9))
    noisy = [(1e4, 1e-3), (1e6, 1.4e-3), (4e6, 3.1e-3)]  # least squares, not the two ends
    link = fit(noisy)
    xs, ys = [p[0] for p in noisy], [p[1] for p in noisy]
    # The normal equations of relative residuals (weights 1/y^2) hold.
    relative = [(y - link.seconds(x, 2)) / y ** 2 for x, y in noisy]
    assert sum(relative) == pytest.approx(0.0, abs=1e-6)
    assert sum(r * x for r, x in zip(relative, xs)) == pytest.approx(0.0, abs=1e-3)
    assert 0 < link.latency < min(ys)
    # Calibration's sizes on the CPU (64 KiB, 1 MiB, 8 MiB of full buffer over 2 ranks): 5% off
    # at the largest barely moves the latency the smallest measures (unweighted: 6%).
    exact = [(x, 5e-4 + x / 5e8) for x in (32768, 524288, 4194304)]
    off = fit([*exact[:2], (exact[2][0], exact[2][1] * 1.05)])
    assert off.latency == pytest.approx(5e-4, rel=0.02)
    # A fit that would need a negative latency goes through the origin instead: the slope of
    # relative residuals, sum(x/y) / sum(x^2/y^2) = 1 / 7.913 GB/s (by hand).
    through_zero = fit([(1e6, 1e-4), (2e6, 3e-4), (4e6, 7e-4)])
    assert through_zero.latency == 0.0 and through_zero.bandwidth == pytest.approx(7.9129e9, rel=1e-4)


def test_calibration_times_the_device_by_a_typical_call_and_the_network_by_the_mean(monkeypatch: Any) -> None:
    from fxshard.driver.report import calibrate

    # A scripted clock: the warm-up call, then calls of 1, 1.5, 4 and 2 ms.
    durations = iter([0.0, 1e-3, 1.5e-3, 4e-3, 2e-3])
    clock = [0.0]

    def perf_counter() -> float:
        return clock[0]

    def call() -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(calibrate.time, "perf_counter", perf_counter)
    # The device's rates: the typical call (1.75 ms), not the fastest (1 ms, which predicted
    # steps 5-15% short) and not moved by the one slow call as a mean of few is.
    assert calibrate._seconds(call, torch.device("cpu"), least=0.0, calls=4) == pytest.approx(1.75e-3)
    for how, expected in (("fastest", 1e-3), ("mean", 2.125e-3)):
        durations, clock[0] = iter([0.0, 1e-3, 1.5e-3, 4e-3, 2e-3]), 0.0
        assert calibrate._seconds(call, torch.device("cpu"), least=0.0, calls=4, how=how) == \
            pytest.approx(expected)
    # A cached entry measured another way is measured again: the method is in every key.
    assert f"method {calibrate.METHOD}" in calibrate.device_key(torch.device("cpu"))


class _TwoRanks:  # two gloo ranks, as far as measure_network asks (nothing runs)
    group_name = "two"

    def size(self) -> int:
        return 2


def _scripted_network(monkeypatch: Any, slow: Callable[[int], float], cold: float = 0.0) -> list[tuple[str, int]]:
    """measure_network's collectives replaced by a scripted host: each call of a collective of
    ``bus`` bytes takes ``slow(call number) * (100 us + bus / 1 GB/s)`` on the patched clock,
    a fifth of its latency and a quarter of its bytes' time in the call that issues it (as
    gloo's reduce_scatter copies its input), the rest until its wait returns. With ``cold``
    (seconds per bus byte), a 4 KiB cache, and a call right after an eviction issues that much
    longer; without, no cache is known and no cold issue is timed. Returns the (kind, input
    bytes) of every call, in order."""
    from fxshard.driver.report import calibrate
    from fxshard.ir.collectives import bus_bytes

    clock, made, evicted = [0.0], [], [False]

    def collective(kind: str, full: torch.Tensor, shard: torch.Tensor, n: int, name: str) -> Any:
        given = (shard if kind == "all_gather" else full).numel() * 4

        def issue() -> float:
            made.append((kind, given))
            factor, bus = slow(len(made)), bus_bytes(kind, given, n)
            clock[0] += factor * (2e-5 + bus / 4e9) + (bus * cold if evicted[0] else 0.0)
            evicted[0] = False
            return factor * (8e-5 + bus * 3 / 4e9)  # what its wait takes
        return issue, given

    def wait(flight: float) -> None:
        clock[0] += flight

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(calibrate, "_collective", collective)
    monkeypatch.setattr(calibrate, "_wait", wait)
    monkeypatch.setattr(calibrate, "comm_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(calibrate.dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(calibrate, "last_level_cache", lambda: (1 << 12) if cold else None)
    monkeypatch.setattr(calibrate, "_evict", lambda buffer: evicted.__setitem__(0, True))
    return made


def test_the_network_is_measured_by_the_mean_of_each_sizes_calls_interleaved(monkeypatch: Any) -> None:
    from fxshard.driver.report import calibrate

    assert calibrate.interleaved([4, 2, 1]) == [0, 0, 1, 0, 0, 1, 2]
    made = _scripted_network(monkeypatch, lambda call: 1.0)
    network = calibrate.measure_network(_TwoRanks())  # type: ignore[arg-type]
    # Every kind at every size, its count of calls (after one to warm up), their mean fitted.
    sizes = calibrate.network_sizes(torch.device("cpu"))
    for kind in calibrate.KINDS:
        link = network.links[kind]
        # Its flight and its issue, each fitted; the whole collective as before.
        assert (link.latency, link.bandwidth) == (pytest.approx(8e-5), pytest.approx(4e9 / 3))
        assert (link.issue_latency, link.issue_bandwidth) == (pytest.approx(2e-5), pytest.approx(4e9))
        assert link.seconds(1e6, 2) == pytest.approx(1e-4 + 1e6 / 1e9)
        for size, calls in sizes:
            given = (size // 8 if kind == "all_gather" else size // 4) * 4
            # The largest size's also warms the link first (untimed).
            assert made.count((kind, given)) == 1 + calls + calibrate.WARM_ROUNDS * (size == sizes[-1][0])
    # Interleaved: the largest size's few calls spread over the whole measurement.
    largest = [i for i, (kind, given) in enumerate(made) if kind == "all_gather" and given == sizes[-1][0] // 2]
    timed = largest[1 + calibrate.WARM_ROUNDS:]  # after the untimed ones
    assert min(b - a for a, b in zip(timed, timed[1:])) > len(made) / (2 * sizes[-1][1])


def test_a_collective_issued_on_a_cold_input_holds_its_thread_for_its_cold_bytes(monkeypatch: Any) -> None:
    """Calibration times each kind's issue right after a read of twice the cache, against the
    same call warm; a step's all_gather of a shard (a placeholder: last touched by the step
    before) is charged the cold issue, one of a tensor just computed the warm one. The Net's
    shard all_gathers took 0.4-0.6 ms to issue in its step, against 0.1-0.2 predicted warm."""
    from fxshard.driver.report import calibrate

    made = _scripted_network(monkeypatch, lambda call: 1.0, cold=1 / 2e9)
    warm = calibrate.measure_network(_TwoRanks())  # type: ignore[arg-type]
    assert all(link.issue_cold_bandwidth is None for link in warm.links.values())
    network = calibrate.measure_cold_issues(warm, _TwoRanks())  # type: ignore[arg-type]
    for kind in calibrate.KINDS:
        link = network.links[kind]
        # Warm: 20 us + bus / 4 GB/s (the fitted line, as before); cold, a bus byte takes
        # 1/4 + 1/2 ns: 4/3 GB/s.
        assert (link.issue_latency, link.issue_bandwidth) == (pytest.approx(2e-5), pytest.approx(4e9))
        assert link.issue_cold_bandwidth == pytest.approx(4e9 / 3)
        assert link.issue(1e6) == pytest.approx(2e-5 + 1e6 / 4e9)
        assert link.issue(1e6, cold=1.0) == pytest.approx(2e-5 + 1e6 * 3 / 4e9)
        assert link.issue(1e6, cold=0.5) == pytest.approx(2e-5 + 1e6 * 2 / 4e9)  # halfway
        given = calibrate.COLD_ISSUE_BYTES // (2 if kind == "all_gather" else 1)
        timed = [c for c in made if c == (kind, given)]
        assert len(timed) >= 2 * calibrate.COLD_ISSUE_CALLS  # each cold call and its warm twin

    # In a step: the shard's issue is cold, the freshly computed tensor's warm.
    f = Builder()
    shard, x = f.input("shard", 1 << 16), f.input("x", 1 << 16)  # 256 KiB: its bus bytes for 2 ranks
    fresh = f.op(torch.ops.aten.relu.default, x)
    cold_gather, warm_gather = f.gather(shard, "a", "g0"), f.gather(fresh, "b", "g1")
    graph = f.done(f.wait(cold_gather), f.wait(warm_gather))
    device = replace(_device(overhead=0.0), cache_bytes=1 << 30)
    time = predict_step({"forward": graph}, Rates("r", device, network))
    spans = {s.node: s.end - s.start for s in time.nodes}
    bus = 1 << 18
    assert spans[cold_gather.name] == pytest.approx(2e-5 + bus * 3 / 4e9)
    assert spans[warm_gather.name] == pytest.approx(2e-5 + bus / 4e9)
    # Without a cache (a profile), every issue is warm.
    assert {s.node: s.end - s.start for s in predict_step(
        {"forward": graph}, Rates("r", replace(device, cache_bytes=None), network)).nodes}[cold_gather.name] == \
        pytest.approx(2e-5 + bus / 4e9)


def test_the_network_is_timed_on_a_warm_link_as_the_steps_find_it(monkeypatch: Any) -> None:
    from fxshard.driver.report import calibrate

    # A link whose first 200 MB (input bytes) move at half the pace of every later byte, as a
    # process's first collectives on gloo do here: the step's collectives find it warm.
    moved = [0]

    def slow(call: int) -> float:
        factor = 2.0 if moved[0] < 200e6 else 1.0
        moved[0] += made[call - 1][1]
        return factor

    made = _scripted_network(monkeypatch, slow)
    network = calibrate.measure_network(_TwoRanks())  # type: ignore[arg-type]
    # The warm link's own: a 100 us latency and 1 GB/s, the issue and the flight together
    # (each rank's 16 MiB reduce_scatter predicted as the warm link moves it).
    for kind in calibrate.KINDS:
        assert network.seconds(kind, 1 << 24, 2) == pytest.approx(1e-4 + bus_bytes(kind, 1 << 24, 2) / 1e9,
                                                                  rel=0.02)
    # Timed from the first call (no untimed rounds), the slow bytes land on the few calls of
    # the largest sizes, and the line predicts a 16 MiB collective over a fifth long.
    moved[0], made[:] = 0, []
    monkeypatch.setattr(calibrate, "WARM_ROUNDS", 0)
    cold = calibrate.measure_network(_TwoRanks())  # type: ignore[arg-type]
    assert cold.seconds("reduce_scatter", 1 << 24, 2) > 1.2 * network.seconds("reduce_scatter", 1 << 24, 2)


def test_a_slow_moment_of_the_host_moves_every_size_alike_not_the_bandwidth(monkeypatch: Any) -> None:
    from fxshard.driver.report import calibrate

    # The host three times slower for a tenth of the calls, wherever that tenth falls.
    sizes = calibrate.network_sizes(torch.device("cpu"))
    total = len(calibrate.KINDS) * (sum(1 + calls for _, calls in sizes) + calibrate.WARM_ROUNDS)
    windows = [range(start, start + total // 10) for start in range(0, total, total // 20)]

    def worst() -> float:
        lowest = math.inf
        for window in windows:
            _scripted_network(monkeypatch, lambda call, window=window: 3.0 if call in window else 1.0)
            network = calibrate.measure_network(_TwoRanks())  # type: ignore[arg-type]
            lowest = min(lowest, *(1 / (1 / link.bandwidth + 1 / link.issue_bandwidth)  # issue and flight
                                   for link in network.links.values()))
        return lowest

    # Interleaved, every size's mean rises alike (a tenth of its calls, at most one in five of
    # the largest's): the bandwidth within 30% of 1 GB/s wherever the slow moment falls.
    assert 0.7e9 < worst() <= 1.0e9
    # Measured one kind and size after the other (as before), some tenth covers the largest
    # size's calls whole, and that kind's bandwidth falls to a third.
    sizes_of = len(sizes)
    monkeypatch.setattr(calibrate, "interleaved", lambda counts: [
        k + len(calibrate.KINDS) * s for k in range(len(calibrate.KINDS)) for s in range(sizes_of)
        for _ in range(counts[k + len(calibrate.KINDS) * s])])
    assert worst() < 0.4e9


def test_hardware_profiles_by_name_and_an_unknown_name_lists_them() -> None:
    h100 = hardware("h100-ib")
    assert h100.device.matmul_flops["bfloat16"] > 1e14 and any("datasheet" in s for s in h100.sources)
    # 8 GPUs on NVLink, then InfiniBand: a gather over 16 ranks is slower per byte.
    assert h100.network.seconds("all_gather", 1 << 24, 16) / 15 > h100.network.seconds("all_gather", 1 << 24, 8) / 7
    with pytest.raises(FxShardError, match="h100-ib, h100-nvlink"):
        hardware("h100")



def test_a_fused_adam_step_streams_its_state_once_where_the_for_each_step_makes_temporaries() -> None:
    from fxshard.ir.cost import optimizer_seconds
    from fxshard.ir.optimizer import OptimizerState

    device = _device(bandwidth=1e9, overhead=1e-6)
    shards = [4_000_000, 2_000_000]
    fused = OptimizerState("AdamW", 2, "fused", adam_temporaries=True)
    foreach = OptimizerState("AdamW", 2, "foreach", adam_temporaries=True)
    # fused: the shard, its gradient and both moments read, the three written; one launch
    assert optimizer_seconds(fused, shards, device) == pytest.approx(7 * 6e6 / 1e9 + 1e-6)
    assert optimizer_seconds(foreach, shards, device) == pytest.approx(21 * 6e6 / 1e9 + 16 * 1e-6)



def test_a_timed_matmul_costs_what_it_took_here_each_layout_its_own() -> None:
    from fxshard.ir.cost import node_key

    b = Builder()
    x, w = b.input("x", 64, 128), b.input("w", 32, 128)
    wt = b.op(torch.ops.aten.t.default, w)  # 128 x 32, transposed strides
    with b.mode:
        wt.meta["val"] = torch.empty(32, 128).t()
    transposed = b.op(torch.ops.aten.mm.default, x, wt)
    plain = b.op(torch.ops.aten.mm.default, x, b.input("v", 128, 32))
    key = node_key(transposed)
    assert key is not None and key != node_key(plain) and node_key(wt) is None
    device = replace(_device(fp32=GFLOP, overhead=1e-6), node_seconds={key: 0.25})
    assert node_cost(transposed, device).seconds == pytest.approx(0.25 + 1e-6)  # timed: what it took
    assert node_cost(plain, device).seconds == pytest.approx(2 * 64 * 128 * 32 / GFLOP + 1e-6)  # roofline


def test_a_timed_node_whose_operands_left_the_cache_costs_its_cold_time() -> None:
    """An operand is cold when more than the cache's bytes of traffic passed since its memory
    was last touched: a placeholder is (the step before touched it), unless an earlier graph's
    node of its name touched it lately; a view touches its base."""
    from fxshard.ir.cost import cold_operands, node_key

    mm, relu = torch.ops.aten.mm.default, torch.ops.aten.relu.default
    kib = 128 * 128 * 4  # 64 KiB a matrix
    f = Builder()
    x, w, big = f.input("x", 128, 128), f.input("w", 128, 128), f.input("big", 512, 512)  # big: 1 MiB
    a = f.op(relu, x)  # a fresh, x touched
    first = f.op(mm, a, w)  # a warm, w cold (a placeholder): half its operand bytes
    flushed = f.op(relu, big)  # 2 MiB of traffic: everything before is out of the cache
    second = f.op(mm, a, w)  # both cold
    view = f.op(torch.ops.aten.view.default, w, [128, 128])
    third = f.op(mm, second, view)  # second fresh, and w touched by second just before
    forward = f.done(third, a, flushed)
    bw = Builder()
    # AOTAutograd names a saved value after the forward node (or input) it is.
    saved_late, saved_early = bw.input(third.name, 128, 128), bw.input(x.name, 128, 128)
    again = bw.op(mm, saved_late, saved_early)  # forward's third was last; its x long before
    backward = bw.done(again)

    key = node_key(first)
    assert key is not None and {node_key(n) for n in (second, third, again)} == {key}
    device = replace(_device(overhead=1e-6), node_seconds={key: 1.0}, node_cold_seconds={key: 3.0},
                     cache_bytes=8 * kib)
    cold = cold_operands([("forward", forward), ("backward", backward)], device)
    assert cold == {("forward", first.name): 0.5, ("forward", second.name): 1.0, ("forward", third.name): 0.0,
                    ("backward", again.name): 0.5}
    assert node_cost(first, device, 0.5).seconds == pytest.approx(2.0 + 1e-6)  # halfway to cold
    assert node_cost(second, device, 1.0).seconds == pytest.approx(3.0 + 1e-6)
    assert node_cost(third, device).seconds == pytest.approx(1.0 + 1e-6)
    # The step charges each timed node so: 2 + 3 + 1 in forward, 2 in backward.
    time = predict_step({"forward": forward, "backward": backward}, Rates("r", device, Network.free()))
    assert time.compute_seconds == pytest.approx(8.0, abs=1e-3)
    # Without a cache (a profile, another OS), or without cold timings, every node is warm.
    assert cold_operands([("forward", forward)], replace(device, cache_bytes=None)) == {}
    assert cold_operands([("forward", forward)], replace(device, node_cold_seconds={})) == {}


def test_a_gathered_weight_is_warm_where_it_lands_and_a_saved_view_or_a_tangent_where_it_was_written() -> None:
    """A collective's result is touched where its wait lands it, not where it was issued; a
    backward placeholder named as a forward view is that view's base; a tangent was just
    written by the loss's backward."""
    from fxshard.ir.cost import cold_operands, node_key

    mm, relu, view = torch.ops.aten.mm.default, torch.ops.aten.relu.default, torch.ops.aten.view.default
    f = Builder()
    x, shard, big = f.input("x", 128, 128), f.input("shard", 128 * 64), f.input("big", 512, 512)
    gather = f.gather(shard, "a", "g0")  # issued here; 64 KiB gathered
    flushed = f.op(relu, big)  # 2 MiB of traffic while it flies
    weight = f.op(view, f.wait(gather), [128, 128])  # lands here
    a = f.op(relu, x)
    used = f.op(mm, a, weight)  # both warm: a just computed, the weight just landed
    saved = f.op(view, a, [128, 128])  # a view of a, saved for backward under its own name
    later = f.op(relu, x)  # 128 KiB of traffic after a was last touched
    forward = f.done(used, saved, flushed, later)
    bw = Builder()
    saved_view, tangent = bw.input(saved.name, 128, 128), bw.input("tangents_1", 128, 128)
    grad = bw.op(mm, tangent, saved_view)  # the tangent just written; a (through the view) long ago
    backward = bw.done(grad)

    key = node_key(used)
    assert key is not None and node_key(grad) == key
    device = replace(_device(), node_seconds={key: 1.0}, node_cold_seconds={key: 3.0}, cache_bytes=512 << 10)
    cold = cold_operands([("forward", forward), ("backward", backward)], device)
    assert cold[("forward", used.name)] == 0.0
    # a was last touched by `used`, 128 KiB of traffic before backward: in a 512 KiB cache
    # its view is warm; in a 64 KiB one it is cold, and the tangent still warm.
    assert cold[("backward", grad.name)] == 0.0
    small = cold_operands([("forward", forward), ("backward", backward)], replace(device, cache_bytes=64 << 10))
    assert small[("backward", grad.name)] == 0.5


def test_cold_timing_holds_at_most_the_eviction_and_two_copies_of_large_operands(monkeypatch: Any) -> None:
    """Small operands: one copy per cold call, all evicted by one read. Operands near the
    cache's size: as few copies as evict each other, called in turn."""
    from fxshard.driver.report import calibrate

    made: list[int] = []
    full = torch.full

    def counting(size: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        made.append(int(size[0]))
        return full(size, *args, **kwargs)

    monkeypatch.setattr(torch, "full", counting)
    evict = torch.ones(1 << 18)  # 1 MiB: the read for a 512 KiB cache
    # 2 x 16 KiB of operands: a copy per call; 2 x 256 KiB: ceil(1 MiB / 512 KiB) + 1 = 3 in turn.
    for n, copies in ((64, calibrate.COLD_CALLS + 1), (256, 3)):
        b = Builder()
        x = b.input("x", n, n)
        node = b.op(torch.ops.aten.mm.default, x, x)
        made.clear()
        timed = calibrate._time_node(node, torch.device("cpu"), evict)
        assert timed is not None and min(timed) > 0
        assert len(made) == 2 * copies  # two operands a copy


def test_the_cache_a_cold_operand_left_is_the_largest_data_cache_linux_describes(tmp_path: Any) -> None:
    from fxshard.driver.report.calibrate import last_level_cache

    for i, (kind, size) in enumerate([("Data", "32K"), ("Instruction", "64K"), ("Unified", "1024K"),
                                      ("Unified", "32768K")]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert last_level_cache(str(tmp_path)) == 32 << 20
    (tmp_path / "index3" / "size").write_text("2M\n")
    assert last_level_cache(str(tmp_path)) == 2 << 20
    assert last_level_cache(str(tmp_path / "none")) is None  # no description: no cache modelled


def test_calibration_times_each_distinct_matmul_once_and_keeps_it(tmp_path: Any, monkeypatch: Any) -> None:
    from fxshard.driver.report import calibrate

    monkeypatch.setenv("FXSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_NODES", {})
    b = Builder()
    x = b.input("x", 256, 256)
    mm = b.op(torch.ops.aten.mm.default, x, x)
    again = b.op(torch.ops.aten.mm.default, mm, x)  # the same shapes: one timing
    gm = b.done(again)
    cpu = torch.device("cpu")
    measured = Rates("r", replace(_device(), measured=True, cache_bytes=1 << 20), Network.free())
    timed = calibrate.with_node_times(measured, {"forward": gm}, cpu)
    assert list(timed.device.node_seconds) == [cost_key(mm)] and timed.device.node_seconds[cost_key(mm)] > 0
    # And cold, where the device knows its cache: operands of 256 KiB each, under twice 1 MiB.
    assert list(timed.device.node_cold_seconds) == [cost_key(mm)] and timed.device.node_cold_seconds[cost_key(mm)] > 0
    # Kept on disk: another process reads it and times nothing.
    monkeypatch.setattr(calibrate, "_NODES", {})
    monkeypatch.setattr(calibrate, "_time_node", lambda *a: pytest.fail("timed again"))
    again_timed = calibrate.with_node_times(measured, {"forward": gm}, cpu).device
    assert (again_timed.node_seconds, again_timed.node_cold_seconds) == \
        (timed.device.node_seconds, timed.device.node_cold_seconds)
    # A profile's figures are not this machine's, and a GPU's matmuls keep the curve.
    profile = Rates("p", _device(), Network.free())
    assert calibrate.with_node_times(profile, {"forward": gm}, cpu) is profile
    assert calibrate.with_node_times(measured, {"forward": gm}, torch.device("cuda")) is measured


def test_calibration_leaves_the_random_stream_as_it_found_it(tmp_path: Any, monkeypatch: Any) -> None:
    """Measured or found cached, the rates leave the user's next random numbers alike: a first
    run, which measures (at compile, at the first step, in report()), trains as a later one
    that reads the cache."""
    from fxshard.driver.report import calibrate

    monkeypatch.setenv("FXSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_NODES", {})
    monkeypatch.setattr(calibrate, "_DEVICES", {})
    monkeypatch.setattr(calibrate, "measure_fresh", lambda device: (None, 0.0))  # a second, and no draws
    b = Builder()
    x = b.input("x", 64, 64)
    gm = b.done(b.op(torch.ops.aten.mm.default, x, x))
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    rates = calibrate.local_rates(cpu)  # the device measured: random operands drawn
    timed = calibrate.with_node_times(replace(rates, device=replace(rates.device, cache_bytes=1 << 20)),
                                      {"forward": gm}, cpu)
    assert timed.device.node_seconds and timed.device.node_cold_seconds  # timed: random operands drawn
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("initialized", [True, False])
def test_calibration_forks_the_current_accelerators_generators_where_it_is_initialized(
        monkeypatch: Any, initialized: bool) -> None:
    """On an XPU (torch's current accelerator; CUDA's alike) calibration draws its operands
    from the device's generators too, so it forks every device's generator with the CPU's;
    on an accelerator not yet initialized it forks none (forking would initialize it).
    Stood in for on this CPU: the accelerator and its module, and fork_rng, recording."""
    import contextlib

    from fxshard.driver.report import calibrate

    forked: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def fork_rng(devices: Any = None, device_type: Any = None) -> Any:
        forked.append((list(devices), device_type))
        yield

    class Module:
        @staticmethod
        def is_initialized() -> bool:
            return initialized

        @staticmethod
        def device_count() -> int:
            return 2

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("xpu"))
    monkeypatch.setattr(torch, "get_device_module", lambda kind: Module if kind == "xpu" else None)
    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    assert calibrate.keeps_rng(lambda: 7)() == 7
    assert forked == [([0, 1] if initialized else [], "xpu")]


def cost_key(node: fx.Node) -> str:
    from fxshard.ir.cost import node_key

    key = node_key(node)
    assert key is not None
    return key


# -- the streams ------------------------------------------------------------------------------------

ALPHA, BETA = 1e-3, 1e6  # 1 ms per collective, 1 MB/s: a 2-rank gather of an S-byte shard takes 1 ms + S us


def _rates(fp32: float = GFLOP) -> Rates:
    link = Link(ALPHA, BETA)
    return Rates("test", _device(fp32=fp32), Network("test", {"all_gather": link, "reduce_scatter": link}))


def test_a_gather_in_flight_while_compute_uses_the_previous_one_against_a_hand_schedule() -> None:
    """gather A, wait A, gather B, compute with A, wait B, compute with B."""
    b = Builder()
    x = b.input("x", 100, 200)
    shard_a, shard_b = b.input("a", 200 * 300 // 2), b.input("b", 300 * 300 // 2)
    wait_a = b.wait(b.gather(shard_a, "a", "g0"))
    gather_b = b.gather(shard_b, "b", "g1")
    y = b.op(torch.ops.aten.mm.default, x, b.op(torch.ops.aten.view.default, wait_a, [200, 300]))
    wait_b = b.wait(gather_b)
    z = b.op(torch.ops.aten.mm.default, y, b.op(torch.ops.aten.view.default, wait_b, [300, 300]))
    y.meta["custom"] = {meta.MODULE_ANNOTATION: "a.proj"}  # computed inside unit a's module
    z.meta["custom"] = {meta.MODULE_ANNOTATION: "b"}
    gm = b.done(z)

    # By hand: A moves its 120 kB shard (the other rank's half), B 180 kB.
    a = ALPHA + 200 * 300 // 2 * 4 / BETA  # 0.121 s
    bb = ALPHA + 300 * 300 // 2 * 4 / BETA  # 0.181 s
    m1, m2 = 2 * 100 * 200 * 300 / GFLOP, 2 * 100 * 300 * 300 / GFLOP  # 0.012 s, 0.018 s
    dims = {"g0": ("shard", 0), "g1": ("shard", 1)}
    t = predict_step({"forward": gm}, _rates(), dimensions=dims, units=["a", "b"])
    assert t.seconds == pytest.approx(a + max(m1, bb) + m2)  # B outlasts the compute that hides it
    assert t.exposed_comm_seconds == pytest.approx(a + bb - m1)
    assert t.compute_seconds == pytest.approx(m1 + m2)
    assert t.seconds == pytest.approx(t.compute_seconds + t.exposed_comm_seconds)
    assert t.flops == 2 * 100 * 200 * 300 + 2 * 100 * 300 * 300  # the two matmuls
    assert t.peak_seconds == pytest.approx(m1 + m2)  # no overhead here: they run at the peak
    (span_a, span_b) = t.collectives
    assert (span_a.start, span_a.end, span_a.exposed) == pytest.approx((0.0, a, a))
    assert (span_b.issued, span_b.start, span_b.end) == pytest.approx((a, a, a + bb))
    assert span_b.waited == pytest.approx(a + m1) and span_b.exposed == pytest.approx(bb - m1)
    units = {u.name: u for u in t.units}
    assert units["a"].compute_seconds == pytest.approx(m1) and units["b"].compute_seconds == pytest.approx(m2)
    assert units["a"].comm_seconds == pytest.approx(a) and units["b"].exposed_comm_seconds == pytest.approx(bb - m1)

    # Faster links: B is hidden entirely behind the first matmul.
    slow = predict_step({"forward": gm}, _rates(fp32=GFLOP / 100), dimensions=dims, units=["a", "b"])
    assert slow.exposed_comm_seconds == pytest.approx(a)
    assert slow.seconds == pytest.approx(a + 100 * (m1 + m2))


def test_a_collective_the_graph_never_waits_for_still_ends_it_and_is_exposed() -> None:
    """gather A, a 2 ms matmul, and no wait (a verified graph always waits; the simulation
    holds its sum anyway): the graph ends when the gather has, 21 ms, of which 19 exposed."""
    b = Builder()
    x = b.input("x", 100, 100)
    b.gather(b.input("a", 5000), "a", "g0")
    gm = b.done(b.op(torch.ops.aten.mm.default, x, x))
    t = predict_step({"forward": gm}, _rates(), dimensions={"g0": ("shard", 0)})
    flight, m = ALPHA + 5000 * 4 / BETA, 2 * 100 ** 3 / GFLOP
    assert t.seconds == pytest.approx(flight)
    assert (t.compute_seconds, t.exposed_comm_seconds) == pytest.approx((m, flight - m))


def _two_in_flight(group_b: str) -> fx.GraphModule:
    """gather A, gather B (both issued first), wait A, compute, wait B, compute."""
    b = Builder()
    x = b.input("x", 100, 100)
    gather_a = b.gather(b.input("a", 5000), "a", "g0")
    gather_b = b.gather(b.input("b", 5000), "b", group_b)
    y = b.op(torch.ops.aten.mm.default, x, b.op(torch.ops.aten.view.default, b.wait(gather_a), [100, 100]))
    z = b.op(torch.ops.aten.mm.default, y, b.op(torch.ops.aten.view.default, b.wait(gather_b), [100, 100]))
    return b.done(z)


@pytest.mark.parametrize("group_b, dimension, ends", [
    # Another process group on the same wires: both in flight at once, each at half the bandwidth.
    ("g1", "shard", lambda w: (ALPHA + 2 * w, ALPHA + 2 * w)),
    # The same process group: one after the other (a group runs its collectives in issue order).
    ("g0", "shard", lambda w: (ALPHA + w, 2 * (ALPHA + w))),
    # Another dimension's wires (HSDP's replicas): each at full bandwidth.
    ("g1", "replicate", lambda w: (ALPHA + w, ALPHA + w)),
])
def test_collectives_in_flight_together_share_their_wires_or_queue_on_their_group(
        group_b: str, dimension: str, ends: Any) -> None:
    w = 5000 * 4 / BETA  # each moves its 20 kB shard: 0.02 s at full bandwidth
    end_a, end_b = ends(w)
    m = 2 * 100 ** 3 / GFLOP
    t = predict_step({"forward": _two_in_flight(group_b)}, _rates(),
                     dimensions={"g0": ("shard", 0), group_b: (dimension, 1)}, units=["a", "b"])
    span_a, span_b = t.collectives
    assert (span_a.end, span_b.end) == pytest.approx((end_a, end_b))
    # By hand: compute waits for A, multiplies, waits for whatever is left of B, multiplies.
    after_b = max(end_a + m, end_b)
    assert t.seconds == pytest.approx(after_b + m)
    assert t.exposed_comm_seconds == pytest.approx(end_a + max(0.0, end_b - end_a - m))


@pytest.mark.parametrize("sharing", [0.0, 0.5, 1.0])
def test_latencies_in_flight_together_pass_one_after_the_other_as_far_as_they_share(sharing: float) -> None:
    """gather A on g0 and B on g1, issued together: their 1 ms latencies pass at
    1/(1 + sharing) of their pace while both wait, so both reach their data at
    (1 + sharing) ms; then each moves its 20 kB at half the wire's bandwidth."""
    w = 5000 * 4 / BETA
    rates = replace(_rates(), latency_sharing=sharing)
    t = predict_step({"forward": _two_in_flight("g1")}, rates,
                     dimensions={"g0": ("shard", 0), "g1": ("shard", 1)}, units=["a", "b"])
    assert [c.end for c in t.collectives] == pytest.approx([(1 + sharing) * ALPHA + 2 * w] * 2)


def test_the_timeline_picture_places_each_collective_at_its_predicted_milliseconds(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from fxshard.driver.report.timeline import _spans

    gm = _two_in_flight("g0")
    t = predict_step({"forward": gm}, _rates(), dimensions={"g0": ("shard", 0)}, units=["a", "b"])
    comms, windows, compute = _spans(gm, 0, t, "forward")
    assert [x for c in comms for x in (c[2], c[3])] == \
        pytest.approx([x for s in t.collectives for x in (s.start * 1e3, s.end * 1e3)])
    # Each unit's window opens at its wait, where the compute stream got past it.
    assert [w[1] for w in windows] == pytest.approx([s.waited * 1e3 + s.exposed * 1e3 for s in t.collectives])
    assert compute == sorted(compute) and compute[-1] < t.seconds * 1e3
    by_order = _spans(gm, 0)  # without a time: node order
    assert [c[2] for c in by_order[0]] == [2.0, 4.0]


def test_a_step_of_hours_is_simulated_as_exactly_as_one_of_milliseconds() -> None:
    """Times add up in floating point: a slow link (1 B/s: the 20 kB gathers take hours) must
    still end each collective once, where the hand schedule says."""
    link = Link(ALPHA, 1.0)
    rates = Rates("slow", _device(), Network("slow", {"all_gather": link}))
    t = predict_step({"forward": _two_in_flight("g1")}, rates,
                     dimensions={"g0": ("shard", 0), "g1": ("shard", 1)})
    w = 5000 * 4 / 1.0
    assert [c.end for c in t.collectives] == pytest.approx([ALPHA + 2 * w] * 2)
    assert t.seconds == pytest.approx(ALPHA + 2 * w + 2 * 2 * 100 ** 3 / GFLOP)


def _gather_beside_a_matmul(ranks: int = 2) -> fx.GraphModule:
    """gather A (a 40 kB buffer in ``ranks`` shards on g0), a 100x100 matmul that does not
    need it, wait A."""
    b = Builder()
    x = b.input("x", 100, 100)
    gather = b.gather(b.input("a", 10000 // ranks), "a", "g0", ranks)
    y = b.op(torch.ops.aten.mm.default, x, x)
    b.op(torch.ops.aten.add.Tensor, y, b.op(torch.ops.aten.view.default, b.wait(gather), [100, 100]))
    return b.done(y)


@pytest.mark.parametrize("fp32", [GFLOP, GFLOP / 100])
def test_a_collective_that_takes_its_time_from_compute_slows_what_overlaps_it(fp32: float) -> None:
    """contention=1 (gloo on the compute's cores): compute runs at half speed while the
    gather is in flight. gather A, a matmul that does not need it, wait A."""
    gm = _gather_beside_a_matmul()
    link = Link(ALPHA, BETA)
    rates = Rates("contended", _device(fp32=fp32), Network("test", {"all_gather": link}), contention=1.0)
    a, m = ALPHA + 5000 * 4 / BETA, 2 * 100 ** 3 / fp32  # 21 ms of gather; 2 ms or 200 ms of matmul
    t = predict_step({"forward": gm}, rates, dimensions={"g0": ("shard", 0)})
    if 2 * m <= a:  # all of the matmul at half speed, then the rest of the gather waited
        assert (t.seconds, t.compute_seconds) == pytest.approx((a, 2 * m))
    else:  # half speed for the gather's time, then full speed
        assert (t.seconds, t.compute_seconds) == pytest.approx((a / 2 + m, a / 2 + m))
    assert t.seconds == pytest.approx(t.compute_seconds + t.exposed_comm_seconds)
    free = predict_step({"forward": gm}, Rates("free overlap", rates.device, rates.network),
                        dimensions={"g0": ("shard", 0)})
    assert free.seconds == pytest.approx(max(a, m)) and free.compute_seconds == pytest.approx(m)


@pytest.mark.parametrize("contention", [0.5, 1.0])
def test_each_collective_in_flight_takes_its_share_from_compute(contention: float) -> None:
    """gather A and gather B in flight at once (another dimension's wires: each at full
    speed, 21 ms), a 200 ms matmul that needs neither, wait A, wait B. On the CPU each is a
    gloo thread wanting a core: compute runs at 1 / (1 + 2 c) while both fly."""
    b = Builder()
    x = b.input("x", 100, 100)
    gather_a, gather_b = b.gather(b.input("a", 5000), "a", "g0"), b.gather(b.input("b", 5000), "b", "g1")
    y = b.op(torch.ops.aten.mm.default, x, x)
    for gather in (gather_a, gather_b):
        b.op(torch.ops.aten.add.Tensor, y, b.op(torch.ops.aten.view.default, b.wait(gather), [100, 100]))
    gm = b.done(y)
    fp32 = GFLOP / 100
    a, m = ALPHA + 5000 * 4 / BETA, 2 * 100 ** 3 / fp32
    rates = Rates("contended", _device(fp32=fp32), Network("test", {"all_gather": Link(ALPHA, BETA)}),
                  contention=contention)
    t = predict_step({"forward": gm}, rates, dimensions={"g0": ("shard", 0), "g1": ("replicate", 0)})
    # Both fly for a: compute gets a / (1 + 2c) done meanwhile, then the rest at full speed.
    assert t.compute_seconds == pytest.approx(a + m - a / (1 + 2 * contention))
    assert t.exposed_comm_seconds == pytest.approx(0.0)


@pytest.mark.parametrize("fp32", [GFLOP, GFLOP / 100])
def test_a_collective_whose_call_copies_its_input_holds_compute_that_long_then_flies(fp32: float) -> None:
    """gather A (its call holds the thread for a quarter of its bytes' time, as gloo's
    reduce_scatter copies its input), a matmul that does not need it, wait A. The collective
    alone takes as long as before; the matmul starts only when the call returns."""
    gm = _gather_beside_a_matmul()
    bus = 5000 * 4
    held, flight = 2e-4 + bus / (4 * BETA), ALPHA - 2e-4 + 3 * bus / (4 * BETA)
    link = Link(ALPHA - 2e-4, 4 * BETA / 3, issue_latency=2e-4, issue_bandwidth=4 * BETA)
    assert link.seconds(bus, 2) == pytest.approx(Link(ALPHA, BETA).seconds(bus, 2))  # alone: the same
    rates = Rates("issue", _device(fp32=fp32), Network("test", {"all_gather": link}))
    m = 2 * 100 ** 3 / fp32  # 2 ms or 200 ms of matmul
    t = predict_step({"forward": gm}, rates, dimensions={"g0": ("shard", 0)})
    assert t.compute_seconds == pytest.approx(held + m)  # the call's copy is compute's time
    assert t.seconds == pytest.approx(held + max(flight, m))
    (span,) = t.collectives
    assert (span.issued, span.start, span.end) == pytest.approx((held, held, held + flight))
    before = predict_step({"forward": gm}, Rates("no issue", rates.device, Network("test", {"all_gather": Link(
        ALPHA, BETA)})), dimensions={"g0": ("shard", 0)})
    assert before.seconds == pytest.approx(max(ALPHA + bus / BETA, m))  # the call free: all of it overlaps


def test_a_collective_over_one_rank_costs_its_call_and_its_copy() -> None:
    """A job of one process with a process group still calls its collectives: each is timed on
    that group (``Network.one_rank``) over its input's bytes, the call on the compute thread and
    the copy in flight beside the matmul. Without such a measurement (no group, the profiles)
    it costs nothing, and over two ranks the network's links decide as before."""
    gm = _gather_beside_a_matmul(ranks=1)
    bus = 10000 * 4  # the whole 40 kB input, copied
    one = Link(30e-6, 1e9, issue_latency=20e-6, issue_bandwidth=4e9)
    held, flight = 20e-6 + bus / 4e9, 30e-6 + bus / 1e9
    device = _device(fp32=100 * GFLOP)
    m = 2 * 100 ** 3 / (100 * GFLOP)  # 20 us of matmul, shorter than the flight
    rates = Rates("one rank", device, replace(Network.free("gloo over one rank"), one_rank={"all_gather": one}))
    t = predict_step({"forward": gm}, rates, dimensions={"g0": ("shard", 0)})
    assert t.compute_seconds == pytest.approx(held + m)
    assert t.seconds == pytest.approx(held + max(flight, m))
    (span,) = t.collectives
    assert (span.issued, span.start, span.end) == pytest.approx((held, held, held + flight))
    assert rates.network.seconds("all_gather", bus, 1) == pytest.approx(held + flight)
    assert "over a group of one rank" in str(rates) and "input bytes" in str(rates)
    assert "bus bytes" not in str(rates)  # no table for the free links between ranks there are not
    assert "network no group: collectives cost nothing" in str(Rates("none", device, Network.free("no group")))
    free = predict_step({"forward": gm}, Rates("no group", device, Network.free()), dimensions={"g0": ("shard", 0)})
    assert free.seconds == pytest.approx(m) and free.collectives[0].seconds == 0.0
    # A network of two ranks' links leaves a collective over one rank free, on any dimension;
    # measured one-rank links stand in for the kinds they leave out as the others do.
    two = Rates("two", device, Network("two ranks", {"all_gather": Link(1.0, 1.0)},
                                       between_nodes={"all_gather": Link(2.0, 2.0)}, ranks_per_node=8))
    assert predict_step({"forward": gm}, two, dimensions={"g0": ("shard", 0)}).seconds == pytest.approx(m)
    assert two.network.seconds("all_reduce", bus, 1, "replicate") == 0.0
    measured = replace(two.network, one_rank={"all_gather": one})
    assert measured.seconds("all_reduce", bus, 1, "replicate") == pytest.approx(held + flight)
    assert rates.network.seconds("broadcast", bus, 1) == pytest.approx(held + flight)


def _one_rank_worker(rank: int, world_size: int, cache: str) -> dict[str, Any]:
    import fxshard
    from fxshard.policies import by_class

    from models import MLP

    os.environ["FXSHARD_CACHE_DIR"] = cache
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(d_in=32, hidden=64, depth=3, d_out=8), policy=by_class(nn.Linear))
    sharded(torch.randn(8, 32)).square().mean().backward()
    report = sharded.report()
    assert report.time is not None
    return dict(rates=str(sharded._driver.rates), one_rank=dict(sharded._driver.rates.network.one_rank),
                spans=[c.seconds for c in report.time.collectives])


@pytest.mark.release  # functional collectives over a gloo group of one rank, and their timing
def test_a_one_rank_job_with_a_process_group_times_its_collectives_on_it(tmp_path: Any) -> None:
    """torchrun with one process: fxshard.compile over a gloo group of one rank emits the
    collectives (a copy each); report() times their calls on that group when it first asks,
    and predicts each collective no shorter than its call and copy."""
    (out,) = run_ranks(_one_rank_worker, 1, str(tmp_path))
    assert "over one rank, measured" in out["rates"]
    assert set(out["one_rank"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    for link in out["one_rank"].values():
        assert link.latency + link.issue_latency > 0
    assert out["spans"] and all(seconds > 0 for seconds in out["spans"])


def test_fxshard_calibrate_under_torchrun_with_one_process_measures_its_group(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``torchrun --nproc-per-node 1 -m fxshard.cli calibrate``: WORLD_SIZE is 1, and the
    command still makes the group and prints the collectives' links over that one rank,
    as the Driver times them (it printed the device's rates alone)."""
    import socket

    import torch.distributed as dist

    from fxshard.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                            WORLD_SIZE="1", FXSHARD_CACHE_DIR=str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "gloo over one rank, measured" in out
    table = out[out.index("over a group of one rank"):]
    assert all(kind in table for kind in ("all_gather", "reduce_scatter", "all_reduce"))
    assert not dist.is_initialized()
    # WORLD_SIZE=1 alone (a shell's, not torchrun's): this machine's rates, no group to make.
    monkeypatch.delenv("MASTER_ADDR")
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "one rank" not in out and "run under torchrun to measure the network too" in out


def test_the_agreement_before_each_graph_is_waited_for() -> None:
    gm = _two_in_flight("g1")
    dims = {"g0": ("shard", 0), "g1": ("shard", 1)}
    alone = predict_step({"forward": gm}, _rates(), dimensions=dims)
    agreed = predict_step({"forward": gm, "backward": gm}, _rates(), dimensions=dims, agreement=(8, 2))
    once = ALPHA + 8 / BETA  # an 8-byte all_gather over 2 ranks
    assert agreed.agreement_seconds == pytest.approx(2 * once)
    assert agreed.seconds == pytest.approx(2 * (alone.seconds + once))
    assert agreed.exposed_comm_seconds == pytest.approx(2 * (alone.exposed_comm_seconds + once))
    assert [g for g, _, _ in agreed.graphs] == ["forward", "backward"]
    assert agreed.graphs[1][1] == pytest.approx(agreed.graphs[0][2])  # backward starts where forward ends



@pytest.mark.parametrize("starvation", [0.0, 1.0, 3.0])
def test_a_collective_whose_latency_waits_for_compute_starts_moving_data_late(starvation: float) -> None:
    """gather A, a 1 ms matmul that does not need it, wait A. With starvation s, A's 1 ms
    latency passes at 1/(1+s) of its pace during the matmul: 1/(1+s) ms of it, the rest after;
    then its 20 ms of data. Compute itself is not slowed (contention 0)."""
    gm = _gather_beside_a_matmul()
    fp32 = 2 * 100 ** 3 / 1e-3  # the matmul: 1 ms
    rates = Rates("starved", _device(fp32=fp32), Network("test", {"all_gather": Link(ALPHA, BETA)}),
                  starvation=starvation)
    t = predict_step({"forward": gm}, rates, dimensions={"g0": ("shard", 0)})
    data = 5000 * 4 / BETA
    latency_left = ALPHA - 1e-3 / (1 + starvation)
    assert t.collectives[0].end == pytest.approx(1e-3 + latency_left + data)
    assert t.compute_seconds == pytest.approx(1e-3)
    assert t.seconds == pytest.approx(1e-3 + latency_left + data)


def test_fresh_pages_follow_the_heap_watermark() -> None:
    """glibc's heap: the live bytes rising above what is mapped are faulted in; the top is
    returned once more than twice the mmap threshold (the largest tensor's size) lies free."""
    mib = 1 << 20
    device = DeviceRates("cpu", {"float32": GFLOP}, 1e9, 0.0, fresh_bytes=32 * mib, fresh_bandwidth=1e9)
    forward = [10 * mib, 11 * mib, 13 * mib, 13 * mib]
    backward = [12 * mib, 10 * mib, 19 * mib // 2]
    # Largest tensor 1 MiB: the trim threshold is 2 MiB. Backward's fall from 13 to 10 MiB (3 MiB
    # free at the top) trims the heap to 10 MiB; the next step's forward faults 1 + 2 MiB again.
    assert fresh_pages([forward, backward], mib, device) == [[0, mib, 2 * mib, 0], [0, 0, 0]]
    # Largest tensor 4 MiB: 8 MiB may lie free, the heap keeps its 13 MiB, nothing is faulted.
    assert fresh_pages([forward, backward], 4 * mib, device) == [[0, 0, 0, 0], [0, 0, 0]]
    # A tensor above the allocator's largest threshold (32 MiB) caps it: 64 MiB may lie free.
    assert fresh_pages([[0, 80 * mib], [0]], 100 * mib, device) == [[0, 80 * mib], [0]]
    assert fresh_pages([[0, 50 * mib], [0]], 100 * mib, device) == [[0, 0], [0]]
    # No fresh pages (a caching allocator, a profile): nothing is charged.
    plain = replace(device, fresh_bytes=None)
    assert fresh_pages([forward, backward], mib, plain) == [[0] * 4, [0] * 3]
    # A process whose threshold was raised before (calibration's probe mapped and freed 2 MiB):
    # 4 MiB may lie free, the heap keeps its 13 MiB; a threshold below the largest tensor's
    # changes nothing, and one above the allocator's largest is capped there.
    assert fresh_pages([forward, backward], mib, device, threshold=2 * mib) == [[0] * 4, [0] * 3]
    assert fresh_pages([forward, backward], mib, device, threshold=mib // 2) == [[0, mib, 2 * mib, 0], [0, 0, 0]]
    assert fresh_pages([[0, 80 * mib], [0]], mib, device, threshold=100 * mib) == [[0, 80 * mib], [0]]


def test_a_fresh_page_probe_that_finds_nothing_slow_here_probes_again_in_a_new_process(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A heap with free memory serves every size the probe asks for, and the probe in this
    process reads "no fresh pages" (stood in for: no boundary found here). Calibration then
    probes in a new process, whose heap holds nothing to serve them, and takes what it finds:
    here glibc's boundary (about its largest mmap threshold, 32 MiB) and a finite cost per
    byte (a host whose fresh fills are not slow, as with transparent huge pages always on,
    may find none there too, and charges none). Where the new process cannot run, it warns
    and charges none, as before."""
    import subprocess

    from fxshard.driver.report import calibrate

    if calibrate._glibc() is None:
        pytest.skip("the C library is not glibc 2.33 or later")
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(calibrate, "fresh_boundary", lambda slow, sizes: None)
    run = subprocess.run
    printed: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        done = run(*args, **kwargs)
        printed.append(done.stdout)
        return done

    monkeypatch.setattr(subprocess, "run", recording)
    low, bandwidth = calibrate.measure_fresh(torch.device("cpu"))
    assert len(printed) == 1  # the probe ran again, in a new process
    assert printed[0].split() == [str(low), str(bandwidth)]  # and its finding is taken
    if low is not None:
        assert 1 << 20 < low <= calibrate.FRESH_LARGEST
        assert 0 < bandwidth < math.inf

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired("python", 300)

    monkeypatch.setattr(subprocess, "run", fails)
    with caplog.at_level("WARNING", logger=calibrate.log.name):
        assert calibrate.measure_fresh(torch.device("cpu")) == (None, math.inf)
    assert "could not run in a new one" in caplog.text


def test_calibration_knows_the_mmap_threshold_its_probe_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc raises its mmap threshold to the size of a mapped allocation it frees and never
    lowers it. In a fresh process (threshold 128 KiB), the fresh-page probe's 16 MiB allocation
    is mapped; once it is freed, calibration reports the threshold at its size, and glibc serves
    the next 16 MiB from its heap: no chunk is mapped. A threshold fixed in the environment is
    read as it is (glibc then raises nothing); any other of glibc's malloc settings turns the
    raising off with the threshold at a default the model does not read: unknown."""
    from fxshard.driver.report import calibrate

    if calibrate._glibc() is None:
        pytest.skip("the C library is not glibc 2.33 or later")
    script = (
        "from fxshard.driver.report import calibrate as c\n"
        "assert c.mmap_threshold() is None\n"
        "t = c._allocate(4 << 20); t.fill_(1.0); del t\n"
        "threshold = c.mmap_threshold()\n"
        "before = c._glibc().mallinfo2().hblks\n"
        "t = c._allocate(4 << 20)\n"
        "print(threshold, c._glibc().mallinfo2().hblks - before)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    threshold, mapped = (int(v) for v in out.stdout.split())
    assert threshold == (16 << 20) + 4096  # the chunk: 16 MiB, glibc's header, torch's alignment
    assert mapped == 0
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(calibrate, "_mapped_and_freed", 9 << 20)
    assert calibrate.mmap_threshold() == 9 << 20
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "67108864")
    assert calibrate.mmap_threshold() is None
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576")
    assert calibrate.mmap_threshold() == 1 << 20
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert calibrate.mmap_threshold() == 4 << 20


def test_a_step_pays_for_the_pages_it_faults_in() -> None:
    """x @ x, then + x, as forward and again as backward; the live bytes given rise by 4 MB at
    each of forward's nodes and fall to 0 in backward (more than twice the threshold, 128 KiB
    for tensors of 40 kB): each step faults 8 MB in again, at 1 GB/s 8 ms, on forward's nodes."""
    b = Builder()
    x = b.input("x", 100, 100)
    y = b.op(torch.ops.aten.mm.default, x, x)
    gm = b.done(b.op(torch.ops.aten.add.Tensor, y, x))
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "call_function", "output"]
    mm = 2 * 100 ** 3 / GFLOP  # 2 ms
    device = DeviceRates("cpu", {"float32": GFLOP}, 1e18, 0.0, fresh_bytes=32 << 20, fresh_bandwidth=1e9)
    memory = {"forward": (0, 4_000_000, 8_000_000, 8_000_000), "backward": (8_000_000, 0, 0, 0)}
    t = predict_step({"forward": gm, "backward": gm}, Rates("r", device, Network.free()), memory=memory)
    assert t.seconds == pytest.approx(2 * mm + 8e-3)
    spans = {(s.graph, s.node): s.end - s.start for s in t.nodes}
    mm_node, add_node = (n.name for n in gm.graph.nodes if n.op == "call_function")
    assert spans[("forward", mm_node)] == pytest.approx(mm + 4e-3)
    assert spans[("forward", add_node)] == pytest.approx(4e-3)
    assert (t.fresh_bytes, t.mmap_threshold) == (8_000_000, 128 << 10)
    # A process whose threshold calibration left at 16 MiB: 32 MiB may lie free at the top,
    # backward's 8 MB fall keeps the pages, and the next step faults in none.
    known = predict_step({"forward": gm, "backward": gm},
                         Rates("r", device, Network.free(), mmap_threshold=16 << 20), memory=memory)
    assert known.seconds == pytest.approx(2 * mm)
    assert (known.fresh_bytes, known.mmap_threshold) == (0, 16 << 20)
    assert spans[("backward", mm_node)] == pytest.approx(mm)
    unfaulted = predict_step({"forward": gm, "backward": gm}, Rates("r", replace(device, fresh_bytes=None),
                                                                   Network.free()), memory=memory)
    assert unfaulted.seconds == pytest.approx(2 * mm)


def test_fresh_boundary_finds_where_every_larger_allocation_is_slow() -> None:
    from fxshard.driver.report.calibrate import fresh_boundary

    mib = 1 << 20
    sizes = [mib << k for k in range(7)]  # 1 to 64 MiB
    probed: list[int] = []

    def slow(nbytes: int) -> bool:
        probed.append(nbytes)
        return nbytes > 30 * mib or nbytes == 2 * mib  # 2 MiB: a noisy probe, fast above it

    low = fresh_boundary(slow, sizes)
    assert low is not None and 28 * mib <= low <= 30 * mib  # 1/8 of the octave (16, 32] MiB
    assert all(n % 4096 == 0 for n in probed)
    assert fresh_boundary(lambda n: False, sizes) is None
    assert fresh_boundary(lambda n: True, sizes) == 0  # every size slow: from the first byte


def test_a_fresh_fill_is_slow_at_the_ratios_measured_where_pages_were_faulted_in() -> None:
    """Fresh fill over kept fill, measured on the project's 2-core host in 16 processes: 0.7-1.7
    from the heap, 3.4-4.2 at 64 MiB (mmapped; the kept tensor outgrows the caches), 4.1-9.1 at
    32 MiB."""
    from fxshard.driver.report.calibrate import fresh_is_slow

    for ratio in (0.7, 1.0, 1.3, 1.7):
        assert not fresh_is_slow(ratio * 1e-3, 1e-3), ratio
    for ratio in (3.4, 3.7, 4.1, 9.1):
        assert fresh_is_slow(ratio * 1e-3, 1e-3), ratio


def test_an_asynchronous_device_runs_behind_the_host_that_launches_its_kernels() -> None:
    """CUDA's model: the host pays each node's launch, the device its kernel, in order."""
    b = Builder()
    x = b.input("x", 100, 100)
    y = x
    for _ in range(3):
        y = b.op(torch.ops.aten.mm.default, y, x)  # 2 MFLOP each
    gm = b.done(y)
    launch = 1e-4
    kernel = 2 * 100 ** 3 / GFLOP  # 2 ms each

    def rates(asynchronous: bool, fp32: float = GFLOP) -> Rates:
        device = DeviceRates("d", {"float32": fp32}, 1e18, launch, asynchronous=asynchronous)
        return Rates("r", device, Network.free())

    # Kernels longer than launches: the device runs back to back after the first launch.
    assert predict_step({"forward": gm}, rates(True)).seconds == pytest.approx(launch + 3 * kernel)
    assert predict_step({"forward": gm}, rates(False)).seconds == pytest.approx(3 * (launch + kernel))
    # Launches longer than kernels: the host decides; the device idles between them.
    fast = rates(True, fp32=1000 * GFLOP)
    t = predict_step({"forward": gm}, fast)
    assert t.seconds == pytest.approx(3 * launch + kernel / 1000)
    assert t.seconds == pytest.approx(t.compute_seconds + t.exposed_comm_seconds)
    # The agreement: the model has the host wait for the device there, so what it ran ahead is
    # lost (on a device's backend the runtime no longer waits in steady state; docs/time.md).
    agreement = Rates("r", rates(True).device, Network("n", {"all_gather": Link(1e-3, math.inf)}))
    agreed = predict_step({"forward": gm, "backward": gm}, agreement, agreement=(8, 2))
    assert agreed.seconds == pytest.approx(2 * (1e-3 + launch + 3 * kernel))


def test_on_an_asynchronous_device_a_collectives_call_holds_the_host_not_the_device() -> None:
    """A 20 ms matmul, gather A (its call holds the host 10 ms: NCCL's enqueue, as calibration
    measures it), a second matmul, wait A. The host is back long before the first kernel ends,
    so the call is hidden; the device runs the two kernels back to back and the gather flies
    from where the device stream reached it (after the first kernel), 21 ms."""
    b = Builder()
    x = b.input("x", 100, 100)
    y = b.op(torch.ops.aten.mm.default, x, x)
    gather = b.gather(b.input("a", 5000), "a", "g0")
    z = b.op(torch.ops.aten.mm.default, y, x)
    gm = b.done(z, b.wait(gather))
    launch, held, m = 1e-4, 1e-2, 2e-2
    device = DeviceRates("d", {"float32": 2 * 100 ** 3 / m}, 1e18, launch, asynchronous=True)
    link = Link(ALPHA, BETA, issue_latency=held, issue_bandwidth=math.inf)
    t = predict_step({"forward": gm}, Rates("r", device, Network("n", {"all_gather": link})),
                     dimensions={"g0": ("shard", 0)})
    flight = ALPHA + 5000 * 4 / BETA  # 21 ms
    (span,) = t.collectives
    assert span.issued == pytest.approx(launch + m)
    assert t.seconds == pytest.approx(launch + m + flight)  # the device never ran the call's 10 ms


# -- a real step --------------------------------------------------------------------------------------

LINK = Link(2e-4, 2e8)  # injected: what the ranks "measure"


def _report_worker(rank: int, world_size: int, cache: str) -> dict[str, Any]:
    import os

    import fxshard
    from fxshard.driver.report import calibrate
    from fxshard.driver.report.trace_events import chrome_trace
    from fxshard.ir.collectives import step_collectives
    from fxshard.policies import by_class

    from models import MLP

    os.environ["FXSHARD_CACHE_DIR"] = os.path.join(cache, f"rank{rank}")  # as if on two hosts
    # As if each rank's fresh-page probe had left glibc's mmap threshold elsewhere: 16 and 8 MiB.
    calibrate._mapped_and_freed = (16 << 20) >> rank
    measured: list[str] = []

    def device(d: torch.device) -> DeviceRates:  # rank 1 is the slower: every rank must use its rates
        measured.append("device")
        return _device(fp32=GFLOP / (1 + rank), bandwidth=1e9, overhead=1e-5, view=1e-6)

    def network(group: Any) -> Network:
        measured.append("network")
        link = Link(LINK.latency * (1 + rank), LINK.bandwidth / (1 + rank))
        return Network("injected", {k: link for k in calibrate.KINDS})

    def contention(group: Any) -> float:
        measured.append("contention")
        return 0.25 * (1 + rank)

    def starvation(group: Any, link: Link) -> float:
        measured.append("starvation")
        return 1.5 * (1 + rank)

    calibrate.measure_device, calibrate.measure_network = device, network  # type: ignore[assignment]
    calibrate.measure_contention = contention  # type: ignore[assignment]
    calibrate.measure_starvation = starvation  # type: ignore[assignment]

    def sharing(world: Any) -> tuple[float, float]:
        measured.append("sharing")
        return 0.5 * rank, 0.25 * rank

    calibrate.measure_latency_sharing = sharing  # type: ignore[assignment]
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(d_in=32, hidden=64, depth=3, d_out=8), policy=by_class(nn.Linear),
                              optimizer=torch.optim.AdamW)
    sharded(torch.randn(8, 32)).square().mean().backward()
    first = list(measured)
    driver = sharded._driver
    again = calibrate.calibrate(driver.world, torch.device("cpu"))  # what the next driver does: no measuring
    assert again == driver.rates
    report = sharded.report()
    return dict(report=report, measured=first, again=measured[len(first):], text=str(report),
                contention=driver.rates.contention, starvation=driver.rates.starvation,
                sharing=(driver.rates.latency_sharing, driver.rates.latency_sharing_mixed),
                mmap_threshold=driver.rates.mmap_threshold,
                collectives=len(step_collectives(sharded.graphs)),
                trace=chrome_trace(sharded.graphs, report))


def test_a_report_on_two_gloo_ranks_predicts_the_step_and_its_parts(tmp_path: Any) -> None:
    ranks = run_ranks(_report_worker, 2, str(tmp_path))
    for out in ranks:
        # Measured once (injected here), then from the process's memo: one all_reduce per driver.
        assert out["measured"] == ["device", "network", "contention", "starvation", "sharing"]
        assert out["again"] == []
        # rank 1's, the larger; and rank 1's mmap threshold, the smaller (a step faults more under it)
        assert (out["contention"], out["starvation"], out["sharing"]) == (0.5, 3.0, (0.5, 0.25))
        assert out["mmap_threshold"] == 8 << 20
    r0, r1 = ranks[0]["report"], ranks[1]["report"]
    t = r0.time
    assert t is not None and r0.predicted_step_seconds > 0 and r0.exposed_comm_seconds > 0
    # Every rank predicts with the slowest rank's rates (rank 1's), so both predict the same.
    assert r0.predicted_step_seconds == r1.predicted_step_seconds
    assert t.rates == r1.time.rates and "slowest" in t.rates
    # The parts add up: the compute stream computes or waits; the units split both.
    assert r0.predicted_step_seconds == pytest.approx(
        r0.predicted_compute_seconds + r0.exposed_comm_seconds + r0.predicted_optimizer_seconds)
    assert r0.predicted_optimizer_seconds > 0  # optimizer=AdamW
    assert r0.mfu == pytest.approx(t.peak_seconds / r0.predicted_step_seconds) and 0 < r0.mfu < 1
    by_unit = {u.name: u for u in t.units}
    assert sum(u.compute_seconds for u in t.units) == pytest.approx(t.compute_seconds)
    assert sum(u.exposed_comm_seconds for u in t.units) == pytest.approx(t.exposed_comm_seconds)
    for u in r0.units:
        assert u.compute_seconds == by_unit[u.name].compute_seconds > 0
        assert u.comm_seconds == by_unit[u.name].comm_seconds > 0
    assert sum(u.comm_seconds for u in r0.units) == pytest.approx(t.comm_seconds)
    # Every collective, each no shorter than it takes alone on rank 1's link (sharing the wires
    # only lengthens it), between its issue and the step's end.
    assert len(t.collectives) == ranks[0]["collectives"] > 0
    slow = Network("rank 1", {"all_gather": Link(LINK.latency * 2, LINK.bandwidth / 2)})
    for c in t.collectives:
        assert c.issued <= c.start <= c.end <= t.seconds
        assert c.seconds >= slow.seconds(c.kind, c.bytes, 2) * (1 - 1e-9)
    assert "predicted step" in ranks[0]["text"] and "compute ms" in ranks[0]["text"]
    # The Chrome trace is drawn in the predicted microseconds.
    trace = ranks[0]["trace"]
    assert trace["otherData"]["time_axis"].startswith("predicted microseconds")
    graphs = [e for e in trace["traceEvents"] if e.get("cat") == "graph"]
    assert sum(e["dur"] for e in graphs) == pytest.approx(t.seconds * 1e6)
    drawn = sorted(e["ts"] for e in trace["traceEvents"] if e.get("cat", "").startswith("collective"))
    assert drawn == pytest.approx(sorted(c.start * 1e6 for c in t.collectives))
    assert all(math.isfinite(e.get("ts", 0)) for e in trace["traceEvents"])


def _node_times_worker(rank: int, world_size: int, cache: str, batches: list[int],
                       fails: int | None = None) -> dict[str, Any]:
    """Two ranks whose matmuls time differently (``_time_node`` scripted: each rank slower on
    half the nodes, by their key's length; on rank ``fails`` it raises): one step each at
    ``batches``, then each rank's timed nodes as its driver holds them, its report's
    prediction and the warnings it gave."""
    import os
    import warnings

    import fxshard
    from fxshard.driver.report import calibrate
    from fxshard.ir.cost import node_key
    from fxshard.policies import by_class

    from models import MLP

    os.environ["FXSHARD_CACHE_DIR"] = os.path.join(cache, f"rank{rank}")  # its own times, as if on two hosts
    rates = Rates("injected", replace(_device(overhead=1e-5), measured=True),
                  Network("injected", {k: LINK for k in calibrate.KINDS}))
    calibrate.calibrate = lambda world, device: rates  # type: ignore[assignment]
    timed: dict[str, tuple[float, float]] = {}

    def time_node(node: fx.Node, device: torch.device, evict: Any = None) -> tuple[float, float]:
        key = node_key(node)
        assert key is not None
        if rank == fails:
            raise RuntimeError("no clock here")
        slower = 1 + (len(key) + rank) % 2  # this rank the slower on half the nodes
        timed[key] = (1e-3 * slower, 1.5e-3 * slower)
        return timed[key]

    calibrate._time_node = time_node  # type: ignore[assignment]
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(d_in=32, hidden=64, depth=3, d_out=8), policy=by_class(nn.Linear))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for batch in batches:
            sharded(torch.randn(batch, 32)).square().mean().backward()
    predicted = sharded.report().predicted_step_seconds
    device = sharded._driver.rates.device
    return dict(timed=timed, warm=dict(device.node_seconds), cold=dict(device.node_cold_seconds),
                predicted=predicted, warned=[str(w.message) for w in warned if "settle" in str(w.message)])


def test_every_rank_predicts_the_step_with_the_slowest_ranks_timed_matmuls() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        ranks = run_ranks(_node_times_worker, 2, cache, [8])
    r0, r1 = ranks
    assert r0["timed"].keys() == r1["timed"].keys() and len(r0["timed"]) >= 4
    assert any(r0["timed"][k] != r1["timed"][k] for k in r0["timed"])  # the ranks time them apart
    for r in ranks:
        # Settled at the first forward: each node the slower rank's, warm and cold.
        assert {k: r["warm"][k] for k in r0["timed"]} == {k: 2e-3 for k in r0["timed"]}
        assert {k: r["cold"][k] for k in r0["timed"]} == {k: 3e-3 for k in r0["timed"]}
    assert r0["predicted"] == r1["predicted"]


def test_a_rank_whose_new_step_asks_to_settle_its_matmuls_is_answered_by_a_rank_that_settled_its_own() -> None:
    import tempfile

    # Rank 1's second step is a new one (a smaller batch: new shapes to time); rank 0 runs the
    # step it settled before. The forward agreement still exchanges, on both ranks, and
    # nothing hangs.
    with tempfile.TemporaryDirectory() as cache:
        ranks = run_ranks(_batches_per_rank_worker, 2, cache)
    r0, r1 = ranks
    new = set(r1["timed"]) - set(r0["timed"])  # the keys of rank 1's batch of 4
    assert new
    for k in new:  # rank 1 timed them alone: its own times are the slowest there are
        assert r1["warm"][k] == r1["timed"][k][0] and r0["warm"][k] == r1["timed"][k][0]


def _batches_per_rank_worker(rank: int, world_size: int, cache: str) -> dict[str, Any]:
    return _node_times_worker(rank, world_size, cache, [8, 8 if rank == 0 else 4])


def _failing_rank_worker(rank: int, world_size: int, cache: str) -> dict[str, Any]:
    return _node_times_worker(rank, world_size, cache, [8], fails=0)


def test_a_rank_that_cannot_time_its_matmuls_warns_and_takes_the_others_without_stopping_anyone() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        r0, r1 = run_ranks(_failing_rank_worker, 2, cache)  # returns: neither rank waited on rank 0
    assert len(r0["warned"]) == 1 and "rank 0" in r0["warned"][0] and "no clock here" in r0["warned"][0]
    assert r1["warned"] == [] and r0["timed"] == {} and r1["timed"]
    for k, (warm, cold) in r1["timed"].items():  # rank 1's times, on both ranks
        assert r0["warm"][k] == r1["warm"][k] == warm and r0["cold"][k] == r1["cold"][k] == cold
    assert r0["predicted"] == r1["predicted"]


def _node_times_under_user_modes_worker(rank: int, world_size: int, cache: str) -> dict[str, Any]:
    """The first step under the user's autocast and a dispatch mode that counts what it sees:
    the context each node is timed in, and what the mode saw."""
    import os

    import fxshard
    from fxshard.driver.report import calibrate
    from fxshard.ir.compat import TorchDispatchMode
    from fxshard.policies import by_class

    from models import MLP

    os.environ["FXSHARD_CACHE_DIR"] = os.path.join(cache, f"rank{rank}")
    rates = Rates("injected", replace(_device(overhead=1e-5), measured=True),
                  Network("injected", {k: LINK for k in calibrate.KINDS}))
    calibrate.calibrate = lambda world, device: rates  # type: ignore[assignment]
    contexts: list[tuple[bool, bool, int]] = []

    def time_node(node: fx.Node, device: torch.device, evict: Any = None) -> tuple[float, float]:
        contexts.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled(),
                         torch._C._len_torch_dispatch_stack()))
        torch.ones(7).neg_()  # an op the step has not: a mode around it would see it
        return 1e-3, 1e-3

    calibrate._time_node = time_node  # type: ignore[assignment]

    seen: list[str] = []

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(d_in=32, hidden=64, depth=3, d_out=8), policy=by_class(nn.Linear))
    with torch.autocast("cpu", dtype=torch.bfloat16), Watching():
        sharded(torch.randn(8, 32)).float().square().mean().backward()
    return dict(contexts=contexts, seen=seen)


def test_matmuls_timed_inside_the_first_step_are_timed_outside_the_users_autocast_and_modes() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        ranks = run_ranks(_node_times_under_user_modes_worker, 2, cache)
    for r in ranks:
        assert r["contexts"] and set(r["contexts"]) == {(False, False, 0)}
        # The mode saw the step's ops and none of the timing's.
        assert "aten.mm.default" in r["seen"] and "aten.neg_.default" not in r["seen"]


def _scripted_contention(monkeypatch: Any, slow: Callable[[int], float], other: list[float] | None = None,
                         flight: float = 10e-3) -> list[int]:
    """measure_contention on a scripted host: an 8 MiB all_gather takes 5 ms alone and
    ``flight`` under compute; a matmul takes 1 ms times ``slow(matmul number)``, and half as
    long again while the all_gather is in flight. Of a loop of 15, those starting at 0, 1.5,
    ... 9 ms are slowed under a 10 ms flight: 3.5 ms lost over the all_gather's 5 alone, 0.7.
    The other rank measured the same, or its 21 pairs ``other``. Returns the number of
    matmuls made, as it goes."""
    from fxshard.driver.report import calibrate

    clock, matmuls, ends = [0.0], [0], [-1.0]  # ends: when the all_gather in flight finishes

    class Work:
        def is_completed(self) -> bool:
            return clock[0] >= ends[0]

        def wait(self) -> None:
            clock[0] = max(clock[0], ends[0])

    def all_gather_single(full: torch.Tensor, shard: torch.Tensor, group: Any = None,
                          async_op: bool = False) -> Work | None:
        if shard.dtype == torch.float64:  # the ranks' slowdowns, pooled (the probe's own: float32)
            full.copy_(torch.cat([shard, shard if other is None else torch.tensor(other).to(shard)]))
        if not async_op:
            clock[0] += 5e-3
            return None
        ends[0] = clock[0] + flight  # issued before the loop: it flies under compute
        return Work()

    def mm(a: torch.Tensor, b: torch.Tensor) -> None:
        matmuls[0] += 1
        clock[0] += 1e-3 * slow(matmuls[0]) * (1.5 if clock[0] < ends[0] else 1.0)

    monkeypatch.setattr(calibrate.compat, "all_gather_single", all_gather_single)
    _on_scripted_host(monkeypatch, clock, mm)
    return matmuls


def _on_scripted_host(monkeypatch: Any, clock: list[float], mm: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Calibration's clock is ``clock[0]``, its matmuls ``mm``, its barriers return at once and
    its collectives' device is the CPU."""
    from fxshard.driver.report import calibrate

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(calibrate.torch, "mm", mm)
    monkeypatch.setattr(calibrate.dist, "barrier", lambda group: None)
    monkeypatch.setattr(calibrate, "comm_device", lambda group: torch.device("cpu"))


def test_contention_is_what_compute_loses_over_the_flight_pooled_over_the_ranks(monkeypatch: Any) -> None:
    """What the matmuls lose over the flight, over its time alone: under a 10 ms flight 3.5 ms,
    0.7 of its 5 ms alone; under a 7 ms one 2.5 ms; under a 17 ms one 6 ms, more than its
    time alone: 1, the most. The ranks' pairs are pooled: 21 at 0.7 and the other rank's 10
    at 0 and 11 at 2 leave 21 at 0.7 and one at 2 in the middle half, 16.7 / 22 (their
    median would be 0.7, their mean 36.7 / 42, each rank's own middle half and then the
    MAX 1)."""
    from fxshard.driver.report import calibrate

    _scripted_contention(monkeypatch, lambda k: 1.0)
    assert calibrate.measure_contention(_TwoRanks()) == pytest.approx(0.7)  # type: ignore[arg-type]
    _scripted_contention(monkeypatch, lambda k: 1.0, flight=17e-3)  # 12 slowed: 6 ms lost
    assert calibrate.measure_contention(_TwoRanks()) == pytest.approx(1.0)  # type: ignore[arg-type]
    _scripted_contention(monkeypatch, lambda k: 1.0, flight=7e-3)  # 5 slowed: 2.5 ms lost
    assert calibrate.measure_contention(_TwoRanks()) == pytest.approx(0.5)  # type: ignore[arg-type]
    _scripted_contention(monkeypatch, lambda k: 1.0, other=[0.0] * 10 + [2.0] * 11)
    assert calibrate.measure_contention(_TwoRanks()) == pytest.approx(16.7 / 22)  # type: ignore[arg-type]


def test_contention_runs_its_matmuls_on_until_the_flight_has_ended(monkeypatch: Any) -> None:
    """The loop is sized at three times the all_gather's time alone (15 matmuls), but under
    compute a flight can last longer: one of 29 ms ends during the 20th slowed matmul, and the
    loop runs on to there, then as many alone: 2 x 5 more matmuls in each of the 21 pairs."""
    from fxshard.driver.report import calibrate

    made = _scripted_contention(monkeypatch, lambda k: 1.0)
    calibrate.measure_contention(_TwoRanks())  # type: ignore[arg-type]
    longer = _scripted_contention(monkeypatch, lambda k: 1.0, flight=29e-3)
    assert calibrate.measure_contention(_TwoRanks()) == 1.0  # type: ignore[arg-type]  # 10 ms lost over 5
    assert longer[0] - made[0] == calibrate.CONTENTION_PAIRS * 2 * 5


def test_contention_is_the_middle_of_paired_loops_so_a_slow_moment_cannot_move_it(monkeypatch: Any) -> None:
    """Each pair times the all_gather alone, the loop with the all_gather in flight, then the
    loop alone: a slow moment of the host (every matmul three times slower, for two loops'
    worth, wherever it falls) moves one or two pairs, not the middle half's mean. Timed
    over one all_gather's time measured before all the pairs, and nine pairs' median,
    twelve measurements back to back on 2 gloo ranks gave 0.24 to 1.00."""
    from fxshard.driver.report import calibrate

    total = _scripted_contention(monkeypatch, lambda k: 1.0)
    calibrate.measure_contention(_TwoRanks())  # type: ignore[arg-type]
    found = []
    for start in range(0, total[0], 7):
        _scripted_contention(monkeypatch, lambda k, start=start: 3.0 if start <= k < start + 30 else 1.0)
        found.append(calibrate.measure_contention(_TwoRanks()))  # type: ignore[arg-type]
    assert all(0.6 <= c <= 0.8 for c in found), found


def _scripted_starvation(monkeypatch: Any, slow: Callable[[int], float]) -> None:
    """measure_starvation on a scripted host: a 256 KiB all_gather takes 1 ms alone; while
    compute runs its time passes at a third of the pace (a starvation of 2: it ends 3 ms
    after its issue under a loop of 0.1 ms matmuls); everything (gathers and matmuls) takes
    ``slow(event number)`` times as long, an event being a gather or a matmul."""
    from fxshard.driver.report import calibrate

    clock, events = [0.0], [0]

    def factor() -> float:
        events[0] += 1
        return slow(events[0])

    class Work:
        def __init__(self) -> None:
            self.left = 1e-3 * factor()  # seconds of its own time still to pass

        def is_completed(self) -> bool:
            return self.left <= 1e-12

        def wait(self) -> None:
            clock[0] += max(self.left, 0.0)
            self.left = 0.0

    inflight: list[Work] = []

    def all_gather_single(full: torch.Tensor, shard: torch.Tensor, group: Any = None,
                          async_op: bool = False) -> Work | None:
        work = Work()
        if not async_op:
            work.wait()
            return None
        inflight.append(work)
        return work

    def mm(a: torch.Tensor, b: torch.Tensor) -> None:
        seconds = 1e-4 * factor()
        clock[0] += seconds
        for work in inflight:
            work.left -= seconds / 3.0

    monkeypatch.setattr(calibrate.compat, "all_gather_single", all_gather_single)
    _on_scripted_host(monkeypatch, clock, mm)


def test_starvation_is_the_median_of_paired_calls_so_a_slow_moment_cannot_move_it(monkeypatch: Any) -> None:
    """Each pair times the all_gather alone, then issued before the loop of matmuls: a slow
    moment of the host (everything three times slower, for forty events, wherever it falls)
    moves a pair or two, not the median. Timed as five calls alone and then five under the
    loop, a slow moment over either five moved it by its whole size (16 fresh calibrations
    on the host measured 0.0 to 3.8, benchmarks/results/calibration_spread.md)."""
    from fxshard.driver.report import calibrate

    link = Link(1e-3, 1e9)
    _scripted_starvation(monkeypatch, lambda k: 1.0)
    assert calibrate.measure_starvation(_TwoRanks(), link) == pytest.approx(2.0, abs=0.1)  # type: ignore[arg-type]
    found = []
    for start in range(0, 420, 10):
        _scripted_starvation(monkeypatch, lambda k, start=start: 3.0 if start <= k < start + 40 else 1.0)
        found.append(calibrate.measure_starvation(_TwoRanks(), link))  # type: ignore[arg-type]
    assert all(1.7 <= s <= 2.3 for s in found), (min(found), max(found))


def _scripted_sharing(monkeypatch: Any, sharing: float, slow: Callable[[int], float],
                      mixed: float | None = None) -> None:
    """measure_latency_sharing on a scripted host: a 64 KiB all_gather's or reduce_scatter's
    wait takes 1 ms when it is the only one in flight; of two issued together, the second wait
    takes ``sharing`` ms more where both are all_gathers, ``mixed`` (None: ``sharing``) where
    one is a reduce_scatter (1: they pass one after the other, 0: side by side); every wait
    takes ``slow(wait number)`` times as long."""
    from types import SimpleNamespace

    from fxshard.driver.report import calibrate

    clock, waits, flying = [0.0], [0], []

    def issue(kind: str) -> tuple[str, ...]:
        flying.append(kind)
        return tuple(flying)  # what is in flight beside it, itself last

    def all_gather_into_tensor(shard: torch.Tensor, n: int, name: str) -> tuple[str, ...]:
        return issue("all_gather")

    def reduce_scatter_tensor(full: torch.Tensor, op: str, n: int, name: str) -> tuple[str, ...]:
        return issue("reduce_scatter")

    def wait_tensor(beside: tuple[str, ...]) -> None:
        waits[0] += 1
        pace = 1.0 if len(beside) == 1 else sharing if len(set(beside)) == 1 or mixed is None else mixed
        clock[0] += slow(waits[0]) * pace * 1e-3
        flying.pop(0)

    ops = SimpleNamespace(all_gather_into_tensor=all_gather_into_tensor, reduce_scatter_tensor=reduce_scatter_tensor,
                          wait_tensor=wait_tensor)
    monkeypatch.setattr(calibrate.compat, "c10d_functional", ops)
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(calibrate, "comm_device", lambda group: torch.device("cpu"))


def _two_groups() -> Any:
    from types import SimpleNamespace

    class Group(_TwoRanks):
        def __init__(self, name: str) -> None:
            self.group_name = name

    return SimpleNamespace(comm=[Group("first"), Group("second")], size=2, layout=SimpleNamespace(replicate=None))


def test_latency_sharing_pools_its_blocks_and_reads_above_one_where_both_at_once_take_longer(
        monkeypatch: Any) -> None:
    """Two collectives at once that take longer than one after the other (gloo's threads on 2
    cores: 1.64 over 150 blocks on the host) read above 1, up to ``SHARING_MAX`` (the clamp
    at 1 predicted the deep MLP's backward 15-31% short). Pooled over 20 blocks, a slow moment
    of the host (every wait three times slower, for thirty waits, wherever it falls) moves
    it by at most an eighth."""
    from fxshard.driver.report import calibrate

    world = _two_groups()
    for sharing in (1.0, 0.25, 1.6):
        _scripted_sharing(monkeypatch, sharing, lambda k: 1.0)
        assert calibrate.measure_latency_sharing(world) == (pytest.approx(sharing), pytest.approx(sharing))
    _scripted_sharing(monkeypatch, 5.0, lambda k: 1.0)
    assert calibrate.measure_latency_sharing(world) == (calibrate.SHARING_MAX, calibrate.SHARING_MAX)
    # Each block: 25 waits alone of the first, then, for each of the two pairs, 25 of the
    # second alone and 25 pairs of each of the two pair variants (a call to warm up, then 24).
    waits = calibrate.SHARING_REPEATS * (calibrate.SHARING_CALLS + 1) * 11
    found = []
    for start in range(0, waits, 10):
        _scripted_sharing(monkeypatch, 1.0, lambda k, start=start: 3.0 if start <= k < start + 30 else 1.0)
        found.extend(calibrate.measure_latency_sharing(world))
    assert 0.88 <= min(found) and max(found) <= 1.13, (min(found), max(found))


def test_latency_sharing_of_an_all_gather_beside_a_reduce_scatter_is_measured_on_that_pair(
        monkeypatch: Any) -> None:
    """Two all_gathers at once and an all_gather beside a reduce_scatter share their latencies
    differently on gloo (1.47-2.08 and 1.01-1.31 here): the backward's pair is measured on its
    own, and the model takes it where the kinds in flight differ."""
    from fxshard.driver.report import calibrate

    world = _two_groups()
    _scripted_sharing(monkeypatch, 1.6, lambda k: 1.0, mixed=0.5)
    assert calibrate.measure_latency_sharing(world) == (pytest.approx(1.6), pytest.approx(0.5))
    # In the model: two all_gathers' latencies at once, or an all_gather and a reduce_scatter.
    same, mixed = Builder(), Builder()
    a, b = same.input("a", 16), same.input("b", 16)
    first, second = same.gather(a, "a", "g0"), same.gather(b, "b", "g1")  # both issued, then waited
    same_graph = same.done(same.wait(first), same.wait(second))
    c, d = mixed.input("c", 16), mixed.input("d", 32)
    gathered = mixed.gather(c, "c", "g0")
    reduced = mixed.op(P.REDUCE_SCATTER, d, "sum", 2, "g1")
    meta.set_info(reduced, NodeInfo(Role.REDUCE_SCATTER, 0, "d", ChainTag(9, Direction.REDUCE, "reduce_scatter")))
    mixed_graph = mixed.done(mixed.wait(gathered), mixed.wait(reduced))
    link = Link(1e-3, math.inf)
    net = Network("n", {"all_gather": link, "reduce_scatter": link})
    rates = Rates("r", _device(overhead=0.0), net, latency_sharing=1.6, latency_sharing_mixed=0.5)
    # Both latencies at once, each at 1 / (1 + s) of its pace: 1 + s ms for both.
    assert predict_step({"forward": same_graph}, rates).seconds == pytest.approx(2.6e-3)
    assert predict_step({"forward": mixed_graph}, rates).seconds == pytest.approx(1.5e-3)
    assert predict_step({"forward": mixed_graph}, replace(rates, latency_sharing_mixed=None)).seconds == \
        pytest.approx(2.6e-3)


def test_latency_sharing_holds_on_a_host_whose_calls_now_and_then_take_a_tick_more(monkeypatch: Any) -> None:
    """One wait in seven takes 3 ms more (a scheduler tick; gloo's 64 KiB all_gathers here: 9-41%
    of calls), at random, on a host whose two collectives at once take as long as one after the
    other (sharing 1). One block of each variant is a ratio of two differences of one latency
    each, and its ticks swing it far: the median of five clamped blocks read 0.0-0.4 in fresh
    calibrations. Pooled over every block, twenty seeds all read within a fifth of 1."""
    import random

    from fxshard.driver.report import calibrate

    world = _two_groups()
    found = []
    for seed in range(20):
        ticks = random.Random(seed)
        extra: dict[int, float] = {}

        def slow(k: int, ticks: random.Random = ticks, extra: dict[int, float] = extra) -> float:
            return extra.setdefault(k, 4.0 if ticks.random() < 1 / 7 else 1.0)

        _scripted_sharing(monkeypatch, 1.0, slow)
        found.extend(calibrate.measure_latency_sharing(world))
    assert 0.8 <= min(found) and max(found) <= 1.2, sorted(found)


def test_the_network_is_measured_on_the_dimension_that_communicates_and_cached_by_its_groups(
        monkeypatch: Any) -> None:
    """A NO_SHARD mesh's shard groups are one rank each: the latency sharing, as the network,
    is measured on its replicas' groups. A job with one group measures no latency sharing (0),
    so its cache entry is not the one a job with two groups reads."""
    from types import SimpleNamespace

    from fxshard.driver.report import calibrate

    class Group(_TwoRanks):
        def __init__(self, name: str, size: int = 2) -> None:
            self.group_name, self._size = name, size

        def size(self) -> int:
            return self._size

    monkeypatch.setattr(calibrate.dist, "get_backend", lambda group: "gloo")
    flat = SimpleNamespace(comm=(Group("s0"), Group("s1")), size=2, layout=SimpleNamespace(replicate=None))
    one = SimpleNamespace(comm=(Group("s0"),), size=2, layout=SimpleNamespace(replicate=None))
    replicas = (Group("r0"), Group("r1"))
    no_shard = SimpleNamespace(comm=(Group("o0", 1), Group("o1", 1)), size=1,
                               layout=SimpleNamespace(replicate="replicate"), groups=lambda dim: replicas)
    assert calibrate.measured_groups(no_shard) == replicas  # type: ignore[arg-type]
    assert calibrate.measured_groups(flat) == flat.comm  # type: ignore[arg-type]
    assert calibrate.network_key(one) != calibrate.network_key(flat)  # type: ignore[arg-type]

    _scripted_sharing(monkeypatch, 0.5, lambda k: 1.0)
    gathered: list[str] = []
    issue = calibrate.compat.c10d_functional.all_gather_into_tensor

    def recorded(shard: torch.Tensor, n: int, name: str) -> Any:
        gathered.append(name)
        return issue(shard, n, name)

    monkeypatch.setattr(calibrate.compat.c10d_functional, "all_gather_into_tensor", recorded)
    assert calibrate.measure_latency_sharing(no_shard) == (pytest.approx(0.5), pytest.approx(0.5))  # type: ignore[arg-type]
    assert set(gathered) == {"r0", "r1"}
    assert calibrate.measure_latency_sharing(one) == (0.0, 0.0)  # type: ignore[arg-type]


def _full_device() -> DeviceRates:
    """A device as calibration measures the CPU: every per-element operator, a curve point per
    matmul size."""
    from fxshard.driver.report.calibrate import matmul_sizes
    from fxshard.ir.cost import PER_ELEMENT

    curve = tuple((2.0 * n ** 3, GFLOP * (i + 1)) for i, n in enumerate(matmul_sizes(torch.device("cpu"))))
    return DeviceRates("cached device", {"float32": GFLOP, "bfloat16": 2 * GFLOP}, 2e10, 2e-6, 1e-6,
                       {"float32": curve, "bfloat16": curve},
                       {name: (i + 1) * 1e-9 for i, name in enumerate(PER_ELEMENT)}, measured=True,
                       fresh_bytes=1 << 20, fresh_bandwidth=3e9, cache_bytes=32 << 20)


@pytest.mark.parametrize("text", ["[]", "null", "3", '"rates"'])
def test_a_cache_file_that_is_not_a_json_object_is_measured_again_and_written_over(
        tmp_path: Any, monkeypatch: Any, text: str) -> None:
    """A cache file that holds JSON but not an object of entries (written by something else):
    no entry is read from it, and the next measurement is saved over it, as for a file that
    is not JSON at all."""
    import json

    from fxshard.driver.report import calibrate

    monkeypatch.setenv("FXSHARD_CACHE_DIR", str(tmp_path))
    calibrate.cache_path().write_text(text)
    assert calibrate._load("a key") is None
    calibrate._save("a key", {"measured": 1.0})
    assert json.loads(calibrate.cache_path().read_text()) == {"a key": {"measured": 1.0}}
    assert calibrate._load("a key") == {"measured": 1.0}


def test_a_cached_device_entry_this_fxshard_would_not_measure_is_measured_again() -> None:
    """The ranks' rates are lined up by position for their MAX (``_pack``): an entry short of a
    per-element operator or of a matmul curve's point would misalign them (one rank's tanh
    read as another's sigmoid) or fail the all_reduce, and a rate of zero divides by zero.
    Such an entry (an older fxshard's, or edited by hand) is measured again."""
    from fxshard.driver.report.calibrate import _device_entry, _device_from

    cpu = torch.device("cpu")
    full = _full_device()
    assert _device_from(_device_entry(full), cpu) == full  # what calibration writes, read back

    def edited(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        entry = _device_entry(full)
        change(entry)
        return entry

    assert _device_from(edited(lambda e: e["per_element"].pop("tanh")), cpu) is None
    assert _device_from(edited(lambda e: e["per_element"].update(unknown_op=1e-9)), cpu) is None
    assert _device_from(edited(lambda e: e["matmul_curve"]["float32"].pop()), cpu) is None
    assert _device_from(edited(lambda e: e.update(bandwidth=0.0)), cpu) is None
    assert _device_from(edited(lambda e: e.update(overhead=math.nan)), cpu) is None
    assert _device_from(edited(lambda e: e["matmul_flops"].update(float32=-1.0)), cpu) is None


def test_a_cached_network_entry_with_a_bandwidth_of_zero_is_measured_again() -> None:
    from fxshard.driver.report.calibrate import KINDS, _network_entry, _network_from

    network = Network("measured", {kind: Link(1e-4, 1e9, issue_latency=1e-5, issue_bandwidth=1e10,
                                              issue_cold_bandwidth=None) for kind in KINDS})
    entry = _network_entry(network, 0.5, 1.0, (1.0, 1.2))
    read = _network_from(entry)
    assert read is not None and read[0].links == network.links and read[1:] == (0.5, 1.0, (1.0, 1.2))
    for field, value in (("bandwidth", 0.0), ("issue_bandwidth", -1.0), ("latency", math.nan)):
        broken = {**entry, "all_gather": {**entry["all_gather"], field: value}}
        assert _network_from(broken) is None, field
    assert _network_from({**entry, "contention": math.inf}) is None


def test_rates_packed_for_the_ranks_max_unpack_to_themselves_an_infinite_bandwidth_included() -> None:
    """``_pack`` stores each bandwidth as its inverse (0 for an infinite one), and ``_unpack``
    turns it back: a link that moves bytes for free stays free, where it divided by zero."""
    from fxshard.driver.report.calibrate import KINDS, _pack, _unpack

    device = _full_device()
    links = {kind: Link(1e-4, 1e9, issue_latency=1e-5, issue_bandwidth=2e10, issue_cold_bandwidth=5e9)
             for kind in KINDS}
    links["all_reduce"] = Link(0.0, math.inf, issue_latency=0.0, issue_bandwidth=math.inf,
                               issue_cold_bandwidth=math.inf)
    unpacked = _unpack(_pack(device, Network("n", links), 0.5, 1.5, (1.0, 1.25), 1 << 20), device, "d", "n")
    rates, network, contention, starvation, sharing, threshold = unpacked
    assert network.links["all_reduce"] == links["all_reduce"]
    assert network.links["all_gather"].bandwidth == pytest.approx(1e9)
    assert rates.per_element == pytest.approx(dict(device.per_element))
    for dtype, curve in device.matmul_curve.items():
        assert [p for point in rates.matmul_curve[dtype] for p in point] == \
            pytest.approx([p for point in curve for p in point])
    assert (contention, starvation, sharing, threshold) == (0.5, 1.5, (1.0, 1.25), 1 << 20)
