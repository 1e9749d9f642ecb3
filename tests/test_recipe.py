"""The features of a real training recipe, on real gloo ranks against DDP."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import Block, TinyGPT

# -- gradient clipping ----------------------------------------------------------------------------

# (norm_type, foreach): torch's foreach kernel and its per-tensor loop; "method" is
# sharded.clip_grad_norm_ with the 1-norm and torch's default choice.
CLIP_CASES = [(2.0, True), (float("inf"), False)]


def _clip(rank: int, norm_type: float, foreach: bool | None, method: bool,
          backend: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT()
    ddp = DDP(copy.deepcopy(model))
    if backend:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=fxshard.backend(policy=by_class(Block)), dynamic=False)
        shards = fxshard.parameters(compiled)
        sharded: Any = compiled
    else:
        sharded = fxshard.compile(model, policy=by_class(Block))
        shards = list(sharded.parameters())
    opt = torch.optim.AdamW(shards, lr=1e-2)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    norms, ref_norms = [], []
    for _ in range(3):
        x = torch.randint(0, 61, (2, 16), generator=gen)
        y = torch.randint(0, 61, (2, 16), generator=gen)
        for m, o, out in ((sharded, opt, norms), (ddp, ref_opt, ref_norms)):
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
            if m is sharded and method:
                norm = sharded.clip_grad_norm_(0.05, norm_type, foreach=foreach)
            else:
                params = shards if m is sharded else m.parameters()
                norm = torch.nn.utils.clip_grad_norm_(params, 0.05, norm_type, foreach=foreach)
            o.step()
            o.zero_grad()
            out.append(norm.item())
    if backend:
        return {"norms": norms, "ref_norms": ref_norms, "state": {}, "ref_state": {}}
    return {"norms": norms, "ref_norms": ref_norms, "state": sharded.full_state_dict(),
            "ref_state": ddp.module.state_dict()}


def _nonfinite(rank: int) -> str:
    torch.manual_seed(0)
    sharded = fxshard.compile(TinyGPT())
    x = torch.randint(0, 61, (2, 16))
    loss = sharded(x).sum() * (float("inf") if rank == 1 else 1.0)  # an inf on one rank only
    loss.backward()
    try:
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0, error_if_nonfinite=True)
    except RuntimeError as e:
        return str(e)
    return "no error"


def clip_worker(rank: int, world_size: int) -> dict[Any, Any]:
    results: dict[Any, Any] = {case: _clip(rank, *case, method=False) for case in CLIP_CASES}
    results["method"] = _clip(rank, 1.0, None, method=True)
    results["backend"] = _clip(rank, 2.0, None, method=False, backend=True)
    results["nonfinite"] = _nonfinite(rank)
    return results


@cache
def clip_results(world_size: int) -> list[dict[Any, Any]]:
    return run_ranks(clip_worker, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_matches_ddp(world_size: int) -> None:
    for rank, results in enumerate(clip_results(world_size)):
        for case in [*CLIP_CASES, "method", "backend"]:
            r = results[case]
            # The norm of the whole gradient, as DDP computes it, on every rank.
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (rank, case)
            assert r["norms"][0] > 0.05 * 10  # the clip is active
            for k, v in r["ref_state"].items():
                torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-6, msg=f"{case} {k}")


def test_clip_grad_norm_error_if_nonfinite_raises_on_every_rank() -> None:
    for results in clip_results(2):
        assert "non-finite" in results["nonfinite"], results["nonfinite"]
