"""Errors fxshard raises. Each names the problem and hints at the fix."""

from __future__ import annotations


class FxShardError(RuntimeError):
    """Base class of every error fxshard raises on purpose."""


class TraceError(FxShardError):
    """The model could not be captured as a static graph.

    ``module`` is the path of the innermost module being traced when it failed
    (``""`` is the root) and ``op`` the operator involved, when known.
    """

    def __init__(self, message: str, *, module: str | None = None, op: str | None = None):
        super().__init__(message)
        self.module = module
        self.op = op


class PlanError(FxShardError):
    """The model cannot be partitioned into FSDP units as asked."""


class GraphInvariantError(FxShardError):
    """A graph broke one of the invariants in passes/README.md (see ``verify``)."""


class CollectiveMismatchError(FxShardError):
    """Ranks disagree on the collectives they are about to issue."""
