"""fxshard's rewriting passes. Which run, in which order and why: ``pipeline.build_pipeline``."""

from .accumulate_in_place import accumulate_in_place_pass
from .assign_groups import assign_groups_pass
from .checkpoint_activations import checkpoint_activations_pass
from .context import GraphKind, PassContext
from .eliminate_dead_code import eliminate_dead_code_pass
from .insert_all_gather import insert_all_gather_pass
from .insert_free import insert_free_pass
from .insert_reduce_scatter import insert_reduce_scatter_pass
from .pipeline import (
    GRAPH_KINDS,
    PassSpec,
    all_pass_names,
    build_pipeline,
    build_pipelines,
    describe,
    run_passes,
)
from .rematerialize_params import rematerialize_params_pass
from .scale_in_place import scale_in_place_pass
from .schedule_gathers import place_gathers_pass, prefetch_gathers_pass
from .schedule_reduce_scatter import schedule_reduce_scatter_pass
from .sink_allocations import sink_allocations_pass
from .topological_sort import topological_sort_pass
from .verify import verify

__all__ = [
    "GRAPH_KINDS",
    "GraphKind",
    "PassContext",
    "PassSpec",
    "accumulate_in_place_pass",
    "assign_groups_pass",
    "all_pass_names",
    "build_pipeline",
    "build_pipelines",
    "describe",
    "eliminate_dead_code_pass",
    "insert_all_gather_pass",
    "insert_free_pass",
    "insert_reduce_scatter_pass",
    "place_gathers_pass",
    "prefetch_gathers_pass",
    "rematerialize_params_pass",
    "checkpoint_activations_pass",
    "run_passes",
    "scale_in_place_pass",
    "schedule_reduce_scatter_pass",
    "sink_allocations_pass",
    "topological_sort_pass",
    "verify",
]
