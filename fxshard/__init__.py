"""fxshard: Fully Sharded Data Parallel (ZeRO-3) as a graph-rewriting compiler pass.

Layers, each importing only the ones before it (docs/architecture.md):
    fxshard.ir       plan, policies, options, configuration, operators, node metadata,
                     predicates, graph analysis, liveness
    fxshard.passes   the rewriting passes and the pipeline built from a configuration
    fxshard.driver   the one compiler every front end runs: trace, passes, codegen,
                     shards, rank check, report, dumps
    front ends       fxshard.compile (api.py), fxshard.backend (backend.py),
                     fxshard.explain (explain.py); tools: cli.py, measure.py

``import fxshard`` imports neither torch nor the rest of the package: each public name
is imported on first use (PEP 562), so ``fxshard --help`` answers without loading
torch. Every module that builds or reads graphs with the ``fxshard::`` operators
imports ``fxshard.ir.ops``, which registers them; ``torch.compile(backend="fxshard")``
finds the backend through the ``torch_dynamo_backends`` entry point (pyproject.toml),
or, from a checkout that is not installed, once ``fxshard.backend`` has been imported.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxshard import checkpoint, policies
    from fxshard.api import ShardedModule, compile
    from fxshard.backend import (
        FxShardBackend,
        backend,
        no_sync,
        parameters,
        set_requires_gradient_sync,
    )
    from fxshard.checkpoint import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )
    from fxshard.driver.report.step_report import Report
    from fxshard.driver.run.rehearsal import rehearse
    from fxshard.explain import Explanation, explain
    from fxshard.ir import meta as meta
    from fxshard.ir import ops as ops
    from fxshard.ir.config import CompileConfig
    from fxshard.ir.errors import (
        BudgetError,
        CollectiveMismatchError,
        FxShardError,
        GraphInvariantError,
        PlanError,
        TraceError,
    )
    from fxshard.ir.options import CPUOffloadPolicy, ShardingOptions
    from fxshard.ir.plan import FlatGroup, FSDPUnit, ShardPlan, make_plan
    from fxshard.ir.precision import MixedPrecision
    from fxshard.passes import verify

# Silent unless the application configures logging (see README: Debugging).
logging.getLogger("fxshard").addHandler(logging.NullHandler())

# Each public name -> the module it is imported from (a name that is the module itself:
# checkpoint, policies, meta, ops).
_SOURCES: dict[str, str] = {
    **dict.fromkeys(["checkpoint", "policies"], "fxshard"),
    **dict.fromkeys(["ShardedModule", "compile"], "fxshard.api"),
    **dict.fromkeys(["FxShardBackend", "backend", "no_sync", "parameters",
                     "set_requires_gradient_sync"], "fxshard.backend"),
    **dict.fromkeys(["get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
                     "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"],
                    "fxshard.checkpoint"),
    "Report": "fxshard.driver.report.step_report",
    **dict.fromkeys(["Explanation", "explain"], "fxshard.explain"),
    **dict.fromkeys(["meta", "ops"], "fxshard.ir"),
    "CompileConfig": "fxshard.ir.config",
    **dict.fromkeys(["BudgetError", "CollectiveMismatchError", "FxShardError",
                     "GraphInvariantError", "PlanError", "TraceError"], "fxshard.ir.errors"),
    **dict.fromkeys(["CPUOffloadPolicy", "ShardingOptions"], "fxshard.ir.options"),
    **dict.fromkeys(["FlatGroup", "FSDPUnit", "ShardPlan", "make_plan"], "fxshard.ir.plan"),
    "MixedPrecision": "fxshard.ir.precision",
    "rehearse": "fxshard.driver.run.rehearsal",
    "verify": "fxshard.passes",
}

# Submodules named like the function they define: the package's attribute is the function.
_FUNCTION_MODULES = ("backend", "explain")


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'fxshard' has no attribute {name!r}")
    if source in ("fxshard", "fxshard.ir"):
        value: Any = importlib.import_module(f"{source}.{name}")
    else:
        value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Importing the submodule ``fxshard.backend`` or ``fxshard.explain`` (by fxshard
    itself, or ``from fxshard.explain import ...``) makes the import system set the
    package's attribute of that name to the module; keep the function there instead,
    as ``fxshard.backend(...)`` and ``fxshard.explain(...)`` are the public names."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTION_MODULES and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "BudgetError",
    "CPUOffloadPolicy",
    "CollectiveMismatchError",
    "CompileConfig",
    "Explanation",
    "FxShardBackend",
    "FSDPUnit",
    "FlatGroup",
    "FxShardError",
    "GraphInvariantError",
    "MixedPrecision",
    "PlanError",
    "Report",
    "ShardPlan",
    "ShardingOptions",
    "ShardedModule",
    "TraceError",
    "backend",
    "checkpoint",
    "compile",
    "explain",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "make_plan",
    "no_sync",
    "parameters",
    "policies",
    "rehearse",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_requires_gradient_sync",
    "set_state_dict",
    "verify",
]
