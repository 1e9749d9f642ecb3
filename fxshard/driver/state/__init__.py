"""State: the shards, made and read back.

This rank's shards of a module, a meta-device one or rank 0's (init.py), and
state dicts under the original names, full or sharded (state_dicts.py).
"""
