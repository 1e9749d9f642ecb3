"""Measured counterparts of the report, usable on fxshard and on the systems it is compared with.

- ``peak_memory(fn, track=...)``: peak live tensor bytes while ``fn`` runs,
  from torch's own ``MemTracker`` (a dispatch mode that follows every storage,
  including ``resize_``, which ``fxshard.free`` uses).
- ``CommCounter``: bus bytes of every collective dispatched while active:
  fxshard's ``_c10d_functional`` ops and the ``c10d`` ops DDP and FSDP issue.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from fxshard.ir import compat
from fxshard.ir.collectives import bus_bytes
from fxshard.ir.compat import TorchDispatchMode

_f = compat.c10d_functional
_c = torch.ops.c10d


def peak_memory(fn: Callable[[], Any], *track: Any) -> int:
    """Peak live tensor bytes (one device) while ``fn()`` runs.

    ``track`` are modules, optimizers and tensors created before the call
    whose memory counts (parameters, optimizer state, inputs).
    """
    tracker = compat.mem_tracker()()
    tracker.track_external(*track)
    with tracker:
        fn()
    snapshot = tracker.get_tracker_snapshot("peak")
    return max(int(dev["Total"]) for dev in snapshot.values())


def _group_size(pg: Any) -> int:
    size = getattr(pg, "size", None)
    return int(size()) if callable(size) else int(torch.distributed.get_world_size())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter(TorchDispatchMode):
    """Counts bus bytes per collective kind (``bytes``) and calls (``calls``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.uncounted: Counter[str] = Counter()

    def _count(self, kind: str, input_bytes: int, group_size: int) -> None:
        self.bytes[kind] += bus_bytes(kind, input_bytes, group_size)
        self.calls[kind] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _f.all_gather_into_tensor.default:
            self._count("all_gather", _nbytes(args[0]), args[1])
        elif func is _f.reduce_scatter_tensor.default:
            self._count("reduce_scatter", _nbytes(args[0]), args[2])
        elif func is _f.all_reduce.default:
            group = compat.resolve_process_group(args[2])
            self._count("all_reduce", _nbytes(args[0]), group.size())
        elif func is _c.allreduce_.default:
            self._count("all_reduce", sum(_nbytes(t) for t in args[0]), _group_size(args[1]))
        elif func is _c._allgather_base_.default:
            self._count("all_gather", _nbytes(args[1]), _group_size(args[2]))
        elif func is _c._reduce_scatter_base_.default:
            self._count("reduce_scatter", _nbytes(args[1]), _group_size(args[2]))
        elif func is _c.allgather_into_tensor_coalesced_.default:
            self._count("all_gather", sum(_nbytes(t) for t in args[1]), _group_size(args[2]))
        elif func is _c.reduce_scatter_tensor_coalesced_.default:
            self._count("reduce_scatter", sum(_nbytes(t) for t in args[1]), _group_size(args[2]))
        elif func is _c.allgather_.default:  # list form, used by FSDP1 on CPU
            self._count("all_gather", sum(_nbytes(t) for t in args[1]), _group_size(args[2]))
        elif func is _c.reduce_scatter_.default:
            full = sum(_nbytes(t) for ts in args[1] for t in ts)
            self._count("reduce_scatter", full, _group_size(args[2]))
        elif func is _c.allreduce_coalesced_.default:
            self._count("all_reduce", sum(_nbytes(t) for t in args[0]), _group_size(args[1]))
        elif func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.name():
            self.uncounted[func.name()] += 1  # a collective this counter does not size
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
