"""State dicts on real gloo ranks: the module's own state-dict hooks are honoured."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard.policies import by_class

from dist_utils import run_ranks


class FusedAttention(nn.Module):
    """q, k and v as one parameter, saved and loaded as three (as torchtitan's Llama3 does)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.wqkv = nn.Parameter(torch.randn(3 * dim, dim) / dim**0.5)
        self.wo = nn.Linear(dim, dim)
        self.register_state_dict_post_hook(FusedAttention._split)
        self.register_load_state_dict_pre_hook(FusedAttention._fuse)

    @staticmethod
    def _split(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        wq, wk, wv = state.pop(prefix + "wqkv").chunk(3)
        state.update({prefix + "wq": wq, prefix + "wk": wk, prefix + "wv": wv})

    @staticmethod
    def _fuse(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "wq" in state:
            state[prefix + "wqkv"] = torch.cat([state.pop(prefix + n) for n in ("wq", "wk", "wv")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, self.wqkv).chunk(3, dim=-1)
        return x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Fused(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(FusedAttention(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def _fused_round_trip(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Fused()
    reference = copy.deepcopy(model)
    sharded = fxshard.compile(model, policy=by_class(FusedAttention))
    x = torch.randn(2, 5, 8)
    saved = sharded.full_state_dict()
    # A checkpoint in the split layout, changed, loads back into the fused parameters.
    changed = {k: v + 1 for k, v in reference.state_dict().items()}
    sharded.load_full_state_dict(changed)
    reference.load_state_dict(changed)
    with torch.no_grad():
        ours, theirs = sharded(x), reference(x)
    return {"saved": saved, "back": sharded.state_dict(), "changed": changed, "out": (ours, theirs)}


@pytest.mark.release("all_gather_single")
def test_state_dict_hooks_are_honoured_on_two_ranks() -> None:
    torch.manual_seed(0)
    expected = Fused().state_dict()  # the unsharded module's own state dict, hooks applied
    assert "blocks.0.wq" in expected and "blocks.0.wqkv" not in expected
    for result in run_ranks(_fused_round_trip, 2):
        saved = result["saved"]
        assert list(saved) == list(expected)  # key for key...
        for k, v in expected.items():
            assert saved[k].device.type == "cpu", k  # never a meta tensor
            assert torch.equal(saved[k], v), k  # ...value for value
        for k, v in result["changed"].items():
            assert torch.equal(result["back"][k], v), k
        ours, theirs = result["out"]
        torch.testing.assert_close(ours, theirs)


def test_a_sharded_state_dict_says_the_modules_hooks_did_not_run() -> None:
    """The sharded values are boxes of the flat shards, which FusedAttention's split cannot
    take: each parameter stays under its own name, and the warning names the hooked modules."""
    torch.manual_seed(0)
    sharded = fxshard.compile(Fused(), policy=by_class(FusedAttention))
    with pytest.warns(UserWarning, match="state-dict hooks of 'blocks.0', 'blocks.1' did not run.*"
                                         "full_state_dict=True"):
        state = fxshard.get_model_state_dict(sharded)
    assert "blocks.0.wqkv" in state and "blocks.0.wq" not in state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxshard.get_model_state_dict(fxshard.compile(Scaled()))  # no hooks, no warning


class Scaled(nn.Module):
    """A 0-dim parameter (CLIP's logit_scale) beside ordinary ones."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.logit_scale = nn.Parameter(torch.tensor(2.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.logit_scale.exp()


def _zero_dim_round_trip(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from fxshard.checkpoint import get_optimizer_state_dict, load, save

    torch.manual_seed(0)
    sharded = fxshard.compile(Scaled(), policy=by_class(nn.Linear))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    sharded(torch.randn(3, 6)).square().mean().backward()
    opt.step()
    save(root, sharded, opt)
    model, moments = sharded.state_dict(), get_optimizer_state_dict(sharded, opt)["state"]["logit_scale"]
    with torch.no_grad():
        for p in sharded.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            s["exp_avg"].add_(1.0)
    load(root, sharded, opt)
    again = get_optimizer_state_dict(sharded, opt)["state"]["logit_scale"]
    return {"model": model, "loaded": sharded.state_dict(), "moments": moments, "again": again}


def test_a_zero_dim_parameter_is_saved_and_loaded_on_two_ranks(tmp_path: Any) -> None:
    """Its one element lives on one rank; the checkpoint raised an IndexError on every rank. Its
    value and its AdamW moments (0-dim too) come back on both ranks."""
    torch.manual_seed(0)
    initial = Scaled().logit_scale.detach()
    results = run_ranks(_zero_dim_round_trip, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["model"]["logit_scale"].shape == () and not torch.equal(r["model"]["logit_scale"], initial)
        assert all(torch.equal(r["loaded"][k], v) for k, v in r["model"].items())
        assert set(r["moments"]) >= {"exp_avg", "exp_avg_sq"} and r["moments"]["exp_avg"].shape == ()
        assert all(torch.equal(r["again"][k], v) for k, v in r["moments"].items())
    assert torch.equal(results[0]["model"]["logit_scale"], results[1]["model"]["logit_scale"])
    assert torch.equal(results[0]["moments"]["exp_avg"], results[1]["moments"]["exp_avg"])
