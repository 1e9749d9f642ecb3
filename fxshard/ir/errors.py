"""Errors fxshard raises. Each names the problem and hints at the fix."""

from __future__ import annotations

from dataclasses import dataclass


class FxShardError(RuntimeError):
    """Base class of every error fxshard raises on purpose."""


@dataclass(frozen=True)
class SourceLine:
    """One line of the user's code: where a trace failed, or where fxshard was called from."""

    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}: {self.code}"


class TraceError(FxShardError):
    """The model could not be captured as a static graph.

    ``module`` is the path of the innermost module being traced when it failed
    (``""`` is the root) and ``op`` the operator involved, when known.
    ``kind`` names the cause, and the hint in the message follows it:
    ``"index-dtype"``, ``"dtype"``, ``"dynamic-shapes"``, ``"data-dependent"``,
    ``"dynamic-output-shape"``, ``"unsupported-operator"`` or ``"unknown"``.
    ``source`` is the line of the user's code that failed (the innermost frame
    of the traceback outside torch, fxshard and the standard library) or, when
    no such frame failed, the line that called fxshard; None when neither is known.
    """

    def __init__(self, message: str, *, module: str | None = None, op: str | None = None,
                 kind: str = "unknown", source: SourceLine | None = None):
        super().__init__(message)
        self.module = module
        self.op = op
        self.kind = kind
        self.source = source


class PlanError(FxShardError):
    """The model cannot be partitioned into FSDP units as asked."""


class GraphInvariantError(FxShardError):
    """A graph broke one of the invariants in fxshard/passes/README.md (see ``verify``)."""


class CollectiveMismatchError(FxShardError):
    """Ranks disagree on the collectives they are about to issue. ``groups_unusable``: some
    rank went on into the phase's collectives (it checked on the device), so the process
    groups cannot be used again; else every rank raised before any collective of the phase."""

    groups_unusable: bool = False


class BudgetError(FxShardError):
    """``memory_budget``: no schedule fxshard can choose has its predicted peak within the
    budget. Raised before anything runs; names the lowest peak found and its largest part.
    ``peak``: that lowest peak in bytes, where the search found one (None: nothing was
    predicted, e.g. every plan has a unit that alone gathers more than the budget)."""

    def __init__(self, message: str, *, peak: int | None = None):
        super().__init__(message)
        self.peak = peak
