"""compute="inductor" through torch's FX graph cache (fxshard/driver/compile/inductor.py).

A resumed job is a new process: it traces again (AOTAutograd's cache cannot key a Python
module), and each emitted graph that Inductor compiled before, the same graph on the same
torch and configuration, is loaded from the cache instead of compiled. The fast test keys
the graphs without compiling; the slow one compiles on 2 gloo ranks in three jobs one after
another, sharing a cache folder: the first compiles, the second loads and trains bit for bit
as the first did, and one with another policy compiles its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxshard
from fxshard.ir import compat
from fxshard.policies import by_class, by_size

from dist_utils import run_ranks
from models import MLP

POLICIES = {"by_class": by_class(torch.nn.Linear), "by_size": by_size(300)}


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)


@pytest.mark.release("inductor_partition_fn")
def test_inductors_cache_keys_the_graphs_fxshard_hands_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every graph reaches Inductor where its FX graph cache can key it (without a shape
    environment in a TracingContext it bypasses them: "No shape env"), and the key is the
    graph's alone: the same model and configuration compiled again key the same, with no name
    or metadata that differs between compiles; another policy keys others."""
    from torch._inductor.codecache import FxGraphCache

    keys: list[str] = []

    def key_only(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        key, info = FxGraphCache.prepare_key(gm, example_inputs, {}, [], False)
        assert key is not None, info.get("cache_bypass_reason")
        keys.append(key[0])
        return gm  # runs as it is

    monkeypatch.setattr(compat, "inductor_compile_fx_inner", key_only)

    def compiled_keys(policy: str) -> list[str]:
        keys.clear()
        torch.manual_seed(0)
        sharded = fxshard.compile(MLP(), policy=POLICIES[policy], compute="inductor")
        x, y = _inputs(0)
        F.mse_loss(sharded(x), y).backward()  # forward and backward compiled at the trace
        return list(keys)

    first = compiled_keys("by_class")
    assert len(first) == 2  # forward, backward
    assert compiled_keys("by_class") == first
    assert not set(compiled_keys("by_size")) & set(first)


def _train(rank: int, world_size: int, policy: str) -> dict[str, Any]:
    """Three Inductor steps of the MLP; the FX graph cache's outcomes as fxshard logged them."""
    outcomes: list[str] = []

    class Outcomes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "FX graph cache:" in message:
                outcomes.append(message.rsplit(": ", 1)[1].rstrip(")"))

    logger = logging.getLogger("fxshard")
    logger.setLevel(logging.INFO)
    logger.addHandler(Outcomes())
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=POLICIES[policy], compute="inductor")
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    losses = []
    x, y = _inputs(rank)
    for _ in range(3):
        loss = F.mse_loss(sharded(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"outcomes": outcomes, "losses": losses, "shards": [p.detach().clone() for p in sharded.parameters()]}


@pytest.mark.slow
@pytest.mark.release("inductor_partition_fn")
def test_a_resumed_job_loads_inductors_graphs_and_trains_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    first = run_ranks(_train, 2, "by_class")
    assert [r["outcomes"] for r in first] == [["miss", "miss"]] * 2
    resumed = run_ranks(_train, 2, "by_class")
    assert [r["outcomes"] for r in resumed] == [["hit", "hit"]] * 2
    for a, b in zip(first, resumed):
        for key in ("losses", "shards"):
            for x, y in zip(a[key], b[key], strict=True):
                assert torch.equal(x, y)
    other = run_ranks(_train, 2, "by_size")  # other units, other collectives: other graphs
    assert [r["outcomes"] for r in other] == [["miss", "miss"]] * 2
