"""fxshard.hf.FxShardTrainer: the Hugging Face Trainer on fxshard trains as its own DDP run does.

On 2 gloo ranks, a tiny random Llama (no download) is trained by the plain
Trainer (Accelerate wraps it in DDP) and by FxShardTrainer, on the same data
and seed, with gradient accumulation, the gradient's norm computed for
clipping, and the Trainer's default AdamW: the logged losses, evaluate()'s loss
and the final weights are equal bit for bit, the norms to float32 rounding.
With clipping active they agree to rounding. ``save_model`` writes a
``model.safetensors`` that ``from_pretrained`` loads, and a training resumed
from a mid-run checkpoint (full optimizer state) ends where the uninterrupted
one does.

The model uses eager attention: with SDPA and no cache, Transformers builds
the causal mask under fxshard's trace (as under torch.compile) where eager
mode passes ``is_causal=True``, and SDPA's kernel then sums in another order
(docs/integrations.md, "Attention numerics").
"""

from __future__ import annotations

import os
import tempfile
from functools import cache
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import fxshard
from fxshard.hf import FxShardTrainer
from fxshard.measure import CommCounter

from dist_utils import run_ranks

STEPS = 4  # optimizer steps, of 2 micro-batches each on each rank
SEQ = 16


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Random token rows; each row's labels mask a different prefix (-100), so the ranks'
    micro-batches count different numbers of tokens, as real data does."""

    def __init__(self, rows: int):
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (rows, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: i % 5] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def _args(out: str, **changes: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=out, use_cpu=True, report_to=[], seed=0, max_steps=STEPS,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
        learning_rate=1e-2, weight_decay=0.1, logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    return TrainingArguments(**(settings | changes))


class CountingTrainer(FxShardTrainer):
    """Records, per micro-batch, whether the Trainer meant to sync and how many
    reduce-scatters its backward issued."""

    micro_batches: list[tuple[bool, int]]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        with CommCounter() as counter:
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro_batches.append((self.accelerator.sync_gradients, counter.calls["reduce_scatter"]))
        return loss


def _history(trainer: Trainer) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _pair(out: str, data: Tokens, **changes: Any) -> tuple[Trainer, CountingTrainer]:
    """The plain Trainer's run (DDP) and FxShardTrainer's, from the same model, data and seed."""
    ddp = Trainer(model=_model(), args=_args(f"{out}/ddp", **changes), train_dataset=data, eval_dataset=data)
    ddp.train()
    assert type(ddp.model_wrapped).__name__ == "DistributedDataParallel"
    sharded = CountingTrainer(model=_model(), args=_args(f"{out}/fx", **changes), train_dataset=data,
                              eval_dataset=data)
    sharded.micro_batches = []
    sharded.train()
    return ddp, sharded


def _torchrun_environment(rank: int, world_size: int) -> None:
    # What torchrun sets; Accelerate reads them, and finds the process group initialised.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")


def worker(rank: int, world_size: int, out: str) -> dict[str, Any]:
    _torchrun_environment(rank, world_size)
    data = Tokens(2 * 2 * world_size * STEPS)

    # max_grad_norm=1.0 stays above every step's norm: the norm is computed, nothing is scaled.
    ddp, sharded = _pair(f"{out}/exact", data, save_strategy="steps", save_steps=2)
    evaluated = (ddp.evaluate()["eval_loss"], sharded.evaluate()["eval_loss"])
    sharded.save_model(f"{out}/saved")
    wrapped = sharded.model_wrapped
    assert isinstance(wrapped, fxshard.ShardedModule) and wrapped._last is not None
    gathers = sum(c.kind == "all_gather" for c in wrapped._driver.steps[0].collectives)

    resumed = FxShardTrainer(model=_model(), args=_args(f"{out}/resumed"), train_dataset=data)
    resumed.train(resume_from_checkpoint=f"{out}/exact/fx/checkpoint-2")
    resumed_state = resumed.model_wrapped.state_dict()  # a collective

    result: dict[str, Any] = {
        "ddp": _history(ddp), "fx": _history(sharded), "resumed": _history(resumed), "evaluated": evaluated,
        "micro_batches": sharded.micro_batches, "gathers": gathers, "units": len(wrapped.plan.units),
    }
    if rank == 0:
        reloaded, info = LlamaForCausalLM.from_pretrained(f"{out}/saved", output_loading_info=True)
        result.update(
            files=sorted(os.listdir(f"{out}/saved")), info=info,
            checkpoint_files=sorted(os.listdir(f"{out}/exact/fx/checkpoint-2")),
            ddp_state=ddp.model.state_dict(), saved_state=reloaded.state_dict(),
            resumed_state=resumed_state,
        )
    return result


@cache
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        return run_ranks(worker, 2, out)


def clip_worker(rank: int, world_size: int, out: str) -> dict[str, Any]:
    _torchrun_environment(rank, world_size)
    data = Tokens(2 * 2 * world_size * STEPS)
    unclipped = Trainer(model=_model(), args=_args(f"{out}/ddp"), train_dataset=data)
    unclipped.train()  # worker()'s DDP run: what clipping changes
    # Every step clips (its norm is above 0.5). Without accumulation: one step to trace, not two.
    ddp_clip, sharded_clip = _pair(f"{out}/clip", data, max_grad_norm=0.5, gradient_accumulation_steps=1)
    clipped_state = sharded_clip.model_wrapped.state_dict()  # a collective
    result: dict[str, Any] = {"ddp_clip": _history(ddp_clip), "fx_clip": _history(sharded_clip)}
    if rank == 0:
        result.update(ddp_state=unclipped.model.state_dict(), ddp_clip_state=ddp_clip.model.state_dict(),
                      clipped_state=clipped_state)
    return result


@cache
def clip_results() -> list[dict[str, Any]]:
    """Ranks of their own: test_clipping_scales_the_gradients_as_ddp_does, their only reader, is
    in the slow tier (tests/conftest.py), and the fast tier's tests need not wait for them."""
    with tempfile.TemporaryDirectory() as out:
        return run_ranks(clip_worker, 2, out)


@pytest.mark.release
def test_fxshard_trainer_trains_as_the_trainers_ddp_run() -> None:
    for rank, r in enumerate(results()):
        assert len(r["fx"]) == STEPS
        # The losses bit for bit. The gradient norm is summed in another order (per flat
        # shard, then across ranks; DDP: per parameter), so it may differ in its last bit.
        assert [loss for loss, _ in r["fx"]] == [loss for loss, _ in r["ddp"]], (rank, r["fx"], r["ddp"])
        torch.testing.assert_close([n for _, n in r["fx"]], [n for _, n in r["ddp"]], rtol=1e-5, atol=0)
        assert all(norm < 1.0 for _, norm in r["ddp"])
        assert r["evaluated"][0] == r["evaluated"][1]  # evaluate() runs the shards too
        assert r["units"] == 3 and r["gathers"] >= 3  # a unit per decoder layer, and the root


def test_accumulation_communicates_only_at_the_sync_step() -> None:
    for r in results():
        micro = r["micro_batches"]
        assert [sync for sync, _ in micro] == [False, True] * STEPS
        assert all(n == 0 for sync, n in micro if not sync), micro  # no_sync: no reduce-scatter
        assert all(n > 0 for sync, n in micro if sync), micro


def test_save_model_writes_the_ddp_runs_weights_for_from_pretrained() -> None:
    r = results()[0]
    assert "model.safetensors" in r["files"] and "config.json" in r["files"], r["files"]
    assert not any(r["info"][k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), r["info"]
    ddp, saved = r["ddp_state"], r["saved_state"]
    assert saved.keys() == ddp.keys()
    for name, value in ddp.items():
        assert torch.equal(saved[name], value), name  # the DDP run's final weights, exactly


def test_clipping_scales_the_gradients_as_ddp_does() -> None:
    # A norm that differs from DDP's in its last bits scales every gradient by a factor that
    # may too, so this agrees to float32 rounding, not bit for bit (docs/devices.md,
    # "Numerics"): losses and norms to 1e-5, weights to 1e-5 and 1e-6 absolute (a ten-
    # thousandth of one step's size, the learning rate).
    for r in clip_results():
        assert all(norm > 0.5 for _, norm in r["ddp_clip"])
        torch.testing.assert_close(r["fx_clip"], r["ddp_clip"], rtol=1e-5, atol=0)
    r = clip_results()[0]
    for name, value in r["ddp_clip_state"].items():
        torch.testing.assert_close(r["clipped_state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(value, r["ddp_state"][name]) or value.dim() == 1, name  # clipping changed it


@pytest.mark.release  # a checkpoint round trip through the Trainer
def test_resume_from_a_checkpoint_ends_where_the_run_does() -> None:
    r = results()[0]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt"} <= set(r["checkpoint_files"])
    for name, value in r["saved_state"].items():
        assert torch.equal(r["resumed_state"][name], value), name
    for res in results():
        assert res["resumed"] == res["fx"]  # the log of steps 1-2 is restored, 3-4 logged alike


# -- refusals (one process, nothing trained) --------------------------------------------------------


@pytest.mark.parametrize("change, words", [
    (dict(fsdp="full_shard"), "fsdp= asks Accelerate for torch FSDP"),
    (dict(torch_compile=True), "torch_compile=True"),
    (dict(fp16=True), "fp16=True is not supported"),
    (dict(bf16_full_eval=True), "bf16_full_eval"),
    (dict(activation_checkpointing=True), "fxshard_options={'activation_checkpointing'"),
    (dict(auto_find_batch_size=True), "auto_find_batch_size=True"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
])
def test_refused_arguments_name_the_problem_and_the_fix(tmp_path: Any, change: dict[str, Any],
                                                        words: str) -> None:
    with pytest.raises(fxshard.FxShardError, match="FxShardTrainer cannot run") as e:
        FxShardTrainer(model=_model(), args=_args(str(tmp_path), **change))
    assert words in str(e.value)


def test_ddp_broadcast_buffers_is_fxshards_broadcast_buffers_and_auto_is_refused(tmp_path: Any) -> None:
    """The Trainer hands ddp_broadcast_buffers to DDP; here it is fxshard's option of the same
    meaning (unset: fxshard's default, FSDP's, no broadcast). auto() needs a batch to plan on,
    which the Trainer shards before it has."""
    from fxshard.hf import compile_options
    from fxshard.policies import auto

    for given in (True, False):
        options, problems = compile_options(_args(str(tmp_path), ddp_broadcast_buffers=given), None, {})
        assert options["broadcast_buffers"] is given and not problems
    assert "broadcast_buffers" not in compile_options(_args(str(tmp_path)), None, {})[0]
    _, problems = compile_options(_args(str(tmp_path), ddp_broadcast_buffers=True), None,
                                  {"broadcast_buffers": False})
    assert problems == ["ddp_broadcast_buffers=True, but fxshard_options names broadcast_buffers=False: drop one"]
    with pytest.raises(fxshard.FxShardError, match="policy=auto\\(\\) chooses its units .* pin a policy"):
        FxShardTrainer(model=_model(), args=_args(str(tmp_path)), policy=auto())


def test_an_unknown_fxshard_option_is_refused_at_construction(tmp_path: Any) -> None:
    with pytest.raises(fxshard.FxShardError, match="reshard_after_foward"):
        FxShardTrainer(model=_model(), args=_args(str(tmp_path)), fxshard_options={"reshard_after_foward": False})


def test_an_optimizer_built_before_compile_is_refused(tmp_path: Any) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(fxshard.FxShardError, match="optimizer_cls_and_kwargs"):
        FxShardTrainer(model=model, args=_args(str(tmp_path)), optimizers=(opt, None))


def test_bf16_is_fxshards_mixed_precision(tmp_path: Any) -> None:
    # One process (world size 1): the mapping, and a step that runs in it.
    trainer = FxShardTrainer(model=_model(), args=_args(str(tmp_path), bf16=True, max_steps=1),
                             train_dataset=Tokens(4))
    trainer.train()
    sharded = trainer.model_wrapped
    assert isinstance(sharded, fxshard.ShardedModule)
    assert sharded.config.mixed_precision == fxshard.MixedPrecision(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in sharded.parameters())  # fp32 master weights
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
    with pytest.raises(fxshard.FxShardError, match="bf16=True, but fxshard_options names"):
        FxShardTrainer(model=_model(), args=_args(str(tmp_path), bf16=True),
                       fxshard_options={"mixed_precision": fxshard.MixedPrecision(param_dtype=torch.float16)})


def test_best_model_and_a_second_train_load_into_the_shards(tmp_path: Any) -> None:
    # One process. load_best_model_at_end, and train() again on the same trainer from a
    # checkpoint: both load saved weights into the shards (the model's own parameters are
    # meta stand-ins once compiled).
    from safetensors.torch import load_file

    args = _args(str(tmp_path), max_steps=3, gradient_accumulation_steps=1, save_steps=1,
                 save_strategy="steps", eval_strategy="steps", eval_steps=1,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 learning_rate=0.5)  # large enough that the last step is not the best
    trainer = FxShardTrainer(model=_model(), args=args, train_dataset=Tokens(6), eval_dataset=Tokens(4))
    trainer.train()
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-2"), best
    sharded = trainer.model_wrapped
    state = sharded.state_dict()
    for name, value in load_file(f"{best}/model.safetensors").items():
        assert torch.equal(state[name], value), name

    # The shards hold the best weights; step 3 from checkpoint-2's weights and optimizer state.
    trainer.train(resume_from_checkpoint=f"{tmp_path}/checkpoint-2")
    assert trainer.model_wrapped is sharded  # compiled once
    resumed = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert resumed[3] == losses[3]


def test_the_optimizer_has_the_trainers_two_groups_by_the_original_names(tmp_path: Any) -> None:
    """Weight decay for the parameters the Trainer's own rule names, none for the others:
    the same names, in the same groups, as the plain Trainer's optimizer."""
    plain = Trainer(model=_model(), args=_args(str(tmp_path / "plain")))
    expected = plain.create_optimizer()
    names = {id(p): n for n, p in plain.model.named_parameters()}
    trainer = FxShardTrainer(model=_model(), args=_args(str(tmp_path / "fx")))
    optimizer = trainer.create_optimizer()
    views = {id(p): n for n, p in trainer.model_wrapped.named_parameters()}
    assert [(g["weight_decay"], [views[id(p)] for p in g["params"]]) for g in optimizer.param_groups] == \
        [(g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in expected.param_groups]
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["params"]


def test_weight_decay_over_flat_shards_is_refused_with_the_default_to_keep(tmp_path: Any) -> None:
    with pytest.raises(fxshard.FxShardError, match="use_orig_params at its default"):
        FxShardTrainer(model=_model(), args=_args(str(tmp_path)), fxshard_options={"use_orig_params": False})


def test_the_plain_trainer_given_a_sharded_module_is_told_to_use_fxshard_trainer(tmp_path: Any) -> None:
    """Trainer's constructor moves its model to args.device: a ShardedModule refuses, naming
    FxShardTrainer, where it used to say to move the model before fxshard.compile."""
    sharded = fxshard.compile(_model())
    with pytest.raises(fxshard.FxShardError) as e:
        Trainer(model=sharded, args=_args(str(tmp_path)))
    message = str(e.value)
    assert message.startswith("rank 0: a ShardedModule cannot be moved or cast after compile"), message
    assert "the Hugging Face Trainer moves its model to args.device" in message, message
    assert "Use fxshard.hf.FxShardTrainer in place of Trainer" in message, message
    assert "before fxshard.compile" not in message, message
    # FxShardTrainer, and subclasses of it, are not told to use themselves
    counting = type("Mine", (FxShardTrainer,), {})(model=_model(), args=_args(str(tmp_path)))
    with pytest.raises(fxshard.FxShardError, match="before fxshard.compile") as e:
        counting._move_model_to_device(counting._shard(), torch.device("cpu"))
    assert "Under Lightning" in str(e.value), e.value
