"""Python attributes a traced forward reads are guarded: a change retraces, as torch.compile
recompiles, instead of being ignored for good."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.driver.compile.guards import MAX_VARIANTS
from fxshard.ir.errors import FxShardError
from fxshard.policies import by_class

from dist_utils import run_ranks

# The step cache and its guards: in the release tier.
pytestmark = pytest.mark.release


class Scaled(nn.Module):
    """Reads plain attributes in forward: a float, a bool and a submodule's int."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = 1.0
        self.use_b = True
        self.a.shift = 0  # type: ignore[assignment]
        self.steps_seen = 0  # written by the loop, never read by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.scale + self.a.shift
        return self.b(h) if self.use_b else h


def _train_and_change_attributes(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Scaled()
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)  # use_b=False skips b
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    changes = [{}, {"scale": 2.0}, {"steps_seen": 1}, {"shift": 3}, {"use_b": False}, {"use_b": True}]
    losses, ref_losses = [], []
    for change in changes:  # the same change on every rank, between steps
        for name, value in change.items():
            for m in (model, ddp.module):
                setattr(m.a if name == "shift" else m, name, value)
        x = torch.randn(4, 8, generator=gen)
        loss, ref_loss = sharded(x).square().mean(), ddp(x).square().mean()
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref_losses": ref_losses,
            "traces": len(sharded._driver.steps),
            "state": sharded.full_state_dict(), "ref_state": ddp.module.state_dict()}


def test_changed_attributes_retrace_and_train_like_ddp() -> None:
    for r in run_ranks(_train_and_change_attributes, 2):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6)
        # A trace for the first values and for each change of scale, shift and use_b, but
        # none for steps_seen (never read), nor for use_b back to True: the values then are
        # those of an earlier trace, which is reused.
        assert r["traces"] == 4, r["traces"]
        for k, v in r["ref_state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


# Module-level values a forward reads, as a config module or a script's constants would be.
GLOBAL_SCALE = 1.0
SETTINGS: dict[str, Any] = {"shift": 0.0, "name": "a"}


def _shifted(h: torch.Tensor) -> torch.Tensor:
    return h + SETTINGS["shift"]  # a dict item, read in a helper the forward calls


class GloballyScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _shifted(self.a(x) * GLOBAL_SCALE)


def _train_and_change_globals(rank: int, world_size: int) -> dict[str, Any]:
    global GLOBAL_SCALE
    torch.manual_seed(0)
    model = GloballyScaled()
    ddp = DDP(copy.deepcopy(model))
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    losses, ref_losses = [], []
    for step in range(5):
        if step == 1:
            GLOBAL_SCALE = 3.0
        if step == 2:
            SETTINGS["shift"] = 0.5
        if step == 3:
            SETTINGS["name"] = "b"  # read by nothing: no retrace needed, none harmful
        x = torch.randn(4, 8, generator=gen)
        loss, ref_loss = sharded(x).square().mean(), ddp(x).square().mean()
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "traces": len(sharded._driver.steps),
            "state": sharded.full_state_dict(), "ref_state": ddp.module.state_dict()}


def test_changed_globals_and_dict_items_retrace_and_train_like_ddp() -> None:
    for r in run_ranks(_train_and_change_globals, 2):
        # The same kernels on both sides: bit for bit.
        assert r["losses"] == r["ref_losses"]
        for k, v in r["ref_state"].items():
            assert torch.equal(r["state"][k], v), k
        assert r["traces"] >= 3  # the first values, the new scale, the new shift


def test_an_attribute_that_changes_every_call_raises_after_the_trace_limit() -> None:
    model = Scaled()
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    x = torch.randn(2, 8)
    with pytest.raises(FxShardError, match=r"traced 8 times.*Scaled attribute 'scale'.*tensor input "
                                           r"or a buffer"):
        for i in range(MAX_VARIANTS + 1):
            model.scale = float(i)
            sharded(x)
