"""What an optimizer keeps per parameter, for the memory model's optimizer-step phase.

``optimizer=torch.optim.AdamW`` (or ``functools.partial(torch.optim.SGD, momentum=0.9)``)
on ``fxshard.compile``, ``fxshard.backend`` or ``fxshard.explain``: nothing is
built from it; the report and the memory budget count its state. torch's
optimizers create each state tensor with ``zeros_like(param)``, so a state is
a parameter shard's size and dtype; the scalar ``step`` counters are left out.

The state lives on the device from the first step on, so the report counts it
through forward and backward too (a steady-state step). The step itself adds
its implementation's temporaries: Adam's family takes the square root of the
second moment out of place, all shards at once with ``foreach`` (one state's
worth; torch's default on accelerators), one shard at a time in the for-loop
(torch's default on the CPU: that shard's root and its quotient), nothing
fused (``fused=True``). torch takes foreach by default only where every tensor
of the step is on a device with foreach kernels: an optimizer over shards of
which some are offloaded to the host takes the for-loop, on the device too.
Other optimizers' temporaries are not counted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OptimizerState:
    """``states`` tensors of each parameter shard's size and dtype, kept between steps."""

    name: str
    states: int
    # "fused", "foreach" or "for-loop"; None: torch's default for the shards' device.
    implementation: str | None = None
    # Whether the step makes Adam's out-of-place square root (see the module's docstring).
    adam_temporaries: bool = False

    def __str__(self) -> str:
        return f"{self.name} ({self.states} state{'' if self.states == 1 else 's'} per parameter)"

    def step_temporary_bytes(self, shard_bytes: list[int], device: torch.device, with_host: bool = False) -> int:
        """Bytes the step allocates on ``device`` beyond the state, at its largest, over the
        shards of ``shard_bytes`` there (meta: planned for an accelerator). ``with_host``: the
        step also holds shards on the host (offloaded), so torch's default is the for-loop."""
        if not self.adam_temporaries or not shard_bytes:
            return 0
        how = self.implementation or ("for-loop" if device.type == "cpu" or with_host else "foreach")
        if how == "fused":
            return 0
        if how == "foreach":
            return sum(shard_bytes)
        return 2 * max(shard_bytes)


def _adam(kw: dict[str, Any]) -> int:
    return 3 if kw.get("amsgrad", False) else 2


def _sgd(kw: dict[str, Any]) -> int:
    return 1 if kw.get("momentum", 0) else 0


def _rmsprop(kw: dict[str, Any]) -> int:
    return 1 + bool(kw.get("momentum", 0)) + bool(kw.get("centered", False))


# Per-parameter state tensors of torch.optim's optimizers, from their constructor's arguments.
_STATES: dict[str, Any] = {
    "Adam": _adam, "AdamW": _adam, "Adamax": lambda kw: 2, "NAdam": lambda kw: 2,
    "RAdam": lambda kw: 2, "Adadelta": lambda kw: 2, "Adagrad": lambda kw: 1,
    "SGD": _sgd, "RMSprop": _rmsprop, "Rprop": lambda kw: 2, "ASGD": lambda kw: 1,
}


# Their step divides by the square root of the second moment, made out of place.
_ADAM_FAMILY = frozenset({"Adam", "AdamW", "NAdam", "RAdam"})


def optimizer_state(spec: Any) -> OptimizerState | None:
    """The state ``spec`` keeps: a torch.optim class, a ``functools.partial`` of one (its
    keywords decide momentum buffers), an ``OptimizerState``, or None."""
    if spec is None or isinstance(spec, OptimizerState):
        return spec
    cls, kwargs = spec, {}
    if isinstance(spec, functools.partial):
        cls, kwargs = spec.func, dict(spec.keywords)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        # torch's optimizers, and subclasses of them: the state of the class they extend.
        for klass in cls.__mro__:
            if klass.__name__ in _STATES and klass.__module__.startswith("torch.optim"):
                foreach = kwargs.get("foreach")
                how = "fused" if kwargs.get("fused") else None if foreach is None else \
                    "foreach" if foreach else "for-loop"
                return OptimizerState(cls.__name__, _STATES[klass.__name__](kwargs), how,
                                      klass.__name__ in _ADAM_FAMILY)
    raise TypeError(
        f"optimizer takes a torch.optim class, a functools.partial of one (partial(torch.optim.SGD, "
        f"momentum=0.9)), or fxshard.OptimizerState(name, states) for an optimizer keeping `states` "
        f"tensors the size of each parameter; got {spec!r}. Known: {sorted(_STATES)}"
    )
