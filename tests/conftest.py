import os
import sys

# Check graph invariants after every pass, in this process and in spawned ranks.
os.environ.setdefault("FXSHARD_VERIFY", "1")
sys.path.insert(0, os.path.dirname(__file__))
# Inductor compiles in-process: no worker pool to outlive a spawned rank.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# -- tiers --------------------------------------------------------------------------------------
# The README's test command runs the fast tier (``-m "not slow"``, from pyproject's addopts); .ci/run
# runs the slow tier (``-m slow``) after it, and both on the other torch releases. The slow tier:
# - a test's 3-rank case when the same test runs on 2 and 3 ranks (and perhaps 1) only: these spawn
#   real ranks. The fast tier keeps the 2-rank case; uneven shards stay in it through
#   test_checkpoint (1 and 3 ranks), test_plan and test_local_ranks (3, 5, 7 ranks, no spawn).
# - tests marked ``@pytest.mark.slow`` in their file: the quick benchmark, the Llama-scale explains,
#   the gloo stress loop, the GPT example script (its resume at another world size is also
#   test_checkpoint's, in the fast tier), Lightning's precision flags (test_lightning), every
#   doc page's examples (test_doc_examples), auto()'s toys (test_auto: each traces every
#   candidate), no_sync under Inductor (test_recipe) and a second job loading the first's
#   Inductor graphs from torch's cache (test_compile_cache);
#   and variants of fast-tier checks marked there with ``pytest.param(..., marks=slow)``:
#   timeouts that wait out their seconds, world size 1 parity, simulated world sizes 4 and 8,
#   Lightning's validate load, the CLI's HF explain, the 4-rank HSDP error messages.
# The release tier (``-m "release and not slow"``, on torch 2.11 and 2.15 in .ci/run): tests marked
# ``@pytest.mark.release`` (tests/test_compat.py checks that every row of compat's table has one).


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    import pytest

    sizes: dict[tuple[str, str], set[int]] = {}
    for item in items:
        size = getattr(item, "callspec", None) and item.callspec.params.get("world_size")
        if isinstance(size, int):
            sizes.setdefault((item.fspath.strpath, item.originalname), set()).add(size)
    for item in items:
        size = getattr(item, "callspec", None) and item.callspec.params.get("world_size")
        if size == 3 and {2, 3} <= sizes[(item.fspath.strpath, item.originalname)] <= {1, 2, 3}:
            item.add_marker(pytest.mark.slow)
