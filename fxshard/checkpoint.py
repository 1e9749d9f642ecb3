"""State dicts for ``torch.distributed.checkpoint``, with torch's names and signatures.

``get_state_dict`` / ``set_state_dict`` (and their model and optimizer halves)
mirror ``torch.distributed.checkpoint.state_dict`` and take its
``StateDictOptions``; they work on a ``ShardedModule`` and on a model compiled
with the fxshard backend. The default is sharded: every rank holds only its
pieces (``fxshard.driver.state.state_dicts``), which DCP saves in parallel and loads at any
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
previous checkpoint at ``path`` whole), stores rank 0's copy of rank-local
buffers (DCP by default keeps any one rank's) and a checksum of every item it
wrote; a load verifies every item before it is read, checks that every rank
reads the same checkpoint, and compares the checkpoint's names, shapes and
dtypes with the model's, listing every difference on every rank, before
anything changes. Both are collectives bounded by ``fxshard.compile``'s
``timeout``, and every failure is a ``StateDictError`` on every rank.

Checksums: :class:`ChecksumWriter` (a ``FileSystemWriter``) reads back each
item DCP wrote (one tensor piece or byte blob, a byte range of a ``.distcp``
file) and hands its CRC-32 to the coordinator with DCP's own write results;
the coordinator writes them, and the CRC-32 of ``.metadata``, to
``.fxshard-checksums.json`` beside it::

    rank r:  write_data -> __r_0.distcp, [(range, crc32)] --gather--> rank 0: finish
    rank 0:  .metadata, then .fxshard-checksums.json {file: [[offset, length, crc32]]}

:class:`ChecksumReader` checks each item before DCP parses it, so each rank
verifies exactly the bytes it reads. A checkpoint without the record
(plain ``dcp.save``) loads unverified, as DCP loads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fxshard.backend import sharding_of
from fxshard.driver.compile.compiler import Driver
from fxshard.driver.run.runtime import settle
from fxshard.driver.state import state_dicts as state
from fxshard.driver.state.state_dicts import Source, StateDictError
from fxshard.ir.compat import IncompatibleKeys as _IncompatibleKeys
from fxshard.ir.compat import flatten_state_dict
from fxshard.ir.errors import FxShardError

__all__ = [
    "CHECKSUMS",
    "ChecksumError",
    "ChecksumReader",
    "ChecksumWriter",
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
    "verify",
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
    from torch.distributed.optim import ZeroRedundancyOptimizer

    found = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if any(isinstance(o, ZeroRedundancyOptimizer) for o in found):
        raise FxShardError(
            "a ZeroRedundancyOptimizer's state lives on one rank per parameter, which this state "
            "dict cannot name: each rank would save or load only its own part. Save the model with "
            "fxshard.checkpoint (or get_model_state_dict) and the optimizer as torch documents it: "
            "optimizer.consolidate_state_dict(to=0), then optimizer.state_dict() on rank 0 "
            "(load_state_dict on every rank to resume)."
        )
    return found


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


def _for_get(options: StateDictOptions | None) -> StateDictOptions:
    options = _options(options)
    if options.cpu_offload and not options.full_state_dict:
        raise FxShardError(
            "StateDictOptions(cpu_offload=True) without full_state_dict=True is not supported by fxshard "
            "yet: the sharded values would stay where the shards are. Pass full_state_dict=True too (full "
            "values on rank 0's CPU), or save with fxshard.checkpoint.save, which writes the shards")
    return options


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict under its original names: sharded values by default."""
    options = _for_get(options)
    module, driver = sharding_of(model)
    if options.full_state_dict:
        return _offload(state.full_model_state(module, driver), options, driver.world.job_rank)
    return state.model_state(module, driver)


def get_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             *, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state keyed by the model's parameter names (torch's format)."""
    options = _for_get(options)
    _, driver = sharding_of(model)
    result = state.optimizer_state(driver, _optimizers(optimizers), full=options.full_state_dict)
    return _offload(result, options, driver.world.job_rank) if options.full_state_dict else result


def get_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                   *, options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optim_state_dict)``, as ``torch.distributed.checkpoint.state_dict``."""
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Load sharded or full values into this rank's shards. Every rank checks names,
    shapes and dtypes first, and that every rank passed the same full values (each keeps
    its own slice of them); on any problem every rank raises and nothing changes."""
    options = _options(options)
    module, driver = sharding_of(model)
    return state.load_model_state(module, driver, model_state_dict, strict=options.strict)


def set_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load the optimizers' state (sharded or full values); checked on every rank first,
    with the values that every rank must pass alike (full ones, scalars, hyperparameters)."""
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


# -- checksums -----------------------------------------------------------------------------------

CHECKSUMS = ".fxshard-checksums.json"  # beside DCP's .metadata: whoever copies one copies both
_FORMAT = "fxshard-checksums/1"
_CHUNK = 8 << 20  # bytes read at a time when checksumming


class ChecksumError(StateDictError):
    """A file of a checkpoint does not hold the bytes it was saved with (one line: the file)."""


# CRC-32 (zlib) over each item's bytes: it detects every single-bit flip and every burst of up to
# 32 bits, by construction, and misses other damage with probability 2^-32 per damaged item. It
# guards against accidents (bit rot, torn or truncated writes, bad copies), not tampering, at
# several times the speed of sha256 or blake2b (docs/checkpoints.md has the measurement).
def _crc32(stream: io.BufferedIOBase, offset: int, length: int, buffer: bytearray) -> tuple[int, int]:
    """The CRC-32 of ``length`` bytes of ``stream`` from ``offset``, and how many there were."""
    stream.seek(offset)
    view = memoryview(buffer)
    crc = done = 0
    while done < length:
        n = stream.readinto(view[:min(len(buffer), length - done)])
        if not n:
            break
        crc = zlib.crc32(view[:n], crc)
        done += n
    return crc, done


Checksums = dict[str, dict[int, tuple[int, int]]]  # file -> offset -> (length, crc32)


def _record_crc(files: Any) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True, separators=(",", ":")).encode())


def read_checksums(directory: str | os.PathLike[str]) -> Checksums | None:
    """The checksums :class:`ChecksumWriter` recorded in ``directory``; None if there are none
    (a checkpoint of plain ``dcp.save``). A damaged record raises :class:`ChecksumError`."""
    path = Path(directory) / CHECKSUMS
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        files = record["files"]
        intact = record["format"] == _FORMAT and record["crc32"] == _record_crc(files)
        checksums = {name: {int(o): (int(n), int(c)) for o, n, c in ranges} for name, ranges in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        intact = False
    if not intact:
        raise ChecksumError(f"{path} is damaged (it does not match its own checksum): the checkpoint "
                            "cannot be verified; load an earlier checkpoint")
    return checksums


def _verify(directory: Path, checksums: Checksums, name: str, stream: io.BufferedIOBase, offset: int,
            length: int, buffer: bytearray) -> None:
    """Check one item, read from ``stream``."""
    _compare(directory, checksums, name, offset, length, *_crc32(stream, offset, length, buffer))


def _compare(directory: Path, checksums: Checksums, name: str, offset: int, length: int, crc: int,
             read: int) -> None:
    """Raise unless ``read`` bytes with CRC-32 ``crc`` are the item at ``offset`` of ``name``."""
    recorded = checksums.get(name, {}).get(offset)
    where = f"{directory / name}: bytes {offset}..{offset + length}"
    if recorded is None or recorded[0] != length:
        raise ChecksumError(f"{where} have no checksum in {CHECKSUMS}: the metadata or the checksums "
                            "are damaged; load an earlier checkpoint")
    if read < length:
        raise ChecksumError(f"{directory / name} is truncated: it ends at byte {offset + read}, where "
                            f"the checkpoint's item runs to byte {offset + length}; load an earlier checkpoint")
    if crc != recorded[1]:
        raise ChecksumError(f"{where} have CRC-32 {crc:08x}, saved with {recorded[1]:08x}: the file is "
                            "damaged; load an earlier checkpoint")


def verify_metadata(directory: str | os.PathLike[str], checksums: Checksums | None) -> bytes:
    """The bytes of ``directory``'s ``.metadata``, checked against ``checksums`` (if any)."""
    path = Path(directory) / ".metadata"
    raw = path.read_bytes()
    if checksums is not None:
        recorded = checksums.get(".metadata", {}).get(0)
        if recorded is None:
            raise ChecksumError(f"{Path(directory) / CHECKSUMS} has no checksum of .metadata: it is "
                                "damaged; load an earlier checkpoint")
        if (len(raw), zlib.crc32(raw)) != recorded:
            raise ChecksumError(f"{path}: {len(raw)} bytes with CRC-32 {zlib.crc32(raw):08x}, saved as "
                                f"{recorded[0]} bytes with {recorded[1]:08x}: the file is damaged; load "
                                "an earlier checkpoint")
    return raw


def verify_items(directory: str | os.PathLike[str], checksums: Checksums, metadata: Metadata,
                 prefixes: tuple[str, ...]) -> None:
    """Check every item of the keys starting with one of ``prefixes`` (file order, one pass)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(prefixes):
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    buffer = bytearray(_CHUNK)
    for name, spans in sorted(ranges.items()):
        if not (Path(directory) / name).is_file():
            raise ChecksumError(f"{Path(directory) / name} is missing: the checkpoint is incomplete; copy "
                                "the checkpoint whole (every rank's .distcp file beside .metadata), or "
                                "load an earlier checkpoint")
        with open(Path(directory) / name, "rb") as f:
            for offset, length in sorted(set(spans)):
                _verify(Path(directory), checksums, name, f, offset, length, buffer)


def verify(path: str | os.PathLike[str]) -> bool:
    """Check every item of the checkpoint at ``path`` against its checksums, in one process
    (a load checks only the items it reads). Raises :class:`ChecksumError` naming the first
    damaged file; False if the checkpoint has no checksums (plain ``dcp.save``)."""
    checksums = read_checksums(path)
    if checksums is None:
        return False
    verify_metadata(path, checksums)
    verify_items(path, checksums, dcp.FileSystemReader(str(path)).read_metadata(), ("",))
    return True


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A write result's storage data with the CRC-32 of its bytes, on its way to the coordinator."""

    info: Any  # DCP's _StorageInfo: relative_path, offset, length
    crc32: int


class ChecksumWriter(dcp.FileSystemWriter):
    """DCP's ``FileSystemWriter``, recording the CRC-32 of every item it writes::

        dcp.save(state_dict, storage_writer=fxshard.checkpoint.ChecksumWriter(path))

    Each rank reads back what it wrote; the coordinator writes the checksums, and the
    ``.metadata``'s, to ``CHECKSUMS`` once DCP has written ``.metadata``."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        if kwargs.get("serialization_format", SerializationFormat.TORCH_SAVE) != SerializationFormat.TORCH_SAVE:
            raise FxShardError("ChecksumWriter writes DCP's default format (torch.save items) only")
        super().__init__(path, **kwargs)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise FxShardError("ChecksumWriter records checksums beside the global .metadata: save "
                               "with use_collectives=True (DCP's default)")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        by_file: dict[str, list[WriteResult]] = {}
        for result in results:
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        checked = []
        buffer = bytearray(_CHUNK)
        for name, written in by_file.items():
            with open(Path(self.path) / name, "rb") as f:
                for result in sorted(written, key=lambda r: r.storage_data.offset):
                    info = result.storage_data
                    crc, _ = _crc32(f, info.offset, info.length, buffer)
                    checked.append(dataclasses.replace(result, storage_data=_Checked(info, crc)))
        future: Future[list[WriteResult]] = Future()
        future.set_result(checked)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, list[list[int]]] = {}
        plain: list[list[WriteResult]] = []
        complete = True
        for written in results:
            plain.append([])
            for result in written:
                if isinstance(result.storage_data, _Checked):
                    info = result.storage_data.info
                    files.setdefault(info.relative_path, []).append(
                        [info.offset, info.length, result.storage_data.crc32])
                    result = dataclasses.replace(result, storage_data=info)
                else:
                    complete = False
                plain[-1].append(result)
        super().finish(metadata, plain)  # DCP's own storage data: plain dcp.load reads it
        if not complete:  # not every item's checksum: a partial record would refuse good items
            return
        directory = Path(self.path)
        raw = (directory / ".metadata").read_bytes()
        files[".metadata"] = [[0, len(raw), zlib.crc32(raw)]]
        for ranges in files.values():
            ranges.sort()
        text = json.dumps({"format": _FORMAT, "algorithm": "crc32", "crc32": _record_crc(files),
                           "files": files}, sort_keys=True)
        tmp = directory / (CHECKSUMS + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, directory / CHECKSUMS)


class ChecksumReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader``, checking each item against the checksums
    :class:`ChecksumWriter` recorded before DCP parses it (each rank checks exactly the bytes
    it reads: an item of up to 8 MiB is read once, checked and parsed from memory; a larger
    one is checked in chunks, then read again), and ``.metadata`` before it is unpickled::

        dcp.load(state_dict, storage_reader=fxshard.checkpoint.ChecksumReader(path))

    A checkpoint without checksums (plain ``dcp.save``) is read unverified, as DCP reads it.
    A mismatch raises :class:`ChecksumError` naming the file."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        if not hasattr(dcp.FileSystemReader, "_slice_file"):  # the one hook each item passes
            raise FxShardError("this torch's FileSystemReader has no _slice_file: fxshard cannot "
                               "check checksums as items are read (update fxshard.checkpoint)")
        super().__init__(path, **kwargs)
        self._checksums: Checksums | None = None
        self._read = False
        self._buffer = bytearray()
        self._checked: set[tuple[str, int]] = set()  # items read in several pieces: checked once

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._read = False
        self._checked.clear()

    def checksums(self) -> Checksums | None:
        if not self._read:
            self._checksums = read_checksums(self.path)
            self._read = True
        return self._checksums

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is None:  # the global metadata (a rank's own is not recorded)
            verify_metadata(self.path, self.checksums())
        return super().read_metadata(*args, **kwargs)

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        checksums = self.checksums()
        item = (sinfo.relative_path, sinfo.offset)
        if checksums is None or item in self._checked:
            return super()._slice_file(file, sinfo)
        if sinfo.length <= _CHUNK:  # read once: checked, then parsed from memory
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            _compare(Path(self.path), checksums, sinfo.relative_path, sinfo.offset, sinfo.length,
                     zlib.crc32(data), len(data))
            self._checked.add(item)
            return io.BytesIO(data)
        if not self._buffer:  # a large item: checked in chunks, then read again (page cache)
            self._buffer = bytearray(_CHUNK)
        _verify(Path(self.path), checksums, sinfo.relative_path, file, sinfo.offset, sinfo.length,
                self._buffer)
        self._checked.add(item)
        return super()._slice_file(file, sinfo)


# -- save and load: collectives within the timeout, StateDictError on every rank ------------------


def _group(driver: Driver) -> dist.ProcessGroup | None:
    """Where save and load communicate: the driver's first group, made with its timeout."""
    return driver.world.job_group if driver.world.group is not None else None


def _failures(e: CheckpointException, driver: Driver) -> str:
    """Each failed rank's last line, under its rank in the job (DCP numbers them in its group)."""
    members = driver.world.job_members()
    return "\n  ".join(f"rank {members[r] if r < len(members) else r}: {_last_line(f)}"
                       for r, f in sorted(e.failures.items()))


def _peer_failed(what: str, rank: int, e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"{what}: rank {rank}: a collective failed ({first}): a peer is gone or stalled past "
            "the timeout (fxshard.compile(..., timeout=seconds)). The process group is unusable "
            "now: let the process exit (torchrun restarts the job).")


# A save renames twice: PATH -> PATH.old, then PATH.partial -> PATH. Killed between the two, it
# leaves nothing at PATH, and two complete checkpoints beside it.
_NEWEST = "the newest checkpoint, which the interrupted save wrote"
_BEFORE = "the checkpoint before it"


def _verifies(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint of :func:`save`: every item matches its checksum
    (a save records them last, so a save's unfinished leftovers never do)."""
    try:
        return path.is_dir() and verify(path)
    except Exception:  # noqa: BLE001 - damaged or unreadable: not a checkpoint to offer
        return False


def _beside(target: Path) -> list[tuple[Path, str]]:
    """The complete checkpoints a save interrupted between its renames left beside ``target``."""
    return [(p, what) for p, what in ((target.with_name(target.name + ".partial"), _NEWEST),
                                      (target.with_name(target.name + ".old"), _BEFORE)) if _verifies(p)]


def _missing(target: Path) -> str:
    """What a load of a ``target`` that does not exist says, and what to do."""
    found = _beside(target)
    if not found:
        return f"{target} does not exist"
    listed = "\n    ".join(f"{p}: complete (every checksum verifies), {what}" for p, what in found)
    first = found[0][0]
    return (f"{target} does not exist, but complete checkpoints are beside it, as a save killed "
            f"between its two renames ({target} -> {target.name}.old, {target.name}.partial -> "
            f"{target}) leaves them:\n    {listed}\n"
            f"  Load one of them by its path, or rename it back: mv {first} {target} (the next "
            f"fxshard.checkpoint.save to {target} moves it back itself before it writes).")


def _recover(target: Path, partial: Path, old: Path) -> str | None:
    """Finish the renames of a save interrupted between them: the complete checkpoint beside a
    missing ``target`` goes back to it, so that this save's failure cannot leave none (its
    first step removes ``partial``, and its last ``old``). What was done, or None."""
    if target.exists() or target.is_symlink():
        return None
    for candidate, what in ((partial, _NEWEST), (old, _BEFORE)):
        if _verifies(candidate):
            candidate.rename(target)
            return (f"{target} did not exist: a save to it was interrupted between its two renames. "
                    f"{candidate} ({what}; every checksum verifies) was moved back to {target} before this save wrote anything.")
    return None


def save(path: str | os.PathLike[str], model: nn.Module,
         optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
         extra: dict[str, Any] | None = None) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optimizers``) with DCP, atomically.

    Every rank writes its own pieces into ``PATH.partial``; once all are done,
    rank 0 renames it to ``path`` (a previous checkpoint there is replaced only
    then: renamed to ``PATH.old`` and removed after). A save killed between those
    two renames leaves nothing at ``path``: the next save first moves
    ``PATH.partial`` back (complete, every checksum verified; else ``PATH.old``)
    and warns, and :func:`load` names both. ``extra`` (the step, a data loader's
    position: anything JSON can hold, rank 0's) is saved with it and returned by :func:`load`. Buffers, which are
    each rank's own unless ``broadcast_buffers=True``, are saved from rank 0, as
    the usual ``torch.save(model.state_dict())`` on rank 0 would. The checksum of
    every item is recorded (:class:`ChecksumWriter`).

    A collective: every rank calls it, with the same ``path``. Its collectives wait at
    most ``fxshard.compile``'s ``timeout``; any failure, on any rank, raises
    ``StateDictError`` on every rank and leaves ``path`` as it was.
    """
    _, driver = sharding_of(model)
    rank = driver.world.job_rank
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    old = target.with_name(target.name + ".old")
    what = f"saving checkpoint {path}"
    problems = []
    if rank == 0:
        try:
            recovered = _recover(target, partial, old)
        except OSError as e:
            problems.append(f"rank 0 cannot move a complete checkpoint back to {target}: {e}")
        else:
            if recovered:
                warnings.warn(recovered, stacklevel=2)
        try:
            shutil.rmtree(partial)  # a crashed save's leftovers (incomplete: not recovered)
        except FileNotFoundError:
            pass
        except OSError as e:
            problems.append(f"rank 0 cannot remove {partial}, a failed save's leftovers: {e}")
    # Every rank is here, with the same path; before anything is written.
    same_path = Source(hashlib.sha256(str(path).encode()).digest()[:8], repr(str(path)),
                       "passed different paths",
                       "Every rank must pass the same path: each writes its pieces there, and rank 0 "
                       "the metadata.")
    state.agree_on(problems, driver, what, collective="fxshard.checkpoint.save",
                   why=f"{path} is unchanged", source=same_path)
    msd, osd = get_state_dict(model, optimizers)
    content: dict[str, Any] = {"model": msd, "optim": osd}
    if extra is not None:
        content["extra"] = io.BytesIO(json.dumps(extra).encode())  # DCP stores it as bytes
    # Buffers are rank-local and `extra` is per rank, but DCP takes values every rank holds
    # whole for replicas and keeps one copy, by default from the rank with the fewest bytes
    # planned so far: rank 0's is the copy a state_dict() saved on rank 0 or DDP's broadcast
    # would give.
    try:
        dcp.save(content, storage_writer=ChecksumWriter(partial), process_group=_group(driver),
                 planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    except CheckpointException as e:  # a BaseException, raised on every rank: one callers catch
        raise StateDictError(f"{what}: writing it failed, {path} is unchanged:\n  {_failures(e, driver)}") from e
    except RuntimeError as e:  # a collective of DCP's (DCP wraps everything else)
        settle(None, _group(driver))
        raise StateDictError(_peer_failed(what, driver.world.global_rank, e) + f" {path} is unchanged.") from e
    # dcp.save returns once the coordinator has written .metadata after every rank's files.
    problems = []
    if rank == 0:
        try:
            shutil.rmtree(old, ignore_errors=True)
            if target.exists():
                target.rename(old)
            partial.rename(target)
        except OSError as e:
            problems.append(f"rank 0 cannot move {partial} to {target} ({e}); the previous "
                            f"checkpoint is at {target} or {old}")
    state.agree_on(problems, driver, what, collective="fxshard.checkpoint.save",
                   why="it was written but is not in place")
    if rank == 0:  # while the other ranks go on
        shutil.rmtree(old, ignore_errors=True)


def _differences(expected: dict[str, Any], metadata: Metadata) -> list[str]:
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(expected)
    problems = []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:  # a value of any kind, which DCP's load would then miss
            problems.append(f"{key}: not in the checkpoint")
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: the checkpoint holds a non-tensor there")
            continue
        shape, dtype = state.value_shape(value), state.value_dtype(value)
        if tuple(md.size) != shape:
            problems.append(f"{key}: shape {tuple(md.size)} in the checkpoint, {shape} in the model")
        elif md.properties.dtype != dtype:
            problems.append(f"{key}: dtype {md.properties.dtype} in the checkpoint, {dtype} in the model")
    # Only under what is requested: the model alone leaves a checkpoint's optimizer state unread.
    extra = sorted(k for k, md in saved.items() if isinstance(md, TensorStorageMetadata)
                   and k.split(".", 1)[0] in expected and k not in flat)
    if extra:
        problems.append(f"in the checkpoint but not in the model: {extra}")
    return problems


def _inspect(expected: dict[str, Any], path: Path, reader: ChecksumReader
             ) -> tuple[list[str], Source | None, Metadata | None]:
    """What is wrong with loading ``path`` into ``expected``, and which checkpoint it is."""
    if not path.exists():
        return [_missing(path)], None, None
    try:
        raw = verify_metadata(path, reader.checksums())
        metadata = reader.read_metadata()
    except ChecksumError as e:
        return [str(e)], None, None
    except Exception as e:  # noqa: BLE001 - any failure to read it is the same answer
        return [f"{path} is not a readable DCP checkpoint ({type(e).__name__}: {e})"], None, None
    # The metadata holds a unique save id: two saves never share it, and a copy of one
    # checkpoint at another path (node-local disk) has the same bytes.
    digest = hashlib.sha256(raw).digest()[:8]
    source = Source(digest, f"{path} (metadata sha256 {digest.hex()})", "read different checkpoints",
                    "Every rank must load the same checkpoint (a copy of it at another path, byte "
                    "for byte, is the same checkpoint).")
    return _differences(expected, metadata), source, metadata


def _error(failure: Any) -> BaseException:
    """The exception of one rank's failure in DCP's CheckpointException ((exception, traceback))."""
    return failure[0] if isinstance(failure, tuple) else failure


def _last_line(failure: Any) -> str:
    """What went wrong on one rank."""
    error = _error(failure)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def load(path: str | os.PathLike[str], model: nn.Module,
         optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = ()) -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save` (or by ``dcp.save`` of ``get_state_dict``'s
    values under "model" and "optim"), at any world size or policy.

    Every rank first checks ``.metadata`` against its checksum, that every rank
    reads the same checkpoint, and the checkpoint's names, shapes and dtypes
    against the model's, and raises a ``StateDictError`` listing all differences.
    Each item's checksum is checked as it is read, into copies: a damaged or
    truncated file raises on every rank, naming it, and changes nothing. A
    checkpoint without checksums (plain ``dcp.save``) loads unverified. A
    collective, bounded by ``fxshard.compile``'s ``timeout``. Returns the
    ``extra`` saved with it (None if none was).
    """
    _, driver = sharding_of(model)
    opts = _optimizers(optimizers)
    msd, osd = get_state_dict(model, opts)
    requested: dict[str, Any] = {"model": msd, "optim": osd} if opts else {"model": msd}
    what = f"loading checkpoint {path}"
    reader = ChecksumReader(path)
    problems, source, metadata = _inspect(requested, Path(path), reader)
    state.agree_on(problems, driver, what, source=source, collective="fxshard.checkpoint.load",
                   why="it does not fit the model or is damaged, nothing was changed")
    assert metadata is not None  # a rank without it found a problem, and every rank raised
    has_extra = "extra" in metadata.state_dict_metadata
    if has_extra:
        requested["extra"] = io.BytesIO()
    try:
        with warnings.catch_warnings():
            # A warning per value, about torch's own reads of fxshard's ShardedTensors
            # (docs/checkpoints.md, "Why not DTensor"): nothing the user can act on.
            warnings.filterwarnings("ignore", message=_SHARDED_TENSOR_DEPRECATED, category=FutureWarning)
            dcp.load(requested, storage_reader=reader, process_group=_group(driver))
    except CheckpointException as e:  # a BaseException: turned into an error callers catch
        named = all(isinstance(_error(f), ChecksumError) for f in e.failures.values())
        raise StateDictError(
            f"{what}: reading it failed, nothing was changed:\n  {_failures(e, driver)}"
            + ("" if named else "\nA file of the checkpoint is truncated or corrupted: load an "
               "earlier checkpoint.")
        ) from e
    except RuntimeError as e:  # a collective of DCP's
        settle(None, _group(driver))
        raise StateDictError(_peer_failed(what, driver.world.global_rank, e) + " Nothing was changed.") from e
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


def _files_source(path: Path, files: list[Path]) -> Source:
    """Which weights ``files`` hold: the CRC-32 of every byte of each (a read of each file), so
    that a copy at another path is the same source and another revision is not."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    for file in files:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            crc, read = _crc32(f, 0, size, buffer)
        digest.update(f"{file.name}\0{read}\0{crc}\0".encode())
    short = digest.digest()[:8]
    return Source(short, f"{path} (content {short.hex()})", "read different files",
                  "Every rank must load the same files (a copy at another path, byte for byte, is the "
                  "same): node-local copies or Hugging Face caches of different revisions differ. Give "
                  "every rank one copy, or pin the revision (from_pretrained / snapshot_download with "
                  "revision=COMMIT) on every node.")


def load_safetensors(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True) -> _IncompatibleKeys:
    """Load pretrained weights from a ``.safetensors`` file, or a directory of shards (a Hugging
    Face checkpoint), reading only this rank's pieces of each parameter.

    For a model built on the meta device and sharded by ``fxshard.compile`` (or
    ``fxshard.parameters``): no rank ever holds more than its shards and one
    piece being read. Names are the module's; a tied parameter may appear under
    any of its names (Hugging Face saves one). Values are cast to the shards'
    dtype, as ``load_state_dict`` does. Names and shapes are checked on every rank
    before anything changes, and that every rank read the same files: each rank reads every
    file once for its CRC-32, and ranks whose files differ (node-local copies of different
    revisions) raise on every rank, naming which rank read what.
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
            piece = group.piece(slot, rank)
            if piece is not None:
                reads.append((group.index, piece.shard.start, i, name, state.owned_boxes(group, slot, rank)))
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
    # Each rank keeps its own pieces: files that differ between ranks would stitch a model
    # together. Compared by content, where there are other ranks.
    state.agree_on(problems, driver, f"loading {path}", source=lambda: _files_source(Path(path), files),
                   collective="fxshard.checkpoint.load_safetensors")
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
