"""Aligned spans: a parameter that follows an odd-sized one in its flat group still starts
16 bytes aligned (fxshard.ir.plan.ALIGN_BYTES), and training matches DDP bit for bit.

The model is EfficientNet's squeeze-excite in small: the 6-element bias of the reducing
1x1 convolution is followed by the weight of the expanding one, which runs on a 1x1
input. That convolution rounds differently when its weight starts off a 16-byte boundary
(torch on this CPU, one thread per rank as in dist_utils). With the weight packed right
after the bias (offset 2 mod 4 in float32), three steps left stem.weight, head.weight and
head.bias different from DDP under SGD, and every parameter under AdamW; aligned, every
value matches exactly.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.ir.plan import ALIGN_BYTES, FlatGroup

from dist_utils import run_ranks

STEPS = 3


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int = 64, reduced: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.reduce = nn.Conv2d(channels, reduced, 1)  # its bias: 6 elements, 24 bytes
        self.expand = nn.Conv2d(reduced, channels, 1)  # on a 1x1 input, right after that bias
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.stem(x))
        s = torch.sigmoid(self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True)))))
        return self.head((x * s).mean((2, 3)))


def _padding(group: FlatGroup, rank: int) -> torch.Tensor:
    """This rank's shard positions that hold no parameter element (gaps and tail)."""
    mask = torch.ones(group.shard_numel, dtype=torch.bool)
    for slot in group.params:
        piece = group.piece(slot, rank)
        if piece is not None:
            mask[piece.shard] = False
    return mask


def train(rank: int, world_size: int, opt_name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SqueezeExcite()
    ddp = DDP(copy.deepcopy(model))
    sharded = fxshard.compile(model)
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if opt_name == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt, ref_opt = make(sharded.parameters()), make(ddp.parameters())
    shards = list(sharded.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, ref_losses, padding_grads, padding_values = [], [], [], []
    for _ in range(STEPS):
        x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        loss = F.cross_entropy(sharded(x), y)
        loss.backward()
        for g, shard in zip(sharded.plan.groups, shards):
            assert shard.grad is not None
            padding_grads.append(shard.grad[_padding(g, rank)].clone())
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(ddp(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    for g, shard in zip(sharded.plan.groups, shards):
        padding_values.append(shard.detach()[_padding(g, rank)].clone())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "state": sharded.full_state_dict(),
        "ref_state": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()},
        "plan": sharded.plan,
        "padding_grads": padding_grads,
        "padding_values": padding_values,
    }


def worker(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {opt_name: train(rank, world_size, opt_name) for opt_name in ("sgd", "adamw")}


@cache
def results() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(worker, 2)


def test_the_weight_after_an_odd_sized_bias_is_aligned_behind_a_gap() -> None:
    plan = results()[0]["sgd"]["plan"]
    (group,) = plan.groups
    slots = {s.name: s for s in group.params}
    bias, weight = slots["reduce.bias"], slots["expand.weight"]
    packed = bias.offset + bias.numel  # where the weight would start without the gap
    assert packed * group.dtype.itemsize % ALIGN_BYTES != 0
    assert weight.offset > packed and weight.offset * group.dtype.itemsize % ALIGN_BYTES == 0
    assert [n for s, n in group.spans() if s is None][0] == weight.offset - packed


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_squeeze_excite_matches_ddp_bitwise_on_two_ranks(opt_name: str) -> None:
    for rank, per_opt in enumerate(results()):
        r = per_opt[opt_name]
        assert r["losses"] == r["ref_losses"], f"rank {rank}"
        assert r["state"].keys() == r["ref_state"].keys()
        differ = [k for k, ref in r["ref_state"].items() if not torch.equal(r["state"][k], ref)]
        assert not differ, f"rank {rank}, {opt_name}: {differ} differ from DDP"
        # The gaps are never read: their gradient is zero and they stay zero.
        assert all(bool((g == 0).all()) for g in r["padding_grads"]), f"rank {rank}"
        assert all(bool((v == 0).all()) for v in r["padding_values"]), f"rank {rank}"
