"""compute="inductor": each emitted graph compiled by Inductor, through torch's FX graph cache.

Inductor keeps what it compiled on disk, keyed by the graph it was handed
(its code, its inputs' shapes, strides and dtypes, Inductor's configuration,
the torch release): torch's FX graph cache (``torch._inductor.config.fx_graph_cache``,
on by default; under ``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_$USER``). A later process that hands it the same graph
loads the compiled module instead of compiling again: a resumed job's first step
skips Inductor's compile, which is most of that step's time.

The cache looks up a graph only inside a ``TracingContext`` whose fake mode has a
``ShapeEnv`` (the guards of a symbolic size live there). ``torch.compile`` always
has one; fxshard's trace has neither (``fxshard.compile`` calls AOTAutograd itself,
on static shapes), and Inductor then bypasses its cache ("No shape env") and
compiles every graph in every process. So ``compile_graph`` gives the trace's fake
mode an empty ``ShapeEnv`` for the compile, inside a ``TracingContext`` of its own::

    emitted graph --compile_graph--> TracingContext(trace's fake mode + ShapeEnv())
                                       compile_fx_inner: key -> hit: load | miss: compile, store

The shape environment is empty and stays so: the fake mode was made with static
shapes, so no size becomes a symbol, the entry has no guards, and the key alone
decides. It is taken off again after the compile. Under ``fxshard.backend`` Dynamo's
context is there already, with a ``ShapeEnv``: nothing is added.

Sound by construction: the key is the emitted graph itself, after every pass, so a
changed model, policy, option, world size or rank layout that changes the graph
misses, and one that does not change it has nothing to compile differently. What a
graph names and resolves only when it runs (process groups by name, fxshard's
operators) is resolved in the new process, hit or miss. A hit on one rank and a miss
on another run the same collectives: each rank already compiles its own graph, and a
hit returns what compiling that same graph with the same configuration and release
made before; the ranks' agreement (``driver/run/consistency.py``) fingerprints the
emitted graphs, which the cache does not change.

AOTAutograd's own cache (``torch._functorch.config.enable_autograd_cache``) does not
apply: it is consulted only for Inductor's serializable compilers and keys a Dynamo
``GraphModule``, and fxshard hands AOTAutograd a Python module (``trace.StepFunction``:
the user's forward through ``functional_call``), which no key can capture ("'StepFunction'
object has no attribute 'graph'" when forced). So every process traces again; see
docs/checkpoints.md, "The first step of a resumed job".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch._dynamo.utils import counters
from torch._guards import TracingContext, tracing
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxshard.ir import compat

log = logging.getLogger("fxshard")

# torch's counters of the FX graph cache's outcomes, in the "inductor" group.
OUTCOMES = ("hit", "miss", "bypass")


def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """Inductor's compile of ``gm`` (``compile_fx_inner``), looked up in and stored to torch's
    FX graph cache; logs the outcome ("hit", "miss", "bypass", or "off" when the cache is
    disabled) at INFO on the "fxshard" logger."""
    before = _outcome_counts()
    start = time.perf_counter()
    mode = compat.detect_fake_mode(example_inputs)
    if mode is None or mode.shape_env is not None:  # torch.compile's context, or no fake inputs
        compiled = compat.inductor_compile_fx_inner(gm, example_inputs)
    else:
        mode.shape_env = ShapeEnv()
        try:
            with tracing(TracingContext(mode)):
                compiled = compat.inductor_compile_fx_inner(gm, example_inputs)
        finally:
            mode.shape_env = None
    after = _outcome_counts()
    outcome = next((o for o, b, a in zip(OUTCOMES, before, after) if a > b), "off")
    log.info("fxshard: Inductor compiled a graph of %d nodes in %.2f s (torch's FX graph cache: %s)",
             len(gm.graph.nodes), time.perf_counter() - start, outcome)
    return compiled


def _outcome_counts() -> tuple[int, ...]:
    return tuple(counters["inductor"][f"fxgraph_cache_{o}"] for o in OUTCOMES)
