"""Compile: a module and its inputs to compiled steps, as values.

The ``Driver`` (compiler.py) and what it runs: the trace (AOTAutograd under fake
tensors, trace.py; CUDA's attention kernels on meta, kernels.py; the attributes a
trace read, guards.py), the hooks AOTAutograd calls (codegen.py), Inductor
(inductor.py), the compiled steps and their schedules (steps.py), and the
planners that choose a schedule from a trace (plan_auto.py, plan_budget.py).
"""
