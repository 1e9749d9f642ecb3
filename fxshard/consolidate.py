"""``fxshard consolidate CKPT_DIR OUT``: a sharded DCP checkpoint to one file of ordinary weights.

The model's full state dict under the original names, as ``torch.save`` writes
it (default) or as a ``safetensors`` file; with ``--optimizer`` also the
optimizer state (torch's FQN-keyed format) in ``OUT.optim``. One process, no
process group.

Checked first: a checkpoint of ``fxshard.checkpoint.save`` records a CRC-32 of
its ``.metadata`` and of every item; all that the output needs is checked
against them before anything is written, and a mismatch is an error naming
the file (a checkpoint of plain ``dcp.save`` has none and is read as it is).

Never a traceback: a checkpoint missing one of its files, an output folder that does not exist,
a disk that fills up while writing are each an ``FxShardError`` naming the cause and the fix
(``fxshard consolidate`` prints it as one ``error:`` line, exit code 2), and leave no output
file, whole or partial. The torch.save format's scratch buffers are reserved on disk before they
are mapped (``posix_fallocate``): a full disk is then an error, not a SIGBUS on a mapped page.

Streaming: the checkpoint's metadata gives every tensor's name, shape and
dtype up front, so the output's layout is known before anything is read.
Each tensor is then read alone (``dcp.load`` of that one key, which reads and
assembles its pieces from every rank's file) straight into its place:

- safetensors: the header is written first, then each tensor's bytes at its
  offset; one tensor is in memory at a time.
- torch.save: every tensor is a view of a file-backed buffer, one per dtype
  (``torch.from_file(shared=True)``; ``torch.save`` refuses views of one storage
  as different dtypes), so what has been read lives in the page cache, which
  the kernel writes back and drops as it needs to, not in the process's own
  memory; ``torch.save`` then copies the buffers into the archive.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import struct
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fxshard.checkpoint import ChecksumError, read_checksums, verify_items, verify_metadata
from fxshard.ir.compat import load_state_dict_from_keys as _load_state_dict_from_keys
from fxshard.ir.errors import FxShardError

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
# torch's UserWarning from every read here (dcp.load(no_dist=True) warns as well), in its two
# wordings: one process without a process group is what consolidation is.
_SINGLE_PROCESS = (r"^torch\.distributed is (disabled, )?unavailable or uninitialized, "
                   r"assuming the intent is to load in a single process\.$")


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        yield


def _tensors(metadata: Any, prefix: str) -> list[tuple[str, TensorStorageMetadata]]:
    return [(key, md) for key, md in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)]


def _read_into(reader_dir: str, key: str, out: torch.Tensor) -> None:
    """Read one tensor of the checkpoint (all its pieces) into ``out``, in place."""
    try:
        with _single_process():
            dcp.load({key: out}, storage_reader=dcp.FileSystemReader(reader_dir), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise FxShardError(f"{reader_dir}: cannot read {key!r} ({type(e).__name__}: {detail}); the "
                           "checkpoint's files are damaged or incomplete") from None


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e``: torch.save reports a failed write of its file object as a
    RuntimeError of its own, raised while handling the file's OSError."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@contextlib.contextmanager
def _writing(target: Path, needs: int) -> Iterator[None]:
    """Failures to write ``target`` (``needs`` bytes on its disk) as errors naming the cause."""
    try:
        yield
    except FxShardError:
        raise
    except (OSError, RuntimeError) as e:
        cause = _os_error(e)
        if cause is None:
            raise
        if cause.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FxShardError(f"cannot write {target}: no space left on the device of {target.parent} "
                               f"(writing it needs about {_mib(needs)}): free space or write elsewhere"
                               ) from None
        raise FxShardError(f"cannot write {target}: {cause.strerror or cause}; check that "
                           f"{target.parent} is writable, or write elsewhere") from None


def _reserve(path: Path, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` allocated on its disk, where the file system can say: a
    full disk then fails here, not as a SIGBUS when a page of a mapping of it is written."""
    with open(path, "wb") as f:
        if nbytes and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(f.fileno(), 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise


@contextlib.contextmanager
def _atomic(target: Path) -> Iterator[Path]:
    """A path to write ``target``'s content to: renamed to ``target`` once complete, removed
    if writing fails, so ``target`` is either whole or as it was."""
    partial = target.with_name(f".{target.name}.partial")
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _write_safetensors(directory: str, entries: list[tuple[str, str, TensorStorageMetadata]],
                       out: Path) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "fxshard consolidate"}}
    offset = 0
    for name, _, md in entries:
        if md.properties.dtype not in _SAFETENSORS_DTYPES:
            raise FxShardError(f"{name}: dtype {md.properties.dtype} has no safetensors name; "
                               "use --format torch")
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[md.properties.dtype], "shape": list(md.size),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, key, md in entries:
            tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            _read_into(directory, key, tensor)
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)  # no copy
            del tensor


def _file_backed(entries: list[tuple[str, str, TensorStorageMetadata]], scratch: Path
                 ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """One view per entry into a file-backed buffer of its dtype (files created in ``scratch``)."""
    sizes: dict[torch.dtype, int] = {}
    spans = []
    for name, key, md in entries:
        dtype, numel = md.properties.dtype, math.prod(md.size)
        spans.append((name, key, md, sizes.get(dtype, 0), numel))
        sizes[dtype] = sizes.get(dtype, 0) + numel
    buffers = {}
    for i, (dtype, n) in enumerate(sizes.items()):
        _reserve(scratch / f"buffer{i}", max(n, 1) * dtype.itemsize)
        buffers[dtype] = torch.from_file(str(scratch / f"buffer{i}"), shared=True, size=max(n, 1), dtype=dtype)
    for name, key, md, start, numel in spans:
        yield name, key, buffers[md.properties.dtype][start:start + numel].view(tuple(md.size))


def _set_path(root: dict[str, Any], path: list[str], value: Any) -> None:
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _check_files(directory: str, metadata: Any, prefixes: tuple[str, ...]) -> None:
    """Every file that holds an item under ``prefixes`` is there."""
    names = sorted({info.relative_path for index, info in metadata.storage_data.items()
                    if index.fqn.startswith(prefixes)})
    missing = [Path(directory) / n for n in names if not (Path(directory) / n).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more of its {len(names)} data files)" if len(missing) > 1 else ""
        raise FxShardError(f"{missing[0]} is missing{more}: the checkpoint is incomplete; copy the "
                           "checkpoint whole (every rank's .distcp file beside .metadata), or "
                           "consolidate an earlier one")


def consolidate(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *,
                format: str = "torch", optimizer: bool = False) -> list[Path]:
    """Write the model's full state dict from a sharded checkpoint; returns the files written."""
    directory = str(checkpoint)
    try:
        checksums = read_checksums(directory)
        verify_metadata(directory, checksums)
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except ChecksumError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read it is the same answer
        raise FxShardError(f"{directory} is not a readable DCP checkpoint "
                           f"({type(e).__name__}: {e})") from None
    model = [(key[len("model."):], key, md) for key, md in _tensors(metadata, "model.")]
    if not model:
        raise FxShardError(f"{directory} has no tensors under 'model.': write checkpoints with "
                           "fxshard.checkpoint.save, or dcp.save({'model': msd, ...})")
    target = Path(out)
    written = [target]
    if format not in ("torch", "safetensors"):
        raise FxShardError(f"unknown format {format!r}: 'torch' or 'safetensors'")
    if not target.parent.is_dir():
        what = "does not exist" if not target.parent.exists() else "is not a folder"
        raise FxShardError(f"{target.parent} {what}: create the folder to write {target.name} into "
                           f"(mkdir -p {target.parent}), or write it elsewhere")
    optim = [(key[len("optim."):], key, md) for key, md in _tensors(metadata, "optim.")]
    if optimizer and not optim:  # before anything is written
        raise FxShardError(f"{directory} has no optimizer state (no 'optim.' keys): it was saved without an "
                           "optimizer; leave out --optimizer (optimizer=False)")
    prefixes = ("model.", "optim.") if optimizer else ("model.",)
    _check_files(directory, metadata, prefixes)
    if checksums is not None:  # every item to be read, before anything is written
        verify_items(directory, checksums, metadata, prefixes)
    # The torch format's scratch buffers sit beside the file while it is written: twice its size.
    needs = sum(math.prod(md.size) * md.properties.dtype.itemsize for _, _, md in model)
    with _writing(target, needs if format == "safetensors" else 2 * needs), _atomic(target) as partial:
        if format == "safetensors":
            _write_safetensors(directory, model, partial)
        else:
            _save_file_backed(directory, model, partial, nested=False)
    if optimizer:
        extra = target.with_name(target.name + ".optim")
        try:
            with _single_process():
                # Everything but the tensors: the hyperparameters, and any state an optimizer
                # keeps as a plain value (an int step count), which DCP stores as bytes.
                plain = _load_state_dict_from_keys(
                    {k for k, md in metadata.state_dict_metadata.items()
                     if k.startswith("optim.") and not isinstance(md, TensorStorageMetadata)},
                    checkpoint_id=directory)
            needs = 2 * sum(math.prod(md.size) * md.properties.dtype.itemsize for _, _, md in optim)
            with _writing(extra, needs), _atomic(extra) as partial:
                _save_file_backed(directory, optim, partial, nested=True,
                                  planner_data=metadata.planner_data, extra=plain.get("optim", {}))
        except BaseException:
            target.unlink(missing_ok=True)  # no output file, whole or partial: not the model's alone
            raise
        written.append(extra)
    return written


def _save_file_backed(directory: str, entries: list[tuple[str, str, TensorStorageMetadata]], out: Path,
                      nested: bool, planner_data: Any = None, extra: dict[str, Any] | None = None) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        result: dict[str, Any] = dict(extra or {})
        for name, key, view in _file_backed(entries, Path(scratch)):
            _read_into(directory, key, view)
            if nested and planner_data and key in planner_data:  # the path DCP flattened
                _set_path(result, [str(p) for p in planner_data[key][1:]], view)
            else:
                result[name] = view
        with open(out, "wb") as f:  # a file object: a failed write is an OSError with its errno
            torch.save(result, f)
