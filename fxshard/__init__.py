"""fxshard: Fully Sharded Data Parallel (ZeRO-3) as a graph-rewriting compiler pass.

Layers, each importing only the ones before it (docs/architecture.md):
    fxshard.ir       plan, policies, options, configuration, operators, node metadata,
                     predicates, graph analysis, liveness
    fxshard.passes   the rewriting passes and the pipeline built from a configuration
    fxshard.driver   the one compiler every front end runs: trace, passes, codegen,
                     shards, rank check, report, dumps
    front ends       fxshard.compile (api.py), fxshard.backend (backend.py),
                     fxshard.explain (explain.py); tools: cli.py, measure.py
"""

import logging

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
from fxshard.driver.report import Report
from fxshard.explain import Explanation, explain
from fxshard.ir import meta as meta
from fxshard.ir import ops as ops  # registers the fxshard:: operators
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
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_requires_gradient_sync",
    "set_state_dict",
    "verify",
]
