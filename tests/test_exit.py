"""A rank's process exits cleanly after fxshard's collectives: nothing is left on a gloo worker thread.

A gloo worker thread drops each collective a moment after it is marked done,
and dropping it releases tensors, which needs the GIL. A worker thread that
does so while the interpreter finalises aborts the process (std::terminate,
SIGABRT) after a run that succeeded: seen under load, in save, load and
full_state_dict. fxshard therefore runs every collective of its own on its own
one-thread groups (never the user's group), and quiesces them at exit
(``runtime.quiesce``): an empty all-reduce that the thread must take after
dropping everything before it, waited until the thread has dropped it too.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxshard
from fxshard.driver.run import runtime
from fxshard.ir import compat
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import MLP

RANKS_START_METHOD = "spawn"  # ranks exit through interpreter teardown (tests/dist_utils.py)

# gloo's worker threads and the one-thread groups: in the release tier.
pytestmark = pytest.mark.release


def _everything_on_gloo(rank: int, world_size: int, path: str, inflight: bool) -> dict[str, Any]:
    user = dist.group.WORLD
    assert user is not None
    before = user._get_sequence_number_for_group()
    torch.manual_seed(rank)  # sync_module_states broadcasts rank 0's parameters
    model = MLP()
    sharded = fxshard.compile(model, policy=by_class(torch.nn.Linear), sync_module_states=True,
                              inflight_groups=inflight)
    optim = torch.optim.SGD(sharded.parameters(), lr=0.1)
    sharded(torch.randn(4, 12)).sum().backward()
    optim.step()
    full = sharded.full_state_dict()
    sharded.load_full_state_dict(full)
    fxshard.checkpoint.save(path, sharded, optim)
    fxshard.checkpoint.load(path, sharded, optim)
    issued_on_user_group = user._get_sequence_number_for_group() - before

    # quiesce: the thread that ran a collective has let go of its tensors when it returns.
    world = sharded._driver.world
    tensor = torch.ones(8)
    work = dist.all_reduce(tensor, group=world.comm_group, async_op=True)
    assert work is not None
    work.wait()
    del work
    quiesced = runtime.quiesce(*world.comm)
    return {"issued": issued_on_user_group, "quiesced": quiesced, "held": compat.use_count(tensor),
            "own": all(g in runtime._OWN_GROUPS for g in world.comm)}


def test_fxshard_never_communicates_on_the_users_gloo_group_and_quiesces_its_own() -> None:
    for inflight in (True, False):
        with tempfile.TemporaryDirectory() as d:
            results = run_ranks(_everything_on_gloo, 2, os.path.join(d, "ckpt"), inflight)
        for rank, r in enumerate(results):
            # compile (broadcast, agreement), a step, full state dicts, DCP save and load
            assert r["issued"] == 0, (inflight, rank, r)
            assert r["own"] and r["quiesced"], (inflight, rank, r)
            assert r["held"] == 1, (inflight, rank, r)  # only this frame's reference
