"""Calibration: the rates of this device and of the live process group, measured briefly.

    device_rates(device)      matmul FLOP/s per dtype (float32, bfloat16), memory bandwidth,
                              the overhead of an operator and of a view: measured once per
                              device, torch release and thread count, cached on disk
    measure_network(group)    all_gather, reduce_scatter and all_reduce at five sizes each (three
                              on an accelerator), fitted by least squares to latency + bus
                              bytes / bandwidth; on the CPU, then each one's issue on an input
                              out of the caches (measure_cold_issues)
    calibrate(world, device)  both, the same on every rank: each rank's numbers, then the
                              slowest of each over the job (a MAX all_reduce), so every rank
                              predicts (and, later, plans) the same
    with_node_times(...)      on the CPU, each distinct matmul of the graphs timed here, by
                              each rank alone (report() may run on one rank); on several
                              ranks the driver settles them at a step's first forward, each
                              node the slowest rank's (with_slowest_node_times), so every
                              rank's report predicts the same after a step (before one, each
                              its own; auto() takes each trial's largest over the ranks)

The cache is one JSON file, ``calibration.json``, in ``$FXSHARD_CACHE_DIR`` or
``~/.cache/fxshard``. The network's entry is keyed by backend, group size, whether
the job has two groups to measure latency sharing on, host, torch release and
thread count; a rank without an entry makes every rank
measure (they decide together, in the same all_reduce), so ranks never wait on
a measurement only some of them run. Delete the file to measure again.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
import torch.fx as fx

from fxshard.driver.run import rehearsal
from fxshard.driver.run.runtime import World, comm_device
from fxshard.ir import compat
from fxshard.ir.collectives import bus_bytes
from fxshard.ir.compat import pytree
from fxshard.ir.cost import (
    DROPOUT_P,
    MMAP_THRESHOLD_MIN,
    PER_ELEMENT,
    DeviceRates,
    Link,
    Network,
    Rates,
    dropout_key,
    node_key,
)

log = logging.getLogger("fxshard")

T = TypeVar("T")
CACHE_ENV = "FXSHARD_CACHE_DIR"
DTYPES = ("float32", "bfloat16")
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# The collectives' sizes (full-buffer bytes) and timed calls at each (their mean), after one to
# warm up: many at the smallest size, which decides the latency, varies most and costs least;
# few at the largest, which cost tens of milliseconds each. A small collective's time on a
# shared host is heavy-tailed (a 64 KiB reduce_scatter between two gloo processes on 2 cores:
# median 0.6 ms, mean 1.2-1.4 ms, one call in a hundred 5-6 ms), so its mean over 60 calls
# moved by a third between fresh calibrations and carried a latency-bound step's prediction
# with it; over 240 calls (about 0.6 s more) 16 fresh calibrations fitted the all_gather's
# latency within -14% to +21% of their median, where 60 calls gave -31% to +41%
# (benchmarks/results/calibration_spread.md). On the CPU up to 16 MiB: gloo's bandwidth falls
# as buffers outgrow the caches. The CPU's 4 and 8 MiB (calibration method 12, about 0.35 s
# more) put the line where the steps' 2-17 MB collectives are: gloo moves 4-8 MiB buffers
# faster per byte than 16 MiB ones, and the line through 64 KiB, 1 MiB and 16 MiB alone
# predicted them long. Timed alone after twelve calibrations on 2 gloo ranks of the second
# machine, all_gathers and reduce_scatters of 1-16 MiB came within 25% of the five-size line in
# 111 of 120 and of the three-size line refitted from the same calls in 86; on the third, with
# method 17, in 89 and 79 (benchmarks/network_sizes.py, docs/time.md). (A fourth size alone, 10
# calls of 4 MiB, with 8 calls of 16 MiB, had left the bandwidth's swing between calibrations
# as it was: 0.50-0.77 GB/s for all_gather.)
NETWORK_SIZES = {"cpu": ((1 << 16, 240), (1 << 20, 20), (1 << 22, 10), (1 << 23, 6), (1 << 24, 5)),
                 "accelerator": ((1 << 20, 60), (1 << 24, 20), (1 << 27, 5))}
# Untimed rounds of every kind at the largest size before any call is timed. A process's first
# collectives on a link run slower than its later ones: between two gloo processes here, 8 MB
# all_gathers and 16 MB reduce_scatters took 10-12 and 26-31 ms in their first six calls and
# 6-7 and 19-21 ms from about the fifteenth on, and stayed there after a 5 s pause (not the
# allocator: the same with glibc's mmap threshold fixed). The step's collectives run warm, so a
# calibration that timed the first calls as its largest size's fitted a bandwidth too low and
# predicted the steps' 6-17 MB collectives 11-62% long (the GPT's, three fresh calibrations).
# Four rounds of 16 MiB (about 0.25 s on 2 gloo ranks) left no first-calls slowdown.
WARM_ROUNDS = 4
# A timed node's cold calls, each on operands of its own (``_time_node``).
COLD_CALLS = 7
# How the rates are measured; a cache entry measured otherwise is measured again.
METHOD = 18  # 16: dropout at three p, the cold issue, and the latency sharing of kinds that differ;
# 17: the device's rates the faster of two passes (DEVICE_PASSES); 18: a fresh-page probe that
# finds nothing slow here probes again in a new process (a cached "no fresh pages" measured again)

# This process's rates, by cache key: a device's, and a network's cache entry.
_DEVICES: dict[str, DeviceRates] = {}
_NODES: dict[str, dict[str, tuple[float, float]]] = {}  # timed nodes' (warm, cold) seconds, by device key
_NETWORKS: dict[str, dict[str, Any]] = {}
_LIBRARY: dict[str, int] = {}  # library_bytes, by device


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fxshard") / "calibration.json"


def _table() -> dict[str, Any]:
    """The cache file's entries; none where it is missing, unreadable, or not a JSON object
    (a file written by something else, or cut short: measured again, and written over)."""
    try:
        table = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _load(key: str) -> dict[str, Any] | None:
    entry = _table().get(key)
    return entry if isinstance(entry, dict) else None


def _save(key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` to the cache file (written whole, then renamed: readers never see half)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = _table()
        table[key] = entry
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        scratch.replace(path)
    except OSError as e:  # a read-only home: measure again next time
        log.info("fxshard: could not cache the calibration in %s: %s", path, e)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{_cpu_name()}, {torch.get_num_threads()} threads"
    return str(device)


def device_key(device: torch.device) -> str:
    return (f"device | {device_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads"
            f" | method {METHOD}")


# -- measuring ----------------------------------------------------------------------------------


def keeps_rng(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with the process's random generators as it found them: calibration draws its
    operands at random, and runs where the user's stream must go on as if it had not (at
    compile, at a step's first forward, in ``report()``). Measured or cached, the next
    dropout mask and ``torch.randn`` are the same: a run that finds the rates cached trains
    bit for bit like one that measures them."""

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> T:
        device_type, devices = _initialized_accelerator()
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            return fn(*args, **kwargs)

    return kept


def _initialized_accelerator() -> tuple[str | None, list[int]]:
    """The accelerator whose generators calibration may draw from (CUDA's, XPU's: torch's
    current one) and its devices, where it is initialized: a fork of one that is not would
    initialize it. (None, []) where there is none; the CPU's generator is always forked."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return None, []
    module = torch.get_device_module(accelerator.type)
    if not getattr(module, "is_initialized", lambda: False)():
        return accelerator.type, []
    return accelerator.type, list(range(module.device_count()))


def _sync(device: torch.device) -> None:
    """Wait for what ``device`` has queued (an accelerator's: CUDA's, XPU's; the CPU runs
    each call to its end)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, least: float = 0.01, calls: int = 3,
             how: Literal["median", "mean", "fastest"] = "median") -> float:
    """The time of one call of ``fn``, over at least ``calls`` calls and ``least`` seconds: by
    default the median, a typical call (on a shared host an operator's typical call is 5-15%
    above its fastest, which is what calibration took before; and one call in three slowed by
    something else moves a mean of three, not their median); ``how="mean"`` the mean, what a
    run of many such calls pays, its slow calls included (a small collective's: twice its
    median, and frequent enough that many calls measure it); ``how="fastest"`` the fastest
    call (where only an order of magnitude is wanted: how many calls fill a loop)."""
    fn()
    _sync(device)
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < calls or time.perf_counter() - begin < least and len(times) < 100:
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    if how == "fastest":
        return min(times)
    return statistics.median(times) if how == "median" else statistics.fmean(times)


def matmul_sizes(device: torch.device) -> tuple[int, ...]:
    """The square matmuls measured, n x n by n x n: from where dispatch dominates to the peak."""
    return (64, 128, 256, 512) if device.type == "cpu" else (512, 1024, 2048, 4096)


# Passes over the device's rates (``measure_device``), the faster of each kept.
DEVICE_PASSES = 2


def measure_device(device: torch.device) -> DeviceRates:
    """This device's rates, in about two seconds on the CPU (at its thread count; the fresh
    pages about a second of it): the matmul curve, the bandwidth, the overheads and the
    per-element operators each measured in ``DEVICE_PASSES`` passes, one after the other,
    each the median of its calls (``_seconds``), and of each the faster pass kept; the
    fresh pages once.

    A moment of a shared host (or of another rank calibrating beside this one) slows the
    few calls a point takes: between two gloo ranks here one calibration in about ten
    measured the 512x512 float32 matmul at 39-77 GFLOP/s and the bandwidth at 8 GB/s
    where the rest measured 86-112 and 15-53, and the step it predicted came out 32% long
    (docs/time.md). A slow moment slows one pass; a slower device slows both."""
    passes = [_device_pass(device) for _ in range(DEVICE_PASSES)]
    curves = {name: tuple((work, max(p.curves[name][i][1] for p in passes))
                          for i, (work, _) in enumerate(passes[0].curves[name])) for name in DTYPES}
    per_element = {name: min(p.per_element[name] for p in passes) for name in passes[0].per_element}
    fresh_bytes, fresh_bandwidth = measure_fresh(device)
    return DeviceRates(device_name(device), {name: curve[-1][1] for name, curve in curves.items()},
                       max(p.bandwidth for p in passes), min(p.overhead for p in passes),
                       min(p.view for p in passes), curves, per_element,
                       asynchronous=device.type != "cpu", measured=True,
                       fresh_bytes=fresh_bytes, fresh_bandwidth=fresh_bandwidth,
                       cache_bytes=last_level_cache() if device.type == "cpu" else None)


@dataclass
class _DevicePass:
    """One pass of ``measure_device``: its rates as measured then."""

    curves: dict[str, tuple[tuple[float, float], ...]]  # by dtype: (FLOPs, FLOP/s) by size
    bandwidth: float  # bytes/s
    overhead: float  # seconds per operator
    view: float  # seconds per view
    per_element: dict[str, float]  # seconds per element, by cost.PER_ELEMENT key


def _device_pass(device: torch.device) -> _DevicePass:
    curves: dict[str, tuple[tuple[float, float], ...]] = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        points = []
        for n in matmul_sizes(device):
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            work = 2.0 * n ** 3
            points.append((work, work / _seconds(functools.partial(torch.mm, a, b), device)))
        curves[name] = tuple(points)
    # Streaming tensors larger than a CPU's caches (16 MiB each), into a buffer already touched:
    # a fresh 64 MiB allocation on the CPU costs its page faults on top (docs/time.md).
    numel = (1 << 26) if device.type != "cpu" else (1 << 22)
    x, y, out = (torch.randn(numel, device=device) for _ in range(3))
    bandwidth = 3 * numel * 4 / _seconds(lambda: torch.add(x, y, out=out), device)
    one, other = torch.ones(1, device=device), torch.ones(1, device=device)
    add, view = torch.ops.aten.add.Tensor, torch.ops.aten.view.default

    def adds() -> None:
        for _ in range(100):
            add(one, other)

    def views() -> None:
        for _ in range(100):
            view(one, [1])

    per_element = {name: _seconds(run, device) / count for name, (run, count) in _per_element_ops(device).items()}
    return _DevicePass(curves, bandwidth, _seconds(adds, device) / 100, _seconds(views, device) / 100, per_element)


def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The CPU's largest data cache in bytes, as Linux describes it (``index*/size``, e.g.
    "32768K"), which a timed node's operands are cold beyond (``cost.cold_operands``); None
    where it says nothing (another OS): the timed nodes then keep their warm times."""
    sizes = []
    for index in Path(root).glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    if not sizes:
        log.info("fxshard: no CPU cache size under %s; timed nodes keep their warm times", root)
    return max(sizes, default=None)


FRESH_LARGEST = 64 << 20  # the largest allocation probed for fresh pages
# A size is slow where its fresh fill takes this many times the kept one. Measured here, in 16
# processes: 0.7-1.7x below glibc's mmap threshold (the heap reuses the pages), 4.1-9.1x at 32 MiB
# and 3.4-4.2x at 64 MiB, where the kept tensor outgrows the caches and its fill slows too.
FRESH_SLOWER = 2.5


def fresh_is_slow(fresh: float, kept: float) -> bool:
    """Whether a fill into a freshly allocated tensor (``fresh`` seconds) paid for page faults,
    against the same fill into a tensor kept (``kept``)."""
    return fresh > FRESH_SLOWER * kept


def measure_fresh(device: torch.device) -> tuple[int | None, float]:
    """Where the CPU's allocator stops reusing memory (``DeviceRates.fresh_bytes``) and what a
    fresh allocation costs on top of writing it (``fresh_bandwidth``): ``probe_fresh`` in this
    process, or where it finds no size slow under glibc, in a new one (``_probe_in_a_new_process``:
    its heap holds no free memory that could serve the probe's allocations). On an accelerator,
    or where neither finds a size slow: (None, inf).

    A process that built a model before calibrating may hold a heap with more free memory than
    the probe's largest allocation; glibc then serves every size from it, none faults, and the
    probe reads "no fresh pages", which the cache keeps for every later process on the host.
    The 12-layer GPT of the time benchmark, calibrated right after it was built in one process
    with a gloo group of its own, read so in three of three processes here; its steps faulted
    in 28-51 MB that the model, charging none, left out (17-21% short; with the new process,
    3-7%: docs/time.md)."""
    if device.type != "cpu":
        return None, math.inf
    found = probe_fresh(device)
    if found[0] is None and _glibc() is not None:
        return _probe_in_a_new_process()
    return found


def _probe_in_a_new_process() -> tuple[int | None, float]:
    """``probe_fresh`` in a new Python process with this one's thread count; (None, inf), with
    a warning, where that process fails."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[3])  # the folder that holds the fxshard package
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch; torch.set_num_threads(int(sys.argv[2])); "
            "from fxshard.driver.report import calibrate; "
            "low, bandwidth = calibrate.probe_fresh(torch.device('cpu')); print(low, bandwidth)")
    try:
        out = subprocess.run([sys.executable, "-c", code, root, str(torch.get_num_threads())],
                             capture_output=True, text=True, timeout=300, check=True).stdout.split()
        low, bandwidth = out[-2], float(out[-1])
        return (None if low == "None" else int(low)), bandwidth
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        log.warning("fxshard: the fresh-page probe found no size slow in this process and could not run "
                    "in a new one (%s); the time model charges no fresh pages", e)
        return None, math.inf


def probe_fresh(device: torch.device) -> tuple[int | None, float]:
    """``measure_fresh``'s probe in this process, in about a second: a tensor allocated, filled
    and freed, against the same fill into a tensor kept. A size is slow where the fresh fill
    takes over ``FRESH_SLOWER`` times the kept one (``fresh_is_slow``) in two measurements;
    sizes double from 1 MiB to ``FRESH_LARGEST`` and ``fresh_boundary`` finds where slow
    begins. The bandwidth is the largest size's over the smaller of its two measured
    differences. (None, inf) where no size up to ``FRESH_LARGEST`` is slow."""

    def costs(nbytes: int) -> tuple[float, float]:
        numel = nbytes // 4
        kept = torch.empty(numel)
        reused = _seconds(lambda: kept.fill_(1.0), device, least=0.0, calls=3, how="fastest")
        fresh = _seconds(lambda: _allocate(numel).fill_(1.0), device, least=0.0, calls=3, how="fastest")
        return fresh, reused

    extra: dict[int, float] = {}  # seconds a slow size's fresh fill takes beyond its kept one (the less of two)

    def slow(nbytes: int) -> bool:
        # Slow twice over: one 16 MiB probe in about ten, under glibc's threshold, came out slow.
        gaps = []
        for _ in range(2):
            fresh, reused = costs(nbytes)
            if not fresh_is_slow(fresh, reused):
                return False
            gaps.append(fresh - reused)
        extra[nbytes] = min(gaps)
        return True

    sizes = [1 << k for k in range(20, FRESH_LARGEST.bit_length())]
    for nbytes in sizes:  # as a step leaves the allocator: each size allocated and freed once
        torch.empty(nbytes // 4).fill_(1.0)
    low = fresh_boundary(slow, sizes)
    if low is None:
        return None, math.inf
    return low + 1, FRESH_LARGEST / extra[FRESH_LARGEST]  # fresh_boundary found it slow


# glibc's largest dynamic mmap threshold on a 64-bit host (DEFAULT_MMAP_THRESHOLD_MAX): a free
# of a mapped chunk no larger than this raises the threshold to its size.
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
# The largest allocation this process mapped afresh and freed while calibrating (glibc's count
# of mapped chunks said so), no larger than GLIBC_MMAP_THRESHOLD_MAX: glibc's threshold is at
# least this from then on.
_mapped_and_freed = 0


def _allocate(numel: int) -> torch.Tensor:
    """A float32 tensor of ``numel`` elements, noting (``_mapped_and_freed``) whether glibc
    mapped it afresh: its free will raise glibc's mmap threshold to its size."""
    global _mapped_and_freed
    libc = _glibc()
    before = libc.mallinfo2().hblks if libc is not None else 0
    tensor = torch.empty(numel)
    nbytes = tensor.untyped_storage().nbytes()
    chunk = (nbytes + 128 + 4095) // 4096 * 4096  # with glibc's header and torch's alignment
    if libc is not None and libc.mallinfo2().hblks > before and chunk <= GLIBC_MMAP_THRESHOLD_MAX:
        _mapped_and_freed = max(_mapped_and_freed, chunk)
    return tensor


def mmap_threshold() -> int | None:
    """glibc's mmap threshold in this process, where it is known: fixed by
    ``MALLOC_MMAP_THRESHOLD_`` (which turns glibc's raising off), or at least the largest
    allocation the fresh-page probe (``measure_fresh``) had mapped and freed here. A free of a
    mapped allocation raises the threshold to its size, up to 32 MiB, and nothing lowers it, so
    a process that calibrated its device keeps a threshold of about ``fresh_bytes``, and a step of
    smaller tensors maps nothing afresh there (``cost.fresh_pages``). None where it is not known
    (not glibc; a calibration read from the cache): the model takes the step's largest tensor.
    Read, not probed: an allocation asked of glibc to find the threshold may be served from a
    free chunk of the heap whatever the threshold."""
    if _glibc() is None:
        return None
    settings = dict(item.partition("=")[::2] for item in os.environ.get("GLIBC_TUNABLES", "").split(":"))
    fixed = os.environ.get("MALLOC_MMAP_THRESHOLD_") or settings.get("glibc.malloc.mmap_threshold", "")
    if fixed.isdigit():
        return int(fixed)
    if any(os.environ.get(f"MALLOC_{name.upper()}_") or settings.get(f"glibc.malloc.{name}")
           for name in ("trim_threshold", "top_pad", "mmap_max")):
        return None  # glibc's raising is off, and the threshold stays at its default
    return _mapped_and_freed or None


@functools.cache
def _glibc() -> Any:
    """The process's C library through ctypes where it is glibc with ``mallinfo2`` (2.33 and
    later); else None."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc's own symbol
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    mallinfo2.restype = Mallinfo2
    return libc


def fresh_boundary(slow: Callable[[int], bool], sizes: list[int]) -> int | None:
    """The largest size found fast below the smallest of ``sizes`` (ascending) from which every
    larger one is ``slow``, bisected to 1/8 of that octave (multiples of 4 KiB pages); None
    where the largest is fast. A slow size with fast ones above it is noise, and ignored."""
    slows = [slow(nbytes) for nbytes in sizes]
    if not slows[-1]:
        return None
    first = len(slows) - 1
    while first > 0 and slows[first - 1]:
        first -= 1
    low, high = (sizes[first - 1] if first else 0), sizes[first]
    step = (high - low) // 8
    while high - low > step:
        middle = (low + high) // 2 // 4096 * 4096
        if slow(middle):
            high = middle
        else:
            low = middle
    return low


def _per_element_ops(device: torch.device) -> dict[str, tuple[Callable[[], object], int]]:
    """Each of ``cost.PER_ELEMENT`` on about a million elements (16 million on an
    accelerator), and the elements of its first operand, which the cost model charges by."""
    aten = torch.ops.aten
    numel = (1 << 24) if device.type != "cpu" else (1 << 20)
    width = 1024
    rows = numel // width

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    x, g, m, gm = randn(numel), randn(numel), randn(rows, width), randn(rows, width)
    w, b = torch.ones(width, device=device), torch.zeros(width, device=device)
    soft, log_soft = aten._softmax(m, -1, False), aten._log_softmax(m, -1, False)
    _, mean, rstd = aten.native_layer_norm(m, [width], w, b, 1e-5)
    image = randn(numel // (64 * 32 * 32), 64, 32, 32)
    pooled, where = aten.max_pool2d_with_indices(image, [2, 2], [2, 2])
    tokens = torch.randint(0, 8192, (rows,), device=device)
    kept = aten.native_dropout(x, 0.1, True)[1]
    ops: dict[str, tuple[Callable[[], object], int]] = {
        "tanh": (lambda: aten.tanh(x), numel),
        "sigmoid": (lambda: aten.sigmoid(x), numel),
        "exp": (lambda: aten.exp(x), numel),
        "gelu": (lambda: aten.gelu(x), numel),
        "gelu_backward": (lambda: aten.gelu_backward(g, x), numel),
        "silu": (lambda: aten.silu(x), numel),
        "silu_backward": (lambda: aten.silu_backward(g, x), numel),
        "_softmax": (lambda: aten._softmax(m, -1, False), numel),
        "_softmax_backward_data": (lambda: aten._softmax_backward_data(gm, soft, -1, m.dtype), numel),
        "_log_softmax": (lambda: aten._log_softmax(m, -1, False), numel),
        "_log_softmax_backward_data": (lambda: aten._log_softmax_backward_data(gm, log_soft, -1, m.dtype), numel),
        "native_layer_norm": (lambda: aten.native_layer_norm(m, [width], w, b, 1e-5), numel),
        "native_layer_norm_backward": (lambda: aten.native_layer_norm_backward(
            gm, m, [width], mean, rstd, w, b, [True, True, True]), numel),
        "max_pool2d_with_indices": (lambda: aten.max_pool2d_with_indices(image, [2, 2], [2, 2]), image.numel()),
        "max_pool2d_with_indices_backward": (lambda: aten.max_pool2d_with_indices_backward(
            pooled, image, [2, 2], [2, 2], [0, 0], [1, 1], False, where), pooled.numel()),
        # Its mask's branch per element makes p matter (cost.DROPOUT_P): one entry per p.
        **{dropout_key(p): (functools.partial(aten.native_dropout, x, p, True), numel) for p in DROPOUT_P},
        # Its mask is bool: cast to the gradient's dtype, then two multiplies (about 2.3 ms for a
        # million elements here, where an add of as many took 0.6).
        "native_dropout_backward": (lambda: aten.native_dropout_backward(g, kept, 1 / 0.9), numel),
        "embedding_dense_backward": (lambda: aten.embedding_dense_backward(gm, tokens, 8192, -1, False), numel),
    }
    assert tuple(ops) == PER_ELEMENT, "calibrate every operator the cost model charges per element"
    return ops


@keeps_rng
def device_rates(device: torch.device) -> DeviceRates:
    """This device's rates: from this process's memo, the cache, or measured (then cached)."""
    key = device_key(device)
    if key in _DEVICES:
        return _DEVICES[key]
    entry = _load(key)
    rates = _device_from(entry, device) if entry is not None else None
    if rates is None:
        rates = measure_device(device)
        _save(key, _device_entry(rates))
        log.info("fxshard: measured %s", rates)
    _DEVICES[key] = rates
    return rates


def _device_entry(rates: DeviceRates) -> dict[str, Any]:
    return {"name": rates.name, "matmul_flops": dict(rates.matmul_flops), "bandwidth": rates.bandwidth,
            "overhead": rates.overhead, "view_overhead": rates.view_overhead,
            "matmul_curve": {k: [list(p) for p in v] for k, v in rates.matmul_curve.items()},
            "per_element": dict(rates.per_element), "asynchronous": rates.asynchronous,
            "fresh_bytes": rates.fresh_bytes, "fresh_bandwidth": rates.fresh_bandwidth,
            "cache_bytes": rates.cache_bytes}


def _device_from(entry: dict[str, Any], device: torch.device) -> DeviceRates | None:
    """The cached rates of ``device``; None (measured again) where the entry is not what this
    fxshard measures there: every ``PER_ELEMENT`` operator, a curve point per matmul size, and
    rates that are positive numbers. ``_pack`` lines the ranks' values up by position, so an
    entry short of an operator would misalign them (or fail the ranks' all_reduce)."""
    rates = _device_entry_read(entry)
    if rates is None:
        return None
    sizes = len(matmul_sizes(device))
    rated = [*rates.matmul_flops.values(), rates.bandwidth, rates.fresh_bandwidth,
             *(rate for curve in rates.matmul_curve.values() for _, rate in curve)]
    if (set(rates.per_element) != set(PER_ELEMENT) or any(len(c) != sizes for c in rates.matmul_curve.values())
            or not all(rate > 0 for rate in rated)
            or not all(math.isfinite(v) and v >= 0 for v in (rates.overhead, rates.view_overhead,
                                                             *rates.per_element.values()))):
        return None
    return rates


def _device_entry_read(entry: dict[str, Any]) -> DeviceRates | None:
    try:
        return DeviceRates(entry["name"], {k: float(v) for k, v in entry["matmul_flops"].items()},
                           float(entry["bandwidth"]), float(entry["overhead"]), float(entry["view_overhead"]),
                           {k: tuple((float(f), float(r)) for f, r in v)
                            for k, v in entry["matmul_curve"].items()},
                           {k: float(v) for k, v in entry["per_element"].items()},
                           asynchronous=bool(entry["asynchronous"]), measured=True,
                           fresh_bytes=None if entry["fresh_bytes"] is None else int(entry["fresh_bytes"]),
                           fresh_bandwidth=float(entry["fresh_bandwidth"]),
                           cache_bytes=None if entry["cache_bytes"] is None else int(entry["cache_bytes"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # an entry of an older fxshard: measured again


def fit(points: list[tuple[float, float]]) -> Link:
    """Least squares ``seconds = latency + bus_bytes / bandwidth`` over (bus bytes, seconds),
    each point weighted by 1/seconds^2: relative residuals, as a timing's noise grows with
    it, so the small sizes decide the latency and the large ones the bandwidth (unweighted,
    a few percent off at the largest size moved the latency by a millisecond). A negative
    latency is taken as 0 (and the bandwidth refitted through the origin)."""
    weights = [1.0 / (y * y) if y > 0 else 1.0 for _, y in points]
    total = sum(weights)
    mx = sum(w * x for w, (x, _) in zip(weights, points)) / total
    my = sum(w * y for w, (_, y) in zip(weights, points)) / total
    var = sum(w * (x - mx) ** 2 for w, (x, _) in zip(weights, points))
    slope = sum(w * (x - mx) * (y - my) for w, (x, y) in zip(weights, points)) / var if var else 0.0
    latency = my - slope * mx
    if latency < 0 or slope <= 0:
        ys = [y for _, y in points]
        latency = max(0.0, min(ys)) if slope <= 0 else 0.0
        square = sum(w * x * x for w, (x, _) in zip(weights, points))
        slope = max(sum(w * x * (y - latency) for w, (x, y) in zip(weights, points)) / square
                    if square else 0.0, 1e-15)
    return Link(latency, 1.0 / slope)


def network_sizes(device: torch.device) -> tuple[tuple[int, int], ...]:
    """(full-buffer bytes, timed calls) of each size measured: up to where bandwidth, not
    latency, decides."""
    return NETWORK_SIZES["cpu" if device.type == "cpu" else "accelerator"]


def _collective(kind: str, full: torch.Tensor, shard: torch.Tensor, n: int,
                name: str) -> tuple[Callable[[], torch.Tensor], int]:
    """The call that issues one collective of ``kind``, as the emitted graphs make it (its
    wait: ``ops.wait_tensor`` of what it returns); its input's bytes."""
    ops = compat.c10d_functional
    if kind == "all_gather":
        return (lambda: ops.all_gather_into_tensor(shard, n, name)), shard.numel() * 4
    if kind == "reduce_scatter":
        return (lambda: ops.reduce_scatter_tensor(full, "sum", n, name)), full.numel() * 4
    return (lambda: ops.all_reduce(full, "sum", name)), full.numel() * 4


def _wait(handle: torch.Tensor) -> None:
    compat.c10d_functional.wait_tensor(handle)


def interleaved(counts: Sequence[int]) -> list[int]:
    """The order in which to make ``counts[i]`` calls of each point ``i``: in rounds, as many
    as the largest count, each point's calls spread evenly over them (a point of 5 calls among
    rounds of 60 is called in every twelfth). A slow moment of a shared host then lands on
    every point alike, not on whichever point was being measured then."""
    rounds = max(counts, default=0)
    return [i for r in range(rounds) for i, c in enumerate(counts) if r * c // rounds != (r + 1) * c // rounds]


def measure_network(group: dist.ProcessGroup) -> Network:
    """all_gather, reduce_scatter and all_reduce on ``group`` (every rank of it calls this),
    five sizes each on the CPU, three on an accelerator (``NETWORK_SIZES``), through the
    functional collectives the emitted graphs run, after ``WARM_ROUNDS`` untimed rounds at the
    largest size; about 2 seconds on gloo between two processes of one host.

    Each size's calls are interleaved with every other size's and kind's (``interleaved``).
    Measured one point after the other, the largest size's few calls (a fitted bandwidth's
    weight) saw a tenth of a second of the host, and a slow moment there moved that kind's
    bandwidth by half. On 2 gloo ranks here, 32 calibrations alternating the two orders:
    an 8 MB all_gather's time alone predicted within 25% by 13 of 16 interleaved, 9 of 16 in
    order (a 16 MB reduce_scatter's: 13 and 14; docs/time.md). The same calls on every rank,
    in the same order: a rank never waits on a call others skip."""
    device = comm_device(group)
    n, name = group.size(), group.group_name
    points: list[tuple[str, Callable[[], torch.Tensor], int]] = []
    counts: list[int] = []
    for size, calls in network_sizes(device):
        numel = size // 4 // n * n
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // n, device=device)
        for kind in KINDS:
            issue, given = _collective(kind, full, shard, n, name)
            _wait(issue())  # to warm up
            points.append((kind, issue, given))
            counts.append(calls)
    for _ in range(WARM_ROUNDS):  # the link, as a step's collectives find it (WARM_ROUNDS)
        for _, issue, _ in points[-len(KINDS):]:
            _wait(issue())
    _sync(device)
    return Network(f"{dist.get_backend(group)} over {n} ranks, measured",
                   _timed_links(points, counts, device, lambda kind, given: bus_bytes(kind, given, n)))


# The cold issue (``measure_cold_issues``): one size (full-buffer bytes) and the calls of each kind.
COLD_ISSUE_BYTES, COLD_ISSUE_CALLS = 4 << 20, 8


def measure_cold_issues(network: Network, group: dist.ProcessGroup) -> Network:
    """``network`` (``measure_network``'s on ``group``; every rank of it calls this) with each
    kind's ``issue_cold_bandwidth``: its issue at ``COLD_ISSUE_BYTES`` with the input out of
    the caches (a read of twice the last-level cache before the call) against the same call
    right after, its input in the caches, the median of ``COLD_ISSUE_CALLS`` pairs, the kinds
    interleaved. A step issues a shard's all_gather on memory last touched by the step before:
    between two gloo ranks here a 2 MiB shard's issue took 0.15 ms warm and 0.35 cold (0.55
    with both ranks computing around it, as in a step), and the Net's in its step 0.4-0.6
    against 0.1-0.2 predicted from warm calls. About 0.3 s on 2 gloo ranks here; on the CPU
    only (a device's input is not the host's caches'), and not where no cache size is known.
    Run after the other measurements: its reads leave the caches and the allocator as no
    other calibration step expects them."""
    cache = last_level_cache() if comm_device(group).type == "cpu" else None
    if cache is None:
        return network
    n, name = group.size(), group.group_name
    numel = COLD_ISSUE_BYTES // 4 // n * n
    full, shard = torch.ones(numel), torch.ones(numel // n)
    evict = torch.ones(cache // 2)  # twice the cache, float32
    calls = {kind: _collective(kind, full, shard, n, name) for kind in KINDS}
    timed: dict[tuple[str, bool], list[float]] = {(kind, cold): [] for kind in KINDS for cold in (True, False)}
    for _ in range(COLD_ISSUE_CALLS):
        for kind, (issue, _) in calls.items():
            for cold in (True, False):  # the same call cold, then warm
                if cold:
                    _evict(evict)
                start = time.perf_counter()
                handle = issue()
                timed[kind, cold].append(time.perf_counter() - start)
                _wait(handle)
    links = dict(network.links)
    for kind, (_, given) in calls.items():
        link, bus = links[kind], bus_bytes(kind, given, n)
        extra = max(0.0, statistics.median(timed[kind, True]) - statistics.median(timed[kind, False]))
        held = bus / link.issue_bandwidth + extra  # the cold bytes' time
        links[kind] = replace(link, issue_cold_bandwidth=bus / held if held > 0 else math.inf)
    return replace(network, links=links)


def _timed_links(points: Sequence[tuple[str, Callable[[], torch.Tensor], int]], counts: Sequence[int],
                 device: torch.device, x: Callable[[str, int], int]) -> dict[str, Link]:
    """Each point's (kind, call, input bytes) calls, ``counts`` of them, ``interleaved``; each
    kind's means fitted over ``x(kind, input bytes)``: its issue and its flight.

    The mean of each point's calls: a step pays every call, and on a shared host a few in ten
    small ones take several times the median (gloo on 2 cores: the mean of a 256 KiB
    reduce_scatter twice its median); a collective waits on its peers, whose own delays are
    part of its time. Each call is timed in two parts: its issue (until the call returns:
    the thread that computes is held that long; gloo's reduce_scatter copies its whole input
    first, a quarter of its time) and its flight (until its wait returns)."""
    issued, flown = [0.0] * len(points), [0.0] * len(points)
    for i in interleaved(counts):
        start = time.perf_counter()
        handle = points[i][1]()
        returned = time.perf_counter()
        _wait(handle)
        _sync(device)
        issued[i] += returned - start
        flown[i] += time.perf_counter() - returned
    links: dict[str, Link] = {}
    for kind in KINDS:
        mine = [(float(x(kind, given)), i) for i, (k, _, given) in enumerate(points) if k == kind]
        flight = fit([(bytes_, flown[i] / counts[i]) for bytes_, i in mine])
        held = fit([(bytes_, issued[i] / counts[i]) for bytes_, i in mine])
        links[kind] = Link(flight.latency, flight.bandwidth, issue_latency=held.latency,
                           issue_bandwidth=held.bandwidth)
    return links


# The sizes (input bytes) and calls of each kind timed on a group of one rank (measure_one_rank).
ONE_RANK_SIZES = ((1 << 16, 60), (1 << 22, 8))


def measure_one_rank(group: dist.ProcessGroup) -> dict[str, Link]:
    """Each kind's call and wait on ``group``, a group of this rank alone (``Network.one_rank``):
    nothing crosses a wire, but the backend is still called, copies the input into the
    output and is waited on: 35-90 us a call and its wait with gloo here (the time benchmark's
    deep MLP's 144 added 7-9 ms to its forward and backward, docs/time.md).
    ``ONE_RANK_SIZES``, interleaved, each kind's means fitted over the input's bytes as
    ``measure_network`` fits bus bytes; about 0.05 s."""
    device = comm_device(group)
    name = group.group_name
    points: list[tuple[str, Callable[[], torch.Tensor], int]] = []
    counts: list[int] = []
    for size, calls in ONE_RANK_SIZES:
        full = torch.ones(size // 4, device=device)
        for kind in KINDS:
            issue, given = _collective(kind, full, full, 1, name)
            _wait(issue())  # to warm up
            points.append((kind, issue, given))
            counts.append(calls)
    return _timed_links(points, counts, device, lambda kind, given: given)


# Pairs of a loop alone and with an all_gather in flight (measure_contention), and the side of
# the loop's matmuls on the CPU: 512, whose operands outgrow a core's L2 cache as the step's
# matmuls do (on 2 gloo ranks, loops of 256x256 matmuls lost 0.1-0.5 of the all_gather's
# time, of 512x512 0.4-0.7); on an accelerator 4096.
CONTENTION_PAIRS = 21
CONTENTION_MATMUL = 512
# Pairs of a small all_gather alone and under compute (measure_starvation).
STARVATION_PAIRS = 9
# Blocks of the latency sharing's seven variants, the calls of each variant in a block, all
# their calls pooled (measure_latency_sharing), and the most it reports.
SHARING_REPEATS, SHARING_CALLS = 20, 24
SHARING_MAX = 3.0


def measure_contention(group: dist.ProcessGroup) -> float:
    """How much of a collective's time compute loses to it in flight (``Rates.contention``),
    the same on every rank. ``CONTENTION_PAIRS`` times, every rank together: an all_gather
    alone (8 MiB on the CPU, 128 MiB on a GPU), then matmuls for about three times its time
    with the all_gather in flight (on the CPU polled after each matmul, and on until it has
    ended), then as many matmuls alone. Of every rank's pairs, the mean of the middle half
    of their slowdowns, each over its own all_gather's time; between 0 and 1.

    On the CPU gloo's threads take their time from cores that compute, and the all_gather
    itself slows under the compute (1.6-2.2 times its time alone on 2 gloo ranks of 2
    cores), so the matmuls must outlast it. In pairs, not all the loops alone and then all
    the overlapped ones: a slow moment of a shared host then slows both halves of a pair or
    one pair, where before it could slow the loops alone and measure 0. Each pair over the
    all_gather timed beside it, and the middle half of every rank's pairs: nine pairs' median
    over one all_gather's time of three calls, then the ranks' MAX, gave 0.24 to 1.00 in
    twelve measurements back to back (docs/time.md)."""
    device = comm_device(group)
    cpu = device.type == "cpu"
    n = group.size()
    numel = ((1 << 23) if cpu else (1 << 27)) // 4 // n * n
    shard, full = torch.ones(numel // n, device=device), torch.empty(numel, device=device)
    side = CONTENTION_MATMUL if cpu else 4096
    a = torch.randn(side, side, device=device)

    def gather() -> None:
        compat.all_gather_single(full, shard, group=group)
        _sync(device)

    # The same collectives on every rank, in the same order; the loops are each rank's own.
    comm = _seconds(gather, device, least=0.0, calls=3, how="median")
    repeats = max(1, math.ceil(3 * comm / _seconds(lambda: torch.mm(a, a), device, how="fastest")))
    slowdowns = []
    for _ in range(CONTENTION_PAIRS):
        dist.barrier(group=group)
        start = time.perf_counter()
        gather()
        alone = time.perf_counter() - start
        dist.barrier(group=group)
        # The matmuls with the all_gather in flight, on until it has ended (a slow moment
        # while the loop was sized must not cut the flight short), then as many alone. On an
        # accelerator the matmuls only queue here: its flight is not polled.
        work = compat.all_gather_single(full, shard, group=group, async_op=True)
        assert work is not None
        start, done = time.perf_counter(), 0
        while done < repeats or cpu and not work.is_completed() and done < 100 * repeats:
            torch.mm(a, a)
            done += 1
        _sync(device)
        hindered = time.perf_counter() - start
        work.wait()
        _sync(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(done):
            torch.mm(a, a)
        _sync(device)
        slowdowns.append((hindered - (time.perf_counter() - start)) / max(alone, 1e-9))
    # Every rank's pairs together: each rank's own, then their MAX, took the noisier rank's.
    mine = torch.tensor(slowdowns, dtype=torch.float64, device=device)
    everyone = torch.empty(mine.numel() * n, dtype=torch.float64, device=device)
    compat.all_gather_single(everyone, mine, group=group)
    return min(1.0, max(0.0, _middle_mean(everyone.tolist())))


def _middle_mean(values: Sequence[float]) -> float:
    """The mean of the middle half of ``values``: a few slow moments at either end move it
    little, and it averages more of them than the median."""
    ordered = sorted(values)
    quarter = len(ordered) // 4
    middle = ordered[quarter:len(ordered) - quarter]
    return sum(middle) / len(middle)


def measure_starvation(group: dist.ProcessGroup, link: Link) -> float:
    """How much longer a small collective's latency takes while compute runs
    (``Rates.starvation``): an all_gather of 256 KiB, alone and then issued before a loop of
    small matmuls about four times its length that polls it after each matmul,
    ``STARVATION_PAIRS`` such pairs with every rank together; the median of the pairs' delays
    over ``link``'s latency, between 0 and 8 (0 on an accelerator, where NCCL's kernels need
    no host thread). On the CPU gloo's thread must be woken on a core the compute holds.

    In pairs, as the contention: timed as five calls alone and then five under the loop, a
    slow moment of the host over either five moved it by its whole size (16 fresh
    calibrations on 2 gloo ranks measured 0.0 to 3.8)."""
    device = comm_device(group)
    if device.type != "cpu":
        return 0.0
    n = group.size()
    numel = (1 << 18) // 4 // n * n
    shard, full = torch.ones(numel // n), torch.empty(numel)
    a = torch.randn(64, 64)
    # The same collectives on every rank, in the same order; the loops are each rank's own.
    alone = _seconds(lambda: compat.all_gather_single(full, shard, group=group), device,
                     least=0.0, calls=3, how="median")
    repeats = max(1, math.ceil(4 * alone / _seconds(lambda: torch.mm(a, a), device, how="fastest")))
    delays = []
    for _ in range(STARVATION_PAIRS):
        dist.barrier(group=group)
        start = time.perf_counter()
        compat.all_gather_single(full, shard, group=group)
        alone = time.perf_counter() - start
        dist.barrier(group=group)
        work = compat.all_gather_single(full, shard, group=group, async_op=True)
        assert work is not None
        start, ended = time.perf_counter(), None
        for _ in range(repeats):
            torch.mm(a, a)
            if ended is None and work.is_completed():
                ended = time.perf_counter() - start
        work.wait()
        delays.append((ended if ended is not None else time.perf_counter() - start) - alone)
    return min(8.0, max(0.0, statistics.median(delays) / link.latency)) if link.latency > 0 else 0.0


def measure_latency_sharing(world: World) -> tuple[float, float]:
    """How far two small collectives on two of the job's process groups at once take as long as
    one after the other (``Rates.latency_sharing``, ``latency_sharing_mixed``): on the first
    two groups of the measured dimension's slots (``measured_groups``: the shard dimension's,
    or a NO_SHARD mesh's replicas'), a 64 KiB all_gather on the first beside a 64 KiB one on
    the second (two of one kind: a gather prefetched beside the one in use), and beside a
    reduce_scatter of 64 KiB on the second (kinds that differ: the backward's next gather
    beside the reduce_scatter before it); each alone, one after the other and both in flight,
    in blocks of ``SHARING_CALLS`` calls of each variant, ``SHARING_REPEATS`` blocks of each;
    over all their calls, (together - alone) / (one after the other - alone), alone being the
    slower one by itself, between 0 and ``SHARING_MAX`` (above 1: both at once take longer
    than one after the other). (0, 0) where the job has one such group (nothing is in flight
    at once) or an accelerator's (NCCL's kernels run side by side).

    A ratio of two differences of about one latency each, where a few calls in ten take a
    scheduler tick more: one block of each variant ranged from -1.8 to 52 on 2 gloo ranks
    here (150 blocks of two all_gathers; all of them pooled: 1.64). The median of five such
    blocks, each clamped to at most 1, read below 0.8 in 7-22% of windows of five and, in
    fresh calibrations, 0.0-0.4 at times, which predicted the deep MLP's step 19-23% short.
    Pooled over 20 blocks, fewer than 3% of windows read below 0.8 (docs/time.md,
    "Calibration"). The two pairs differ: in twelve measurements here two all_gathers read
    1.47-2.08 and an all_gather beside a reduce_scatter 1.01-1.31, and the deep MLP's backward,
    that pair at every block, was predicted 10-45% long with the all_gathers' reading (the
    replay of its collectives agrees with about 1). About 5 s on 2 gloo ranks here."""
    groups = measured_groups(world)
    if len(groups) < 2:
        return 0.0, 0.0
    first, second = groups[0], groups[1]
    device = comm_device(first)
    if device.type != "cpu":
        return 0.0, 0.0
    ops = compat.c10d_functional
    n = first.size()
    numel = (1 << 16) // 4 // n * n
    shard, full = torch.ones(numel // n, device=device), torch.ones(numel, device=device)

    def gather(group: dist.ProcessGroup) -> torch.Tensor:
        return ops.all_gather_into_tensor(shard, n, group.group_name)

    def reduce(group: dist.ProcessGroup) -> torch.Tensor:
        return ops.reduce_scatter_tensor(full, "sum", n, group.group_name)

    def mean(fn: Callable[[], object]) -> float:
        return _seconds(fn, device, least=0.0, calls=SHARING_CALLS, how="mean")

    def pair(other: Callable[[dist.ProcessGroup], torch.Tensor]) -> tuple[Callable[[], object], ...]:
        """The second collective alone, one after the other, both in flight."""
        return (lambda: ops.wait_tensor(other(second)),
                lambda: (ops.wait_tensor(gather(first)), ops.wait_tensor(other(second))),
                lambda: [ops.wait_tensor(t) for t in (gather(first), other(second))])

    variants = (lambda: ops.wait_tensor(gather(first)), *pair(gather), *pair(reduce))
    totals = [0.0] * len(variants)
    for _ in range(SHARING_REPEATS):  # each block's mean, pooled: every block's calls weigh alike
        for i, variant in enumerate(variants):
            totals[i] += mean(variant)

    def ratio(alone: float, serial: float, together: float) -> float:
        if serial <= alone:
            return 1.0  # two one after the other no longer than one: no latency to share, read as 1
        return min(SHARING_MAX, max(0.0, (together - alone) / (serial - alone)))

    first_alone = totals[0]
    return (ratio(max(first_alone, totals[1]), totals[2], totals[3]),
            ratio(max(first_alone, totals[4]), totals[5], totals[6]))


# -- agreeing ---------------------------------------------------------------------------------


def _pack(device: DeviceRates, network: Network | None, contention: float = 0.0,
          starvation: float = 0.0, sharing: tuple[float, float] = (0.0, 0.0),
          threshold: int | None = None) -> list[float]:
    """Seconds per unit of work, so that the MAX over ranks is the slowest rank's; and the
    inverse of the mmap ``threshold`` this rank knows (None: not known). Every rank measures
    the same sizes (its device type's), so the vectors line up."""
    values = [1.0 / device.matmul_flops.get(d, math.inf) for d in DTYPES]
    values += [1.0 / device.bandwidth, device.overhead, device.view_overhead]
    for kind in KINDS:
        link = network.links.get(kind) if network is not None else None
        cold = link.issue_cold_bandwidth if link is not None else None
        values += [link.latency, 1.0 / link.bandwidth, link.issue_latency, 1.0 / link.issue_bandwidth,
                   1.0 / cold if cold is not None else -1.0] if link is not None else [0.0, 0.0, 0.0, 0.0, -1.0]
    for d in DTYPES:
        values += [1.0 / rate for _, rate in device.matmul_curve.get(d, ())]
    values += [device.per_element[name] for name in PER_ELEMENT if name in device.per_element]
    # The MAX over ranks: the smallest allocation any rank maps afresh, the slowest fault rate.
    values += [1.0 / device.fresh_bytes if device.fresh_bytes else 0.0, 1.0 / device.fresh_bandwidth]
    values += [1.0 / device.cache_bytes if device.cache_bytes else 0.0]  # the smallest cache
    # The smallest mmap threshold known (an unknown one counts as glibc's default, the smallest).
    return [*values, contention, starvation, *sharing, 1.0 / (threshold or MMAP_THRESHOLD_MIN)]


def _unpack(values: list[float], like: DeviceRates, name: str,
            network_name: str) -> tuple[DeviceRates, Network, float, float, tuple[float, float], int | None]:
    flops = {d: 1.0 / v for d, v in zip(DTYPES, values) if v > 0}
    bandwidth, overhead, view = 1.0 / values[2], values[3], values[4]
    def cold(inverse: float) -> float | None:  # -1: some rank measured none (the MAX is then -1 only if all)
        return None if inverse < 0 else 1.0 / inverse if inverse > 0 else math.inf

    links = {kind: Link(values[5 + 5 * i], 1.0 / values[6 + 5 * i] if values[6 + 5 * i] > 0 else math.inf,
                        issue_latency=values[7 + 5 * i],
                        issue_bandwidth=1.0 / values[8 + 5 * i] if values[8 + 5 * i] > 0 else math.inf,
                        issue_cold_bandwidth=cold(values[9 + 5 * i]))
             for i, kind in enumerate(KINDS)}
    rest, curves = iter(values[5 + 5 * len(KINDS):]), {}
    for d in DTYPES:
        curves[d] = tuple((work, 1.0 / next(rest)) for work, _ in like.matmul_curve.get(d, ()))
    per_element = {op: next(rest) for op in PER_ELEMENT if op in like.per_element}
    inverse_fresh, fault, inverse_cache = next(rest), next(rest), next(rest)
    return (DeviceRates(name, flops, bandwidth, overhead, view, {d: c for d, c in curves.items() if c},
                        per_element, asynchronous=like.asynchronous, measured=like.measured,
                        fresh_bytes=round(1.0 / inverse_fresh) if inverse_fresh > 0 else None,
                        fresh_bandwidth=1.0 / fault if fault > 0 else math.inf,
                        cache_bytes=round(1.0 / inverse_cache) if inverse_cache > 0 else None),
            Network(network_name, links), next(rest), next(rest), (next(rest), next(rest)), _threshold(next(rest)))


def _threshold(inverse: float) -> int | None:
    """The agreed mmap threshold from its inverse: None where some rank's is not known."""
    threshold = round(1.0 / inverse)
    return None if threshold <= MMAP_THRESHOLD_MIN else threshold


def _max_over(group: dist.ProcessGroup, values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in tensor.tolist()]


def measured_groups(world: World) -> tuple[dist.ProcessGroup, ...]:
    """The groups the network is measured on, in slot order: the shard dimension's, or where
    the shard group is one rank (a NO_SHARD mesh), the replicas' (every rank has one of each)."""
    if world.size == 1 and world.layout.replicate is not None:
        return world.groups(world.layout.replicate)
    return tuple(world.comm) or (world.comm_group,)


def measured_group(world: World) -> dist.ProcessGroup:
    """The group the network is measured on: the first of ``measured_groups``."""
    return measured_groups(world)[0]


def network_key(world: World) -> str:
    """The cache entry of a host's network: also whether the job had two groups to measure the
    latency sharing on (one that had not measures 0, which a later job with two must not
    take)."""
    group = measured_group(world)
    groups = "two groups" if len(measured_groups(world)) >= 2 else "one group"
    return (f"network | {dist.get_backend(group)} | {group.size()} ranks, {groups} | {socket.gethostname()} | "
            f"torch {torch.__version__} | {torch.get_num_threads()} threads | method {METHOD}")


@keeps_rng
def calibrate(world: World, device: torch.device) -> Rates:
    """The rates every rank of ``world`` predicts with: each rank's device and network (cached,
    or measured now), the slowest of each over the job. Every rank of the job calls this
    together where there is a live group of more than one rank (the driver, when it is
    built); elsewhere it measures the device alone and communicates nothing."""
    local = device_rates(device)
    if world.group is None or world.job_size == 1:
        network = Network.free("one rank: no collectives")
        if world.group is not None and dist.get_backend(world.group) != "fake" and rehearsal.of(world.group) is None:
            group = measured_group(world)
            network = replace(Network.free(f"{dist.get_backend(world.group)} over one rank, measured"),
                              one_rank=measure_one_rank(group))
        return Rates(f"{local.name}, one rank", local, network, mmap_threshold=mmap_threshold())
    backend = dist.get_backend(world.group)
    rehearsed = rehearsal.of(world.group)
    if rehearsed is not None:  # what its collectives are made to last (one process: its threshold)
        return Rates(f"{local.name}; {rehearsed.network.name}, rehearsed", local, rehearsed.network,
                     ("this device, calibrated", *rehearsed.rates.sources), mmap_threshold=mmap_threshold())
    if backend == "fake":
        return Rates(f"{local.name}, fake process group", local,
                     Network.free("torch's fake process group: collectives move nothing"),
                     mmap_threshold=mmap_threshold())
    key = network_key(world)
    entry = _NETWORKS.get(key) or _load(key)
    cached = _network_from(entry) if entry is not None else None
    threshold = mmap_threshold()
    mine = _pack(local, *cached, threshold) if cached is not None else _pack(local, None, threshold=threshold)
    agreed = _max_over(world.job_group, [float(cached is None), *mine])
    name = f"{backend} over {world.size} ranks"
    if agreed[0] > 0:  # some rank has no entry: every rank measures, now
        start = time.perf_counter()
        group = measured_group(world)
        measured, contention = measure_network(group), measure_contention(group)
        starvation = measure_starvation(group, measured.link("all_gather", group.size()))
        sharing = measure_latency_sharing(world)
        measured = measure_cold_issues(measured, group)
        _NETWORKS[key] = _network_entry(measured, contention, starvation, sharing)
        _save(key, _NETWORKS[key])
        log.info("fxshard: measured the %s network in %.2f s", name, time.perf_counter() - start)
        agreed = [0.0, *_max_over(world.job_group, _pack(local, measured, contention, starvation, sharing,
                                                         threshold))]
    elif entry is not None:
        _NETWORKS[key] = entry
    device_rates_, network, contention, starvation, sharing, threshold = _unpack(
        agreed[1:], local, f"{local.name} (the slowest of {world.job_size} ranks)",
        f"{name}, measured (the slowest rank's)")
    return Rates(f"calibrated: {device_rates_.name}; {network.name}", device_rates_, network,
                 (f"measured on this job's ranks; cached in {cache_path()}",), contention, starvation, sharing[0],
                 threshold, latency_sharing_mixed=sharing[1])


def _network_entry(network: Network, contention: float, starvation: float,
                   sharing: tuple[float, float]) -> dict[str, Any]:
    return {**{kind: {"latency": link.latency, "bandwidth": link.bandwidth, "issue_latency": link.issue_latency,
                      "issue_bandwidth": link.issue_bandwidth, "issue_cold_bandwidth": link.issue_cold_bandwidth}
               for kind, link in network.links.items()},
            "contention": contention, "starvation": starvation, "latency_sharing": sharing[0],
            "latency_sharing_mixed": sharing[1]}


def _network_from(entry: dict[str, Any]) -> tuple[Network, float, float, tuple[float, float]] | None:
    """A cached network entry; None (measured again) where it is not one this fxshard wrote:
    every kind's link, latencies of zero or more, bandwidths above zero."""
    read = _network_entry_read(entry)
    if read is None:
        return None
    links = read[0].links.values()
    if not all(math.isfinite(v) and v >= 0 for link in links for v in (link.latency, link.issue_latency)):
        return None
    if not all(v > 0 for link in links for v in (link.bandwidth, link.issue_bandwidth, link.issue_cold_bandwidth)
               if v is not None):
        return None
    if not all(math.isfinite(v) and v >= 0 for v in (read[1], read[2], *read[3])):
        return None
    return read


def _network_entry_read(entry: dict[str, Any]) -> tuple[Network, float, float, tuple[float, float]] | None:
    try:
        return (Network("cached", {kind: Link(float(entry[kind]["latency"]), float(entry[kind]["bandwidth"]),
                                              issue_latency=float(entry[kind]["issue_latency"]),
                                              issue_bandwidth=float(entry[kind]["issue_bandwidth"]),
                                              issue_cold_bandwidth=_optional(entry[kind]["issue_cold_bandwidth"]))
                                   for kind in KINDS}),
                float(entry["contention"]), float(entry["starvation"]),
                (float(entry["latency_sharing"]), float(entry["latency_sharing_mixed"])))
    except (KeyError, TypeError, ValueError):
        return None  # an entry of an older fxshard: measured again


def _evict(buffer: torch.Tensor) -> None:
    """Read ``buffer`` (twice the last-level cache): whatever was in the caches leaves them."""
    buffer.sum()


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


@keeps_rng
def with_node_times(rates: Rates, graphs: Mapping[str, fx.GraphModule], device: torch.device) -> Rates:
    """``rates`` with each matmul and convolution of ``graphs`` (``cost.TIMED``) timed on
    ``device``, once per distinct node (``cost.node_key``), cached beside the device's rates:
    warm (``node_seconds``) and, where the device knows its cache, with its operands evicted
    (``node_cold_seconds``). On the CPU only, and only for rates measured here (a profile's
    are its figures). Each rank times its own: no collective (``report()`` may run on one
    rank alone); the driver settles them over the ranks at a step's first forward
    (``compiler.NodeTimes``: ``node_times``, ``with_slowest_node_times``)."""
    if device.type != "cpu" or not rates.device.measured:
        return rates
    nodes: dict[str, fx.Node] = {}
    for gm in graphs.values():
        for node in gm.graph.nodes:
            key = node_key(node)
            if key is not None and key not in rates.device.node_seconds:
                nodes.setdefault(key, node)
    if not nodes:
        return rates
    cache = rates.device.cache_bytes  # cold times are measured against it: part of the key
    where = f"nodes | {device_key(device)}" + (f" | cache {cache}" if cache is not None else "")
    if where not in _NODES:
        _NODES[where] = {k: (float(v[0]), float(v[1])) for k, v in (_load(where) or {}).items()
                         if isinstance(v, list) and len(v) == 2}
    table = _NODES[where]
    missing = [k for k in nodes if k not in table]
    evict = torch.ones(cache // 2, device=device) if missing and cache is not None else None  # 2x, float32
    for key in missing:
        seconds = _time_node(nodes[key], device, evict)
        if seconds is not None:
            table[key] = seconds
    if missing:
        _save(where, {k: list(v) for k, v in table.items()})
    timed = {k: table[k] for k in nodes if k in table}
    d = rates.device
    return replace(rates, device=replace(
        d, node_seconds={**d.node_seconds, **{k: w for k, (w, _) in timed.items()}},
        node_cold_seconds={**d.node_cold_seconds, **{k: c for k, (_, c) in timed.items()}}))


def node_times(rates: Rates, graphs: Mapping[str, fx.GraphModule]) -> dict[str, tuple[float, float | None]]:
    """The timed nodes of ``graphs`` that ``rates`` holds (``with_node_times``'s): by
    ``cost.node_key``, (warm seconds, cold seconds or None)."""
    d = rates.device
    return {key: (d.node_seconds[key], d.node_cold_seconds.get(key))
            for gm in graphs.values() for node in gm.graph.nodes
            if (key := node_key(node)) is not None and key in d.node_seconds}


def with_slowest_node_times(rates: Rates, everyone: Sequence[Mapping[str, tuple[float, float | None]] | None]
                            ) -> Rates:
    """``rates`` with each node's times the largest of every rank's ``node_times`` that has
    it (None: a rank with none): the slowest rank's, as the rest of the job's rates are, so
    every rank predicts the same; a step waits for its slowest rank at every collective."""
    warm: dict[str, float] = {}
    cold: dict[str, float] = {}
    for times in everyone:
        for key, (w, c) in (times or {}).items():
            warm[key] = max(warm.get(key, 0.0), w)
            if c is not None:
                cold[key] = max(cold.get(key, 0.0), c)
    if not warm:
        return rates
    d = rates.device
    return replace(rates, device=replace(d, node_seconds={**d.node_seconds, **warm},
                                         node_cold_seconds={**d.node_cold_seconds, **cold}))


def _time_node(node: fx.Node, device: torch.device, evict: torch.Tensor | None = None) -> tuple[float, float] | None:
    """One run of ``node`` on tensors of its arguments' shapes, strides and dtypes on
    ``device``, warm and cold: the median of a few calls on the same operands, one after the
    other (``_seconds``: they stay in the caches), and the median of ``COLD_CALLS`` calls each on
    operands of its own, made before a read of ``evict`` (twice the cache; untimed) evicted
    them all: where a step finds a weight, with the kernel's code as hot as in the step (an
    eviction before each call also evicts the code, and charged a 10 us matmul 50 us more).
    Where that many copies would outgrow ``evict``, fewer copies in turn, as many as evict
    each other (at most ``evict`` and two copies' bytes). Operands as large as ``evict`` are
    cold even when warm. Without ``evict`` cold is warm. None where the node does not run."""

    def real(v: Any, fill: float | None = None) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        span = 1 + sum((n - 1) * s for n, s in zip(v.shape, v.stride()) if n > 0) if v.numel() else 0
        if not v.dtype.is_floating_point:
            base = torch.zeros(span, dtype=v.dtype, device=device)
        elif fill is None:
            base = torch.randn(span, device=device).to(v.dtype)
        else:
            base = torch.full((span,), fill, dtype=v.dtype, device=device)
        return base.as_strided(tuple(v.shape), tuple(v.stride()))

    try:
        vals = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        args, kwargs = pytree.tree_map(real, vals)
        target: Callable[..., Any] = node.target  # type: ignore[assignment]
        warm = _seconds(lambda: target(*args, **kwargs), device)
        operands = sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor))
        if evict is None or operands >= evict.nbytes:
            return warm, warm
        # Each copy is called once its successors' bytes (or the read) evicted it.
        count = min(COLD_CALLS + 1, math.ceil(evict.nbytes / max(operands, 1)) + 1)
        copies = [pytree.tree_map(lambda v: real(v, 0.5), vals) for _ in range(count)]
        if count == COLD_CALLS + 1:
            _evict(evict)
        cold = []
        for i in range(COLD_CALLS + 1):  # the first call warms the code the read evicted
            a, k = copies[i % count]
            _sync(device)
            start = time.perf_counter()
            target(*a, **k)
            _sync(device)
            cold.append(time.perf_counter() - start)
        return warm, statistics.median(cold[1:])
    except Exception as e:  # noqa: BLE001 - the roofline stands in for it
        log.info("fxshard: could not time %s: %s", node.format_node(), e)
        return None


def library_bytes(device: torch.device) -> int:
    """The device memory the math libraries hold through a training step, which no tensor
    owns: on CUDA, cuBLAS's and cuBLASLt's workspaces, which the caching allocator holds (and
    counts) for each pair of a thread's handle and a stream, from its first matmul on: one
    for forward's matmuls, one for backward's (autograd's device thread has its own handle).
    Measured once per device, outside any fake mode (a planner may ask while tracing), as the
    allocator's growth over a forward and backward of each kind of matmul on a stream of its
    own; the workspaces are then released (each is made again at its next matmul). 0
    elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    key = str(torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device()))
    if key not in _LIBRARY:
        with compat.fake_tensor.unset_fake_temporarily(), torch.cuda.device(device), torch.enable_grad():
            a = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            bias = torch.ones(64, device=device, dtype=torch.bfloat16, requires_grad=True)
            f = torch.ones(64, 64, device=device, requires_grad=True)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            with torch.cuda.stream(stream):
                outs = [torch.mm(a, a), torch.addmm(bias, a, a), torch.mm(f, f)]
                torch.stack([o.float().sum() for o in outs]).sum().backward()
            torch.cuda.synchronize(device)
            grown = torch.cuda.memory_allocated(device) - before
            held = [*outs, a.grad, bias.grad, f.grad]
            _LIBRARY[key] = max(0, grown - sum(t.untyped_storage().nbytes() for t in held if t is not None))
            del outs, held, a, bias, f
            compat.clear_cublas_workspaces()
    return _LIBRARY[key]


def local_rates(device: torch.device) -> Rates:
    """This device alone, for a step whose collectives cost nothing (one rank, or torch's fake
    process group); communicates nothing."""
    local = device_rates(device)
    return Rates(local.name, local, Network.free(), mmap_threshold=mmap_threshold())
