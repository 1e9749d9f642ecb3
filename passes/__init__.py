"""fxshard's rewriting passes. The order they run in is in ``pipeline.py``."""

from .accumulate_in_place import accumulate_in_place_pass
from .context import PassContext
from .eliminate_dead_code import eliminate_dead_code_pass
from .insert_all_gather import insert_all_gather_pass
from .insert_free import insert_free_pass
from .insert_reduce_scatter import insert_reduce_scatter_pass
from .pipeline import BACKWARD_PASSES, FORWARD_PASSES, JOINT_PASSES, run_passes
from .rematerialize_params import rematerialize_params_pass
from .schedule import schedule_pass
from .schedule_reduce_scatter import schedule_reduce_scatter_pass
from .sink_allocations import sink_allocations_pass
from .verify import verify

__all__ = [
    "BACKWARD_PASSES",
    "FORWARD_PASSES",
    "JOINT_PASSES",
    "PassContext",
    "accumulate_in_place_pass",
    "eliminate_dead_code_pass",
    "insert_all_gather_pass",
    "insert_free_pass",
    "insert_reduce_scatter_pass",
    "rematerialize_params_pass",
    "run_passes",
    "schedule_pass",
    "schedule_reduce_scatter_pass",
    "sink_allocations_pass",
    "verify",
]
