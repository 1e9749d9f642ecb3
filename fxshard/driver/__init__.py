"""The driver layer: one compiler behind every front end (``compile.compiler.Driver``).

Split by what it does: ``compile`` (trace, the hooks AOTAutograd calls, the
compiled steps, the planners), ``run`` (the world, what running changes, the
ranks' agreement), ``state`` (the shards, made and read back as state dicts)
and ``report`` (predicted memory, communication and time; dumps, the timeline,
the trace). Imports the IR and the passes; the front ends (api, backend,
explain) import it.
"""
