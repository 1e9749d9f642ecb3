import os
import sys

# Check graph invariants after every pass, in this process and in spawned ranks.
os.environ.setdefault("FXSHARD_VERIFY", "1")
sys.path.insert(0, os.path.dirname(__file__))
# Inductor compiles in-process: no worker pool to outlive a spawned rank.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
