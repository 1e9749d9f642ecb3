"""Never silent: a damaged checkpoint, ranks that read different sources, and save or load
called on some ranks only all raise on every rank, on real gloo ranks."""

from __future__ import annotations

import atexit
import math
import os
import re
import shutil
import tempfile
import time
from functools import cache, partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import fxshard
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import MLP, Block, TinyGPT

RANKS_START_METHOD = "spawn"  # ranks exit through interpreter teardown (tests/dist_utils.py)

RECORD = ".fxshard-checksums.json"
FULL = StateDictOptions(full_state_dict=True)


def _build(seed: int, **options: Any) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    sharded = fxshard.compile(TinyGPT(), policy=by_class(Block), **options)
    # An lr of its own: a load that kept the fresh optimizer's hyperparameters shows.
    return sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2 / (1 + seed))


def _snapshot(sharded: Any, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], Any]:
    return sharded.full_state_dict(), fxshard.get_optimizer_state_dict(sharded, opt, options=FULL)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _attempt(fn: Any) -> str:
    try:
        fn()
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}"
    return ""


def _flip(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


# -- damaged files ---------------------------------------------------------------------------------

FRACTIONS = (0.02, 0.3, 0.55, 0.8, 0.999)


def _flips(good: Path) -> list[tuple[str, int, bool]]:
    """(file, offset, read): several offsets of every rank's data file, and the metadata;
    whether a load reads the item there. A rank that holds none of a parameter saves an empty
    placeholder piece (fxshard.driver.state.state_dicts._pieces), which no load reads."""
    metadata = dcp.FileSystemReader(str(good)).read_metadata()
    cases = []
    for data in sorted(good.glob("*.distcp")):
        size = data.stat().st_size
        for offset in (int(size * f) for f in FRACTIONS):
            index = next(i for i, info in metadata.storage_data.items()
                         if info.relative_path == data.name and info.offset <= offset < info.offset + info.length)
            chunks = getattr(metadata.state_dict_metadata[index.fqn], "chunks", None)
            empty = chunks is not None and any(
                list(c.offsets) == list(index.offset or ()) and math.prod(c.sizes) == 0 for c in chunks)
            cases.append((data.name, offset, not empty))
    return cases + [(".metadata", (good / ".metadata").stat().st_size // 2, True)]


def _verify(path: Path) -> None:
    fxshard.checkpoint.verify(path)


def integrity_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    sharded, opt = _build(0)
    good = Path(root) / "good"
    fxshard.checkpoint.save(good, sharded, opt, extra={"step": 3})
    fresh, fresh_opt = _build(1)
    other_checkpoint = Path(root) / "other"
    fxshard.checkpoint.save(other_checkpoint, fresh, fresh_opt)
    before = _snapshot(fresh, fresh_opt)
    results = []
    for i, (name, offset, read) in enumerate(_flips(good) + [(RECORD, 40, True)]):
        damaged = Path(root) / f"flip{i}"
        if rank == 0:
            shutil.copytree(good, damaged)
            if (damaged / name).exists():
                _flip(damaged / name, offset, i % 8)
        dist.barrier()
        error = _attempt(partial(fxshard.checkpoint.load, damaged, fresh, fresh_opt))
        results.append({"file": name, "offset": offset, "read": read, "error": error,
                         "unchanged": _same(_snapshot(fresh, fresh_opt), before),
                         "as_saved": _same(_snapshot(fresh, fresh_opt), _snapshot(sharded, opt)),
                         "verify": _attempt(partial(_verify, damaged))})
        fxshard.checkpoint.load(other_checkpoint, fresh, fresh_opt)  # `before` again
    # A checkpoint written by plain dcp.save has no checksums: it loads as DCP loads it.
    plain = Path(root) / "plain"
    msd, osd = fxshard.get_state_dict(sharded, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(plain))
    fxshard.checkpoint.load(plain, fresh, fresh_opt)
    plain_loads = _same(fresh.full_state_dict(), sharded.full_state_dict())
    extra = fxshard.checkpoint.load(good, fresh, fresh_opt)  # the undamaged one still loads
    return {"flips": results, "plain_loads": plain_loads, "extra": extra,
            "loads": _same(_snapshot(fresh, fresh_opt), _snapshot(sharded, opt)),
            "record": (good / RECORD).exists(),
            # In the same spawn, to spare the suite one: its failed loads leave the group usable.
            "sources": sources_worker(rank, world_size, str(Path(root) / "sources"))}


@cache
def integrity_runs() -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="fxshard-integrity-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # the consolidation tests read `good`
    (Path(root) / "sources").mkdir()  # sources_worker's root, whose listing it checks
    return {"root": root, "ranks": run_ranks(integrity_worker, 2, root)}


def test_save_records_checksums_and_an_undamaged_checkpoint_loads() -> None:
    for r in integrity_runs()["ranks"]:
        assert r["record"] and r["loads"] and r["extra"] == {"step": 3}


def test_a_flipped_bit_in_what_a_load_reads_raises_on_every_rank_naming_the_file() -> None:
    """...and changes nothing: the model and the optimizer are as they were."""
    ranks = integrity_runs()["ranks"]
    for r in ranks:
        assert len(r["flips"]) == 2 * len(FRACTIONS) + 2
        assert sum(not case["read"] for case in r["flips"]) <= 2  # nearly every flip is in a read item
        for case in r["flips"]:
            error = case["error"]
            if not case["read"]:  # an empty placeholder piece: nothing reads it, nothing is wrong
                assert error == "" and case["as_saved"], case
                continue
            assert error.startswith("StateDictError: loading checkpoint"), case
            assert case["file"] in error, case  # the damaged file, by name
            assert "nothing was changed" in error, case
            assert case["unchanged"], case


def test_verify_finds_every_flipped_bit() -> None:
    for case in integrity_runs()["ranks"][0]["flips"]:
        assert case["verify"].startswith("ChecksumError: ") and case["file"] in case["verify"], case


def test_a_checkpoint_of_plain_dcp_save_has_no_checksums_and_loads() -> None:
    for r in integrity_runs()["ranks"]:
        assert r["plain_loads"]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("where", ["data", "metadata"])
def test_consolidate_of_a_flipped_bit_is_one_error_line_naming_the_file_and_writes_nothing(
        fmt: str, where: str, tmp_path: Path, capsys: Any) -> None:
    from fxshard.cli import main

    damaged = tmp_path / "ckpt"
    shutil.copytree(Path(integrity_runs()["root"]) / "good", damaged)
    name = sorted(damaged.glob("*.distcp"))[-1].name if where == "data" else ".metadata"
    size = (damaged / name).stat().st_size
    _flip(damaged / name, size // 2, 3)
    out = tmp_path / f"model.{fmt}"
    assert main(["consolidate", str(damaged), str(out), "--format", fmt, "--optimizer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxshard consolidate: error:"), err
    assert name in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- one source for every rank ---------------------------------------------------------------------


def sources_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    a, b, copy = (os.path.join(root, n) for n in ("a", "b", "copy-of-a"))
    source, source_opt = _build(0)
    fxshard.checkpoint.save(a, source, source_opt)
    other, other_opt = _build(1)
    fxshard.checkpoint.save(b, other, other_opt)
    if rank == 0:
        shutil.copytree(a, copy)
    dist.barrier()
    target, target_opt = _build(2)
    before = _snapshot(target, target_opt)
    errors: dict[str, str] = {}
    unchanged: dict[str, bool] = {}

    def attempt(name: str, fn: Any) -> None:
        errors[name] = _attempt(fn)
        unchanged[name] = _same(_snapshot(target, target_opt), before)

    attempt("different_checkpoints",
            lambda: fxshard.checkpoint.load(a if rank == 0 else b, target, target_opt))
    full_model = source.full_state_dict()
    full_optim = fxshard.get_optimizer_state_dict(source, source_opt, options=FULL)
    model_1 = {k: v + 1 if rank == 1 and k == "ln_f.weight" else v for k, v in full_model.items()}
    attempt("different_full_model_state_dicts", lambda: fxshard.set_model_state_dict(target, model_1))
    attempt("different_full_state_dicts_by_load_state_dict", lambda: target.load_state_dict(model_1))
    optim_1 = fxshard.get_optimizer_state_dict(source, source_opt, options=FULL)
    if rank == 1:
        optim_1["state"]["tok.weight"]["exp_avg"].add_(1.0)
    attempt("different_full_optimizer_state_dicts",
            lambda: fxshard.set_optimizer_state_dict(target, target_opt, optim_1))
    attempt("different_hyperparameters", lambda: fxshard.set_optimizer_state_dict(
        target, target_opt, {**full_optim, "param_groups": [
            {**g, "lr": g["lr"] * (rank + 1)} for g in full_optim["param_groups"]]}))
    attempt("saved_to_different_paths",
            lambda: fxshard.checkpoint.save(os.path.join(root, f"rank{rank}"), target, target_opt))
    # What must load: a copy of the same checkpoint at another path, the same full dicts.
    loads = {}
    for name, fn in [("a_copy_at_another_path", lambda: fxshard.checkpoint.load(a if rank == 0 else copy,
                                                                                target, target_opt)),
                     ("the_same_full_dicts", lambda: fxshard.set_state_dict(
                         target, target_opt, model_state_dict=full_model, optim_state_dict=full_optim))]:
        fxshard.checkpoint.load(b, target, target_opt)  # other values first
        error = _attempt(fn)
        loads[name] = error or _same(_snapshot(target, target_opt), _snapshot(source, source_opt))
    return {"errors": errors, "unchanged": unchanged, "loads": loads,
            "wrote": sorted(os.listdir(root))}


def sources_runs() -> list[dict[str, Any]]:
    return [r["sources"] for r in integrity_runs()["ranks"]]


DIFFERENT = {
    "different_checkpoints": r"loading checkpoint .*the ranks read different checkpoints.*rank 0: .*a "
                             r"\(metadata sha256 [0-9a-f]+\).*rank 1: .*b \(metadata sha256",
    "different_full_model_state_dicts": r"the ranks passed different state dicts.*rank 0: .*rank 1: ",
    "different_full_state_dicts_by_load_state_dict": r"the ranks passed different state dicts.*rank 0: .*rank 1: ",
    "different_full_optimizer_state_dicts": r"loading the optimizer state.*the ranks passed different "
                                            r"state dicts.*rank 0: .*rank 1: ",
    "different_hyperparameters": r"loading the optimizer state.*the ranks passed different state dicts",
    "saved_to_different_paths": r"saving checkpoint .*the ranks passed different paths.*rank 0: .*rank0.*"
                                r"rank 1: .*rank1",
}


@pytest.mark.parametrize("name", sorted(DIFFERENT))
def test_ranks_with_different_sources_raise_on_every_rank_and_change_nothing(name: str) -> None:
    for r in sources_runs():
        assert r["errors"][name].startswith("StateDictError: "), r["errors"][name]
        assert re.search(DIFFERENT[name], r["errors"][name], re.DOTALL), r["errors"][name]
        assert "nothing was changed" in r["errors"][name]
        assert r["unchanged"][name], name


@pytest.mark.parametrize("name", ["a_copy_at_another_path", "the_same_full_dicts"])
def test_the_same_source_on_every_rank_loads(name: str) -> None:
    for r in sources_runs():
        assert r["loads"][name] is True, r["loads"][name]


def test_saves_to_different_paths_write_nothing() -> None:
    for r in sources_runs():
        assert r["wrote"] == ["a", "b", "copy-of-a"]


# -- a collective called on some ranks only, a stalled writer: raise within the timeout ------------

TIMEOUT = 3.0


def _small(**options: Any) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), timeout=TIMEOUT, **options)
    return sharded, torch.optim.AdamW(sharded.parameters())


def one_rank_worker(rank: int, world_size: int, root: str, call: str) -> dict[str, Any]:
    sharded, opt = _small()
    path = os.path.join(root, "ckpt")
    if call == "load":
        fxshard.checkpoint.save(path, sharded, opt)
    start = time.monotonic()
    if rank == 0:
        if call == "save":
            error = _attempt(lambda: fxshard.checkpoint.save(path, sharded, opt))
        else:
            error = _attempt(lambda: fxshard.checkpoint.load(path, sharded, opt))
    else:
        error = _attempt(dist.barrier)  # ends when rank 0's process exits
    return {"error": error, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("call", [pytest.param("save", marks=pytest.mark.slow), "load"])
def test_save_or_load_on_one_rank_raises_a_clear_error_within_the_timeout(call: str) -> None:
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        r0, r1 = run_ranks(one_rank_worker, 2, root, call)
    assert r0["error"].startswith(f"StateDictError: fxshard.checkpoint.{call} is a collective: every "
                                  "rank must call it; rank 1 did not arrive within 3s"), r0
    assert TIMEOUT <= r0["seconds"] < TIMEOUT + 10, r0
    assert r1["error"] and r1["seconds"] < TIMEOUT + 20, r1  # the barrier ends: rank 0 exited
    assert time.monotonic() - start < 90  # both processes ended


def stalled_writer_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    sharded, opt = _small()
    path = os.path.join(root, "ckpt")
    fxshard.checkpoint.save(path, sharded, opt)
    write = dcp.FileSystemWriter.write_data

    def stall(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 1:
            time.sleep(3 * TIMEOUT)
        return write(self, plan, planner)

    dcp.FileSystemWriter.write_data = stall  # type: ignore[method-assign]
    start = time.monotonic()
    error = _attempt(lambda: fxshard.checkpoint.save(path, sharded, opt))
    return {"error": error, "seconds": time.monotonic() - start,
            "previous": sorted(os.listdir(path))}


def test_a_stalled_writer_raises_on_every_rank_within_the_timeout() -> None:
    with tempfile.TemporaryDirectory() as root:
        r0, r1 = run_ranks(stalled_writer_worker, 2, root)
    for r in (r0, r1):
        assert r["error"].startswith("StateDictError: saving checkpoint"), r
        assert "a peer is gone or stalled" in r["error"], r
        assert r["previous"] == sorted([RECORD, ".metadata", "__0_0.distcp", "__1_0.distcp"])
    assert r0["seconds"] < TIMEOUT + 5, r0  # rank 0 waits for the stalled rank 1 at most the timeout


# -- plain DCP calls with fxshard's writer and reader ----------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist: one process, as meant
def test_plain_dcp_with_checksums_refuses_a_flipped_bit_in_a_large_item(tmp_path: Path) -> None:
    """Items over 8 MiB are checked in chunks before DCP reads them (smaller ones: read once)."""
    values = {"large": torch.arange(3 << 20, dtype=torch.float32), "small": torch.ones(5)}
    path = tmp_path / "ckpt"
    dcp.save(values, storage_writer=fxshard.checkpoint.ChecksumWriter(path), no_dist=True)
    info = next(i for k, i in dcp.FileSystemReader(str(path)).read_metadata().storage_data.items()
                if k.fqn == "large")
    assert info.length > 8 << 20
    out = {k: torch.zeros_like(v) for k, v in values.items()}
    dcp.load(out, storage_reader=fxshard.checkpoint.ChecksumReader(path), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in values.items())
    _flip(path / info.relative_path, info.offset + info.length - 100, 5)
    with pytest.raises(BaseException, match=rf"ChecksumError: .*{info.relative_path}: bytes "
                                            rf"{info.offset}..{info.offset + info.length} have CRC-32"):
        dcp.load(out, storage_reader=fxshard.checkpoint.ChecksumReader(path), no_dist=True)
    with pytest.raises(fxshard.checkpoint.ChecksumError, match=info.relative_path):
        fxshard.checkpoint.verify(path)
