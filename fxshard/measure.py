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
from fxshard.ir import predicates as P
from fxshard.ir.collectives import bus_bytes
from fxshard.ir.compat import TorchDispatchMode, pytree

_c = torch.ops.c10d

# The c10d collectives DDP and FSDP issue: each one's kind, and the argument that holds
# what it sends (a tensor, a list, or FSDP1's list of lists); all name ``process_group``.
_C10D = {
    _c.allreduce_.default: ("all_reduce", "tensors"),
    _c.allreduce_coalesced_.default: ("all_reduce", "tensors"),
    _c._allgather_base_.default: ("all_gather", "input_tensor"),
    _c.allgather_into_tensor_coalesced_.default: ("all_gather", "inputs"),
    _c.allgather_.default: ("all_gather", "input_tensors"),  # list form, used by FSDP1 on CPU
    _c._reduce_scatter_base_.default: ("reduce_scatter", "input_tensor"),
    _c.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", "inputs"),
    _c.reduce_scatter_.default: ("reduce_scatter", "input_tensors"),
}


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
        call = P.collective_call(func, args, kwargs)
        legacy = _C10D.get(func)
        if call is not None and call.kind != "all_to_all":
            self._count(call.kind, _nbytes(call.input), call.ranks())
        elif legacy is not None:
            kind, sent = legacy
            bound = P.bind(func, args, kwargs)
            self._count(kind, sum(_nbytes(t) for t in pytree.tree_leaves(bound[sent])),
                        _group_size(bound["process_group"]))
        elif func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.name():
            self.uncounted[func.name()] += 1  # a collective this counter does not size
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
