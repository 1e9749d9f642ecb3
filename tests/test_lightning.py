"""PyTorch Lightning: FxShardStrategy against Lightning's own DDP strategy, on 2 gloo ranks."""

from __future__ import annotations

import math
import os
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fxshard
from fxshard.lightning import FxShardMixedPrecision, FxShardStrategy
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import Block, TinyGPT


class LitGPT(L.LightningModule):
    """The suite's TinyGPT as a LightningModule; built in configure_model, which FxShardStrategy
    runs on the meta device (meta init) and DDP on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.grouped = False

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TinyGPT()

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        assert self.model is not None
        loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The gradient's norm before Lightning clips it: over all ranks' shards under fxshard.
        self.norms.append(torch.nn.utils.clip_grad_norm_(self.parameters(), float("inf")).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if not self.grouped:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        # The recipe's groups, by name: needs the original names (use_orig_params=True).
        named = list(self.named_parameters())
        plain = [p for n, p in named if n.endswith("bias") or ".ln" in n]
        decay = [p for n, p in named if not (n.endswith("bias") or ".ln" in n)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": plain, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)


def _data() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 61, (16, 16), generator=gen)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=2)  # 4 steps a rank and epoch


def _fit(strategy: Any, epochs: int, ckpt_path: str | None = None, save: str | None = None,
         grouped: bool = False, **trainer: Any) -> tuple[LitGPT, L.Trainer]:
    L.seed_everything(0, verbose=False)
    lit = LitGPT()
    lit.grouped = grouped
    t = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  **trainer)
    t.fit(lit, _data(), ckpt_path=ckpt_path)
    if save is not None:
        t.save_checkpoint(save)
    return lit, t


def _weights(lit: LitGPT) -> dict[str, torch.Tensor]:
    model = lit.model
    if isinstance(model, fxshard.ShardedModule):
        return model.full_state_dict()
    assert model is not None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lightning_worker(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    # Lightning finds the processes already made (LOCAL_RANK) and the process group up.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    out: dict[str, Any] = {}
    ddp, _ = _fit("ddp", 2)
    out["ddp"] = (ddp.losses, _weights(ddp))
    strategy = FxShardStrategy(policy=by_class(Block))
    whole, trainer = _fit(strategy, 2)
    out["fxshard"] = (whole.losses, _weights(whole))
    out["sharded"] = isinstance(whole.model, fxshard.ShardedModule) and trainer.strategy is strategy
    out["units"] = len(whole.model.plan.units)  # type: ignore[union-attr]
    # Resumed: one epoch, a checkpoint, and fit(ckpt_path=) to the second epoch.
    ckpt = str(Path(directory) / "epoch1.ckpt")
    first, _ = _fit(FxShardStrategy(policy=by_class(Block)), 1, save=ckpt)
    resumed, t = _fit(FxShardStrategy(policy=by_class(Block)), 2, ckpt_path=ckpt)
    out["resumed"] = (first.losses + resumed.losses, _weights(resumed), t.global_step)
    # Gradient accumulation (no_sync for the batch that does not step) and clipping.
    # The optimizer in two groups by name (use_orig_params=True).
    ddp_acc, _ = _fit("ddp", 1, accumulate_grad_batches=2, gradient_clip_val=1.0, grouped=True)
    acc, t = _fit(FxShardStrategy(policy=by_class(Block), use_orig_params=True), 1, accumulate_grad_batches=2,
                  gradient_clip_val=1.0, grouped=True)
    out["accumulate"] = (ddp_acc.losses, _weights(ddp_acc), acc.losses, _weights(acc))
    out["norms"] = (ddp_acc.norms, acc.norms)
    out["grad_sync"] = [s.grad_sync for s in acc.model._driver.steps]  # type: ignore[union-attr]
    return out


def precision_worker(rank: int, world_size: int) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    out: dict[str, Any] = {}
    bf16, t = _fit(FxShardStrategy(policy=by_class(Block)), 1, precision="bf16-mixed")
    out["bf16"] = (type(t.precision_plugin), bf16.model.config.mixed_precision,  # type: ignore[union-attr]
                   {c.dtype for c in bf16.model._driver.steps[-1].collectives  # type: ignore[union-attr]
                    if c.kind == "all_gather"})
    # fp16 with Lightning's GradScaler (on CPU only as a plugin: Trainer(precision="16-mixed")
    # turns into bf16 there), and fxshard's own options through the strategy.
    from lightning.pytorch.plugins.precision import MixedPrecision

    fp16, t = _fit(FxShardStrategy(policy=by_class(Block), activation_checkpointing=by_class(Block)), 1,
                   plugins=[MixedPrecision("16-mixed", "cpu")])
    out["fp16"] = (type(t.precision_plugin), t.precision_plugin.scaler is not None,  # type: ignore[attr-defined]
                   fp16.model.config.mixed_precision, fp16.losses,  # type: ignore[union-attr]
                   [len(m.graphs["forward"].graph.output_node().args[0])  # type: ignore[union-attr]
                    for m in (fp16.model, bf16.model)])  # what forward saves for backward
    return out


@cache
def _results(directory: str) -> list[dict[str, Any]]:
    return run_ranks(lightning_worker, 2, directory)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _results(str(tmp_path_factory.mktemp("lightning")))


@pytest.fixture(scope="module")
def precision() -> list[dict[str, Any]]:
    return run_ranks(precision_worker, 2)


@pytest.mark.release
def test_fxshard_strategy_trains_like_lightnings_ddp(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["sharded"] and r["units"] == 3  # two blocks and the root, built on meta
        ddp_losses, ddp_weights = r["ddp"]
        losses, weights = r["fxshard"]
        assert len(losses) == 8  # 2 epochs of 4 steps on each rank
        # Step for step, bit for bit: the same init (meta init draws as the CPU build does),
        # data, clipping by the global norm and AdamW.
        assert losses == ddp_losses
        for k, v in ddp_weights.items():
            assert torch.equal(weights[k], v), k


@pytest.mark.release  # a checkpoint round trip through Lightning
def test_a_resumed_fit_equals_the_uninterrupted_one(results: list[dict[str, Any]]) -> None:
    for r in results:
        losses, weights, step = r["resumed"]
        assert losses == r["fxshard"][0] and step == 8
        for k, v in r["fxshard"][1].items():
            assert torch.equal(weights[k], v), k


def test_accumulate_grad_batches_and_clipping_train_like_ddp(results: list[dict[str, Any]]) -> None:
    """With the optimizer in two groups by name (weight decay, and a second learning rate),
    built in configure_optimizers from the LightningModule's named_parameters()."""
    for r in results:
        ddp_losses, ddp_weights, losses, weights = r["accumulate"]
        assert len(losses) == 4
        # The batch that does not step ran inside no_sync, the next flushed its sum.
        assert [(g.accumulate, bool(g.flush)) for g in r["grad_sync"]] == [(True, False), (False, True)]
        # no_sync adds the unreduced gradients and reduces the sum once, DDP reduces each
        # backward's, and the global norm adds the shards' squares: the same sums in another
        # order, rounding apart (test_recipe's bounds for both).
        assert losses == pytest.approx(ddp_losses, rel=1e-5)
        for k, v in ddp_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-6, msg=k)
        ddp_norms, norms = r["norms"]
        assert norms == pytest.approx(ddp_norms, rel=1e-5) and min(norms) > 1.0  # the clip acts


@pytest.mark.slow
def test_bf16_mixed_maps_to_fxshards_mixed_precision(precision: list[dict[str, Any]]) -> None:
    for r in precision:
        plugin, precision, gathered = r["bf16"]
        assert plugin is FxShardMixedPrecision  # no autocast: the module computes in bf16
        assert precision == fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        assert gathered == {torch.bfloat16}


@pytest.mark.slow
def test_16_mixed_keeps_lightnings_scaler_and_options_reach_fxshard(precision: list[dict[str, Any]]) -> None:
    for r in precision:
        plugin, scaled, precision, losses, (saved, saved_without_ac) = r["fp16"]
        assert plugin is FxShardMixedPrecision and scaled
        assert precision == fxshard.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        assert len(losses) == 4 and all(map(math.isfinite, losses))
        assert saved < saved_without_ac  # activation_checkpointing= reached fxshard.compile


def test_the_strategy_is_registered_and_refuses_what_it_cannot_do() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["fxshard"]["strategy"] is FxShardStrategy
    with pytest.raises(TypeError, match="Trainer\\(precision="):
        FxShardStrategy(mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="reshard_after_forwards"):
        FxShardStrategy(reshard_after_forwards=False)
    # FSDPStrategy's names: the one fxshard option to write (fxshard/ir/spellings.py).
    with pytest.raises(TypeError, match=r"policy=fxshard\.policies\.by_class\(Linear\)"):
        FxShardStrategy(auto_wrap_policy={torch.nn.Linear})
    with pytest.raises(TypeError, match=r"activation_checkpointing=fxshard\.policies\.by_class\(Block\)"):
        FxShardStrategy(activation_checkpointing_policy={torch.nn.Linear})
    with pytest.raises(TypeError, match="policy=auto\\(\\) chooses its units from a trace .* pin a policy"):
        FxShardStrategy(fxshard.policies.auto())
    # The process group's timeout: a timedelta as Lightning takes it, or seconds as fxshard.compile does.
    assert FxShardStrategy(timeout=90)._process_group_timeout == timedelta(seconds=90)
    assert FxShardStrategy(timeout=timedelta(minutes=2))._process_group_timeout == timedelta(minutes=2)
    for bad in ("60", -1, True, timedelta(seconds=-5), timedelta(0)):
        with pytest.raises(TypeError, match="timeout=.*timedelta or a positive number of seconds"):
            FxShardStrategy(timeout=bad)
    lit = LitGPT()
    lit.model, lit.head = TinyGPT(), torch.nn.Linear(2, 2)
    with pytest.raises(fxshard.FxShardError, match="found 2 \\(model, head\\).*module=\"model\""):
        FxShardStrategy()._child_name(lit)
    # Precision flags (the whole runs: the slow tier's tests above).
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    strategy = FxShardStrategy()
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    strategy._map_precision()
    assert isinstance(strategy.precision_plugin, FxShardMixedPrecision)
    assert strategy.precision_plugin.param_dtype == torch.bfloat16
    strategy.precision_plugin = type("Bitsandbytes", (Precision,), {})()
    with pytest.raises(fxshard.FxShardError, match="does not support the precision plugin Bitsandbytes"):
        strategy._map_precision()
    # Trainer(sync_batchnorm=True): DDP's setup converts BatchNorm; fxshard refuses, not ignores.
    synced = L.Trainer(accelerator="cpu", devices=1, strategy=FxShardStrategy(), sync_batchnorm=True,
                       logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(fxshard.FxShardError, match="sync_batchnorm=True"):
        synced.strategy.setup(synced)
    del lit.head
    lit.scale = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(fxshard.FxShardError, match="\\['scale'\\] lie outside it"):
        FxShardStrategy(module="model")._shard(lit)


class _Pickled:
    """An object torch.load refuses under weights_only=True."""


def test_load_checkpoint_passes_weights_only_through_as_lightning_does(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's own load leaves weights_only=None to torch.load (True by default): the
    trainer state inside fxshard's checkpoint is read as strictly as Lightning reads its own."""
    import base64
    import io
    import pickle

    import fxshard.lightning as fl

    buffer = io.BytesIO()
    torch.save({"state": _Pickled()}, buffer)
    extra = {fl._EXTRA_KEY: base64.b64encode(buffer.getvalue()).decode("ascii")}
    monkeypatch.setattr(fl, "load", lambda path, sharded, optimizers: extra)
    monkeypatch.setattr(FxShardStrategy, "sharded", property(lambda self: None))
    monkeypatch.setattr(FxShardStrategy, "broadcast", lambda self, obj, src=0: obj)
    strategy = FxShardStrategy()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        strategy.load_checkpoint(tmp_path, weights_only=None)
    assert isinstance(strategy.load_checkpoint(tmp_path, weights_only=False)["state"], _Pickled)


class _HoldsSharded(L.LightningModule):
    """A LightningModule around a model compiled by hand, as a DDP script's would be."""

    def __init__(self) -> None:
        super().__init__()
        self.model = fxshard.compile(TinyGPT(), policy=by_class(Block))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if not self.grouped:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        # The recipe's groups, by name: needs the original names (use_orig_params=True).
        named = list(self.named_parameters())
        plain = [p for n, p in named if n.endswith("bias") or ".ln" in n]
        decay = [p for n, p in named if not (n.endswith("bias") or ".ln" in n)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": plain, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)


def _fit_a_sharded_module(rank: int, world_size: int) -> dict[str, list[str]]:
    """Lightning's own strategies fitting a LightningModule that holds a ShardedModule: the
    errors fit raises, the one it chains included (teardown moves the module back to the CPU)."""
    said = {}
    for strategy in ("ddp", "auto"):
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        try:
            trainer.fit(_HoldsSharded(), _data())
        except Exception as e:  # noqa: BLE001 - the type is the result
            said[strategy] = []
            error: BaseException | None = e
            while error is not None:
                said[strategy].append(f"{type(error).__name__}: {error}")
                error = error.__context__
        else:
            said[strategy] = []
    return said


@pytest.mark.slow  # a whole Lightning fit per strategy; test_hf_trainer's refusal stays fast
def test_lightnings_own_strategies_given_a_sharded_module_are_told_to_use_strategy_fxshard() -> None:
    """DDPStrategy (and the single-device strategy) move the LightningModule to their device at
    setup: the ShardedModule inside refuses, naming strategy="fxshard", where it used to say to
    move the model before fxshard.compile. One rank (Lightning's DDP over a 1-rank group)."""
    said = run_ranks(_fit_a_sharded_module, 1)[0]
    for strategy, name in (("ddp", "DDPStrategy"), ("auto", "SingleDeviceStrategy")):
        assert said[strategy], strategy
        for message in said[strategy]:
            assert message.startswith("FxShardError: rank 0: a ShardedModule cannot be moved or cast "
                                      "after compile"), message
            assert f"Lightning's {name} moves the LightningModule to its device" in message, message
            assert 'use Trainer(strategy="fxshard")' in message, message
            assert "keep the model unsharded in the LightningModule" in message, message
