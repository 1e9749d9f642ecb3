"""Time: how long one step takes, read off the emitted graphs and a set of rates.

Pure: nothing here measures anything or touches a process group. The rates come
from a measurement on the live group (``fxshard/driver/report/calibrate.py``) or from a
named hardware profile (``hardware(name)``); given the same rates, every rank
predicts the same times.

    a node          max(flops / rate(dtype), bytes / bandwidth) + overhead      (a roofline;
                    FLOPs by torch.utils.flop_counter's formulas, bytes the node's inputs
                    and outputs from meta["val"]; a view costs the dispatch overhead alone)
    a collective    latency + (n - 1) * hop_latency + bus bytes / bandwidth      (alpha-beta;
                    bus bytes by the ring accounting: all_gather and reduce_scatter move
                    (n-1)/n of the full buffer per rank, all_reduce 2(n-1)/n)
    the step        predict_step: the graphs run one after the other

      compute   |--fw node--|--node--|...wait A..|--node--|          one stream, graph order
      group g0  |  gather A ----------|  gather C ---|                    FIFO per process group:
      group g1  |        gather B --------|                               a group runs one at a time
                ^ issued where the graph issues it; a wait is a join: compute resumes at
                  max(now, the collective's end); collectives in flight together on one link
                  (a layout dimension) share its bandwidth equally

That is the runtime fxshard emits: the graphs run eagerly in node order on one
compute stream (CUDA's current stream; the CPU's calling thread); a functional
collective is issued asynchronously on the process group it names (gloo: the
group's one worker thread; NCCL: the group's own stream), so collectives on one
group run in issue order and collectives on different groups (the in-flight
slots of ``assign_groups_pass``) run at once over the same wires.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.collectives import Collective, bus_bytes, collective_nodes
from fxshard.ir.errors import FxShardError
from fxshard.ir.optimizer import OptimizerState

# -- rates ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceRates:
    """What one device computes per second.

    ``matmul_flops``: FLOP/s of the operators torch's flop counter counts (matmuls,
    convolutions, attention), by dtype name ("float32", "bfloat16"); ``bandwidth``:
    bytes/s an elementwise operator moves (its inputs read, its output written);
    ``overhead``: seconds each operator costs whatever its size (eager dispatch, a
    kernel launch); ``view_overhead``: the same for a view (no kernel, the dispatch).
    ``matmul_curve``: per dtype, (FLOPs of one matmul, FLOP/s), smallest first: a small
    matmul runs below the peak, so an operator's rate is read off this curve by its FLOPs
    (interpolated in log-log, the ends held); a dtype without one runs at ``matmul_flops``.
    ``asynchronous``: the host only launches kernels, which the device runs in order while
    the host goes on (CUDA): a node costs the host its overhead and the device its
    roofline, and the device idles only where the host falls behind. Otherwise (the CPU)
    the host computes: a node costs its roofline plus its overhead.
    ``node_seconds``: on the CPU, each distinct matmul and convolution of the graphs timed
    once here (``node_key``): a rectangular or transposed matmul runs far from the square
    curve's rate for its FLOPs.
    ``per_element``: seconds per element of the first operand, by aten operator name, for
    operators with no FLOP formula whose kernels are slower than streaming their bytes
    (``tanh``, ``_softmax``, ``max_pool2d_with_indices``: ``PER_ELEMENT``); the node costs
    the larger of that and its bytes over the bandwidth.
    """

    name: str
    matmul_flops: Mapping[str, float]
    bandwidth: float
    overhead: float
    view_overhead: float = 0.0
    matmul_curve: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    per_element: Mapping[str, float] = field(default_factory=dict)
    # The datasheet's dense peak by dtype, which FLOPs utilisation is measured against (a
    # profile's ``matmul_flops`` are what large matmuls reach, below it); none given: the
    # highest rate the device was measured at.
    peak_flops: Mapping[str, float] = field(default_factory=dict)
    asynchronous: bool = False
    # Measured on this machine (calibration), not a profile's figures: what may be timed here.
    measured: bool = False
    # A profile's device memory in bytes: auto()'s budget where none is given (a measured
    # device's is read from the device itself).
    memory_bytes: int | None = None
    # Seconds of one run of a node, by ``node_key``, timed on this device (``TIMED``: matmuls and
    # convolutions, whose rate depends on their shapes and layouts more than on their FLOPs); the
    # node costs that, plus its overhead, in place of its roofline.
    node_seconds: Mapping[str, float] = field(default_factory=dict)
    # The same nodes timed with their operands out of the caches (operands of its own per
    # call, evicted by a read of twice the last-level cache): a step touches each weight once
    # per phase, so it comes from memory, where the repeated calls of ``node_seconds`` find it
    # in the cache.
    # ``cache_bytes``: the last-level cache; an operand last touched more than that many bytes
    # of the step's traffic ago is cold (``cold_operands``). None: no cache modelled.
    node_cold_seconds: Mapping[str, float] = field(default_factory=dict)
    cache_bytes: int | None = None
    # Fresh memory (the CPU): memory the allocator takes from the system anew is faulted in,
    # page by page, as it is first written, at ``fresh_bandwidth`` bytes/s on top of the write.
    # ``fresh_bytes``: the largest mmap threshold of the allocator (glibc: 32 MiB), from which
    # an allocation is mapped afresh every time (``fresh_pages`` models the rest). None: every
    # allocation reuses memory (a caching allocator; a profile).
    fresh_bytes: int | None = None
    fresh_bandwidth: float = math.inf

    def __post_init__(self) -> None:
        if not self.matmul_flops or min(self.matmul_flops.values()) <= 0 or self.bandwidth <= 0:
            raise ValueError(f"{self.name}: rates must be positive: {self}")

    def flop_rate(self, dtype: torch.dtype | None, flops: float | None = None) -> float:
        """FLOP/s for ``dtype`` (float16 at bfloat16's, anything else at float32's, or the
        slowest known), for an operator of ``flops`` where the curve says (None: the peak)."""
        name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        for candidate in (name, "bfloat16" if name == "float16" else name, "float32"):
            if candidate in self.matmul_flops:
                curve = self.matmul_curve.get(candidate)
                return _interpolate(curve, flops) if curve and flops else self.matmul_flops[candidate]
        return min(self.matmul_flops.values())

    def peak_rate(self, dtype: torch.dtype | None) -> float:
        """The peak FLOP/s for ``dtype`` that utilisation is measured against."""
        name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        for candidate in (name, "bfloat16" if name == "float16" else name, "float32"):
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        for candidate in (name, "bfloat16" if name == "float16" else name, "float32"):
            if candidate in self.matmul_flops:  # the highest it was measured at, on its curve too
                return max([self.matmul_flops[candidate], *(r for _, r in self.matmul_curve.get(candidate, ()))])
        return self.flop_rate(dtype)


def _interpolate(curve: Sequence[tuple[float, float]], x: float) -> float:
    """``curve``'s value at ``x``, linear in log-log between its points, its ends held."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    return curve[-1][1]


@dataclass(frozen=True)
class Link:
    """One collective kind over one kind of wire: ``latency`` seconds, plus ``hop_latency``
    per ring step (n - 1 of them), plus bus bytes over ``bandwidth`` (bytes/s), in flight;
    before that, its issue holds the thread that calls it for ``issue_latency`` plus bus
    bytes over ``issue_bandwidth`` (gloo's reduce_scatter copies its whole input before the
    call returns; NCCL's calls only enqueue, which the profiles take as free: 0, inf, and
    calibration measures as the call's time on the host). On an asynchronous device the
    issue is the host's time, not the device stream's. ``issue_cold_bandwidth``: the same
    bytes where the input is out of the caches (a shard, last touched by the step before),
    measured so on the CPU (None: as warm)."""

    latency: float
    bandwidth: float
    hop_latency: float = 0.0
    issue_latency: float = 0.0
    issue_bandwidth: float = math.inf
    issue_cold_bandwidth: float | None = None

    def issue(self, bus: float, cold: float = 0.0) -> float:
        """Seconds the call holds its thread before the collective is in flight; ``cold``: the
        fraction of its input out of the caches (``cold_operands``)."""
        warm = bus / self.issue_bandwidth
        if cold and self.issue_cold_bandwidth is not None:
            warm += cold * max(0.0, bus / self.issue_cold_bandwidth - warm)
        return self.issue_latency + warm

    def seconds(self, bus: float, group_size: int) -> float:
        """The whole collective alone: its issue, then its flight."""
        return self.issue(bus) + self.latency + self.hop_latency * (group_size - 1) + bus / self.bandwidth


# Kinds a network table may leave out, and the kind whose link they take instead.
_SAME_AS = {"all_to_all": "reduce_scatter", "broadcast": "all_gather", "agreement": "all_gather"}


@dataclass(frozen=True)
class Network:
    """Collectives' links by kind: ``links`` inside a node, ``between_nodes`` for a group
    larger than ``ranks_per_node`` or HSDP's "replicate" dimension (None: one node).

    ``one_rank``: a collective over a group of one rank (a job of one process that made a
    process group, as ``torchrun --nproc-per-node 1`` does), which moves nothing between
    ranks but is still called, copies its input and is waited: its issue and flight over
    the input's bytes (``_bus``). Empty: free (the profiles; no group at all)."""

    name: str
    links: Mapping[str, Link]
    between_nodes: Mapping[str, Link] | None = None
    ranks_per_node: int | None = None
    one_rank: Mapping[str, Link] = field(default_factory=dict)

    @classmethod
    def free(cls, name: str = "no communication") -> Network:
        """Collectives that cost nothing (torch's fake process group: nothing runs)."""
        return cls(name, {"all_gather": Link(0.0, math.inf)})

    def link(self, kind: str, group_size: int, dimension: str = "shard") -> Link:
        table = self.links
        if group_size <= 1:  # no wire: the one-rank calls, where measured, else free
            table = self.one_rank
            if not table:
                return _NO_WIRE
        elif self.between_nodes is not None and (
                dimension == "replicate" or self.ranks_per_node is not None and group_size > self.ranks_per_node):
            table = self.between_nodes
        for candidate in (kind, _SAME_AS.get(kind, "all_gather"), "all_gather"):
            if candidate in table:
                return table[candidate]
        return next(iter(table.values()))

    def seconds(self, kind: str, input_bytes: int, group_size: int, dimension: str = "shard") -> float:
        """One collective of ``kind`` whose input is ``input_bytes`` (all_gather: the shard;
        the others: the full buffer) over ``group_size`` ranks."""
        return self.link(kind, group_size, dimension).seconds(_bus(kind, input_bytes, group_size), group_size)


_NO_WIRE = Link(0.0, math.inf)


def _bus(kind: str, input_bytes: int, group_size: int) -> int:
    if group_size <= 1:  # nothing crosses a wire: the backend copies the input into the output
        return input_bytes
    if kind == "broadcast":  # the whole buffer over each link of the ring or tree (the report's count)
        return input_bytes
    if kind == "agreement":  # each rank's few bytes to every other: an all_gather
        kind = "all_gather"
    return bus_bytes(kind, input_bytes, group_size)


@dataclass(frozen=True)
class Rates:
    """Everything the time model needs: a device and a network, with where they came from."""

    name: str
    device: DeviceRates
    network: Network
    sources: tuple[str, ...] = ()
    # How much of a collective's time in flight the compute stream loses to it: 0, compute
    # and communication overlap for free (the profiles: NCCL's SMs are not modelled); 1, a
    # collective takes its whole time from compute (gloo's threads on cores that compute,
    # as calibration measures on the CPU). Compute runs at 1 / (1 + contention k) of its speed
    # while k collectives are in flight (on the CPU each is a gloo thread wanting a core).
    contention: float = 0.0
    # How much longer a collective's latency takes while compute runs: 0, as long (the
    # profiles); on the CPU, gloo's thread waits for a core to wake on, so a small collective
    # issued before compute barely moves until the compute stops (calibration measures it).
    # The latency passes at 1 / (1 + starvation) of its pace while compute runs.
    starvation: float = 0.0
    # How far the latencies of collectives in flight at once add up: 0, they pass together
    # (NCCL's kernels, the profiles); 1, one after the other; above 1, at once they take
    # longer than one after the other (gloo's threads on the CPU wait for the same cores: two
    # small all_gathers on two groups at once, 1.64 times as long beyond one alone as one
    # after the other on 2 cores). k latencies at once pass at 1 / (1 + sharing (k - 1)).
    # ``latency_sharing`` for collectives of one kind (a gather prefetched beside the one in
    # use), ``latency_sharing_mixed`` for kinds that differ (the backward's next gather beside
    # the reduce_scatter before it: 1.0-1.3 where two all_gathers read 1.5-2.1 on 2 gloo ranks
    # here); None: as ``latency_sharing``.
    latency_sharing: float = 0.0
    # The allocator's mmap threshold known in the job's processes when the rates were taken
    # (``calibrate.mmap_threshold``; the smallest over ranks, so every rank predicts the same),
    # which decides the fresh pages a step faults in (``fresh_pages``). None: not known.
    mmap_threshold: int | None = None
    latency_sharing_mixed: float | None = None

    def __str__(self) -> str:
        d, lines = self.device, [f"rates {self.name}"]
        lines.append(f"  device {d.name}: " + ", ".join(
            f"{dtype} {rate / 1e12:.3g} TFLOP/s" for dtype, rate in d.matmul_flops.items())
            + f"; memory {d.bandwidth / 1e9:.3g} GB/s; {d.overhead * 1e6:.3g} us per operator"
            + f" ({d.view_overhead * 1e6:.3g} us per view)"
            + (f"; fresh pages faulted in at {d.fresh_bandwidth / 1e9:.3g} GB/s (mmap threshold up to "
               f"{d.fresh_bytes / (1 << 20):.3g} MiB)" if d.fresh_bytes is not None else ""))
        for dtype, curve in d.matmul_curve.items():
            lines.append(f"    {dtype} by a matmul's size: " + ", ".join(
                f"{flops / 1e6:.3g} MFLOP at {rate / 1e9:.3g} GFLOP/s" for flops, rate in curve))
        tables = [("", "bus bytes", self.network.links)]
        if self.network.between_nodes is not None:
            tables += [(f" between nodes ({self.network.ranks_per_node} ranks per node)", "bus bytes",
                        self.network.between_nodes)]
        if self.network.one_rank:
            tables += [(" over a group of one rank", "input bytes", self.network.one_rank)]
        for where, per, table in tables:
            if all(link == _NO_WIRE for link in table.values()):  # Network.free's: one rank, or fake
                if not self.network.one_rank:  # else only the group of one rank has collectives
                    lines.append(f"  network {self.network.name}{where}: collectives cost nothing")
                continue
            lines.append(f"  network {self.network.name}{where}:")
            for kind, link in table.items():
                hop = f" + {link.hop_latency * 1e6:.3g} us per ring step" if link.hop_latency else ""
                cold = (f" ({link.issue_cold_bandwidth / 1e9:.3g} GB/s cold)"
                        if link.issue_cold_bandwidth is not None else "")
                issue = (f"; its issue {link.issue_latency * 1e6:.1f} us + {per} / "
                         f"{link.issue_bandwidth / 1e9:.3g} GB/s{cold} on the calling thread"
                         if link.issue_latency or link.issue_bandwidth != math.inf else "")
                lines.append(f"    {kind:<15} {link.latency * 1e6:8.1f} us{hop} + {per} / "
                             f"{link.bandwidth / 1e9:.3g} GB/s{issue}")
        if self.contention:
            lines.append(f"  contention {self.contention:.2f}: compute runs at 1/(1 + {self.contention:.2f} k) of "
                         "its speed while k collectives are in flight")
        if self.starvation:
            lines.append(f"  starvation {self.starvation:.2f}: a collective's latency passes at "
                         f"1/{1 + self.starvation:.2f} of its pace while compute runs")
        if self.latency_sharing:
            lines.append(f"  latency sharing {self.latency_sharing:.2f}: k latencies at once pass at "
                         f"1/(1 + {self.latency_sharing:.2f} (k - 1)) of their pace"
                         + (f" ({self.latency_sharing_mixed:.2f} where their kinds differ)"
                            if self.latency_sharing_mixed is not None else ""))
        lines += [f"  source: {s}" for s in self.sources]
        return "\n".join(lines)


# -- named hardware profiles ----------------------------------------------------------------------

_H100_SXM = DeviceRates(
    "NVIDIA H100 SXM5 80GB",
    # Dense peaks at 70% (large GEMMs reach 65-75% of peak): bf16 989 TFLOP/s; fp32 matmuls run
    # on the CUDA cores (torch's default allow_tf32=False) at 67 TFLOP/s.
    {"bfloat16": 0.7 * 989e12, "float32": 0.7 * 67e12},
    0.85 * 3.35e12,  # HBM3 3.35 TB/s; STREAM-like kernels reach about 85%
    5e-6,  # an eager operator: dispatch and launch, about 5 us
    2e-6,
    peak_flops={"bfloat16": 989e12, "float32": 67e12},  # the datasheet's dense peaks (MFU's base)
    asynchronous=True,
    memory_bytes=81559 * (1 << 20),  # "80GB" HBM3: nvidia-smi's memory.total, 81559 MiB
)
# NVLink 4: 900 GB/s per GPU both ways together, 450 GB/s each way; NCCL's ring reaches
# about 80% of it in bus bandwidth (nccl-tests' busbw) for large messages.
_NVLINK = {kind: Link(10e-6, 0.8 * 450e9, 1e-6) for kind in ("all_gather", "reduce_scatter", "all_reduce")}
# 400 Gb/s InfiniBand NDR per GPU (a ConnectX-7 per GPU in DGX H100): 50 GB/s each way; NCCL's
# rings across nodes reach about 80% of it in bus bandwidth.
_IB = {kind: Link(20e-6, 0.8 * 50e9, 3e-6) for kind in ("all_gather", "reduce_scatter", "all_reduce")}

_SOURCES = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): bf16 dense 989 TFLOP/s, fp32 67 TFLOP/s, "
    "HBM3 3.35 TB/s, NVLink 900 GB/s",
    "NVIDIA DGX H100 user guide: 8 GPUs on NVSwitch, 8 ConnectX-7 400 Gb/s InfiniBand ports (one per GPU)",
    "NVIDIA nccl-tests, doc/PERFORMANCE.md: bus bandwidth (busbw) = algbw x (n-1)/n for all_gather "
    "and reduce_scatter, 2(n-1)/n for all_reduce; ring latency grows with n - 1 steps",
)

PROFILES: dict[str, Rates] = {
    "h100-nvlink": Rates("h100-nvlink", _H100_SXM, Network("NVLink 4 (NVSwitch), 8 GPUs", _NVLINK),
                         _SOURCES),
    "h100-ib": Rates("h100-ib", _H100_SXM,
                     Network("NVLink 4 inside a node; InfiniBand NDR 400 Gb/s per GPU between nodes",
                             _NVLINK, _IB, ranks_per_node=8), _SOURCES),
}


def hardware(name: str) -> Rates:
    """The named profile (``PROFILES``); an unknown name raises, listing the known ones."""
    if name not in PROFILES:
        raise FxShardError(f"unknown hardware profile {name!r}: known are {', '.join(sorted(PROFILES))}")
    return PROFILES[name]


# -- one node ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeCost:
    flops: int
    bytes: int
    seconds: float  # the whole node: its kernel's roofline and its launch
    launch: float = 0.0  # of which the host's dispatch and launch (the device's overhead)


_FREE = NodeCost(0, 0, 0.0)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _val(arg: Any) -> Any:
    return fx.node.map_arg(arg, lambda n: n.meta.get("val"))


def flops(node: fx.Node) -> int:
    """FLOPs of ``node`` by torch's flop counter's formula for its operator (0: none there)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    try:
        return int(formula(*_val(node.args), out_val=node.meta.get("val"), **_val(node.kwargs)))
    except Exception:  # a formula that does not take this overload's arguments: count none
        return 0


# Operators without a FLOP formula whose CPU kernels run well below the streaming bandwidth
# (transcendentals, normalisations, softmax, pooling, random masks): calibration times each on
# about a million elements (fxshard/driver/report/calibrate.py); every other operator streams its bytes.
# native_dropout's CPU kernel draws its mask with a branch per element, so its time depends on the
# probability p, most at 0.5 and the same for p as for 1 - p (a million elements on the project's
# CPU: 5.5 ms at p = 0.1, 7.8 at 0.25, 11.1 at 0.5, 7.7 at 0.75, 5.4 at 0.9): calibration times it
# at each of these p, and a node is charged at its own, interpolated (``per_element_seconds``).
DROPOUT_P = (0.1, 0.25, 0.5)


def dropout_key(p: float) -> str:
    """``per_element``'s key for native_dropout timed at ``p`` ("native_dropout" at the first)."""
    return "native_dropout" if p == DROPOUT_P[0] else f"native_dropout p={p}"


PER_ELEMENT = (
    "tanh", "sigmoid", "exp", "gelu", "gelu_backward", "silu", "silu_backward",
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward",
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward",
    *(dropout_key(p) for p in DROPOUT_P), "native_dropout_backward", "embedding_dense_backward",
)


def per_element_seconds(node: fx.Node, device: DeviceRates) -> float | None:
    """Seconds per element of ``node``'s first operand, where calibration measured its operator
    (``PER_ELEMENT``); None elsewhere. native_dropout's is read off the times at ``DROPOUT_P`` by
    min(p, 1 - p), linear between them, the ends held."""
    name = op_name(node)
    p = node.args[1] if name == "native_dropout" and len(node.args) > 1 else None
    if not isinstance(p, float | int):
        return device.per_element.get(name)
    points = [(q, device.per_element[dropout_key(q)]) for q in DROPOUT_P if dropout_key(q) in device.per_element]
    if not points:
        return None
    q = min(float(p), 1.0 - float(p))
    if q <= points[0][0]:
        return points[0][1]
    for (q0, s0), (q1, s1) in zip(points, points[1:]):
        if q <= q1:
            return s0 + (q - q0) / (q1 - q0) * (s1 - s0)
    return points[-1][1]


# Operators whose time calibration measures per distinct node (shapes, strides, dtypes and
# arguments) on the CPU, where their rate depends on more than their FLOPs.
TIMED = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")


def node_key(node: fx.Node) -> str | None:
    """What one run of ``node`` takes depends on (a ``TIMED`` operator's): its overload, and each
    argument's shape, strides and dtype, or value; None for other nodes."""
    if node.op != "call_function" or op_name(node) not in TIMED:
        return None

    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), tuple(v.stride()), str(v.dtype).removeprefix("torch."))
        if isinstance(v, (list, tuple)):
            return tuple(describe(x) for x in v)
        return v

    return repr((str(node.target), describe(_val(node.args)), sorted(describe(_val(node.kwargs)).items())
                 if node.kwargs else ()))


def op_name(node: fx.Node) -> str:
    """The aten operator's name without namespace and overload ("_softmax"); "" for others."""
    packet = getattr(node.target, "overloadpacket", None)
    return str(getattr(packet, "__name__", "")) if packet is not None else ""


def _moved(node: fx.Node) -> int:
    """The bytes a computing node moves: its output written, each operand read (twice if twice)."""
    return _nbytes(node.meta.get("val")) + _nbytes(_val(node.args)) + _nbytes(_val(node.kwargs))


def node_cost(node: fx.Node, device: DeviceRates, cold: float = 0.0) -> NodeCost:
    """What ``node`` costs on the compute stream (a collective: its issue; its wait: nothing).
    ``cold``: the fraction of its operands' bytes out of the caches (``cold_operands``), which
    moves a timed node from its warm time towards its cold one."""
    if node.op != "call_function" or P.is_getitem(node) or P.is_wait(node):
        return _FREE
    if P.is_collective(node):
        return NodeCost(0, 0, device.overhead, device.overhead)
    if P.is_view(node) or P.is_free(node):
        return NodeCost(0, 0, device.view_overhead, device.view_overhead)
    out = node.meta.get("val")
    moved = _moved(node)
    count = flops(node)
    if device.node_seconds:
        key = node_key(node) or ""
        timed = device.node_seconds.get(key)
        if timed is not None:
            if cold and key in device.node_cold_seconds:
                timed += cold * max(0.0, device.node_cold_seconds[key] - timed)
            return NodeCost(count, moved, timed + device.overhead, device.overhead)
    outs = _tensors(out)
    seconds = moved / device.bandwidth
    per = per_element_seconds(node, device) if device.per_element else None
    if per:
        first = _tensors(_val(node.args))
        seconds = max(seconds, per * first[0].numel() if first else 0.0)
    if count:
        seconds = max(seconds, count / device.flop_rate(outs[0].dtype if outs else None, count))
    return NodeCost(count, moved, seconds + device.overhead, device.overhead)


def cold_operands(graphs: Sequence[tuple[str, fx.GraphModule]], device: DeviceRates) -> dict[tuple[str, str], float]:
    """For each timed node and each collective of ``graphs`` ((name, graph), in the order they
    run), the fraction of its operands' bytes that are out of the caches when it runs, by
    (graph, node name): a timed node costs its cold time by it, a collective's issue its cold
    bytes (``Link.issue``).

    An operand is cold when more than ``device.cache_bytes`` of the step's traffic (each
    node's bytes moved, ``node_cost``; a collective's result where it is waited for) passed
    since its memory was last touched. A view (or a getitem) is its base's memory; a wait
    lands its collective's result, touching it; a placeholder of a later graph named as a
    node of an earlier one (AOTAutograd's saved activations, views among them) is that
    node's memory; a tangent was just written (by the loss's backward). Other placeholders
    (parameters, inputs: last touched by the step before) are cold. Empty without a cache
    (a profile's)."""
    if device.cache_bytes is None:
        return {}
    clock = 0
    last: dict[str, int] = {}  # a memory's name: the clock when it was last touched
    alias: dict[str, str] = {}  # a view's name: its base's, across graphs (a saved view)
    fractions: dict[tuple[str, str], float] = {}
    for name, gm in graphs:
        # A node: the memory it is. A graph's placeholders come first, so a saved view's
        # alias is read before a node of this graph of the same name could replace it.
        base: dict[fx.Node, str] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                base[node] = alias.get(node.name, node.name)
                if P.is_tangent(node):
                    last[base[node]] = clock
                continue
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if P.is_wait(node) and inputs:  # a view of its collective's result, landed now
                base[node] = base.get(inputs[0], inputs[0].name)
                clock += _nbytes(node.meta.get("val"))
                last[base[node]] = clock
                continue
            if (P.is_view(node) or P.is_getitem(node)) and inputs:
                base[node] = alias[node.name] = base.get(inputs[0], inputs[0].name)
                continue
            base[node] = node.name
            key = node_key(node)
            if (key is not None and key in device.node_cold_seconds) or P.is_collective(node):
                sizes = [(_nbytes(a.meta.get("val")), last.get(base.get(a, a.name))) for a in inputs]
                total = sum(b for b, _ in sizes)
                cold = sum(b for b, t in sizes if t is None or clock - t > device.cache_bytes)
                fractions[(name, node.name)] = cold / total if total else 0.0
            clock += 0 if P.is_collective(node) or P.is_free(node) else _moved(node)  # node_cost's bytes
            for a in inputs:
                last[base.get(a, a.name)] = clock
            last[node.name] = clock
    return fractions


# The smallest mmap threshold of glibc's malloc (its default, before any free raises it).
MMAP_THRESHOLD_MIN = 128 << 10


def steady_threshold(most: int, largest: int, known: int | None = None) -> int:
    """glibc's mmap threshold once a step whose largest tensor is ``largest`` bytes has run in a
    process whose threshold was ``known`` (None: not known, the default's): a free of a mapped
    allocation raises it to its size, up to ``most`` (``DeviceRates.fresh_bytes``), and
    nothing lowers it."""
    return min(most, max(largest, known or 0, MMAP_THRESHOLD_MIN))


def fresh_pages(curves: Sequence[Sequence[int]], largest: int, device: DeviceRates,
                threshold: int | None = None) -> list[list[int]]:
    """The bytes the allocator faults in afresh at each node, in the steady state of a step
    whose live bytes after each node are ``curves`` (a graph each, in the order they run; the
    report's ``memory_curve``) and whose largest tensor is ``largest`` bytes.

    glibc's malloc, as the CPU's allocator: an allocation at or above its mmap threshold is
    mapped afresh each time; a free of one raises the threshold to its size, up to
    ``fresh_bytes``, and nothing lowers it, so in the steady state the threshold is the larger
    of the step's largest tensor's and ``threshold``, what the process had raised it to before
    (None: nothing known; calibration's own probe raises it to about ``fresh_bytes``), at most
    ``fresh_bytes``, and the heap holds the rest. The heap returns its top to the system when
    more than twice the threshold lies free there. So the heap is a watermark: the live bytes
    rising above it are faulted in, and it falls to the live bytes when it stands more than
    twice the threshold above them (backward frees forward's activations, the next forward
    faults them in again). Frees land at the top where they are the latest allocations:
    forward's activations, freed in reverse by backward, are. Two steps are walked; the
    second's faults are returned; none on a device without fresh pages."""
    if device.fresh_bytes is None:
        return [[0] * len(c) for c in curves]
    trim = 2 * steady_threshold(device.fresh_bytes, largest, threshold)
    mapped = curves[0][0] if curves and curves[0] else 0
    faults: list[list[int]] = []
    for _ in range(2):
        faults = []
        for curve in curves:
            row = []
            for live in curve:
                grown = max(0, live - mapped)
                row.append(grown)
                mapped = live if grown or mapped - live > trim else mapped
            faults.append(row)
    return faults


def largest_tensor(graphs: Sequence[fx.GraphModule]) -> int:
    """The bytes of the largest tensor a node of ``graphs`` allocates (not a view, not in place)."""
    return max((t.numel() * t.element_size() for gm in graphs for node in gm.graph.nodes
                if node.op == "call_function" and not P.is_view(node) and not P.mutates(node)
                for t in _tensors(node.meta.get("val"))), default=0)


def optimizer_seconds(state: OptimizerState, shard_bytes: Sequence[int], device: DeviceRates) -> float:
    """The optimizer step over shards of ``shard_bytes`` (those with gradients), memory-bound:
    the passes over a shard's size its operators make, one operator each. torch's Adam and
    AdamW (for-loop or foreach) make 21: the weight decay (2), the first moment's lerp (3),
    the second moment's mul and addcmul (2 + 4), the denominator's sqrt, div and add (2 each)
    and the update's addcdiv (4); a fused step (``fused=True``: one kernel over every
    shard) and another optimizer, the shard, its gradient and each state read and written
    (3 + 2 per state)."""
    fused = state.implementation == "fused"
    passes = 21 if state.adam_temporaries and not fused else 3 + 2 * state.states
    ops = 1 if fused else (8 if state.adam_temporaries else 1 + state.states) * len(shard_bytes)
    if device.asynchronous:  # the host launches while the device streams
        return max(passes * sum(shard_bytes) / device.bandwidth, ops * device.overhead)
    return passes * sum(shard_bytes) / device.bandwidth + ops * device.overhead


# -- the step -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveSpan:
    """One collective of the predicted step; times in seconds from the step's start."""

    graph: str
    node: str  # the collective's node
    wait: str  # its wait's node
    kind: str
    unit: str
    group: str
    dimension: str
    bytes: int  # its input's bytes
    issued: float  # compute issued it
    start: float  # its group began it (after the group's earlier collectives)
    end: float
    waited: float  # compute reached its wait

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def exposed(self) -> float:
        """How long compute waited for it."""
        return max(0.0, self.end - self.waited)


@dataclass(frozen=True)
class NodeSpan:
    graph: str
    node: str
    unit: str
    start: float
    end: float


@dataclass(frozen=True)
class UnitTime:
    name: str
    compute_seconds: float  # its nodes on the compute stream (module path, or its chains)
    comm_seconds: float  # its collectives, start to end
    exposed_comm_seconds: float  # the compute stream's waits on them


@dataclass(frozen=True)
class StepTime:
    """The predicted step. The compute stream is always computing or waiting, so
    ``seconds == compute_seconds + exposed_comm_seconds``; ``units`` split both (and the
    collectives' own durations) by FSDP unit, the agreement's waits under "agreement"."""

    rates: str
    seconds: float
    compute_seconds: float
    exposed_comm_seconds: float
    comm_seconds: float  # every collective's duration, start to end, overlapped or not
    graphs: tuple[tuple[str, float, float], ...]  # (graph, start, end)
    units: tuple[UnitTime, ...]
    collectives: tuple[CollectiveSpan, ...]
    agreement_seconds: float = 0.0  # the ranks' agreement before each graph (exposed)
    # The graphs' FLOPs (torch's formulas; recomputation included), and the seconds the
    # device would take for them at its peak rate per dtype: ``peak_seconds / seconds`` is
    # the step's FLOPs utilisation.
    flops: int = 0
    peak_seconds: float = 0.0
    nodes: tuple[NodeSpan, ...] = field(default=(), repr=False, compare=False)
    # On the CPU: the bytes of fresh pages charged to the graphs' nodes (``fresh_pages``), and
    # the mmap threshold they were walked with (the process's where known, else the largest
    # tensor's); (0, None) where nothing is charged.
    fresh_bytes: int = 0
    mmap_threshold: int | None = None


_EPS = 1e-12  # relative: times compare equal this close (seconds that add up stay exact enough)


def node_times(time: StepTime, graph: str, gm: fx.GraphModule) -> dict[fx.Node, tuple[float, float]]:
    """Each node of ``gm`` (``time``'s ``graph``) with its predicted start and end in seconds;
    a node that costs nothing sits where the one before it ended."""
    predicted = {s.node: (s.start, s.end) for s in time.nodes if s.graph == graph}
    now = next(start for name, start, _ in time.graphs if name == graph)
    clock: dict[fx.Node, tuple[float, float]] = {}
    for node in gm.graph.nodes:
        clock[node] = predicted.get(node.name, (now, now))
        now = clock[node][1]
    return clock


@dataclass
class _Flight:
    key: int
    group: str
    link: str  # what it shares bandwidth with
    latency: float
    work: float  # seconds at the link's full bandwidth
    issued: float
    start: float = math.nan
    end: float = math.nan
    pending: float = 0.0  # latency left: it moves no data until that has passed
    left: float = 0.0  # work left
    kind: str = ""  # all_gather, reduce_scatter, ...: which latency sharing applies

    def begin(self, at: float) -> None:
        self.start, self.pending, self.left = at, self.latency, self.work

    def in_data(self) -> bool:
        return self.pending <= 0.0


class _Streams:
    """The communication streams: one FIFO per process group; collectives in flight at once
    on one link share its bandwidth equally (processor sharing). A collective's latency
    passes at ``pace`` (1, or slower while compute runs where its wake-ups wait for a core:
    ``Rates.starvation``), divided among the latencies passing at once as ``sharing`` says
    (``Rates.latency_sharing``; ``mixed`` where the kinds waiting differ)."""

    def __init__(self, sharing: float = 0.0, mixed: float | None = None) -> None:
        self.now = 0.0
        self.pace = 1.0
        self.sharing = sharing
        self.mixed = sharing if mixed is None else mixed
        self.queues: dict[str, deque[_Flight]] = {}

    def _latency_pace(self, active: list[_Flight]) -> float:
        waiting = [f.kind for f in active if not f.in_data()]
        if len(waiting) < 2:
            return self.pace
        sharing = self.sharing if len(set(waiting)) == 1 else self.mixed
        return self.pace / (1.0 + sharing * (len(waiting) - 1))

    def _active(self) -> list[_Flight]:
        return [q[0] for q in self.queues.values() if q]

    def _sharing(self, active: list[_Flight]) -> dict[str, int]:
        sharing: dict[str, int] = {}
        for f in active:
            if f.in_data():
                sharing[f.link] = sharing.get(f.link, 0) + 1
        return sharing

    def _next_event(self) -> tuple[float, _Flight | None]:
        active = self._active()
        sharing, pace = self._sharing(active), self._latency_pace(active)
        best, who = math.inf, None
        for f in active:
            at = self.now + (f.pending / pace if not f.in_data() else f.left * sharing[f.link])
            if at < best:
                best, who = at, f
        return best, who

    def _step(self, until: float) -> bool:
        """Advance to the next event or ``until``, whichever is first; True if an event."""
        at, who = self._next_event()
        latency_ends = who is not None and not who.in_data()  # else its data does
        target = min(at, until)
        active = self._active()
        sharing, pace = self._sharing(active), self._latency_pace(active)
        elapsed = max(0.0, target - self.now)
        for f in active:
            if not f.in_data():
                f.pending -= elapsed * pace
            else:
                f.left -= elapsed / sharing[f.link]
        self.now = max(self.now, target)
        if who is None or at > until:
            return False
        # Exactly: rounding must not leave a sliver of latency or work that never ends.
        if latency_ends:
            who.pending = 0.0
        else:
            who.left = 0.0
        for q in self.queues.values():  # everything done by now leaves its queue
            while q and q[0].in_data() and q[0].left <= _EPS * max(q[0].work, 1e-9):
                done = q.popleft()
                done.end = self.now
                if q:
                    q[0].begin(max(self.now, q[0].issued))
        return True

    def advance(self, t: float) -> None:
        while self._step(t):
            pass
        self.now = max(self.now, t)

    def issue(self, f: _Flight) -> None:
        self.advance(f.issued)
        q = self.queues.setdefault(f.group, deque())
        if not q:
            f.begin(f.issued)
        q.append(f)

    def compute(self, now: float, seconds: float, contention: float, starvation: float = 0.0) -> float:
        """When ``seconds`` of compute that start at ``now`` end: slowed by ``1 + contention k``
        while k collectives are in flight (those already issued: nothing is issued meanwhile),
        the collectives' latencies passing at ``1 / (1 + starvation)`` of their pace meanwhile."""
        self.advance(now)
        if not contention and not starvation:
            return now + seconds
        self.pace = 1.0 / (1.0 + starvation)
        try:
            while seconds > 0:
                if not self._active():
                    self.now = now + seconds
                    return now + seconds
                at, _ = self._next_event()
                slow = seconds * (1 + contention * len(self._active()))
                if now + slow <= at:
                    self.advance(now + slow)
                    return now + slow
                seconds -= (at - now) / (1 + contention * len(self._active()))
                self.advance(at)
                now = at
            return now
        finally:
            self.pace = 1.0

    def finish(self, f: _Flight) -> float:
        while math.isnan(f.end):
            if not self._step(math.inf):
                raise AssertionError(f"collective {f.key} never ends")
        return f.end


def unit_of(node: fx.Node, units: Sequence[str]) -> str:
    """The FSDP unit ``node`` belongs to: its chain's, else the innermost unit whose module
    path contains the module that computed it; "" (the root) otherwise."""
    info = meta.get_info(node)
    if info is not None:
        return info.unit
    path = meta.module_path(node)
    best, depth = "", 0
    for unit in units if path else ():
        for name in unit.split("+"):  # tied units merge: "a+b"
            if name and len(name) > depth and (path == name or path.startswith(name + ".")):  # type: ignore[union-attr]
                best, depth = unit, len(name)
    return best


def predict_step(graphs: Mapping[str, fx.GraphModule], rates: Rates, *,
                 dimensions: Mapping[str, tuple[str, int]] | None = None,
                 units: Sequence[str] = (), agreement: tuple[int, int] | None = None,
                 memory: Mapping[str, Sequence[int]] | None = None) -> StepTime:
    """Simulate ``graphs`` ("forward" or "inference", then "backward") one after the other.

    ``dimensions``: each process group's layout dimension and slot (``Layout.dimensions``),
    which link it runs on; ``units``: the plan's unit names, to attribute compute to;
    ``agreement``: (bytes, ranks) of the ranks' all_gather before each graph, which the
    compute stream and the host wait for (None: no agreement); ``memory``: the live bytes after each
    node, by phase (the report's ``memory_curve``), from which a device with fresh pages
    (the CPU) charges each node the pages it faults in (``fresh_pages``, with the allocator's
    threshold ``rates.mmap_threshold`` where it is known).
    """
    device, network = rates.device, rates.network
    names = [n for n in ("forward", "inference", "backward") if n in graphs]
    faulted: dict[str, list[int]] = {}
    threshold = None
    if memory is not None and device.fresh_bytes is not None:
        phases = [p for p in ("forward", "loss", "backward", "optimizer step") if p in memory]
        largest = largest_tensor([graphs[n] for n in names])
        threshold = steady_threshold(device.fresh_bytes, largest, rates.mmap_threshold)
        faulted = dict(zip(phases, fresh_pages([memory[p] for p in phases], largest, device,
                                               rates.mmap_threshold)))
    charged = 0
    cold = cold_operands([(n, graphs[n]) for n in names], device)
    net = _Streams(rates.latency_sharing, rates.latency_sharing_mixed)
    now = 0.0  # the compute stream's clock
    host = 0.0  # where the host has launched up to (an asynchronous device's; else ``now``)
    compute = exposed = agreed = peak = 0.0
    total_flops = 0
    per_unit: dict[str, list[float]] = {u: [0.0, 0.0, 0.0] for u in units}
    spans: list[CollectiveSpan] = []
    node_spans: list[NodeSpan] = []
    windows: list[tuple[str, float, float]] = []
    key = 0
    for name in names:
        gm = graphs[name]
        begin = now
        if agreement is not None and agreement[1] > 1:
            # The compute stream waits for the exchange, which starts where both the host and
            # the device have got to; the host is taken to wait for it too. On a device's
            # backend the runtime compares on the device in steady state and the host runs on
            # (driver/run/consistency.py), but a lead carried from graph to graph makes the
            # step's time depend on depth other than linearly, which auto()'s prediction from
            # a few blocks relies on (tests/test_auto.py); the model keeps the wait.
            waited = network.seconds("agreement", agreement[0], agreement[1])
            compute += max(0.0, host - now)  # the device idle until the host got here
            now = host = max(now, host) + waited
            agreed += waited
            exposed += waited
        issued: dict[fx.Node, tuple[_Flight, Collective]] = {}
        info = {node: c for node, c in collective_nodes(name, gm, dimensions)}
        fresh = faulted.get("forward" if name == "inference" else name, [])
        for i, node in enumerate(gm.graph.nodes):
            cost = node_cost(node, device, cold.get((name, node.name), 0.0))
            if i < len(fresh) and fresh[i]:
                cost = replace(cost, seconds=cost.seconds + fresh[i] / device.fresh_bandwidth)
                charged += fresh[i]
            c = info.get(node)
            if c is not None:  # a collective
                link = network.link(c.kind, c.group_size, c.dimension or "shard")
                bus = _bus(c.kind, c.input_bytes, c.group_size)
                held = link.issue(bus, cold.get((name, node.name), 0.0))
                if held:  # its call holds the thread, then it flies (the host's, on a device)
                    cost = replace(cost, seconds=cost.seconds + held,
                                   launch=cost.launch + held if device.asynchronous else cost.launch)
            unit = unit_of(node, units) if cost.seconds else ""
            if cost.seconds:
                if device.asynchronous:  # launched by the host, then run when the stream is free
                    host += cost.launch
                    start, kernel = max(now, host), cost.seconds - cost.launch
                    end = net.compute(start, kernel, rates.contention, rates.starvation) if kernel > 0 else start
                else:
                    end = net.compute(now, cost.seconds, rates.contention, rates.starvation)
                node_spans.append(NodeSpan(name, node.name, unit, now, end))
                compute += end - now
                per_unit.setdefault(unit, [0.0, 0.0, 0.0])[0] += end - now
                now = end
            if cost.flops:
                total_flops += cost.flops
                outs = _tensors(node.meta.get("val"))
                peak += cost.flops / device.peak_rate(outs[0].dtype if outs else None)
            if c is not None:
                flight = _Flight(key, c.group_name, c.dimension or "shard",
                                 link.latency + link.hop_latency * (c.group_size - 1),
                                 bus / link.bandwidth, now, kind=c.kind)
                key += 1
                net.issue(flight)
                issued[node] = (flight, c)
            elif P.is_wait(node) and isinstance(node.args[0], fx.Node) and node.args[0] in issued:
                flight, c = issued.pop(node.args[0])
                end = net.finish(flight)
                wait = max(0.0, end - now)
                spans.append(CollectiveSpan(name, node.args[0].name, node.name, c.kind, c.unit, c.group_name,
                                            c.dimension, c.input_bytes, flight.issued, flight.start, end, now))
                entry = per_unit.setdefault(c.unit, [0.0, 0.0, 0.0])
                entry[1] += end - flight.start
                entry[2] += wait
                if wait:  # the wait node spans the compute stream's wait
                    node_spans.append(NodeSpan(name, node.name, c.unit, now, now + wait))
                exposed += wait
                now += wait
        for flight, _ in issued.values():  # not waited in this graph (never, once verified)
            end = net.finish(flight)
            exposed += max(0.0, end - now)  # the graph ends when it has: seconds stay compute + exposed
            now = max(now, end)
        windows.append((name, begin, now))
    if host > now:  # the host launched the last node after the device had finished the rest
        compute += host - now
        now = host
    if agreed:
        per_unit["agreement"] = [0.0, 0.0, agreed]
    unit_times = tuple(UnitTime(u, *v) for u, v in per_unit.items())
    return StepTime(rates.name, now, compute, exposed, sum(s.seconds for s in spans), tuple(windows),
                    unit_times, tuple(sorted(spans, key=lambda s: (s.issued, s.start))), agreed,
                    total_flops, peak, tuple(node_spans), charged, threshold)

