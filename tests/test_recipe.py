"""The features of a real training recipe, on real gloo ranks against DDP."""

from __future__ import annotations

import copy
import ctypes
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import Block, BNNet, TinyGPT

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


# -- meta-device init and sync_module_states --------------------------------------------------------


class Wide(nn.Module):
    """32 layers of 4 MiB each: large enough for the process's resident memory to show it."""

    def __init__(self, width: int = 1024, depth: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _meta_init(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = TinyGPT()  # built normally, in one process
    torch.manual_seed(100 + rank)  # the ranks' generators differ: they must agree on rank 0's
    if rank == 0:
        torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT()
    sharded = fxshard.compile(model, policy=by_class(Block))
    state = sharded.full_state_dict()
    x = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        out, ref_out = sharded(x), reference(x)

    # The backend: the same model on the meta device, sharded by fxshard.parameters.
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = TinyGPT()
    torch._dynamo.reset()
    compiled = torch.compile(meta, backend=fxshard.backend(policy=by_class(Block)), dynamic=False)
    fxshard.parameters(compiled)
    with torch.no_grad():
        backend_out = compiled(x)

    # Peak memory while sharding a model 2x a rank's shard, built on the meta device.
    # Resident memory counts live memory only with a fixed mmap threshold: glibc
    # otherwise raises it after a free and keeps freed layers on its heap.
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    with torch.device("meta"):
        wide = Wide()
    full_bytes = sum(p.numel() * p.element_size() for p in wide.parameters())
    _reset_peak_rss()
    base = _peak_rss_bytes()
    wide_sharded = fxshard.compile(wide)
    peak = _peak_rss_bytes() - base
    shard_bytes = sum(p.numel() * p.element_size() for p in wide_sharded.parameters())
    return {"state": state, "ref_state": reference.state_dict(), "out": out, "ref_out": ref_out,
            "backend_out": backend_out, "peak": peak, "full_bytes": full_bytes,
            "shard_bytes": shard_bytes}


def _sync_module_states(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    if rank == 0:
        model = BNNet()  # the real weights (a checkpoint loaded on rank 0, say)
        model.bn.running_mean.fill_(0.5)
        expected = copy.deepcopy(model).state_dict()
    else:
        with torch.device("meta"):
            model = BNNet()
        expected = {}
    sharded = fxshard.compile(model, sync_module_states=True)
    return {"state": sharded.full_state_dict(), "expected": expected}


def init_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {"meta": _meta_init(rank, world_size), "sync": _sync_module_states(rank, world_size)}


@cache
def init_results() -> list[dict[str, Any]]:
    return run_ranks(init_worker, 2)


def test_meta_init_equals_a_model_built_normally() -> None:
    for r in (res["meta"] for res in init_results()):
        assert list(r["state"]) == list(r["ref_state"])
        for k, v in r["ref_state"].items():
            assert torch.equal(r["state"][k], v), k  # bit for bit: rank 0's seed, torch's own init
        torch.testing.assert_close(r["out"], r["ref_out"])
        torch.testing.assert_close(r["backend_out"], r["ref_out"])


def test_meta_init_never_holds_the_whole_model() -> None:
    for r in (res["meta"] for res in init_results()):
        assert r["shard_bytes"] == r["full_bytes"] // 2
        # This rank's shards (64 MiB) plus one layer (4 MiB) at a time, and ~10 MiB that
        # any first run of torch code allocates; the whole model is 128 MiB.
        assert r["peak"] < r["shard_bytes"] + 24 * 2**20 < r["full_bytes"], (r["peak"], r["shard_bytes"])


def test_sync_module_states_broadcasts_rank0s_weights_and_buffers() -> None:
    results = init_results()
    expected = results[0]["sync"]["expected"]
    for r in results:
        assert list(r["sync"]["state"]) == list(expected)
        for k, v in expected.items():
            assert torch.equal(r["sync"]["state"][k], v), k


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)  # computed in __init__

    def reset_parameters(self) -> None:
        pass  # "nothing to reset": right for a real model, not for one built on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.freqs


def test_meta_model_that_cannot_be_initialised_is_refused_by_name() -> None:
    with torch.device("meta"):
        model = NoReset()
    with pytest.raises(fxshard.FxShardError, match=r"no reset_parameters\(\).*<root> \(NoReset\).*param_init_fn"):
        fxshard.compile(model)
    with torch.device("meta"):
        rotary = Rotary()
    with pytest.raises(fxshard.FxShardError, match="reset_parameters.*'<root>' \\(Rotary\\) left buffer 'freqs'"):
        fxshard.compile(rotary)


def test_param_init_fn_initialises_what_reset_parameters_cannot() -> None:
    def init(module: nn.Module) -> None:
        if isinstance(module, NoReset):
            module.scale.fill_(2.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    torch.manual_seed(0)
    with torch.device("meta"):
        model = NoReset()
    sharded = fxshard.compile(model, param_init_fn=init)
    state = sharded.full_state_dict()
    torch.manual_seed(0)
    reference = nn.Linear(4, 4)
    assert torch.equal(state["scale"], torch.full((4,), 2.0))
    assert torch.equal(state["lin.weight"], reference.weight)
