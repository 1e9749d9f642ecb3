"""The IR layer: plain data (plan, policies, options, configuration, errors), fxshard's
operators and node metadata, node predicates, and read-only graph analysis (aliases,
windows, liveness, collectives).

Imports nothing else of fxshard: passes, the driver and the front ends build on it.
"""
