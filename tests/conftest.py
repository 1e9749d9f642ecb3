import os
import sys

# Check graph invariants after every pass, in this process and in spawned ranks.
os.environ.setdefault("FXSHARD_VERIFY", "1")
sys.path.insert(0, os.path.dirname(__file__))
