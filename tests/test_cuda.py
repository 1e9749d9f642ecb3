"""On a CUDA GPU: explain on fake CUDA tensors, one rank on nccl against DDP, offload against
FSDP2's, and the predicted peak against ``torch.cuda.max_memory_allocated``.

Skipped where torch sees no CUDA device (this suite's CI). ``explain(device="cuda")``
needs one because the autograd engine opens a CUDA context for backward (pytorch#92627).
World size 1 runs on a real nccl group; larger world sizes on torch's fake process
group, where one GPU computes rank 0's step (its compute and memory; the collectives
communicate nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard.ir import compat
from fxshard.policies import by_class

from graph_utils import fake_world
from models import Block, TinyGPT, _lm_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from llama import LLAMA3_8B, Llama, LlamaConfig, TransformerBlock  # noqa: E402

CUDA = torch.device("cuda", 0)
BF16 = fxshard.MixedPrecision(param_dtype=torch.bfloat16)
GIB = 1 << 30


@contextlib.contextmanager
def nccl_world() -> Iterator[None]:
    """One rank on a real nccl group."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=CUDA)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _llama(layers: int, **changes: Any) -> nn.Module:
    with torch.device("meta"):
        return Llama(dataclasses.replace(LLAMA3_8B, layers=layers, **changes))


def _attention_ops(e: Any) -> set[str]:
    return {str(n.target) for g in e.graphs.values() for n in g.graph.nodes if "attention" in str(n.target)}


# -- explain on fake CUDA tensors ----------------------------------------------------------------


def test_explain_on_cuda_takes_cudas_attention_kernel_and_allocates_nothing() -> None:
    model = _llama(2, dim=1024, heads=8, kv_heads=2, ffn=2048, vocab=4096)
    tokens = torch.zeros(2, 1024, dtype=torch.long)
    before = torch.cuda.memory_allocated()
    on_cuda = fxshard.explain(model, tokens, by_class(TransformerBlock), world_size=4, device="cuda",
                              mixed_precision=BF16)
    assert torch.cuda.memory_allocated() == before
    on_meta = fxshard.explain(model, tokens, by_class(TransformerBlock), world_size=4, mixed_precision=BF16)
    fused = _attention_ops(on_cuda)
    assert any(k in op for op in fused for k in ("flash", "efficient", "cudnn")), fused
    assert not any(k in op for op in _attention_ops(on_meta) for k in ("flash", "efficient", "cudnn"))
    # The fused kernel keeps no (seq x seq) score matrix for backward.
    assert on_cuda.report.predicted_peak_bytes < on_meta.report.predicted_peak_bytes
    assert [u.name for u in on_cuda.plan.units] == [u.name for u in on_meta.plan.units]


def test_llama3_8b_8_layers_world_size_8_offload_lowers_the_cuda_peak_by_the_shards_and_gradients() -> None:
    """Issue's shape: 8 layers at world size 8, bf16, AdamW, on fake CUDA. The state lives on
    the device from the first step on; offload moves the parameter shards, their gradients
    and that state to the host, so the device peak drops by at least P + G."""
    model = _llama(8)

    def explained(**options: Any) -> Any:
        return fxshard.explain(model, torch.zeros(1, 2048, dtype=torch.long), by_class(TransformerBlock),
                               world_size=8, device="cuda", mixed_precision=BF16,
                               optimizer=torch.optim.AdamW, **options).report

    on_device, offloaded = explained(), explained(offload_policy=fxshard.CPUOffloadPolicy())
    params = on_device.shard_bytes
    assert params * 8 == sum(p.numel() * 4 for p in model.parameters())  # fp32 shards, no padding
    assert on_device.grad_shard_bytes == params
    assert offloaded.host_bytes == 4 * params  # shards, gradients and AdamW's two states
    drop = on_device.predicted_peak_bytes - offloaded.predicted_peak_bytes
    assert drop >= on_device.shard_bytes + on_device.grad_shard_bytes, (str(on_device), str(offloaded))
    assert "on the host" in str(offloaded)


def test_llama3_8b_world_size_1_fits_70_gib_on_cuda_only_with_offload() -> None:
    """Sequence 2048 (test_explain plans the same on a machine without CUDA, with CUDA's
    fused attention on meta: 16 units offloaded, the optimizer step the peak)."""
    model = _llama(32)

    def explained(**options: Any) -> Any:
        return fxshard.explain(model, torch.zeros(1, 2048, dtype=torch.long), by_class(TransformerBlock),
                               device="cuda", mixed_precision=BF16, optimizer=torch.optim.AdamW,
                               memory_budget=70 * GIB, **options).report

    with pytest.raises(fxshard.BudgetError, match="offload_policy="):
        explained()
    report = explained(offload_policy=fxshard.CPUOffloadPolicy())
    assert report.budget is not None and report.predicted_peak_bytes <= 70 * GIB
    offloaded = report.budget.chosen.offloaded
    assert offloaded and report.host_bytes == 4 * sum(u.shard_bytes for u in report.units if u.name in offloaded)
    rows = {u.unit: u for u in report.budget.units}
    assert all(rows[u].why.startswith("offloaded: the budget needs") for u in offloaded)
    assert all(not r.offloaded for name, r in rows.items() if name not in offloaded)


# -- one rank on nccl --------------------------------------------------------------------------


def _gpt_steps(model: nn.Module, steps: int, make_optimizer: Any) -> tuple[list[float], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 61, (4, 17), generator=g).to(CUDA)
        loss = _lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(dim=64, layers=3).to(CUDA)


def test_one_rank_on_nccl_trains_like_ddp() -> None:
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    with nccl_world():
        ddp = nn.parallel.DistributedDataParallel(_gpt(), device_ids=[0])
        ddp_losses, _ = _gpt_steps(ddp, 4, adamw)
        reference = ddp.module.state_dict()
        sharded = fxshard.compile(_gpt(), by_class(Block))
        losses, _ = _gpt_steps(sharded, 4, adamw)
        assert {p.device for p in sharded.parameters()} == {CUDA}
        state = sharded.full_state_dict()
    assert losses == pytest.approx(ddp_losses, rel=1e-6, abs=0)
    for k, v in reference.items():
        torch.testing.assert_close(state[k].to(CUDA), v, rtol=1e-5, atol=1e-6)


def test_offload_on_cuda_trains_like_fsdp2s_offload_with_its_shards_pinned_on_the_host() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    with nccl_world():
        reference = _gpt()
        mesh = init_device_mesh("cuda", (1,))
        for block in reference.blocks:
            fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
        fully_shard(reference, mesh=mesh, offload_policy=CPUOffloadPolicy())
        fsdp2_losses, _ = _gpt_steps(reference, 4, adamw)
        fsdp2_state = {k: v.to_local().cpu() for k, v in reference.state_dict().items()}  # 1 rank: whole
        sharded = fxshard.compile(_gpt(), by_class(Block), offload_policy=fxshard.CPUOffloadPolicy())
        losses, _ = _gpt_steps(sharded, 4, adamw)
        for p in sharded.parameters():
            assert p.device.type == "cpu" and p.is_pinned()
        state = {k: v.cpu() for k, v in sharded.full_state_dict().items()}
        torch.cuda.synchronize()
    assert losses == pytest.approx(fsdp2_losses, rel=1e-5, abs=0)
    for k, v in fsdp2_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("dtype", "scaling"), [(torch.float8_e4m3fn, "tensor"), (torch.float8_e4m3fn, "block"),
                                               (torch.int8, "tensor"), (torch.int8, "block")])
def test_quantized_gathers_on_one_nccl_rank_train_within_3_percent_of_bf16(dtype: torch.dtype,
                                                                            scaling: str) -> None:
    """CUDA's float8 and int8 casts in the quantize and dequantize lowerings: a GPT learning
    one batch, 12 AdamW steps within 3% of bf16 mixed precision's loss at every step
    (test_quantized_gathers' setting and bound, on 2 gloo ranks there)."""
    def trained(precision: fxshard.MixedPrecision) -> list[float]:
        torch.manual_seed(0)
        model = TinyGPT(dim=64).to(CUDA)
        for p in model.parameters():  # GPT-2's initialisation: logits near zero
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        sharded = fxshard.compile(model, by_class(Block), mixed_precision=precision)
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=3e-3)
        x = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)
        losses = []
        for _ in range(12):
            loss = F.cross_entropy(sharded(x).flatten(0, 1).float(), x.roll(-1, 1).flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    with nccl_world():
        bf16 = trained(fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        got = trained(fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                             gather_dtype=dtype, gather_scaling=scaling))
    assert bf16[-1] < 0.7 * bf16[0]  # it learns
    assert got != bf16  # the weights were rounded
    for step, (a, b) in enumerate(zip(got, bf16)):
        assert abs(a - b) <= 0.03 * b, (step, a, b)


# -- the predicted peak against the allocator's ----------------------------------------------------


def _measured_step_peak(sharded: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> int:
    """``max_memory_allocated`` over one steady-state step, above what this process held
    before the model existed (CUDA's own workspaces)."""
    def step() -> None:
        loss = sharded(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


class _LM(nn.Module):
    """The Llama with its loss inside, so that the whole step is in the graphs."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.model = Llama(config)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize(("world_size", "gather"), [(2, None), (4, None), (8, None),
                                                  (8, (torch.float8_e4m3fn, "tensor")), (8, (torch.int8, "block"))])
def test_predicted_peak_within_three_percent_of_cudas_on_the_fake_process_group(
        world_size: int, gather: tuple[torch.dtype, str] | None) -> None:
    """Also with quantized gathers: their uint8 buffers, scales and dequantised weights."""
    precision = BF16 if gather is None else fxshard.MixedPrecision(
        param_dtype=torch.bfloat16, gather_dtype=gather[0], gather_scaling=gather[1])
    config = dataclasses.replace(LLAMA3_8B, layers=2, dim=2048, heads=16, kv_heads=4, ffn=5632, vocab=32000)
    # The floor under the step: what earlier tests left. cuBLAS's workspaces are released, so
    # that the step makes its stream's, as a job's first step does: the prediction counts them
    # (calibrate.library_bytes).
    compat.clear_cublas_workspaces()
    torch.cuda.synchronize()
    floor = torch.cuda.memory_allocated()
    with fake_world(world_size):
        torch.manual_seed(0)
        with torch.device(CUDA):
            model = _LM(config)
        sharded = fxshard.compile(model, by_class(TransformerBlock), mixed_precision=precision,
                                  optimizer=torch.optim.AdamW)
        del model
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, config.vocab, (2, 1024), device=CUDA)
        measured = _measured_step_peak(sharded, optimizer, (tokens, tokens)) - floor
        report = sharded.report()
        predicted = report.predicted_peak_bytes
        del sharded, optimizer
    torch.cuda.empty_cache()
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured, str(report))


@pytest.mark.parametrize("on_device", [True, False])
def test_a_steady_steps_agreement_does_not_stop_the_host_on_cuda(on_device: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a rehearsal on the GPU (a device's backend): after the first step, the ranks'
    agreement before forward and backward makes no synchronizing CUDA call (torch's sync debug
    mode); made to check on the host, as gloo does, it makes them (what the test would see)."""
    import warnings

    from fxshard.driver.run import consistency

    if not on_device:
        monkeypatch.setattr(consistency, "checks_on_device", lambda device: False)
    rehearsal = fxshard.rehearse(2, "h100-nvlink", device=CUDA)
    try:
        torch.manual_seed(0)
        sharded = fxshard.compile(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(CUDA),
                                  by_class(nn.Linear))
        x = torch.randn(16, 64, device=CUDA)
        sharded(x).sum().backward()  # the first phases are checked on the host
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(2):
                    sharded(x).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        agreement = sharded._driver.state.agreement
        synced = [f"{w.filename}:{w.lineno}" for w in seen
                  if "consistency.py" in str(w.filename) and "synchroniz" in str(w.message)]
        if on_device:
            assert agreement.on_device and agreement.outstanding, agreement.outstanding
            assert agreement.outstanding[-1].event is not None
            assert synced == [], synced
            agreement.settle()  # every result read: they all agreed
            assert not agreement.outstanding
        else:
            assert not agreement.on_device and not agreement.outstanding
            assert synced, [str(w.message)[:80] for w in seen]
        assert len(rehearsal.log) > 0
    finally:
        dist.destroy_process_group()
