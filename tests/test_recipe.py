"""The features of a real training recipe, on real gloo ranks against DDP."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
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
from graph_utils import fake_world
from models import Block, BNNet, Net, RotaryBlock, RotaryGPT, TinyGPT

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


@pytest.mark.release
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


class HFStyle(nn.Module):
    """Initialised by _init_weights after construction, as Hugging Face's post_init() does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.zero_()
            module.bias.data.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_model_initialised_by_init_weights_needs_param_init_fn() -> None:
    with torch.device("meta"):
        model = HFStyle()
    with pytest.raises(fxshard.FxShardError, match="_init_weights.*param_init_fn=model._init_weights"):
        fxshard.compile(model)  # reset_parameters() would silently give torch's default init
    state = fxshard.compile(model, param_init_fn=model._init_weights).full_state_dict()
    assert torch.equal(state["lin.weight"], torch.zeros(4, 4)) and torch.equal(state["lin.bias"], torch.ones(4))


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


# -- mixed precision ---------------------------------------------------------------------------------

BF16 = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _net_inputs(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 1, 28, 28, generator=gen), torch.randint(0, 10, (4,), generator=gen)


def _gpt_inputs(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 61, (2, 16), generator=gen), torch.randint(0, 61, (2, 16), generator=gen)


def _fsdp2_bf16(model: nn.Module, unit: type[nn.Module]) -> nn.Module:
    """A copy of ``model`` under FSDP2 with bf16 compute and fp32 reduction, one unit per ``unit``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reference = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in reference.modules():
        if isinstance(m, unit):
            fully_shard(m, mp_policy=policy)
    fully_shard(reference, mp_policy=policy)
    return reference


def _bf16_against_fsdp2(rank: int, name: str) -> dict[str, Any]:
    from fxshard.measure import CommCounter

    torch.manual_seed(0)
    model, unit = {"gpt": (TinyGPT, Block), "net": (lambda: Net(dropout=False), nn.Linear),
                   "rotary": (RotaryGPT, RotaryBlock)}[name]
    model = model()
    reference = _fsdp2_bf16(model, unit)
    sharded = fxshard.compile(model, policy=by_class(unit), mixed_precision=BF16)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    inputs = _net_inputs if name == "net" else _gpt_inputs
    gen = torch.Generator().manual_seed(rank)
    losses, ref_losses, counted = [], [], []
    for _ in range(3):
        x, y = inputs(gen)
        for m, o, out in ((sharded, opt, losses), (reference, ref_opt, ref_losses)):
            with CommCounter() as counter:
                logits = m(x)
                loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
                loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
            counted.append(counter.total)
    full = {k: v.full_tensor() for k, v in reference.state_dict().items()}
    return {"losses": losses, "ref_losses": ref_losses, "state": sharded.full_state_dict(),
            "ref_state": full, "bytes": counted[-2], "ref_bytes": counted[-1],
            "shard_dtypes": {p.dtype for p in sharded.parameters()},
            "gathered": {c.dtype for c in sharded._driver.steps[-1].collectives if c.kind == "all_gather"},
            "reduced": {c.dtype for c in sharded._driver.steps[-1].collectives if c.kind == "reduce_scatter"},
            "report_bytes": sharded.report().comm_bytes_per_step}


def _fp16_scaler(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT()
    sharded = fxshard.compile(model, policy=by_class(Block),
                              mixed_precision=fxshard.MixedPrecision(param_dtype=torch.float16,
                                                                    reduce_dtype=torch.float32))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(0)
    before = [p.detach().clone() for p in sharded.parameters()]
    skipped = []
    for step in range(2):
        x, y = _gpt_inputs(gen)
        loss = F.cross_entropy(sharded(x).flatten(0, 1).float(), y.flatten())
        scaler.scale(loss).backward()
        if step == 0 and rank == 1:
            # An overflow in rank 1's slice of the gradient only (an fp16 reduction can
            # overflow in one rank's slice); rank 0's shards are all finite.
            with torch.no_grad():
                next(iter(sharded.parameters())).grad[0] = float("inf")
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        opt.zero_grad()
        if step == 0:
            unchanged = all(torch.equal(p, b) for p, b in zip(sharded.parameters(), before))
    return {"skipped": skipped, "unchanged_after_inf": unchanged, "scale": scaler.get_scale()}


def _bf16_backend_against_fsdp2(rank: int) -> dict[str, Any]:
    """The torch.compile backend with MixedPrecision, against FSDP2 with the same policy."""
    from fxshard.driver.run.runtime import full_parameters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT()
    reference = _fsdp2_bf16(model, Block)
    be = fxshard.backend(policy=by_class(Block), mixed_precision=BF16)
    compiled = torch.compile(model, backend=be, dynamic=False)
    opt = torch.optim.AdamW(fxshard.parameters(compiled), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    losses, ref_losses = [], []
    for _ in range(3):
        x, y = _gpt_inputs(gen)
        for m, o, out in ((compiled, opt, losses), (reference, ref_opt, ref_losses)):
            loss = F.cross_entropy(m(x).flatten(0, -2).float(), y.flatten())
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    driver = be._modules[0].driver
    collectives = [c for step in be.steps() for c in step.collectives]
    return {"losses": losses, "ref_losses": ref_losses,
            "state": full_parameters(driver.shards, driver.plan, driver.world, 60),
            "ref_state": {k: v.full_tensor() for k, v in reference.named_parameters()},
            "gathered": {c.dtype for c in collectives if c.kind == "all_gather"},
            "reduced": {c.dtype for c in collectives if c.kind == "reduce_scatter"}}


def _autocast_against_fsdp2(rank: int) -> dict[str, Any]:
    """The FairScale seed's recipe: fp32 parameters, the forward under torch.autocast. Three
    steps under bf16 autocast, then one without it (a new trace, not the autocast graph)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    for m in reference.modules():
        if isinstance(m, Block):
            fully_shard(m)
    fully_shard(reference)
    sharded = fxshard.compile(model, policy=by_class(Block))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (sharded, reference)]
    gen = torch.Generator().manual_seed(rank)
    losses: list[list[float]] = [[], []]
    for step in range(4):
        x, y = _gpt_inputs(gen)
        for m, opt, out in zip((sharded, reference), opts, losses):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step < 3):
                loss = F.cross_entropy(m(x).flatten(0, -2).float(), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    return {"losses": losses[0], "ref_losses": losses[1], "state": sharded.full_state_dict(),
            "ref_state": {k: v.full_tensor() for k, v in reference.state_dict().items()},
            "steps": len(sharded._driver.steps)}


def precision_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {"fp16": _fp16_scaler(rank), "backend": _bf16_backend_against_fsdp2(rank),
            "autocast": _autocast_against_fsdp2(rank)}


@cache
def precision_results() -> list[dict[str, Any]]:
    return run_ranks(precision_worker, 2)


def bf16_worker(rank: int, world_size: int) -> dict[str, Any]:
    names = ("gpt", "net", "rotary") if world_size == 2 else ("gpt",)
    return {name: _bf16_against_fsdp2(rank, name) for name in names}


@cache
def bf16_results(world_size: int) -> list[dict[str, Any]]:
    """Ranks of their own: test_bf16_matches_fsdp2_mixed_precision, their only reader, is in the
    slow tier (tests/conftest.py), and the fast tier's precision tests need not wait for them."""
    return run_ranks(bf16_worker, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_matches_fsdp2_mixed_precision(world_size: int) -> None:
    for results in bf16_results(world_size):
        # rotary: the root computes an fp32 rotary table and passes it to every block,
        # which casts it to bf16 on entry, as FSDP2's cast_forward_inputs does.
        for name in ("gpt", "net", "rotary") if world_size == 2 else ("gpt",):
            r = results[name]
            assert r["shard_dtypes"] == {torch.float32}  # master weights stay fp32
            assert r["gathered"] == {torch.bfloat16} and r["reduced"] == {torch.float32}
            # The same bf16 computation as FSDP2's: bit for bit equal at world size 2
            # (measured). At 3, gloo's reduce-scatter sums in another order than FSDP2's
            # (test_parity.py explains), and the next bf16 forward rounds that ulp up to
            # bf16's: losses 2.6e-4 apart after three steps (measured).
            rel = 1e-6 if world_size == 2 else 1e-3
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=rel), name
            for k, v in r["ref_state"].items():
                torch.testing.assert_close(r["state"][k], v, rtol=100 * rel, atol=rel, msg=f"{name} {k}")
            # Never more bytes than FSDP2 (plus the ranks' 16-byte agreement).
            assert r["bytes"] <= r["ref_bytes"] + 16, (name, r["bytes"], r["ref_bytes"])
            assert r["report_bytes"]["total"] == r["bytes"]


def test_bf16_through_the_backend_matches_fsdp2_mixed_precision() -> None:
    for r in (res["backend"] for res in precision_results()):
        assert r["gathered"] == {torch.bfloat16} and r["reduced"] == {torch.float32}
        # Dynamo's graph of the same model: the same bf16 arithmetic, within bf16 rounding.
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-3)
        for k, v in r["ref_state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-2, atol=1e-3, msg=k)


def test_a_forward_under_autocast_trains_like_fsdp2_under_the_same_autocast() -> None:
    for r in (res["autocast"] for res in precision_results()):
        # Bit for bit: the same bf16 casts of the same fp32 weights, then the same sums.
        assert r["losses"] == r["ref_losses"]
        for k, v in r["ref_state"].items():
            assert torch.equal(r["state"][k], v), k
        assert r["steps"] == 2  # autocast on and off are two traces, each used as it was traced


def test_fp16_grad_scaler_skips_an_overflow_on_every_rank() -> None:
    ranks = [r["fp16"] for r in precision_results()]
    for r in ranks:
        assert r["skipped"] == [True, False]  # the inf was on rank 1 only; both skip, both go on
        assert r["unchanged_after_inf"]
    assert ranks[0]["scale"] == ranks[1]["scale"]


def test_a_param_dtype_the_device_cannot_compute_in_is_refused() -> None:
    model = Net()
    # float8_e4m3fn multiplies on CPU, then failed at the first gather ("Invalid scalar type").
    for dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        with pytest.raises(fxshard.FxShardError, match=rf"param_dtype={dtype}\) is not supported.*"
                                                       r"scaled matmuls.*Supported: torch.bfloat16"):
            fxshard.compile(model, mixed_precision=fxshard.MixedPrecision(param_dtype=dtype))
        assert all(p.device.type == "cpu" for p in model.parameters())  # nothing was sharded
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        fxshard.MixedPrecision(param_dtype=torch.int8)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_a_batch_norm_the_device_cannot_cast_is_refused_with_the_option_that_keeps_it() -> None:
    # CPU's batch_norm refuses bf16 weights against the fp32 running statistics (a raw
    # "expected scalar type BFloat16 but found Float" at the first step, before the probe).
    message = (r"param_dtype=torch.bfloat16\) cannot run BatchNorm on cpu: 'bn' \(BatchNorm2d\).*"
               r"expected scalar type.*full_precision_modules=\(nn.BatchNorm2d,\)")
    model = ConvBN()
    with pytest.raises(fxshard.FxShardError, match=message):
        fxshard.compile(model, mixed_precision=BF16)
    assert all(p.device.type == "cpu" for p in model.parameters())  # refused before sharding
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fxshard.backend(mixed_precision=BF16), dynamic=False)
    with pytest.raises(fxshard.FxShardError, match=message):
        fxshard.parameters(compiled)
    # The option the error names: BatchNorm in fp32, the rest in bf16; it trains.
    torch.manual_seed(0)
    sharded = fxshard.compile(ConvBN(), mixed_precision=fxshard.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, full_precision_modules=(nn.BatchNorm2d,)))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 6, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(sharded(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert {g.param_dtype for g in sharded.plan.groups} == {torch.bfloat16, None}


def test_mixed_precision_is_visible_in_the_plan_and_graphs() -> None:
    with fake_world(2):
        sharded = fxshard.compile(TinyGPT(), policy=by_class(Block), mixed_precision=fxshard.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, full_precision_modules=(nn.LayerNorm,)),
            example_inputs=torch.randint(0, 61, (2, 16)))
    table = str(sharded.plan)
    assert "float32>bfloat16/float32" in table
    # LayerNorms keep fp32: groups of their own, no cast.
    kept = [g for g in sharded.plan.groups if g.param_dtype is None]
    assert kept and all("ln" in s.name for g in kept for s in g.params)
    casts = [n for n in sharded.graphs["forward"].graph.nodes
             if n.target is torch.ops.prims.convert_element_type.default
             and all(u.target is torch.ops._c10d_functional.all_gather_into_tensor.default for u in n.users)]
    assert len(casts) == len(sharded.plan.groups) - len(kept)
    gathers = sharded.report().comm_bytes_per_step["all_gather"]
    # bf16 bytes where cast: each rank receives the other's half, in forward, and again in
    # backward for the units resharded after forward (all but the root).
    expected = sum(g.padded_numel // 2 * (2 if g.param_dtype else 4)
                   * (2 if sharded.options.reshards(g.unit) else 1) for g in sharded.plan.groups)
    assert gathers == expected


# -- gradient accumulation without communication ---------------------------------------------------


def _no_sync(rank: int, world_size: int, fsdp2_name: bool) -> dict[str, Any]:
    from fxshard.measure import CommCounter

    torch.manual_seed(0)
    model = TinyGPT()
    ddp = DDP(copy.deepcopy(model))
    sharded = fxshard.compile(model, policy=by_class(Block))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    inside: list[int] = []
    losses, ref_losses = [], []
    for _ in range(2):
        batches = [_gpt_inputs(gen) for _ in range(3)]
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            if fsdp2_name:
                sharded.set_requires_gradient_sync(last)
                context: Any = contextlib.nullcontext()
            else:
                context = contextlib.nullcontext() if last else sharded.no_sync()
            with context, CommCounter() as counter:
                loss = F.cross_entropy(sharded(x).flatten(0, 1), y.flatten())
                loss.backward()
            if not last:
                inside.append(counter.calls["reduce_scatter"])
            else:
                assert sharded.report().predicted_peak_bytes > 0  # a step that reduces the sums
            with contextlib.nullcontext() if last else ddp.no_sync():
                ref_loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                ref_loss.backward()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    with sharded.no_sync():
        x, y = _gpt_inputs(gen)
        sharded(x)  # a step inside no_sync: its report shows the unsharded sums
        accumulating = sharded.report()
    return {"losses": losses, "ref_losses": ref_losses, "inside": inside,
            "state": sharded.full_state_dict(), "ref_state": ddp.module.state_dict(),
            "accumulator_bytes": accumulating.accumulator_bytes,
            "full_bytes": sum(g.padded_numel * 4 for g in sharded.plan.groups)}


def no_sync_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {"no_sync": _no_sync(rank, world_size, False), "fsdp2": _no_sync(rank, world_size, True)}


@pytest.mark.release
def test_no_sync_matches_ddp_and_communicates_no_gradient() -> None:
    for results in run_ranks(no_sync_worker, 2):
        for name in ("no_sync", "fsdp2"):
            r = results[name]
            assert r["inside"] == [0, 0, 0, 0], name  # no reduce-scatter inside no_sync
            # The memory cost: one unsharded fp32 gradient per flat group, in the report.
            assert r["accumulator_bytes"] == r["full_bytes"] > 0
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), name
            for k, v in r["ref_state"].items():
                torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-6, msg=f"{name} {k}")


def _forgotten_flush(rank: int, world_size: int) -> dict[str, Any]:
    """Every micro-batch inside no_sync, then a step: refused. zero_grad drops the sums, and
    the next ordinary step equals DDP's after the same loop."""
    torch.manual_seed(0)
    model = TinyGPT()
    ddp = DDP(copy.deepcopy(model))
    sharded = fxshard.compile(model, policy=by_class(Block))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    batches = [_gpt_inputs(gen) for _ in range(3)]
    for x, y in batches[:2]:  # the flush forgotten: both micro-batches inside no_sync
        with sharded.no_sync():
            F.cross_entropy(sharded(x).flatten(0, 1), y.flatten()).backward()
        with ddp.no_sync():
            F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
    before = [p.detach().clone() for p in sharded.parameters()]
    try:
        opt.step()
        error = "no error"
    except fxshard.FxShardError as e:
        error = str(e)
    unchanged = all(torch.equal(p, b) for p, b in zip(sharded.parameters(), before))
    sharded.zero_grad()  # drops the sums, as DDP's zero_grad drops its accumulated .grad
    ref_opt.zero_grad()
    x, y = batches[2]
    F.cross_entropy(sharded(x).flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    ref_opt.step()
    result = {"error": error, "unchanged": unchanged, "state": sharded.full_state_dict(),
              "ref_state": ddp.module.state_dict()}

    # step(closure), as Lightning steps: the closure runs the last micro-batch's backward,
    # so the check comes after it. A flush there is a step; one inside no_sync is refused.
    def closure(sync: bool) -> torch.Tensor:
        x, y = batches[1]
        with contextlib.nullcontext() if sync else sharded.no_sync():
            loss = F.cross_entropy(sharded(x).flatten(0, 1), y.flatten())
            loss.backward()
        return loss

    for sync in (True, False):
        opt.zero_grad()
        x, y = batches[0]
        with sharded.no_sync():
            F.cross_entropy(sharded(x).flatten(0, 1), y.flatten()).backward()
        try:
            opt.step(functools.partial(closure, sync))
            result[f"closure {sync}"] = "no error"
        except fxshard.FxShardError as e:
            result[f"closure {sync}"] = str(e)
    sharded.zero_grad()
    return result


def test_a_step_over_sums_no_sync_never_reduced_raises_and_zero_grad_drops_them() -> None:
    for r in run_ranks(_forgotten_flush, 2):
        assert "SGD.step() ran while the gradients of units" in r["error"], r["error"]
        assert "outside no_sync()" in r["error"] and "zero_grad()" in r["error"]
        assert r["unchanged"]
        assert r["closure True"] == "no error"
        assert "SGD.step() ran while the gradients of units" in r["closure False"], r["closure False"]
        for k, v in r["ref_state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def _windows_across_epochs(rank: int, world_size: int) -> dict[bool, dict[str, Any]]:
    return {set_to_none: _windows(rank, set_to_none) for set_to_none in (True, False)}


def _windows(rank: int, set_to_none: bool) -> dict[str, Any]:
    """The everyday manual accumulation loop: the optimizer's zero_grad() opens each window of
    two micro-batches, no_sync for all but its last. Three micro-batches an epoch, so each epoch
    ends mid-window: DDP's zero_grad() at the next window drops that micro-batch's gradient."""
    torch.manual_seed(0)
    model = TinyGPT()
    ddp = DDP(copy.deepcopy(model))
    sharded = fxshard.compile(model, policy=by_class(Block))
    pairs = [(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1)),
             (ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))]
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        batches = [_gpt_inputs(gen) for _ in range(3)]
        for module, opt in pairs:
            for i, (x, y) in enumerate(batches):
                if i % 2 == 0:
                    opt.zero_grad(set_to_none=set_to_none)
                last = i % 2 == 1
                with contextlib.nullcontext() if last else module.no_sync():
                    F.cross_entropy(module(x).flatten(0, 1), y.flatten()).backward()
                if last:
                    opt.step()
    return {"state": sharded.full_state_dict(), "ref_state": ddp.module.state_dict()}


def test_the_optimizers_zero_grad_drops_no_syncs_sums_as_ddps_does() -> None:
    for results in run_ranks(_windows_across_epochs, 2):
        for set_to_none, r in results.items():
            for k, v in r["ref_state"].items():
                torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6,
                                           msg=f"set_to_none={set_to_none}: {k}")


def _accumulate_under_inductor(rank: int, front_end: str) -> dict[str, Any]:
    """The manual accumulation loop under compute="inductor" through ``front_end``, beside DDP's:
    two micro-batches a step, the first inside no_sync, three AdamW steps."""
    from fxshard.driver.run.runtime import full_parameters
    from fxshard.measure import CommCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT()
    ddp = DDP(copy.deepcopy(model))
    if front_end == "compile":
        sharded = fxshard.compile(model, policy=by_class(Block), compute="inductor")
        run: nn.Module = sharded
        shards, driver = list(sharded.parameters()), sharded._driver

        def syncing(sync: bool) -> Any:
            return contextlib.nullcontext() if sync else sharded.no_sync()
    else:  # the torch.compile backend, with FSDP2's spelling of the switch
        be = fxshard.backend(policy=by_class(Block), compute="inductor")
        run = torch.compile(model, backend=be, dynamic=False)
        shards, driver = fxshard.parameters(run), be._modules[0].driver

        def syncing(sync: bool) -> Any:
            fxshard.set_requires_gradient_sync(run, sync)
            return contextlib.nullcontext()
    opt = torch.optim.AdamW(shards, lr=1e-2)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses, ref_losses, reduce_scatters = [], [], []
    for _ in range(3):
        for i in range(2):
            x, y = _gpt_inputs(gen)
            last = i == 1
            with syncing(last):
                loss = F.cross_entropy(run(x).flatten(0, 1), y.flatten())
                with CommCounter() as counter:  # around backward only: Dynamo runs under no mode
                    loss.backward()
            reduce_scatters.append(counter.calls["reduce_scatter"])
            with contextlib.nullcontext() if last else ddp.no_sync():
                ref_loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                ref_loss.backward()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "reduce_scatters": reduce_scatters,
            "state": full_parameters(driver.shards, driver.plan, driver.world, 60),
            "ref_state": {k: v.detach() for k, v in ddp.module.named_parameters()}}


def _accumulate_under_inductor_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {front_end: _accumulate_under_inductor(rank, front_end) for front_end in ("compile", "backend")}


@cache
def _accumulated_under_inductor() -> list[dict[str, Any]]:
    return run_ranks(_accumulate_under_inductor_worker, 2)


@pytest.mark.slow  # Inductor compiles three graphs per front end (forward, both backwards)
@pytest.mark.parametrize("front_end", ["compile", "backend"])
def test_no_sync_under_inductor_trains_like_ddp(front_end: str) -> None:
    # The accumulators are graph inputs of Inductor's compiled backward, which adds into them in
    # place; the sync step reduces gradient + sum. Refused before ("not supported with
    # compute='inductor'"). Inductor's kernels are not eager's: docs/devices.md's tolerance.
    for r in (res[front_end] for res in _accumulated_under_inductor()):
        assert r["reduce_scatters"][0::2] == [0, 0, 0]  # inside no_sync: nothing reduced
        assert all(n > 0 for n in r["reduce_scatters"][1::2])  # the counter sees Inductor's
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        for k, v in r["ref_state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)
