"""Rehearsal: an N-rank job's step on one device, each collective taking as long as a
named network says it would.

    rehearsal = fxshard.rehearse(world_size=8, hardware="h100-nvlink")  # instead of init_process_group
    model = fxshard.compile(model, policy)      # or FSDP2's fully_shard: anything over c10d
    ... train as usual: this process runs rank 0's step ...
    rehearsal.log                               # every collective: kind, bytes, ranks, seconds
    dist.destroy_process_group()

The process group is torch's, a ``dist.ProcessGroup`` whose backend is this module's
(``fxshard_rehearsal``), registered with c10d like any other. Each group (the world,
and every group made with ``new_group`` or a ``DeviceMesh`` while it is the default)
runs its collectives one after another on a stream of its own, as NCCL does:

    caller's stream  |--compute--|issue|--compute-------------|wait|--compute
    group's stream               |data|---- sleep -----------|    ^ the caller waits here
                                  the collective: the network's latency + bus bytes / bandwidth

On a GPU the stream is a CUDA stream that first waits for the caller's, copies the
data and then spins (``torch.cuda._sleep``) for the rest of the predicted time; a
``work.wait()`` or ``wait_tensor`` makes the caller's stream wait for it, so the host
never blocks. On the CPU the stream is a thread per group, which copies and sleeps.
The time is ``Network.seconds`` of the named profile (``fxshard.ir.cost.PROFILES``)
for the collective's kind, input bytes and group size, over the links between nodes
where the group's ranks span nodes (``ranks_per_node``).

The data are what N identical ranks would exchange: an all_gather repeats this rank's
input, a sum multiplies by N. A rehearsal measures time and memory, not numerics: the
parameters an FSDP system gathers are this rank's shard repeated.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxshard.ir import compat
from fxshard.ir.cost import Network, Rates
from fxshard.ir.cost import hardware as profile
from fxshard.ir.errors import FxShardError

BACKEND = "fxshard_rehearsal"


@dataclass(frozen=True)
class Issued:
    """One collective of the rehearsal, as its group ran it."""

    kind: str  # all_gather, reduce_scatter, all_reduce, broadcast, barrier
    input_bytes: int  # all_gather: the shard; the others: the full buffer
    group_size: int
    between_nodes: bool
    seconds: float  # what the network predicts, the time the collective takes


@dataclass
class Rehearsal:
    """A rehearsal in progress: its rates, where it runs, and what its groups ran."""

    world_size: int
    rates: Rates
    device: torch.device
    log: list[Issued] = field(default_factory=list)
    _cycles_per_second: float = 0.0  # torch.cuda._sleep's, measured once

    @property
    def network(self) -> Network:
        return self.rates.network

    def seconds(self, kind: str, input_bytes: int, ranks: Sequence[int]) -> tuple[float, bool]:
        """The network's time for ``kind`` over ``ranks``, and whether they span nodes."""
        per_node = self.network.ranks_per_node
        between = per_node is not None and len({r // per_node for r in ranks}) > 1
        seconds = self.network.seconds(kind, input_bytes, len(ranks), "replicate" if between else "shard")
        return seconds, between

    def cycles(self, seconds: float) -> int:
        if not self._cycles_per_second:
            self._cycles_per_second = _sleep_rate(self.device)
        return int(seconds * self._cycles_per_second)


_ACTIVE: list[Rehearsal] = []


def rehearse(world_size: int, hardware: str | Rates, *, device: torch.device | str | None = None) -> Rehearsal:
    """Start a rehearsal of a ``world_size``-rank job on this one process: the default
    process group (``dist.init_process_group``) of this module's backend, this process
    its rank 0, each collective lasting what ``hardware`` (a profile's name, or
    ``Rates``) predicts. ``device``: where the model runs (default: the current CUDA
    device where torch sees one, else the CPU). End it with ``dist.destroy_process_group()``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise FxShardError(f"rehearse(world_size={world_size!r}): give the number of ranks to rehearse, "
                           "an int >= 1 (e.g. 8 for one node of 8 GPUs)")
    rates = profile(hardware) if isinstance(hardware, str) else hardware
    if not isinstance(rates, Rates):
        raise FxShardError(f"rehearse(hardware={hardware!r}): give a profile's name (fxshard calibrate "
                           "--list shows them) or an fxshard.ir.cost.Rates")
    if dist.is_initialized():
        raise FxShardError("rehearse(): a process group is already initialised; a rehearsal is this "
                           "process's default group: call it instead of dist.init_process_group (or "
                           "dist.destroy_process_group() first)")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise FxShardError(f"rehearse(device={device}): a rehearsal runs on the CPU or a CUDA device")
    _register()
    rehearsal = Rehearsal(world_size, rates, device)
    _ACTIVE[:] = [rehearsal]
    # The store is never read: every rank of the rehearsal is this process.
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=world_size)
    return rehearsal


def of(group: dist.ProcessGroup | None) -> Rehearsal | None:
    """The rehearsal ``group`` belongs to, or None (a real process group)."""
    return group.rehearsal if isinstance(group, RehearsalGroup) else None


def _sleep_rate(device: torch.device) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on ``device`` (its clock), timed with events."""
    with torch.cuda.device(device):
        compat.cuda_sleep(1_000_000)  # warm: the clock rises under load
        rates = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compat.cuda_sleep(10_000_000)
            end.record()
            end.synchronize()
            rates.append(10_000_000 / (start.elapsed_time(end) / 1e3))
    return sorted(rates)[1]


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
        _REGISTERED = True


def _create(store: Any, rank: int, world_size: int, timeout: Any) -> RehearsalGroup:
    if not _ACTIVE:
        raise FxShardError(f"the {BACKEND} backend makes groups of a rehearsal: start one with "
                           "fxshard.rehearse(world_size, hardware)")
    return RehearsalGroup(_ACTIVE[0], rank, world_size)


def _done(result: Any) -> dist.Work:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result)
    return compat.work_from_future(future)


def _reduction(op: Any) -> str:
    """What reducing N identical values by ``op`` (a ``ReduceOp``) does to one."""
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.PRODUCT:
        return "product"
    return "same"  # AVG, MAX, MIN, bitwise: N identical values give the value


class RehearsalGroup(dist.ProcessGroup):
    """One process group of a rehearsal: this process is its rank ``rank`` of ``size``."""

    def __init__(self, rehearsal: Rehearsal, rank: int, size: int):
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.rehearsal = rehearsal
        self._rank, self._size = rank, size
        self._ranks: list[int] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None]] | None = None
        self._failed: BaseException | None = None  # a collective's data failed on the thread

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return compat.registered_group_name(self)

    @property
    def pg_name(self) -> str:
        return self.group_name

    def __repr__(self) -> str:
        return f"RehearsalGroup(rank {self._rank} of {self._size}, {self.rehearsal.rates.name})"

    # -- running one collective ----------------------------------------------------------

    def _global_ranks(self) -> list[int]:
        if self._ranks is None:
            try:
                self._ranks = dist.get_process_group_ranks(self)
            except (ValueError, RuntimeError, KeyError):  # not registered yet (while it is made)
                return list(range(self._size))
        return self._ranks

    def _run(self, kind: str, input_bytes: int, data: Callable[[], None], result: Any,
             tensors: Sequence[torch.Tensor]) -> dist.Work:
        """Issue one collective: ``data`` fills its outputs, then it lasts the network's time."""
        if self._failed is not None:  # a Work from a future does not raise what its thread raised
            raise FxShardError(f"{self!r}: a collective failed: {self._failed!r}") from self._failed
        seconds, between = self.rehearsal.seconds(kind, input_bytes, self._global_ranks())
        self.rehearsal.log.append(Issued(kind, input_bytes, self._size, between, seconds))
        device = self.rehearsal.device
        on_gpu = device.type == "cuda" and all(t.device.type == "cuda" for t in tensors)
        if on_gpu:
            return self._on_stream(device, seconds, data, result, tensors)
        if device.type == "cuda" or self._size == 1:  # CPU tensors of a GPU rehearsal (objects): now
            data()
            return _done(result)
        return self._on_thread(seconds, data, result)

    def _on_stream(self, device: torch.device, seconds: float, data: Callable[[], None], result: Any,
                   tensors: Sequence[torch.Tensor]) -> dist.Work:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        caller = torch.cuda.current_stream(device)
        stream.wait_stream(caller)  # NCCL's rule: a collective starts after what was issued before it
        future: torch.futures.Future[Any] = torch.futures.Future(devices=[device])
        with torch.cuda.stream(stream):
            data()
            # The copies' own time is part of the collective's: spin for the rest.
            moved = 2 * sum(t.numel() * t.element_size() for t in tensors)
            rest = seconds - moved / _bandwidth(self.rehearsal)
            if rest > 0:
                compat.cuda_sleep(self.rehearsal.cycles(rest))
            for t in tensors:  # the caching allocator must not reuse them before the stream is done
                t.record_stream(stream)
            future.set_result(result)  # records an event on this stream; wait() joins it
        return compat.work_from_future(future)

    def _on_thread(self, seconds: float, data: Callable[[], None], result: Any) -> dist.Work:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_worker, args=(self._jobs,), daemon=True,
                             name=f"fxshard-rehearsal-{id(self):x}").start()
        future: torch.futures.Future[Any] = torch.futures.Future()

        def job() -> None:
            start = time.perf_counter()
            try:
                data()
            except BaseException as e:  # raised at the group's next collective
                self._failed = e
                future.set_exception(e)
                return
            rest = seconds - (time.perf_counter() - start)
            if rest > 0:
                time.sleep(rest)
            future.set_result(result)

        self._jobs.put(job)
        return compat.work_from_future(future)

    # -- the collectives, under each name c10d calls them by ---------------------------------
    # The C++ names (allgather_into_tensor_coalesced, _allgather_base, ...: functional
    # collectives and torch 2.11's Python API) and the Python API's own (all_gather_single,
    # reduce_scatter_single from 2.13; their _coalesced forms in 2.15's coalescing manager).

    def _all_gather(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> dist.Work:
        n = self._size

        def data() -> None:
            with torch.no_grad():
                for out, inp in zip(outs, ins):
                    source = inp.reshape(-1)
                    for slot in out.view(n, -1):  # FSDP2 gathers in place: its input is one slot
                        if slot.data_ptr() != source.data_ptr():
                            slot.copy_(source)

        return self._run("all_gather", sum(_nbytes(t) for t in ins), data, list(outs), [*outs, *ins])

    def _reduce_scatter(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], op: Any) -> dist.Work:
        n, rank = self._size, self._rank
        kind = _reduction(op)

        def data() -> None:
            with torch.no_grad():
                for out, inp in zip(outs, ins):
                    out.view(-1).copy_(inp.reshape(n, -1)[rank])
                    _combine(out, kind, n)

        return self._run("reduce_scatter", sum(_nbytes(t) for t in ins), data, list(outs), [*outs, *ins])

    def _all_reduce(self, tensors: Sequence[torch.Tensor], op: Any) -> dist.Work:
        n, kind = self._size, _reduction(op)

        def data() -> None:
            with torch.no_grad():
                for t in tensors:
                    _combine(t, kind, n)

        return self._run("all_reduce", sum(_nbytes(t) for t in tensors), data, list(tensors), list(tensors))

    def allgather_into_tensor_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._all_gather(outs, ins)

    def all_gather_single_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:  # torch 2.15's coalescing manager
        return self._all_gather(outs, ins)

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._all_gather([out], [inp])

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._all_gather([out], [inp])

    def allgather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        def data() -> None:
            with torch.no_grad():
                for slots, inp in zip(outs, ins):
                    for slot in slots:
                        slot.copy_(inp)

        flat = [t for slots in outs for t in slots]
        return self._run("all_gather", sum(_nbytes(t) for t in ins), data, outs, [*flat, *ins])

    def reduce_scatter_tensor_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._reduce_scatter(outs, ins, _op(opts))

    def reduce_scatter_single_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._reduce_scatter(outs, ins, _op(opts))

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._reduce_scatter([out], [inp], _op(opts))

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._reduce_scatter([out], [inp], _op(opts))

    def reduce_scatter(self, outs: list[torch.Tensor], ins: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        kind, n, rank = _reduction(_op(opts)), self._size, self._rank

        def data() -> None:
            with torch.no_grad():
                for out, pieces in zip(outs, ins):
                    out.copy_(pieces[rank])
                    _combine(out, kind, n)

        flat = [t for pieces in ins for t in pieces]
        return self._run("reduce_scatter", sum(_nbytes(t) for t in flat), data, outs, [*outs, *flat])

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._all_reduce(tensors, _op(opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._all_reduce(tensors, _op(opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        # Every rank holds what the root holds.
        return self._run("broadcast", sum(_nbytes(t) for t in tensors), lambda: None, tensors, tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run("barrier", 0, lambda: None, None, [])

    def _unsupported(self, *args: Any, **kwargs: Any) -> dist.Work:
        raise FxShardError(f"{self!r}: a rehearsal runs all_gather, reduce_scatter, all_reduce, broadcast "
                           "and barrier; this collective is not rehearsed")

    alltoall = alltoall_base = all_to_all_single = scatter = gather = reduce = send = recv = _unsupported


def _op(opts: Any) -> Any:
    return getattr(opts, "reduceOp", dist.ReduceOp.SUM)


def _combine(t: torch.Tensor, kind: str, n: int) -> None:
    if kind == "sum":
        t.mul_(n)
    elif kind == "product":
        t.pow_(n)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bandwidth(rehearsal: Rehearsal) -> float:
    bandwidth = rehearsal.rates.device.bandwidth
    return bandwidth if bandwidth > 0 and math.isfinite(bandwidth) else math.inf


def _worker(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
    while True:
        jobs.get()()
