"""Never silent, continued, on real gloo ranks: a save killed between its two renames, the model
loaded alone from a checkpoint that holds optimizer state (directly and through Lightning),
safetensors that differ between ranks, and `fxshard consolidate` of what it cannot read or write."""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fxshard
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import Block, TinyGPT
from test_checkpoint_integrity import _attempt

RANKS_START_METHOD = "spawn"  # ranks exit through interpreter teardown (tests/dist_utils.py)

TIMEOUT = 5.0


def _build(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    sharded = fxshard.compile(TinyGPT(), policy=by_class(Block), timeout=TIMEOUT)
    # An lr of its own: a load that kept the fresh optimizer's hyperparameters shows.
    return sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2 / (1 + seed))


def _train(sharded: Any, opt: torch.optim.Optimizer, seed: int) -> None:
    """One step on this rank's batch: the optimizer then holds state (AdamW makes it at its first step)."""
    gen = torch.Generator().manual_seed(100 * seed + dist.get_rank())
    batch = torch.randint(0, 61, (2, 17), generator=gen)
    logits = sharded(batch[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- a save killed between its two renames ---------------------------------------------------------


def killed_between_renames_worker(rank: int, world_size: int, root: str) -> None:
    """Save S1 to PATH, then save S2 to PATH and die on rank 0 between PATH -> PATH.old and
    PATH.partial -> PATH: PATH is gone, PATH.old holds S1 and PATH.partial S2, both complete."""
    path = Path(root) / "ckpt"
    sharded, opt = _build(0)
    _train(sharded, opt, 1)
    fxshard.checkpoint.save(path, sharded, opt)
    s1 = sharded.full_state_dict()
    _train(sharded, opt, 2)
    s2 = sharded.full_state_dict()
    if rank == 0:
        torch.save({"s1": s1, "s2": s2}, Path(root) / "expected.pt")
        rename = Path.rename

        def die_before_the_second(self: Path, target: Any) -> Any:
            if self.name.endswith(".partial"):
                os._exit(1)  # killed after PATH -> PATH.old, before PATH.partial -> PATH
            return rename(self, target)

        Path.rename = die_before_the_second  # type: ignore[method-assign]
    try:
        fxshard.checkpoint.save(path, sharded, opt)
    except fxshard.checkpoint.StateDictError:
        assert rank == 1  # rank 0 is gone: its peer's wait ends in an error


def after_the_kill_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    path = Path(root) / "ckpt"
    out: dict[str, Any] = {"files": sorted(p.name for p in Path(root).iterdir())}
    sharded, opt = _build(5)
    _train(sharded, opt, 5)
    before = sharded.full_state_dict()
    out["missing"] = _attempt(lambda: fxshard.checkpoint.load(path, sharded, opt))
    out["missing_unchanged"] = _equal(sharded.full_state_dict(), before)
    # What the error says to do: load PATH.partial (or PATH.old) itself.
    out["partial_error"] = _attempt(lambda: fxshard.checkpoint.load(f"{path}.partial", sharded, opt))
    out["partial"] = sharded.full_state_dict()
    # The next save must not delete the only complete copy of the newest checkpoint: it fails on
    # rank 1 here, and PATH must then hold what the killed save wrote.
    _train(sharded, opt, 6)
    write = dcp.FileSystemWriter.write_data

    def fail(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 1:
            raise OSError("disk full (simulated)")
        return write(self, plan, planner)

    dcp.FileSystemWriter.write_data = fail  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["failed_save"] = _attempt(lambda: fxshard.checkpoint.save(path, sharded, opt))
    finally:
        dcp.FileSystemWriter.write_data = write  # type: ignore[method-assign]
    out["save_warnings"] = [str(w.message) for w in caught]
    dist.barrier()
    out["files_after_failed_save"] = sorted(p.name for p in Path(root).iterdir())
    fresh, fresh_opt = _build(7)
    out["after_failed_save_error"] = _attempt(lambda: fxshard.checkpoint.load(path, fresh, fresh_opt))
    out["after_failed_save"] = fresh.full_state_dict()
    # A save that succeeds then replaces it, and leaves no leftovers.
    fxshard.checkpoint.save(path, sharded, opt)
    out["saved"] = sharded.full_state_dict()
    dist.barrier()
    out["files_after_save"] = sorted(p.name for p in Path(root).iterdir())
    fxshard.checkpoint.load(path, fresh, fresh_opt)
    out["after_save"] = fresh.full_state_dict()
    return out


@cache
def killed_runs() -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="fxshard-renames-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    with pytest.raises(Exception, match="process 0 terminated with exit code 1"):
        run_ranks(killed_between_renames_worker, 2, root)
    expected = torch.load(Path(root) / "expected.pt")
    return {"root": root, "expected": expected, "ranks": run_ranks(after_the_kill_worker, 2, root)}


@pytest.mark.slow  # a save killed on one rank, then two runs after it: two spawns
def test_a_save_killed_between_its_renames_leaves_the_old_and_the_partial_checkpoint() -> None:
    """The situation itself: nothing at PATH, both others complete."""
    for r in killed_runs()["ranks"]:
        assert r["files"] == ["ckpt.old", "ckpt.partial", "expected.pt"], r["files"]
        assert r["partial_error"] == "", r["partial_error"]
        assert _equal(r["partial"], killed_runs()["expected"]["s2"])


@pytest.mark.slow  # a save killed on one rank, then two runs after it: two spawns
def test_loading_a_missing_checkpoint_names_the_complete_ones_beside_it() -> None:
    root = killed_runs()["root"]
    for r in killed_runs()["ranks"]:
        error = r["missing"]
        assert error.startswith(f"StateDictError: loading checkpoint {root}/ckpt"), error
        assert f"{root}/ckpt does not exist" in error, error
        # Both are named, as complete, with what to do with each.
        assert re.search(rf"{root}/ckpt\.partial.*complete.*newest", error, re.DOTALL), error
        assert re.search(rf"{root}/ckpt\.old.*complete.*before", error, re.DOTALL), error
        assert f"mv {root}/ckpt.partial {root}/ckpt" in error, error
        assert "nothing was changed" in error and r["missing_unchanged"], error


@pytest.mark.slow  # a save killed on one rank, then two runs after it: two spawns
def test_the_next_save_keeps_the_killed_saves_checkpoint() -> None:
    """The next save puts PATH.partial (complete, verified) back at PATH before it writes; when it
    then fails, PATH holds what the killed save wrote."""
    runs = killed_runs()
    rank0, rank1 = runs["ranks"]
    for r in (rank0, rank1):
        assert r["failed_save"].startswith("StateDictError: saving checkpoint"), r["failed_save"]
        assert r["after_failed_save_error"] == "", r["after_failed_save_error"]
        assert _equal(r["after_failed_save"], runs["expected"]["s2"])
        assert "ckpt" in r["files_after_failed_save"], r["files_after_failed_save"]
    assert any("ckpt.partial" in w and "moved" in w for w in rank0["save_warnings"]), rank0["save_warnings"]
    for r in (rank0, rank1):  # and a save that succeeds replaces it, leaving no leftovers
        assert r["files_after_save"] == ["ckpt", "expected.pt"], r["files_after_save"]
        assert _equal(r["after_save"], r["saved"])


# -- the model alone, from a checkpoint with optimizer state; safetensors that differ by rank ------


def _write_hf_style(model: nn.Module, directory: Path) -> None:
    """Two shard files, the tied output embedding saved once (as Hugging Face does)."""
    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = sorted(state)
    directory.mkdir()
    save_file({k: state[k] for k in names[::2]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(directory / "model-00002-of-00002.safetensors"))


def _pretrained(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT()


def loads_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The model alone from a checkpoint saved with its optimizer (docs/checkpoints.md).
    trained, opt = _build(0)
    _train(trained, opt, 1)
    with_optimizer = Path(root) / "with-optimizer"
    fxshard.checkpoint.save(with_optimizer, trained, opt, extra={"step": 1})
    out["saved"] = trained.full_state_dict()
    model_only, _ = _build(1)
    out["model_only_error"] = _attempt(
        lambda: out.__setitem__("model_only_extra", fxshard.checkpoint.load(with_optimizer, model_only)))
    out["model_only"] = model_only.full_state_dict()
    # Pretrained safetensors: rank 0 reads revision a, rank 1 revision b (node-local caches).
    hf = Path(root) / "hf"
    with torch.device("meta"):
        meta = TinyGPT()
    sharded = fxshard.compile(meta, policy=by_class(Block), timeout=TIMEOUT)
    before = sharded.full_state_dict()
    out["different_files"] = _attempt(
        lambda: fxshard.checkpoint.load_safetensors(sharded, hf / ("a" if rank == 0 else "b")))
    out["different_files_unchanged"] = _equal(sharded.full_state_dict(), before)
    # A copy of the same files at another path is the same source, and loads.
    out["copy_error"] = _attempt(
        lambda: fxshard.checkpoint.load_safetensors(sharded, hf / ("a" if rank == 0 else "copy-of-a")))
    out["copy"] = sharded.full_state_dict()
    return out


@cache
def loads_runs() -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="fxshard-loads-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # the consolidation tests read it
    hf = Path(root) / "hf"
    hf.mkdir()
    _write_hf_style(_pretrained(3), hf / "a")
    _write_hf_style(_pretrained(4), hf / "b")
    shutil.copytree(hf / "a", hf / "copy-of-a")
    return {"root": root, "ranks": run_ranks(loads_worker, 2, root)}


def test_the_model_alone_loads_from_a_checkpoint_with_optimizer_state() -> None:
    """The optimizer state is left unread; the weights are the saved ones, bit for bit."""
    for r in loads_runs()["ranks"]:
        assert r["model_only_error"] == "", r["model_only_error"]
        assert r["model_only_extra"] == {"step": 1}
        assert _equal(r["model_only"], r["saved"])


def test_safetensors_that_differ_between_ranks_raise_on_every_rank_and_change_nothing() -> None:
    root = loads_runs()["root"]
    for r in loads_runs()["ranks"]:
        error = r["different_files"]
        assert error.startswith(f"StateDictError: loading {root}/hf/"), error
        assert re.search(rf"the ranks read different files, nothing was changed:\n  rank 0: {root}/hf/a "
                         rf"\(content [0-9a-f]+\)\n  rank 1: {root}/hf/b \(content [0-9a-f]+\)", error), error
        assert "Every rank must load the same files" in error, error
        assert r["different_files_unchanged"]


def test_safetensors_copied_to_another_path_load() -> None:
    reference = _pretrained(3).state_dict()
    for r in loads_runs()["ranks"]:
        assert r["copy_error"] == "", r["copy_error"]
        assert _equal(r["copy"], reference)


# -- fxshard consolidate: one `error:` line naming the cause and the fix, exit code 2 --------------


def _consolidate(args: list[str], capsys: Any) -> tuple[int, list[str]]:
    from fxshard.cli import main

    rc = main(["consolidate", *args])
    return rc, capsys.readouterr().err.strip().splitlines()


def _checkpoint(tmp_path: Path) -> Path:
    """A copy of the checkpoint the gloo ranks saved (model and optimizer, with checksums)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(Path(loads_runs()["root"]) / "with-optimizer", ckpt)
    return ckpt


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_consolidate_of_a_checkpoint_missing_a_data_file(fmt: str, tmp_path: Path, capsys: Any) -> None:
    ckpt = _checkpoint(tmp_path)
    (ckpt / "__1_0.distcp").unlink()
    rc, err = _consolidate([str(ckpt), str(tmp_path / "model.out"), "--format", fmt], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("fxshard consolidate: error: "), err
    assert f"{ckpt}/__1_0.distcp is missing" in err[0] and "copy the checkpoint whole" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_consolidate_into_a_missing_folder(fmt: str, tmp_path: Path, capsys: Any) -> None:
    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "no" / "such" / "model.out"
    rc, err = _consolidate([str(ckpt), str(out), "--format", fmt], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("fxshard consolidate: error: "), err
    assert f"{tmp_path}/no/such does not exist" in err[0] and "mkdir -p" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written, as on a full disk."""

    def __init__(self, file: Any, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            self.file.write(memoryview(data).cast("B")[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return int(self.file.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "optimizer", "scratch"])
def test_consolidate_onto_a_full_disk(fmt: str, tmp_path: Path, capsys: Any,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes of the output fail with ENOSPC after 4 KiB: the model's file (torch.save or
    safetensors), the optimizer's file after the model's, or reserving the torch format's scratch
    buffers (posix_fallocate; writing to a mapping of them on a full disk would be a SIGBUS)."""
    import fxshard.consolidate

    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "model.out"
    failing = f".{out.name}.optim.partial" if fmt == "optimizer" else f".{out.name}.partial"

    def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        raw = open(file, mode, *args, **kwargs)
        return _FullDisk(raw, 4096) if "w" in mode and Path(file).name == failing else raw

    def full_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if fmt == "scratch":
        monkeypatch.setattr(os, "posix_fallocate", full_fallocate)
    else:
        monkeypatch.setattr(fxshard.consolidate, "open", full_open, raising=False)
    args = ["--format", "safetensors" if fmt == "safetensors" else "torch"]
    rc, err = _consolidate([str(ckpt), str(out), *args, *(["--optimizer"] if fmt == "optimizer" else [])],
                           capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("fxshard consolidate: error: "), err
    written = f"{out}.optim" if fmt == "optimizer" else str(out)
    assert f"cannot write {written}: no space left on the device of {tmp_path}" in err[0], err
    assert "free space or write elsewhere" in err[0], err
    # No partial file, no scratch, and no model file without the optimizer's asked for beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- Lightning: trainer.validate(ckpt_path=...) on a checkpoint that fit wrote ---------------------


def lightning_validate_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import lightning.pytorch as L
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from fxshard.lightning import FxShardStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: nn.Module | None = None
            self.validated: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = TinyGPT()

        def _loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            assert self.model is not None
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self._loss(batch)

        def validation_step(self, batch: Any, index: int) -> None:
            self.validated.append(self._loss(batch).item())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 61, (8, 16), generator=gen)
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=2)

    def trainer(**kwargs: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=2, strategy=FxShardStrategy(policy=by_class(Block)),
                         max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         **kwargs)

    L.seed_everything(0, verbose=False)
    fitted = Lit()
    callback = ModelCheckpoint(dirpath=root, filename="fit")
    trainer(callbacks=[callback], enable_checkpointing=True).fit(fitted, data)
    assert isinstance(fitted.model, fxshard.ShardedModule)
    weights = fitted.model.full_state_dict()
    L.seed_everything(1, verbose=False)  # other initial weights: the checkpoint must replace them
    fresh = Lit()
    out: dict[str, Any] = {"path": callback.best_model_path, "fitted": weights}
    out["error"] = _attempt(lambda: trainer(enable_checkpointing=False).validate(
        fresh, data, ckpt_path=callback.best_model_path, verbose=False))
    model = fresh.model
    out["validated"] = model.full_state_dict() if isinstance(model, fxshard.ShardedModule) else None
    out["losses"] = fresh.validated
    return out


@pytest.mark.slow  # the direct load test above covers the fast tier
def test_lightning_validate_loads_a_checkpoint_that_fit_wrote(tmp_path: Path) -> None:
    """Lightning's validate (and test, predict) restore the model alone: no optimizer is set up."""
    for r in run_ranks(lightning_validate_worker, 2, str(tmp_path)):
        assert r["path"] == f"{tmp_path}/fit.ckpt" and (tmp_path / "fit.ckpt").is_dir(), r["path"]
        assert r["error"] == "", r["error"]
        assert r["validated"] is not None and _equal(r["validated"], r["fitted"])
        assert len(r["losses"]) == 2  # this rank's half of 4 batches
