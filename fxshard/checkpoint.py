"""State dicts for ``torch.distributed.checkpoint``, with torch's names and signatures.

``get_state_dict`` / ``set_state_dict`` (and their model and optimizer halves)
mirror ``torch.distributed.checkpoint.state_dict`` and take its
``StateDictOptions``; they work on a ``ShardedModule`` and on a model compiled
with the fxshard backend. The default is sharded: every rank holds only its
pieces (``fxshard.driver.state``), which DCP saves in parallel and loads at any
world size or policy::

    msd, osd = fxshard.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    ...
    msd, osd = fxshard.get_state_dict(model, opt)          # the layout to load into
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    fxshard.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

``StateDictOptions(full_state_dict=True)`` gives full tensors (a collective),
with ``cpu_offload=True`` on rank 0 only, as torch does.

``save(path, model, optimizers)`` and ``load(path, model, optimizers)`` do the
above with guarantees plain DCP calls lack: a save is atomic (written next to
``path``, renamed into place when every rank is done, so a crash leaves the
previous checkpoint at ``path`` whole) and stores rank 0's copy of rank-local
buffers (DCP by default keeps any one rank's); a load compares the
checkpoint's names, shapes and dtypes with the model's first and lists every
difference, on every rank, before anything is read.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fxshard.backend import sharding_of
from fxshard.driver import state
from fxshard.driver.runtime import slot_overlap
from fxshard.driver.state import StateDictError
from fxshard.ir.compat import IncompatibleKeys as _IncompatibleKeys
from fxshard.ir.compat import flatten_state_dict
from fxshard.ir.errors import FxShardError

__all__ = [
    "StateDictError",
    "StateDictOptions",
    "StagedCopies",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "load",
    "load_safetensors",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

# torch's FutureWarning whenever DCP's load planner reads a ShardedTensor's ``size()`` or
# ``device`` (``torch.distributed._shard._utils.DEPRECATE_MSG``).
_SHARDED_TENSOR_DEPRECATED = "^" + re.escape("Please use DTensor instead and we are deprecating ShardedTensor.") + "$"

_UNSUPPORTED = ("ignore_frozen_params", "broadcast_from_rank0", "flatten_optimizer_state_dict")


def _options(options: StateDictOptions | None) -> StateDictOptions:
    options = options or StateDictOptions()
    for name in _UNSUPPORTED:
        if getattr(options, name, False):
            raise FxShardError(f"StateDictOptions({name}=True) is not supported by fxshard yet")
    return options


def _optimizers(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _offload(values: dict[str, Any], options: StateDictOptions, rank: int) -> dict[str, Any]:
    """Full values on the CPU, on rank 0 only (torch's ``cpu_offload`` with ``full_state_dict``)."""
    if not options.cpu_offload:
        return values
    if rank != 0:
        return {}

    def cpu(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.cpu()
        if isinstance(v, dict):
            return {k: cpu(x) for k, x in v.items()}
        if isinstance(v, list):
            return [cpu(x) for x in v]
        return v

    return cpu(values)


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict under its original names: sharded values by default."""
    options = _options(options)
    module, driver = sharding_of(model)
    if options.full_state_dict:
        return _offload(state.full_model_state(module, driver), options, driver.world.rank)
    return state.model_state(module, driver)


def get_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state keyed by the model's parameter names (torch's format)."""
    options = _options(options)
    _, driver = sharding_of(model)
    result = state.optimizer_state(driver, _optimizers(optimizers), full=options.full_state_dict)
    return _offload(result, options, driver.world.rank) if options.full_state_dict else result


def get_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                   *, options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optim_state_dict)``, as ``torch.distributed.checkpoint.state_dict``."""
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Load sharded or full values into this rank's shards. Every rank checks names,
    shapes and dtypes first; on any problem every rank raises and nothing changes."""
    options = _options(options)
    module, driver = sharding_of(model)
    return state.load_model_state(module, driver, model_state_dict, strict=options.strict)


def set_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load the optimizers' state (sharded or full values); checked on every rank first."""
    _options(options)
    _, driver = sharding_of(model)
    state.load_optimizer_state(driver, _optimizers(optimizers), optim_state_dict)


def set_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *,
                   model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any],
                   options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Load both halves. Both are checked before either changes anything."""
    options = _options(options)
    module, driver = sharding_of(model)
    opts = _optimizers(optimizers)
    model_load = state.prepare_model_state(module, driver, model_state_dict, strict=options.strict)
    optimizer_load = state.prepare_optimizer_state(driver, opts, optim_state_dict)
    state.commit_optimizer_state(optimizer_load)
    return state.commit_model_state(model_load)


# -- save and load with DCP ----------------------------------------------------------------------


class StagedCopies:
    """``dcp.async_save(..., async_stager=fxshard.checkpoint.StagedCopies(),
    process_group=dist.new_group(backend="gloo"))``: the values of fxshard's state dicts are
    copies already, so there is nothing to stage (DCP's default stager cannot copy a
    ShardedTensor) and training may go on while they are written. The save needs a process
    group of its own: its collectives run on a thread while training's run on the main one."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass



def _barrier(model: nn.Module) -> None:
    world = sharding_of(model)[1].world
    if world.group is not None and world.size > 1:
        dist.barrier(group=world.group)


def save(path: str | os.PathLike[str], model: nn.Module,
         optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
         extra: dict[str, Any] | None = None) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optimizers``) with DCP, atomically.

    Every rank writes its own pieces into ``PATH.partial``; once all are done,
    rank 0 renames it to ``path`` (a previous checkpoint there is replaced only
    then). ``extra`` (the step, a data loader's position: anything JSON can hold,
    rank 0's) is saved with it and returned by :func:`load`. Buffers, which are
    each rank's own unless ``broadcast_buffers=True``, are saved from rank 0, as
    the usual ``torch.save(model.state_dict())`` on rank 0 would. A collective: every
    rank calls it.
    """
    _, driver = sharding_of(model)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    if driver.world.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
    _barrier(model)
    msd, osd = get_state_dict(model, optimizers)
    content: dict[str, Any] = {"model": msd, "optim": osd}
    if extra is not None:
        content["extra"] = io.BytesIO(json.dumps(extra).encode())  # DCP stores it as bytes
    # Buffers are rank-local and `extra` is per rank, but DCP takes values every rank holds
    # whole for replicas and keeps one copy, by default from the rank with the fewest bytes
    # planned so far: rank 0's is the copy a state_dict() saved on rank 0 or DDP's broadcast
    # would give.
    dcp.save(content, checkpoint_id=str(partial), process_group=driver.world.group,
             planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    _barrier(model)  # every rank's files are written (DCP writes .metadata last, on rank 0)
    if driver.world.rank == 0:
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        partial.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(model)


def _differences(expected: dict[str, Any], path: Path) -> list[str]:
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read it is the same answer
        return [f"{path} is not a readable DCP checkpoint ({type(e).__name__}: {e})"]
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(expected)
    problems = []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        md = saved.get(key)
        if md is None:
            problems.append(f"{key}: not in the checkpoint")
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: the checkpoint holds a non-tensor there")
            continue
        shape, dtype = state.value_shape(value), state.value_dtype(value)
        if tuple(md.size) != shape:
            problems.append(f"{key}: shape {tuple(md.size)} in the checkpoint, {shape} in the model")
        elif md.properties.dtype != dtype:
            problems.append(f"{key}: dtype {md.properties.dtype} in the checkpoint, {dtype} in the model")
    extra = sorted(k for k, md in saved.items() if isinstance(md, TensorStorageMetadata) and k not in flat)
    if extra:
        problems.append(f"in the checkpoint but not in the model: {extra}")
    return problems


def _last_line(failure: Any) -> str:
    """What went wrong on one rank, from DCP's (exception, traceback) pair."""
    error = failure[0] if isinstance(failure, tuple) else failure
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def load(path: str | os.PathLike[str], model: nn.Module,
         optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = ()) -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save` (or by ``dcp.save`` of ``get_state_dict``'s
    values under "model" and "optim"), at any world size or policy.

    Every rank first compares the checkpoint's names, shapes and dtypes with the
    model's and raises a ``StateDictError`` listing all differences; the values
    are read into copies, so a read that fails (a truncated file) changes nothing.
    Returns the ``extra`` saved with it (None if none was).
    """
    _, driver = sharding_of(model)
    opts = _optimizers(optimizers)
    msd, osd = get_state_dict(model, opts)
    requested: dict[str, Any] = {"model": msd, "optim": osd} if opts else {"model": msd}
    state.agree_on(_differences(requested, Path(path)), driver, f"loading checkpoint {path}")
    has_extra = "extra" in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if has_extra:
        requested["extra"] = io.BytesIO()
    try:
        with warnings.catch_warnings():
            # A warning per value, about torch's own reads of fxshard's ShardedTensors
            # (docs/checkpoints.md, "Why not DTensor"): nothing the user can act on.
            warnings.filterwarnings("ignore", message=_SHARDED_TENSOR_DEPRECATED, category=FutureWarning)
            dcp.load(requested, checkpoint_id=str(path), process_group=driver.world.group)
    except CheckpointException as e:  # a BaseException: turned into an error callers catch
        failures = "\n  ".join(f"rank {r}: {_last_line(f)}" for r, f in sorted(e.failures.items()))
        raise StateDictError(
            f"loading checkpoint {path}: reading it failed, nothing was changed:\n  {failures}\n"
            "A file of the checkpoint is truncated or corrupted: load an earlier checkpoint."
        ) from e
    if opts:
        set_state_dict(model, opts, model_state_dict=msd, optim_state_dict=osd)
    else:
        set_model_state_dict(model, msd)
    return json.loads(requested["extra"].getvalue()) if has_extra else None


# -- pretrained weights -------------------------------------------------------------------------


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FxShardError(f"{path} holds no *.safetensors files")
        return files
    if not path.exists():
        raise FxShardError(f"{path} does not exist: pass a .safetensors file or a directory of them")
    return [path]


def load_safetensors(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True) -> _IncompatibleKeys:
    """Load pretrained weights from a ``.safetensors`` file, or a directory of shards (a Hugging
    Face checkpoint), reading only this rank's pieces of each parameter.

    For a model built on the meta device and sharded by ``fxshard.compile`` (or
    ``fxshard.parameters``): no rank ever holds more than its shards and one
    piece being read. Names are the module's; a tied parameter may appear under
    any of its names (Hugging Face saves one). Values are cast to the shards'
    dtype, as ``load_state_dict`` does. Names and shapes are checked on every rank
    before anything changes.
    """
    from safetensors import safe_open

    module, driver = sharding_of(model)
    files = _safetensors_files(Path(path))
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    problems: list[str] = []
    plan, rank = driver.plan, driver.world.rank
    reads: list[tuple[int, int, int, str, list[state.Box]]] = []  # group, start in shard, slot, name, boxes
    expected: set[str] = set()
    missing: list[str] = []
    for group in plan.groups:
        lo = group.shard_range(rank)[0]
        for i, slot in enumerate(group.params):
            expected.update(slot.names)
            name = next((n for n in slot.names if n in where), None)
            if name is None:
                missing.append(slot.name)
                if strict:
                    problems.append(f"missing parameter {slot.name!r}")
                continue
            shape = tuple(where[name].get_slice(name).get_shape())
            if shape != slot.shape:
                problems.append(f"{name!r}: shape {shape} in the file, {slot.shape} in the model")
                continue
            span = slot_overlap(group, slot.offset, slot.numel, rank)
            if span is not None:
                reads.append((group.index, span[0] - lo, i, name, state.owned_boxes(group, slot, rank)))
    buffers = state.persistent_buffers(module)
    expected.update(buffers)
    for name, buffer in buffers.items():
        if name in where and tuple(where[name].get_slice(name).get_shape()) != tuple(buffer.shape):
            problems.append(f"buffer {name!r}: shape {tuple(where[name].get_slice(name).get_shape())} "
                            f"in the file, {tuple(buffer.shape)} in the model")
        elif name not in where:
            missing.append(name)
            if strict:
                problems.append(f"missing buffer {name!r}")
    unexpected = sorted(n for n in where if n not in expected)
    if strict and unexpected:
        problems.append(f"in the file but not in the model: {unexpected}")
    state.agree_on(problems, driver, f"loading {path}")
    with torch.no_grad():
        for index, start, _, name, pieces in reads:
            shard = driver.shards[index]
            for offsets, sizes in pieces:
                piece = where[name].get_slice(name)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                n = piece.numel()
                shard[start:start + n].copy_(piece.reshape(-1))
                start += n
        for name, buffer in buffers.items():
            if name in where:
                buffer.copy_(where[name].get_tensor(name))
    return _IncompatibleKeys(sorted(missing), unexpected)
