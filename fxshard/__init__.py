"""fxshard: Fully Sharded Data Parallel (ZeRO-3) as a graph-rewriting compiler pass.

Pipeline (one module each): trace.py -> plan.py -> passes/ (rewrite, schedule)
-> codegen.py -> runtime.py; api.py ties them together.
"""

import logging

from fxshard import meta as meta
from fxshard import ops as ops  # registers the fxshard:: operators
from fxshard import policies
from fxshard.api import ShardedModule, compile
from fxshard.backend import FxShardBackend, backend, parameters
from fxshard.errors import (
    CollectiveMismatchError,
    FxShardError,
    GraphInvariantError,
    PlanError,
    TraceError,
)
from fxshard.explain import Explanation, explain
from fxshard.options import ShardingOptions
from fxshard.passes import verify
from fxshard.plan import FlatGroup, FSDPUnit, ShardPlan, make_plan
from fxshard.report import Report

# Silent unless the application configures logging (see README: Debugging).
logging.getLogger("fxshard").addHandler(logging.NullHandler())

__all__ = [
    "CollectiveMismatchError",
    "Explanation",
    "FxShardBackend",
    "FSDPUnit",
    "FlatGroup",
    "FxShardError",
    "GraphInvariantError",
    "PlanError",
    "Report",
    "ShardPlan",
    "ShardingOptions",
    "ShardedModule",
    "TraceError",
    "backend",
    "compile",
    "explain",
    "make_plan",
    "parameters",
    "policies",
    "verify",
]
