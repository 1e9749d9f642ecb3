"""The driver layer: one compiler behind every front end (``compiler.Driver``).

Tracing (trace.py), the hooks AOTAutograd calls (codegen.py), runtime shards
(runtime.py), the rank check (consistency.py), the report, dumps and the timeline.
Imports the IR and the passes; the front ends (api, backend, explain) import it.
"""
