"""Sharded checkpoints through torch.distributed.checkpoint: save, resume at any world size and
policy, and bad input that changes nothing, on real gloo ranks."""

from __future__ import annotations

import atexit
import copy
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
from torch.distributed.checkpoint.state_dict import StateDictOptions

import fxshard
from fxshard.driver.state.state_dicts import boxes
from fxshard.policies import by_class, by_size

from dist_utils import run_ranks
from models import Block, BNNet, TinyGPT

RANKS_START_METHOD = "spawn"  # ranks exit through interpreter teardown (tests/dist_utils.py)

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks: every world size trains on the same global batch
POLICIES = {"block": dict(policy=by_class(Block)),
            "size_zero2": dict(policy=by_size(2000), reshard_after_forward=False)}


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 61, (GLOBAL_BATCH, 17), generator=gen) for _ in range(n)]


def _step(sharded: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One step on this rank's rows of the global batch; returns the global mean loss."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    rows = batch[rank * GLOBAL_BATCH // ws:(rank + 1) * GLOBAL_BATCH // ws]
    logits = sharded(rows[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / ws


def _build(policy: str, seed: int = 0) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    sharded = fxshard.compile(TinyGPT(), **POLICIES[policy])
    return sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2)


def _save(sharded: Any, opt: torch.optim.Optimizer, path: str) -> None:
    msd, osd = fxshard.get_state_dict(sharded, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(sharded: Any, opt: torch.optim.Optimizer, path: str) -> None:
    msd, osd = fxshard.get_state_dict(sharded, opt)  # this layout: what to read into
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    fxshard.set_state_dict(sharded, opt, model_state_dict=msd, optim_state_dict=osd)


def save_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    sharded, opt = _build("block")
    batches = _batches(4)
    for b in batches[:2]:
        _step(sharded, opt, b)
    _save(sharded, opt, os.path.join(root, "ckpt2"))
    saved = sharded.full_state_dict()
    # In this spawn, to spare the suite two: bad input last, as it leaves safetensors patched.
    return {"saved": saved, "ref": [_step(sharded, opt, b) for b in batches[2:]],
            "bn": bn_worker(rank, world_size, root), "bad_input": bad_input_worker(rank, world_size, root)}


def _warnings(fn: Any) -> tuple[Any, list[str]]:
    """``fn()``'s result and every warning it raised, none filtered out."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [f"{w.category.__name__}: {w.message}" for w in caught]


def _bn_buffers(model: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.full_state_dict().items() if ".running_" in k or "num_batches" in k}


def bn_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """BatchNorm statistics, rank-local by default: each rank trains on its own data."""
    def build(seed: int) -> tuple[Any, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        sharded = fxshard.compile(BNNet(), policy=by_class(nn.BatchNorm2d))
        return sharded, torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)

    sharded, opt = build(0)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x, y = torch.randn(5, 3, 6, 6, generator=gen), torch.randn(5, 4, generator=gen)
        nn.functional.mse_loss(sharded(x), y).backward()
        opt.step()
        opt.zero_grad()
    path = os.path.join(root, "bn")
    _, save_warnings = _warnings(lambda: fxshard.checkpoint.save(path, sharded, opt, extra={"rank": rank}))
    fresh, fresh_opt = build(1)
    extra, load_warnings = _warnings(lambda: fxshard.checkpoint.load(path, fresh, fresh_opt))
    trained = _bn_buffers(sharded)
    # Plain DCP keeps rank 0's copy when asked to (docs/checkpoints.md); loaded into the
    # trained model, whose rank 1 holds other statistics.
    msd, osd = fxshard.get_state_dict(sharded, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "bn-dcp"),
             planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    _load(sharded, opt, os.path.join(root, "bn-dcp"))
    return {"trained": trained, "loaded": _bn_buffers(fresh), "extra": extra,
            "by_dcp": _bn_buffers(sharded), "params": fresh.full_state_dict(),
            "warnings": save_warnings + load_warnings}


def _resume(source: str, policy: str, save_to: str | None = None) -> dict[str, Any]:
    sharded, opt = _build(policy, seed=1)  # other weights: the load must replace them
    _load(sharded, opt, source)
    loaded = sharded.full_state_dict()
    if save_to is not None:
        _save(sharded, opt, save_to)
    return {"loaded": loaded, "losses": [_step(sharded, opt, b) for b in _batches(4)[2:]]}


def resume_worker(rank: int, world_size: int, root: str, cases: list[tuple[str, str, str | None]],
                  killed: str | None = None) -> dict[str, Any]:
    out = {f"{source}-{policy}": _resume(os.path.join(root, source), policy,
                                         os.path.join(root, save_to) if save_to else None)
           for source, policy, save_to in cases}
    if killed is not None:
        out["killed"] = load_worker(rank, world_size, killed)
    return out


@cache
def _saved() -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="fxshard-ckpt-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # the consolidation tests read ckpt2
    _write_hf_style(_pretrained(), Path(root) / "hf")  # what bad_input_worker loads
    saves = run_ranks(save_worker, 2, root)
    return {"bn": [s.pop("bn") for s in saves], "bad_input": [s.pop("bad_input") for s in saves],
            "save": saves[0], "root": root}


@cache
def _killed() -> dict[str, Any]:
    """A save killed on one rank (its own spawn dies), loaded by the 2-rank resume."""
    killed = os.path.join(_saved()["root"], "killed")
    with pytest.raises(Exception, match="process 1 terminated with exit code 1"):
        run_ranks(killed_save_worker, 2, killed)
    return {"path": killed, "killed_partial": os.path.exists(killed + ".partial"),
            "killed_expected": torch.load(f"{killed}-expected-0.pt")}


@cache
def _resumed(world_size: int) -> dict[str, Any]:
    root = _saved()["root"]
    if world_size == 3:  # it writes ckpt3, which the 2-rank resume reads
        return run_ranks(resume_worker, 3, root, [("ckpt2", "block", "ckpt3")])[0]
    if world_size == 2:
        _resumed(3)
        return run_ranks(resume_worker, 2, root, [("ckpt2", "block", None), ("ckpt2", "size_zero2", None),
                                                  ("ckpt3", "block", None)], _killed()["path"])[0]
    return run_ranks(resume_worker, 1, root, [("ckpt2", "block", None)])[0]


class _Runs:
    """Each spawn on first use, so that the fast tier's readers (the save, the 1-rank resume)
    wait for none of the slow tier's (the 3- and 2-rank resumes, the killed save)."""

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, int):
            return _resumed(key)
        return _killed()[key] if key.startswith("killed_") else _saved()[key]


def runs() -> _Runs:
    return _Runs()


def _assert_equal_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("world_size,case", [(2, "ckpt2-block"), (2, "ckpt2-size_zero2"),
                                             (3, "ckpt2-block"), (1, "ckpt2-block"), (2, "ckpt3-block")])
def test_resume_loads_the_saved_parameters_bitwise(world_size: int, case: str) -> None:
    _assert_equal_state(runs()[world_size][case]["loaded"], runs()["save"]["saved"])


@pytest.mark.parametrize("world_size,case", [(2, "ckpt2-block"), (2, "ckpt2-size_zero2"), (2, "ckpt3-block")])
def test_resume_at_two_ranks_continues_bitwise(world_size: int, case: str) -> None:
    # Same world size, another plan (other units, ZeRO-2), or a checkpoint written by 3 ranks:
    # the next steps are the uninterrupted run's, bit for bit.
    assert runs()[world_size][case]["losses"] == runs()["save"]["ref"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_at_another_world_size_continues(world_size: int) -> None:
    # Gradients are averaged over another number of ranks: the same sum, other rounding.
    assert runs()[world_size]["ckpt2-block"]["losses"] == pytest.approx(runs()["save"]["ref"], rel=1e-5)


def test_rank_local_buffers_are_saved_from_rank_0() -> None:
    # Each rank's BatchNorm statistics are its own; a checkpoint holds rank 0's, as
    # state_dict() and DDP's broadcast would, and every rank loads them.
    rank0, rank1 = runs()["bn"]
    assert not torch.equal(rank0["trained"]["bn.running_mean"], rank1["trained"]["bn.running_mean"])
    for r in (rank0, rank1):
        _assert_equal_state(r["loaded"], rank0["trained"])
        _assert_equal_state(r["by_dcp"], rank0["trained"])
        assert r["extra"] == {"rank": 0}  # extra is rank 0's too


def test_save_and_load_raise_no_warning() -> None:
    for r in runs()["bn"]:
        assert r["warnings"] == []


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_consolidate_of_a_model_with_integer_buffers_raises_no_warning(fmt: str, tmp_path: Path) -> None:
    from fxshard.consolidate import consolidate

    out = tmp_path / f"model.{fmt}"
    ckpt = os.path.join(runs()["root"], "bn")
    _, caught = _warnings(lambda: consolidate(ckpt, out, format=fmt, optimizer=True))
    assert caught == []
    if fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    plain = BNNet()
    plain.load_state_dict(state, strict=True)  # num_batches_tracked is int64 beside float32
    _assert_equal_state(plain.state_dict(), runs()["bn"][0]["params"])


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_consolidate_writes_the_full_model_that_loads_strictly(fmt: str, tmp_path: Path) -> None:
    from fxshard.cli import main

    out = tmp_path / f"model.{fmt}"
    ckpt = os.path.join(runs()["root"], "ckpt2")
    assert main(["consolidate", ckpt, str(out), "--format", fmt, "--optimizer"]) == 0
    if fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    plain = TinyGPT()
    plain.load_state_dict(state, strict=True)
    _assert_equal_state(plain.state_dict(), runs()["save"]["saved"])
    optim = torch.load(f"{out}.optim", weights_only=True)
    assert optim["param_groups"][0]["lr"] == 1e-2
    assert optim["state"]["blocks.0.attn.qkv.weight"]["exp_avg"].shape == (96, 32)
    assert set(optim["state"]) == {n for n, _ in TinyGPT().named_parameters()}


def test_consolidate_refuses_what_is_not_a_checkpoint(tmp_path: Path, capsys: Any) -> None:
    from fxshard.cli import main

    assert main(["consolidate", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    assert "is not a readable DCP checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("shape,start,stop", [((4, 3), 2, 10), ((4, 3), 0, 12), ((4, 3), 3, 9),
                                              ((2, 3, 4), 5, 19), ((7,), 2, 5), ((2, 3, 4), 1, 2)])
def test_boxes_tile_a_flat_range_in_order(shape: tuple[int, ...], start: int, stop: int) -> None:
    ids = torch.arange(torch.Size(shape).numel()).view(shape)
    pieces = [ids[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
              for off, size in boxes(shape, start, stop)]
    assert torch.equal(torch.cat(pieces), torch.arange(start, stop))
    assert len(pieces) <= 2 * (len(shape) - 1) + 1


# -- bad input: every rank raises, nothing changes ---------------------------------------------


def _unchanged(sharded: Any, opt: torch.optim.Optimizer, before: tuple[Any, Any]) -> bool:
    full, optim = before
    now = sharded.full_state_dict()
    state = opt.state_dict()["state"]
    return all(torch.equal(now[k], v) for k, v in full.items()) and all(
        torch.equal(state[i][k], v) for i, s in optim.items() for k, v in s.items())


def _snapshot(sharded: Any, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    return sharded.full_state_dict(), {i: {k: v.clone() for k, v in s.items()}
                                       for i, s in opt.state_dict()["state"].items()}


def bad_input_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    sharded, opt = _build("block")
    _step(sharded, opt, _batches(1)[0])
    good = os.path.join(root, "good")
    _save(sharded, opt, good)
    before = _snapshot(sharded, opt)
    errors: dict[str, str] = {}
    unchanged: dict[str, bool] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            errors[name] = ""
        except BaseException as e:  # DCP raises CheckpointException, a BaseException
            errors[name] = f"{type(e).__name__}: {e}"
        unchanged[name] = _unchanged(sharded, opt, before)

    def wrong_model() -> None:  # names and shapes differ: another width, one more layer
        torch.manual_seed(0)
        other = fxshard.compile(TinyGPT(dim=16, layers=3), policy=by_class(Block))
        o2 = torch.optim.AdamW(other.parameters())
        msd, osd = fxshard.get_state_dict(other, o2)
        fxshard.set_state_dict(sharded, opt, model_state_dict=msd, optim_state_dict=osd)

    def one_rank_missing_a_key() -> None:
        msd, osd = fxshard.get_state_dict(sharded, opt)
        if rank == 1:
            del msd["blocks.1.mlp.0.weight"]
        fxshard.set_state_dict(sharded, opt, model_state_dict=msd, optim_state_dict=osd)

    def missing_optimizer_state() -> None:
        msd, osd = fxshard.get_state_dict(sharded, opt)
        msd["pos.weight"] = msd["pos.weight"]  # the model half is fine
        del osd["state"]["blocks.0.attn.qkv.weight"]
        fxshard.set_state_dict(sharded, opt, model_state_dict=msd, optim_state_dict=osd)

    def mixed_dtypes() -> None:
        full = sharded.full_state_dict()
        full["ln_f.weight"] = full["ln_f.weight"].to(torch.bfloat16)
        fxshard.set_model_state_dict(sharded, full)

    def truncated_file() -> None:
        broken = os.path.join(root, "broken")
        if rank == 0:
            shutil.copytree(good, broken)
            shard = sorted(Path(broken).glob("*.distcp"))[-1]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        dist.barrier()
        _load(sharded, opt, broken)

    def truncated_file_by_fxshard_load() -> None:
        fxshard.checkpoint.load(os.path.join(root, "broken"), sharded, opt)

    def checkpoint_of_another_model() -> None:
        other_dir = os.path.join(root, "other")
        torch.manual_seed(0)
        other = fxshard.compile(TinyGPT(dim=16), policy=by_class(Block))
        _save(other, torch.optim.AdamW(other.parameters()), other_dir)
        _load(sharded, opt, other_dir)

    def listed_by_fxshard_load() -> None:
        fxshard.checkpoint.load(os.path.join(root, "other"), sharded, opt)

    def save_that_fails_on_one_rank() -> None:
        atomic = os.path.join(root, "atomic")
        fxshard.checkpoint.save(atomic, sharded, opt)
        _step(sharded, opt, _batches(2)[1])  # new state, which the failed save must not leave
        write = dcp.FileSystemWriter.write_data

        def fail(self: Any, plan: Any, planner: Any) -> Any:
            if rank == 1:
                raise OSError("disk full (simulated)")
            return write(self, plan, planner)

        dcp.FileSystemWriter.write_data = fail  # type: ignore[method-assign]
        try:
            fxshard.checkpoint.save(atomic, sharded, opt)
        finally:
            dcp.FileSystemWriter.write_data = write  # type: ignore[method-assign]

    def load_after_failed_save() -> None:
        fxshard.checkpoint.load(os.path.join(root, "atomic"), sharded, opt)  # the first save's state
        raise RuntimeError("loaded")  # to record the state after it

    for name, fn in [("wrong_model", wrong_model), ("one_rank_missing_a_key", one_rank_missing_a_key),
                     ("missing_optimizer_state", missing_optimizer_state), ("mixed_dtypes", mixed_dtypes),
                     ("truncated_file", truncated_file),
                     ("truncated_file_by_fxshard_load", truncated_file_by_fxshard_load),
                     ("checkpoint_of_another_model", checkpoint_of_another_model),
                     ("listed_by_fxshard_load", listed_by_fxshard_load)]:
        attempt(name, fn)
    attempt("save_that_fails_on_one_rank", save_that_fails_on_one_rank)
    attempt("load_after_failed_save", load_after_failed_save)  # unchanged: the state of `good`
    fxshard.checkpoint.load(good, sharded, opt)  # still loads after all that
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"errors": errors, "unchanged": unchanged, "after": _unchanged(sharded, opt, before),
            "full_model": fxshard.get_model_state_dict(sharded, options=full),
            "full_optim": fxshard.get_optimizer_state_dict(sharded, opt, options=full),
            "expected": before[0],
            # In the same spawn, to spare the suite two more:
            "async": async_worker(rank, world_size, os.path.join(root, "async")),
            "safetensors": safetensors_worker(rank, world_size, os.path.join(root, "hf"))}


def _pretrained() -> nn.Module:
    torch.manual_seed(3)
    return TinyGPT()


def bad_input_results() -> list[dict[str, Any]]:
    return _saved()["bad_input"]  # save_worker's spawn ran it


BAD = {
    "wrong_model": r"StateDictError: .*nothing was changed.*'blocks.0.attn.qkv.weight': shape \(48, 16\) where "
                   r"the model has \(96, 32\).*unexpected keys \(not in this model\): \['blocks.2",
    "one_rank_missing_a_key": r"StateDictError: .*rank 1: missing parameter 'blocks.1.mlp.0.weight'",
    "missing_optimizer_state": r"StateDictError: loading the optimizer state.*missing optimizer state for "
                               r"parameter 'blocks.0.attn.qkv.weight'",
    "mixed_dtypes": r"StateDictError: .*'ln_f.weight': dtype torch.bfloat16 where the model's shards are torch.float32",
    "truncated_file": r"CheckpointException",
    "truncated_file_by_fxshard_load": r"StateDictError: loading checkpoint .*broken: reading it failed, "
                                      r"nothing was changed:.*rank 1: .*corrupted",
    "checkpoint_of_another_model": r"CheckpointException.*Size mismatch",
    "listed_by_fxshard_load": r"StateDictError: loading checkpoint .*nothing was changed.*"
                              r"model.tok.weight: shape \(61, 16\) in the checkpoint, \(61, 32\) in the model.*"
                              r"model.pos.weight: shape \(16, 16\) in the checkpoint, \(16, 32\)",
    "save_that_fails_on_one_rank": r"StateDictError: saving checkpoint .*atomic: writing it failed, .*atomic "
                                   r"is unchanged:\n  rank 1: OSError: disk full \(simulated\)",
    "load_after_failed_save": r"RuntimeError: loaded",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_on_every_rank_and_changes_nothing(name: str) -> None:
    for r in bad_input_results():
        assert r["errors"][name], f"{name}: no error"
        assert re.search(BAD[name], r["errors"][name], re.DOTALL), r["errors"][name]
        # The failing save's test trains a step first; load_after_failed_save then checks
        # that the checkpoint the failed save would have replaced still holds the old state.
        assert r["unchanged"][name] or name == "save_that_fails_on_one_rank", \
            f"{name}: the model or optimizer changed"
        assert r["after"]


_RSS_SCRIPT = """
import sys, torch
import torch.distributed.checkpoint as dcp
from fxshard.consolidate import consolidate
dcp.FileSystemReader(sys.argv[1]).read_metadata()
with open("/proc/self/status") as f:
    before = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
with open("/proc/self/clear_refs", "w") as f:  # the peak from here on, not the imports'
    f.write("5")
consolidate(sys.argv[1], sys.argv[2], format="safetensors")
with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) - before)
"""


def test_consolidate_streams_one_tensor_at_a_time(tmp_path: Path) -> None:
    import subprocess
    import sys

    # 32 tensors of 4 MiB: the consolidation's peak grows with the largest tensor (DCP reads
    # an item whole, then copies it into place: a few of them), not with the 128 MiB of all.
    state = {f"layer{i}.weight": torch.full((1024, 1024), float(i)) for i in range(32)}
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    del state
    done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(ckpt), str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    growth = int(done.stdout.split()[-1])
    assert growth < 32 * 1024 * 1024 * 4 / 3, growth
    from safetensors.torch import load_file

    out = load_file(tmp_path / "out")
    assert all(torch.equal(out[f"layer{i}.weight"], torch.full((1024, 1024), float(i))) for i in range(32))


# -- pretrained safetensors into a meta-built model ------------------------------------------------


def _write_hf_style(model: nn.Module, directory: Path) -> None:
    """Two shard files, the tied output embedding saved once (as Hugging Face does)."""
    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = sorted(state)
    directory.mkdir()
    save_file({k: state[k] for k in names[::2]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(directory / "model-00002-of-00002.safetensors"))


def safetensors_worker(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    import safetensors

    read = [0]
    opened = safetensors.safe_open

    class Counting:  # counts the elements this rank reads
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = opened(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def get_slice(self, name: str) -> Any:
            inner = self.inner.get_slice(name)

            class Slice:
                def get_shape(self) -> Any:
                    return inner.get_shape()

                def __getitem__(self, index: Any) -> torch.Tensor:
                    piece = inner[index]
                    read[0] += piece.numel()
                    return piece

            return Slice()

    safetensors.safe_open = Counting  # type: ignore[misc,assignment]
    with torch.device("meta"):
        model = TinyGPT()
    sharded = fxshard.compile(model, policy=by_class(Block))
    result = fxshard.checkpoint.load_safetensors(sharded, directory)
    return {"full": sharded.full_state_dict(), "read": read[0], "missing": result.missing_keys,
            "shard_numel": sum(s.numel() for s in sharded.parameters())}


def test_pretrained_safetensors_load_into_a_meta_model_reading_only_this_ranks_pieces() -> None:
    reference = _pretrained()
    results = [r["safetensors"] for r in bad_input_results()]
    total = sum(p.numel() for p in reference.parameters())
    for r in results:
        _assert_equal_state(r["full"], reference.state_dict())
        assert r["missing"] == []
        assert 0 < r["read"] <= r["shard_numel"] < total  # its own pieces, never a whole tensor set
    assert sum(r["read"] for r in results) == total


def test_pretrained_safetensors_of_another_model_are_refused_by_name(tmp_path: Path) -> None:
    _write_hf_style(TinyGPT(dim=16), tmp_path / "hf")
    sharded = fxshard.compile(TinyGPT(), policy=by_class(Block))
    before = sharded.full_state_dict()
    with pytest.raises(fxshard.checkpoint.StateDictError,
                       match=r"(?s)'pos.weight': shape \(16, 16\) in the file, \(16, 32\) in the model"):
        fxshard.checkpoint.load_safetensors(sharded, tmp_path / "hf")
    _assert_equal_state(sharded.full_state_dict(), before)
    with pytest.raises(fxshard.FxShardError, match="does not exist"):
        fxshard.checkpoint.load_safetensors(sharded, tmp_path / "nothing")


# -- a save killed on one rank ---------------------------------------------------------------------


def killed_save_worker(rank: int, world_size: int, path: str) -> None:
    sharded, opt = _build("block")
    _step(sharded, opt, _batches(1)[0])
    fxshard.checkpoint.save(path, sharded, opt)
    torch.save(sharded.full_state_dict(), f"{path}-expected-{rank}.pt")
    _step(sharded, opt, _batches(2)[1])
    write = dcp.FileSystemWriter.write_data

    def die(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 1:
            os._exit(1)  # the process is killed mid-save
        return write(self, plan, planner)

    dcp.FileSystemWriter.write_data = die  # type: ignore[method-assign]
    fxshard.checkpoint.save(path, sharded, opt)


def load_worker(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    sharded, opt = _build("size_zero2", seed=1)
    fxshard.checkpoint.load(path, sharded, opt)
    return sharded.full_state_dict()


def test_a_save_killed_on_one_rank_leaves_the_previous_checkpoint_loadable() -> None:
    assert runs()["killed_partial"]  # the killed save's files, never renamed into place
    _assert_equal_state(runs()[2]["killed"], runs()["killed_expected"])


def async_worker(rank: int, world_size: int, path: str) -> bool:
    sharded, opt = _build("block")
    _step(sharded, opt, _batches(1)[0])
    msd, osd = fxshard.get_state_dict(sharded, opt)  # copies: nothing left to stage
    # A group of its own: the save's collectives run on a thread while training's run here.
    future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path,
                            storage_writer=fxshard.checkpoint.ChecksumWriter(path),
                            async_stager=fxshard.checkpoint.StagedCopies(),
                            process_group=dist.new_group(backend="gloo"))
    saved = sharded.full_state_dict()
    _step(sharded, opt, _batches(2)[1])  # training goes on while the checkpoint is written
    future.result()
    other, other_opt = _build("block", seed=1)
    fxshard.checkpoint.load(path, other, other_opt)
    loaded = other.full_state_dict()
    checked = fxshard.checkpoint.verify(path)  # the writer recorded checksums from its thread
    return checked and all(torch.equal(loaded[k], v) for k, v in saved.items())


@pytest.mark.release  # a DCP round trip: async_save with fxshard's stager, then load
def test_async_save_with_fxshards_copies() -> None:
    # DCP's default stager cannot copy a ShardedTensor (it asks for data_ptr); the values are
    # copies already, so StagedCopies hands them over as they are.
    assert [r["async"] for r in bad_input_results()] == [True, True]


@pytest.mark.release  # torch.distributed.checkpoint.state_dict's options
def test_full_state_dicts_offloaded_to_rank0() -> None:
    rank0, rank1 = bad_input_results()
    assert rank1["full_model"] == {} and rank1["full_optim"] == {}  # torch's cpu_offload: rank 0 only
    _assert_equal_state(rank0["full_model"], rank0["expected"])
    state = rank0["full_optim"]["state"]
    assert state["blocks.0.attn.qkv.weight"]["exp_avg"].shape == (96, 32)
    assert state["tok.weight"]["exp_avg"].device.type == "cpu"


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_consolidate_of_a_damaged_checkpoint_is_one_error_line_and_writes_nothing(
        fmt: str, tmp_path: Path, capsys: Any) -> None:
    """Truncated .distcp files: one `error:` line, rc 2, and no output file, whole or partial
    (safetensors had written its header and part of the data)."""
    from fxshard.cli import main

    damaged = tmp_path / "ckpt"
    shutil.copytree(os.path.join(runs()["root"], "ckpt2"), damaged)
    for data in damaged.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:64])
    out = tmp_path / f"model.{fmt}"
    assert main(["consolidate", str(damaged), str(out), "--format", fmt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxshard consolidate: error:") and "cannot read" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_empty_groups_of_several_optimizers_reload_each_its_own_hyperparameters() -> None:
    """The saved param_groups are the optimizers' one after the other: the second optimizer's
    empty group took the first one's twin (weight_decay 0.5 for 0.7). The Hugging Face
    Trainer's groups: the same but for weight_decay, the one without decay empty where the
    model has no vectors (over flat shards, groups that differ otherwise with one empty are
    refused at the step: tests/test_orig_params.py)."""
    torch.manual_seed(0)
    sharded = fxshard.compile(nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)),
                              policy=by_class(nn.Linear))
    first, second = list(sharded.parameters())[:2]

    def optimizers(decays: tuple[float, float]) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW([{"params": [p]}, {"params": [], "weight_decay": wd}])
                for p, wd in zip((first, second), decays)]

    opts = optimizers((0.5, 0.7))
    sharded(torch.randn(2, 4)).sum().backward()
    for opt in opts:
        opt.step()
    saved = fxshard.get_optimizer_state_dict(sharded, opts, options=StateDictOptions(full_state_dict=True))
    fresh = optimizers((0.1, 0.1))
    fxshard.set_optimizer_state_dict(sharded, fresh, saved)
    assert [o.param_groups[1]["weight_decay"] for o in fresh] == [0.5, 0.7]
    one = [torch.optim.AdamW([{"params": [first, second]}, {"params": [], "lr": 0.1}, {"params": [], "lr": 0.1}])]
    with pytest.raises(fxshard.FxShardError, match="param_group 2 holds no parameter.* at its position "
                                                     "\\(2\\), which holds parameters"):
        fxshard.set_optimizer_state_dict(sharded, one, saved)


class _Calibrated(nn.Module):
    """A module with extra state (as Transformer Engine keeps its FP8 scales)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calibration = {"scale": 1.0, "seen": 0}

    def get_extra_state(self) -> Any:
        return dict(self.calibration)

    def set_extra_state(self, state: Any) -> None:
        self.calibration = dict(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_a_modules_extra_state_is_saved_and_loaded_with_the_sharded_state(tmp_path: Path) -> None:
    """nn.Module.state_dict holds get_extra_state's value under "<module>._extra_state"; the
    sharded state dict and fxshard.checkpoint dropped it."""
    from fxshard.checkpoint import load, save

    sharded = fxshard.compile(nn.Sequential(_Calibrated(), nn.Linear(4, 2)), policy=by_class(nn.Linear))
    skeleton = sharded._skeleton[0]
    skeleton.calibration = {"scale": 0.25, "seen": 7}
    saved = fxshard.get_model_state_dict(sharded)
    assert saved["0._extra_state"] == {"scale": 0.25, "seen": 7}
    save(tmp_path / "ckpt", sharded)
    skeleton.calibration = {"scale": 1.0, "seen": 0}
    load(tmp_path / "ckpt", sharded)
    assert skeleton.calibration == {"scale": 0.25, "seen": 7}
    skeleton.calibration = {}
    fxshard.set_model_state_dict(sharded, saved)
    assert skeleton.calibration == {"scale": 0.25, "seen": 7}
    with pytest.raises(fxshard.FxShardError, match="missing extra state '0._extra_state'"):
        fxshard.set_model_state_dict(sharded, {k: v for k, v in saved.items() if k != "0._extra_state"})


def test_loading_an_optimizer_from_a_model_only_checkpoint_names_what_is_missing(tmp_path: Path) -> None:
    """An optimizer without per-parameter state (SGD without momentum) has only hyperparameters
    to load: they are named as missing, not blamed on a corrupted file."""
    from fxshard.checkpoint import load, save

    sharded = fxshard.compile(nn.Sequential(nn.Linear(4, 4)))
    save(tmp_path / "ckpt", sharded)
    with pytest.raises(fxshard.FxShardError, match="optim.param_groups.0.lr: not in the checkpoint") as e:
        load(tmp_path / "ckpt", sharded, torch.optim.SGD(sharded.parameters(), lr=0.1))
    assert "corrupted" not in str(e.value)


def test_consolidating_the_optimizer_of_a_model_only_checkpoint_writes_nothing(tmp_path: Path) -> None:
    from fxshard.checkpoint import save
    from fxshard.consolidate import consolidate

    sharded = fxshard.compile(nn.Sequential(nn.Linear(4, 4)))
    save(tmp_path / "ckpt", sharded)
    with pytest.raises(fxshard.FxShardError, match="has no optimizer state .* leave out --optimizer"):
        consolidate(tmp_path / "ckpt", tmp_path / "model.pt", optimizer=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_cpu_offload_of_sharded_values_is_refused_not_ignored() -> None:
    """torch's cpu_offload moves sharded values too; fxshard's stayed on the device, silently."""
    sharded = fxshard.compile(nn.Sequential(nn.Linear(4, 4)))
    opt = torch.optim.AdamW(sharded.parameters())
    offload = StateDictOptions(cpu_offload=True)
    with pytest.raises(fxshard.FxShardError, match="cpu_offload=True\\) without full_state_dict=True"):
        fxshard.get_model_state_dict(sharded, options=offload)
    with pytest.raises(fxshard.FxShardError, match="cpu_offload=True\\) without full_state_dict=True"):
        fxshard.get_optimizer_state_dict(sharded, opt, options=offload)


def test_an_optimizer_with_an_empty_group_reloads_its_own_state() -> None:
    """The Hugging Face Trainer builds a group that may hold no parameter (no decay, for a model
    without biases or norms): its saved twin (by position) gives its hyperparameters back, and
    the other groups load as always."""
    torch.manual_seed(0)
    sharded = fxshard.compile(nn.Sequential(nn.Linear(4, 4, bias=False)))
    opt = torch.optim.AdamW([{"params": list(sharded.parameters())}, {"params": [], "weight_decay": 0.5}])
    sharded(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = fxshard.get_optimizer_state_dict(sharded, opt, options=StateDictOptions(full_state_dict=True))
    fresh = torch.optim.AdamW([{"params": list(sharded.parameters())}, {"params": [], "weight_decay": 0.1}])
    fxshard.set_optimizer_state_dict(sharded, fresh, saved)
    assert fresh.param_groups[1]["weight_decay"] == 0.5
    shard = next(iter(sharded.parameters()))
    assert torch.equal(fresh.state[shard]["exp_avg"], opt.state[shard]["exp_avg"])


class _CountingSGD(torch.optim.SGD):
    """SGD that also counts its steps per parameter in a plain int, as optimizers written
    before torch kept ``step`` in a tensor do: DCP stores it as bytes, not as a tensor."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return super().step(closure)


def test_consolidate_keeps_optimizer_state_that_is_not_a_tensor(tmp_path: Path) -> None:
    from fxshard.checkpoint import save
    from fxshard.consolidate import consolidate

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4))
    sharded = fxshard.compile(copy.deepcopy(plain))
    opt = _CountingSGD(sharded.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        sharded(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    save(tmp_path / "ckpt", sharded, opt)
    consolidate(tmp_path / "ckpt", tmp_path / "model.pt", optimizer=True)
    optim = torch.load(tmp_path / "model.pt.optim", weights_only=True)
    assert {name: state["count"] for name, state in optim["state"].items()} == {"0.weight": 3, "0.bias": 3}
    assert optim["state"]["0.weight"]["momentum_buffer"].shape == (4, 4)
    assert optim["param_groups"][0]["momentum"] == 0.9


def test_the_original_modules_own_state_dict_and_load_are_refused_after_compile() -> None:
    """FSDP2 shards the model in place, so ``model.state_dict()`` is its habit. After
    fxshard.compile the original module's parameters are stand-ins on the meta device: its
    state_dict() saved them (failing only when loaded), and load_state_dict() loaded into
    them and left the shards as they were. Both raise, naming the sharded module's; the
    sharded module's own state dicts, which run the module's with its parameters in place,
    still work."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    with pytest.raises(fxshard.FxShardError, match=r"state_dict\(\) would return fxshard's stand-ins for 0.weight.*"
                                                   r"Use sharded.state_dict\(\)"):
        model.state_dict()
    with pytest.raises(fxshard.FxShardError, match=r"stand-ins for weight"):
        model[2].state_dict()  # one layer's too
    with pytest.raises(fxshard.FxShardError, match=r"would load 0.weight into fxshard's stand-ins.*"
                                                   r"Use sharded.load_state_dict\(state_dict\)"):
        model.load_state_dict(reference)
    state = sharded.state_dict()
    assert state.keys() == reference.keys() and all(torch.equal(state[k], v) for k, v in reference.items())
    zeros = {k: torch.zeros_like(v) for k, v in reference.items()}
    sharded.load_state_dict(zeros)
    assert all(torch.equal(v, zeros[k]) for k, v in sharded.state_dict().items())
