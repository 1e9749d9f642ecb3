"""Rank consistency: a divergent program fails fast, naming the collective that differs."""

from __future__ import annotations

import torch
import torch.nn as nn

import fxshard
from fxshard.ir.errors import CollectiveMismatchError
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import MLP


def _divergent(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    # Rank 1 builds its hidden layer one unit wider: different shard shapes.
    model = MLP(hidden=24 + rank)
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    try:
        sharded(torch.randn(4, 12)).sum().backward()
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def test_divergent_ranks_raise_instead_of_hanging() -> None:
    messages = run_ranks(_divergent, 2)
    for msg in messages:
        assert "collective #0 of the step differs" in msg, msg
        assert "rank 0: forward: all_gather(float32[156]" in msg
        assert "rank 1: forward: all_gather(float32[163]" in msg
        assert "unit 'layers.0'" in msg


def _consistent(rank: int, world_size: int) -> tuple[int, int]:
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    for _ in range(2):
        sharded(torch.randn(4, 12)).sum().backward()
    step = sharded._last
    assert step is not None and step.checked
    return len(step.collectives), len({c.kind for c in step.collectives})


def test_consistent_ranks_pass_the_check_once() -> None:
    assert run_ranks(_consistent, 2) == [(8, 2), (8, 2)]
