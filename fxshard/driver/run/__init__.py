"""Run: what a compiled step needs while it runs.

The world and its process groups, full <-> sharded buffers, waits that say what
ended them (runtime.py); what running changes (run_state.py); the ranks'
agreement before each phase (consistency.py); shard gradients with global norms
(grads.py); use_orig_params' views (orig_params.py); a rehearsed network
(rehearsal.py).
"""
