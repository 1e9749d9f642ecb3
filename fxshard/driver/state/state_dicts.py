"""State dicts of a sharded module and its optimizer under the original module's names.

Sharded (the default): each rank holds, for every parameter, the range of its
flattened elements that falls in this rank's range of the parameter's flat
group. A range of a row-major tensor is a union of at most 2·(ndim−1)+1
boxes, each one contiguous run of the flat shard::

    shape (4, 3), elements [2, 10):  row 0 cols 2..3 | rows 1..2 | row 3 col 0
                                     box (0,2)+(1,1)   (1,0)+(2,3)  (3,0)+(1,1)

So a parameter's piece is a ``ShardedTensor`` whose local shards are those
boxes, with global metadata listing every rank's boxes, computed from the plan
without communicating. ``torch.distributed.checkpoint`` (DCP) saves those
boxes without gathering anything and reads any saved boxes into any requested
ones: a checkpoint loads at another world size, or under another policy.
Optimizer state of the shard's shape is described the same way; scalars
("step") are repeated per parameter, as torch's ``get_optimizer_state_dict``
does. Values are copies: a failed ``dcp.load`` into them changes nothing, and
``load_model_state`` / ``load_optimizer_state`` check everything on every rank
before anything changes.

Full: the module's own ``state_dict()`` on the skeleton with gathered
parameters (its state-dict hooks run); optimizer state gathered per flat group.

Agreement (:func:`agree_on`): every load of a state dict or a checkpoint, and
a checkpoint's save before and after writing, start with one all_gather of 16
bytes per rank, bounded by the driver's timeout::

    rank r: [found a problem?, digest of its source]   ->   all agree: go on
                                                            else: exchange the texts, raise everywhere

A rank that does not arrive within the timeout is named (each rank marks its
arrival in the process group's store first). The source digest is what must be
the same on every rank: a checkpoint's metadata, the content of a full state
dict (each rank keeps its own slice of it: different dicts would mix silently).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import math
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxshard.driver.run.runtime import (
    World,
    comm_device,
    full_parameters,
    gather_full,
    load_shards,
    settle,
)
from fxshard.ir import compat
from fxshard.ir.compat import IncompatibleKeys as _IncompatibleKeys
from fxshard.ir.compat import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from fxshard.ir.compat import reparametrize_module as _reparametrize_module
from fxshard.ir.errors import FxShardError
from fxshard.ir.plan import FlatGroup, ParamSlot

if TYPE_CHECKING:
    from fxshard.driver.compile.compiler import Driver  # whose plan, shards and world it reads

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes


class StateDictError(FxShardError):
    """A state dict that does not fit the model or optimizer; nothing was changed."""


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of a row-major tensor of ``shape``, as boxes in order."""
    if start >= stop:
        return []
    shape = tuple(shape)
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)

    def row(r: int, lo: int, hi: int) -> list[Box]:
        return [((r, *o), (1, *s)) for o, s in boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *rest), (r1 - r0, *shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


def owned_boxes(group: FlatGroup, slot: ParamSlot, rank: int) -> list[Box]:
    """The boxes of ``slot`` that ``rank`` holds, in flat order (none: empty)."""
    piece = group.piece(slot, rank)
    if piece is None:
        return []
    return boxes(slot.shape, piece.param.start, piece.param.stop)


def _pieces(group: FlatGroup, slot: ParamSlot, rank: int) -> list[Box]:
    """:func:`owned_boxes`, except that a rank holding none of ``slot`` gets one empty box
    past the end of dim 0: DCP's load planner drops a ShardedTensor with no local shards
    from the request, and then fails on the checkpoint's extra key."""
    return owned_boxes(group, slot, rank) or \
        [((slot.shape[0], *(0,) * (len(slot.shape) - 1)), (0, *slot.shape[1:]))]


def _distributed(driver: Driver, group: FlatGroup) -> bool:
    world = driver.world
    return not group.replicated and world.group is not None and world.size > 1


def sharded_value(flat: torch.Tensor, group: FlatGroup, slot: ParamSlot, driver: Driver) -> torch.Tensor:
    """The piece of ``slot`` in ``flat`` (this rank's shard-shaped tensor of ``group``): a
    ``ShardedTensor`` of views of ``flat``, or the whole parameter where it is not sharded."""
    if not _distributed(driver, group):
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
    world = driver.world
    pg = world.group
    assert pg is not None
    if not slot.shape:
        # A 0-dim parameter (CLIP's logit_scale): one rank holds its element, and a
        # ShardedTensor's pieces are boxes along dim 0, which it has not. Its value, from
        # that rank, on every rank: a plain tensor, as DCP saves a replicated one (a
        # collective: every rank walks the plan in the same order).
        holder = next(r for r in range(world.size) if group.piece(slot, r) is not None)
        piece = group.piece(slot, world.rank)
        value = (flat[piece.shard].reshape(()).clone() if piece is not None
                 else torch.empty((), dtype=flat.dtype, device=flat.device))
        dist.broadcast(value, src=dist.get_global_rank(pg, holder), group=pg)
        return value
    device = str(flat.device)

    def metadata(rank: int, box: Box) -> ShardMetadata:
        global_rank = dist.get_global_rank(pg, rank)
        return ShardMetadata(list(box[0]), list(box[1]), f"rank:{global_rank}/{device}")

    everyone = [metadata(r, b) for r in range(world.size) for b in _pieces(group, slot, r)]
    local = []
    piece = group.piece(slot, world.rank)
    start = piece.shard.start if piece is not None else 0
    for box in _pieces(group, slot, world.rank):
        n = math.prod(box[1])
        local.append(Shard(flat[start:start + n].view(box[1]), metadata(world.rank, box)))
        start += n
    properties = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(everyone, torch.Size(slot.shape), properties),
        process_group=world.group)


def value_shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, ShardedTensor):  # its metadata: tensor attributes warn of deprecation
        return tuple(value.metadata().size)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def value_dtype(value: Any) -> torch.dtype | None:
    if isinstance(value, ShardedTensor):
        return value.metadata().tensor_properties.dtype
    return value.dtype if isinstance(value, torch.Tensor) else None


def _local_piece(value: Any, group: FlatGroup, slot: ParamSlot, driver: Driver, what: str,
                 problems: list[str]) -> torch.Tensor | None:
    """This rank's elements of ``slot`` from ``value`` (a sharded value of this layout, or the
    full tensor), flattened; None where this rank holds none of it or ``value`` is wrong."""
    shape = value_shape(value)
    if shape != slot.shape:
        problems.append(f"{what}: shape {shape if shape is not None else type(value).__name__} "
                        f"where the model has {slot.shape}")
        return None
    piece = group.piece(slot, driver.world.rank)
    if isinstance(value, ShardedTensor):
        shards = sorted(value.local_shards(), key=lambda s: tuple(s.metadata.shard_offsets))
        got = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in shards]
        want = _pieces(group, slot, driver.world.rank) if _distributed(driver, group) else \
            [((0,) * len(slot.shape), slot.shape)]
        if got != want:
            problems.append(f"{what}: its local shards {got} are not this rank's pieces {want}: "
                            "the dict was made for another plan or world size. Load checkpoints "
                            "into the dict fxshard.get_state_dict returns for this model")
            return None
        return torch.cat([s.tensor.reshape(-1) for s in shards]) if piece is not None else None
    if piece is None:
        return None
    return value.detach().reshape(-1)[piece.param]


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` saves, by name."""
    result = {}
    for name, buffer in module.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            result[name] = buffer
    return result


@dataclass(frozen=True)
class Source:
    """What every rank must have read the same: ``digest`` (8 bytes) is compared across
    ranks; ``name`` is this rank's, for the message."""

    digest: bytes
    name: str
    differ: str  # what the ranks did: "read different checkpoints"
    hint: str  # what to do instead


def agree_on(problems: list[str], driver: Driver, what: str, *,
             source: Source | Callable[[], Source | None] | None = None, collective: str | None = None,
             why: str = "the state dict does not fit, nothing was changed") -> None:
    """Raise on every rank when any rank found a problem (``why`` heads the list) or read
    another ``source`` than the others (a callable: computed only where there are others). A
    collective when sharded, bounded by the driver's timeout: a rank that does not arrive is
    named as not having called ``collective`` (``what`` by default)."""
    world = driver.world
    if world.group is None or world.job_size == 1 or dist.get_backend(world.group) == "fake":
        _raise(what, why, [(problems, None)], None)
        return
    if callable(source):
        source = source()
    group = world.job_group
    digest = int.from_bytes(source.digest[:8].ljust(8, b"\0"), "little", signed=True) if source else 0
    flags = _exchange(world, group, [int(bool(problems)), digest], collective or what)
    if not bool(flags[:, 0].any()) and bool((flags[:, 1] == flags[0, 1]).all()):
        return
    found: list[Any] = [None] * world.job_size
    dist.all_gather_object(found, (problems, source.name if source else None,
                                   (source.differ, source.hint) if source else None), group=group)
    differ = None
    if not bool((flags[:, 1] == flags[0, 1]).all()):
        # Every rank raises, also one that read no source itself: the words of a rank that did.
        differ = source or next(Source(b"", "", *f[2]) for f in found if f[2] is not None)
    _raise(what, why, found, differ, [int(d) for d in flags[:, 1]], world.job_members())


def _raise(what: str, why: str, found: list[Any], source: Source | None, digests: Sequence[int] = (),
           members: Sequence[int] = ()) -> None:
    """The error of an agreement: every rank's problems, and which ranks read which source;
    ``found`` and ``digests`` are in the job group's order, ``members`` its ranks in the job."""
    members = list(members) or list(range(len(found)))
    found = [f if f is not None else ([], None) for f in found]
    if all(f[0] == found[0][0] for f in found):  # the same on every rank: say it once
        lines = list(found[0][0])
    else:
        lines = [f"rank {r}: {p}" for r, (ps, *_) in zip(members, found) for p in ps]
    text = []
    if lines:
        shown = "\n  ".join(lines[:40]) + (f"\n  ... {len(lines) - 40} more" if len(lines) > 40 else "")
        text.append(f"{what}: {why}:\n  {shown}")
    if source is not None:
        ranks: dict[int, list[int]] = {}
        for i, d in enumerate(digests):
            ranks.setdefault(d, []).append(i)
        who = "\n  ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(str(members[i]) for i in rs)}: "
                          f"{found[rs[0]][1] or 'nothing to compare'}" for rs in ranks.values())
        text.append(f"{what}: the ranks {source.differ}, nothing was changed:\n  {who}\n{source.hint}")
    if text:
        raise StateDictError("\n".join(text))


# Agreements entered per process group: each rank's arrival at one is a key in the group's store.
_ARRIVALS: dict[str, int] = {}


def _arrival(group: dist.ProcessGroup, rank: int, size: int) -> Callable[[], list[int] | None]:
    """Mark this rank's arrival at the next agreement on ``group``; returns what tells which
    ranks have not arrived (None where the store cannot say)."""
    store = compat.group_store(group)
    if store is None:
        return lambda: None
    name = group.group_name
    seq = _ARRIVALS.get(name, 0)
    _ARRIVALS[name] = seq + 1

    def key(n: int, r: int) -> str:
        return f"fxshard/arrived/{name}/{n}/{r}"

    try:
        store.set(key(seq, rank), "1")
        if seq:  # every rank passed the previous agreement: its keys are no longer read
            store.delete_key(key(seq - 1, rank))
    except RuntimeError:
        return lambda: None

    def missing() -> list[int] | None:
        try:
            return [r for r in range(size) if not store.check([key(seq, r)])]
        except RuntimeError:
            return None

    return missing


def _exchange(world: World, group: dist.ProcessGroup, values: list[int], collective: str) -> torch.Tensor:
    """Every rank's ``values`` (one row per rank), within the driver's timeout."""
    missing = _arrival(group, world.job_rank, world.job_size)
    device = comm_device(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = torch.empty(world.job_size * len(values), dtype=torch.int64, device=device)
    seconds = world.timeout.total_seconds() if world.timeout is not None else None
    start = time.monotonic()
    work = None
    try:
        work = compat.all_gather_single(everyone, mine, group=group, async_op=True)
        assert work is not None
        if seconds is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        waited = time.monotonic() - start
        if work is not None:
            settle(work, group)
        gone = missing()
        members = world.job_members()
        raise StateDictError(_not_arrived(collective, world.global_rank,
                                          None if gone is None else [members[r] for r in gone],
                                          seconds, waited, e)) from e
    return everyone.view(world.job_size, len(values)).cpu()


def _not_arrived(collective: str, rank: int, missing: list[int] | None, seconds: float | None,
                 waited: float, error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    after = f"within {seconds:g}s" if seconds is not None and waited >= 0.9 * seconds \
        else f"(its connection closed after {waited:.1f}s: {first})"
    if missing:
        who = f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))}"
        cause = f"{who} did not arrive {after}"
    else:
        cause = f"the exchange failed on rank {rank} after {waited:.1f}s ({first}): a peer is gone or stalled"
    return (f"{collective} is a collective: every rank must call it; {cause}. The process group is "
            "unusable now: let the process exit (fxshard.compile(..., timeout=seconds) sets how "
            "long to wait).")


def _fold(hasher: Any, value: Any) -> None:
    """Add ``value`` to ``hasher``: tensors by dtype, shape and a checksum of their bytes;
    ShardedTensors not at all (each rank holds its own pieces)."""
    if isinstance(value, ShardedTensor):
        return
    if isinstance(value, torch.Tensor):
        hasher.update(f"{value.dtype}{tuple(value.shape)}".encode())
        if not value.is_meta and value.numel():
            try:
                data = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            except (RuntimeError, TypeError):  # no plain bytes (a quantized tensor): its shape alone
                return
            hasher.update(zlib.crc32(data.data).to_bytes(4, "little"))
    elif isinstance(value, Mapping):
        for k in sorted(value, key=repr):
            hasher.update(repr(k).encode())
            _fold(hasher, value[k])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"{type(value).__name__}{len(value)}".encode())
        for v in value:
            _fold(hasher, v)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        hasher.update(repr(value).encode())
    else:  # an object of its own: its repr may hold an address
        hasher.update(type(value).__qualname__.encode())


def content_source(values: Iterable[tuple[str, Any]], what: str) -> Source | None:
    """The :class:`Source` of a state dict's values that every rank must pass alike (None when
    there are none: a sharded dict's values are each rank's own)."""
    hasher = hashlib.sha256()
    count = 0
    for name, value in values:
        if isinstance(value, ShardedTensor):
            continue
        hasher.update(repr(name).encode())
        _fold(hasher, value)
        count += 1
    if not count:
        return None
    digest = hasher.digest()[:8]
    return Source(digest, f"{what} with digest {digest.hex()}", "passed different state dicts",
                  "Every rank must pass the same full state dict (each keeps its own slice of it): "
                  "read the same file on every rank, or broadcast rank 0's "
                  "(torch.distributed.broadcast_object_list).")


# -- the model --------------------------------------------------------------------------------


def extra_states(module: nn.Module) -> dict[str, nn.Module]:
    """The modules whose state dict holds extra state (``get_extra_state`` overridden, as
    ``nn.Module.state_dict`` decides: Transformer Engine's FP8 metadata), by its key."""
    return {(f"{name}." if name else "") + _EXTRA_STATE_KEY: m for name, m in module.named_modules()
            if type(m).get_extra_state is not nn.Module.get_extra_state}


_EXTRA_STATE_KEY = "_extra_state"


def model_state(module: nn.Module, driver: Driver) -> dict[str, Any]:
    """Sharded: every parameter under each of its names, the persistent buffers (copies), and
    each module's extra state (``get_extra_state``; this rank's, as a buffer is rank 0's).
    The module's state-dict hooks do not run (they would compute on full tensors, where this
    holds boxes of the flat shards): a warning names the modules that have them."""
    hooked = compat.state_dict_hooked(module)
    if hooked:
        warnings.warn(
            "fxshard: a sharded state dict keys each parameter by its own name, and the state-dict hooks of "
            f"{', '.join(repr(n or '<root>') for n in hooked)} did not run. Its checkpoint loads back "
            "into fxshard and consolidates to a dict the module's load_state_dict takes; for the hooks' "
            "keys, take the full state dict (StateDictOptions(full_state_dict=True), or "
            "sharded.state_dict()), which runs them", stacklevel=3)
    result: dict[str, Any] = {}
    for group, shard in zip(driver.plan.groups, driver.shards):
        copy_ = shard.detach().clone()
        for slot in group.params:
            value = sharded_value(copy_, group, slot, driver)
            for name in slot.names:
                result[name] = value
    for name, buffer in persistent_buffers(module).items():
        result[name] = buffer.detach().clone()
    for key, owner in extra_states(module).items():
        result[key] = owner.get_extra_state()
    return result


ModelLoad = tuple[list[tuple[nn.Parameter, slice, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]],
                  _IncompatibleKeys, list[tuple[nn.Module, Any]]]


def load_model_state(module: nn.Module, driver: Driver, state: Mapping[str, Any],
                     strict: bool = True) -> _IncompatibleKeys:
    """Inverse of :func:`model_state` (full tensors are accepted too). Checks names, shapes
    and dtypes on every rank first; on any problem every rank raises and nothing changes."""
    return commit_model_state(prepare_model_state(module, driver, state, strict))


def commit_model_state(load: ModelLoad) -> _IncompatibleKeys:
    updates, buffers, result, extras = load
    with torch.no_grad():
        for shard, where, piece in updates:
            shard[where].copy_(piece)
        for buffer, value in buffers:
            buffer.copy_(value)
    for owner, value in extras:
        owner.set_extra_state(value)
    return result


def prepare_model_state(module: nn.Module, driver: Driver, state: Mapping[str, Any],
                        strict: bool = True) -> ModelLoad:
    """What loading ``state`` writes where, checked on every rank; nothing is changed."""
    problems: list[str] = []
    plan = driver.plan
    updates: list[tuple[nn.Parameter, slice, torch.Tensor]] = []
    expected: set[str] = set()
    for group, shard in zip(plan.groups, driver.shards):
        for slot in group.params:
            expected.update(slot.names)
            name = next((n for n in slot.names if n in state), None)
            if name is None:
                if strict:
                    problems.append(f"missing parameter {slot.name!r}")
                continue
            value = state[name]
            if value_dtype(value) not in (None, group.dtype):
                problems.append(f"{name!r}: dtype {value_dtype(value)} where the model's shards are "
                                f"{group.dtype}; convert the state dict (or the model) first")
                continue
            local = _local_piece(value, group, slot, driver, repr(name), problems)
            piece = group.piece(slot, driver.world.rank)
            if local is not None and piece is not None:
                updates.append((shard, piece.shard, local))
    buffers = persistent_buffers(module)
    expected.update(buffers)
    for name, buffer in buffers.items():
        if name not in state:
            if strict:
                problems.append(f"missing buffer {name!r}")
            continue
        value = state[name]
        if not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
            problems.append(f"buffer {name!r}: shape {getattr(value, 'shape', type(value).__name__)} "
                            f"where the model has {tuple(buffer.shape)}")
        elif value.dtype != buffer.dtype:
            problems.append(f"buffer {name!r}: dtype {value.dtype} where the model has {buffer.dtype}")
    extras = extra_states(module)
    expected.update(extras)
    if strict:
        problems += [f"missing extra state {key!r} (its module's get_extra_state)" for key in extras
                     if key not in state]
    unexpected = sorted(k for k in state if k not in expected)
    missing = sorted(k for k in expected if k not in state)
    if strict and unexpected:
        problems.append(f"unexpected keys (not in this model): {unexpected}")
    parameters = [n for g in plan.groups for slot in g.params for n in slot.names if n in state]
    agree_on(problems, driver, "loading the model state",
             source=lambda: content_source(((n, state[n]) for n in parameters), "parameters"))
    return (updates, [(b, state[name]) for name, b in buffers.items() if name in state],
            _IncompatibleKeys(missing, unexpected), [(m, state[key]) for key, m in extras.items() if key in state])


@contextlib.contextmanager
def materialised(module: nn.Module, params: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """The skeleton with ``params`` (every name) as its parameters and copies of its buffers,
    for the module's own state-dict code to run on; yields the buffer copies."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers(remove_duplicate=False)}
    with _reparametrize_module(module, {**params, **buffers}):
        yield buffers


def gather_seconds(driver: Driver, timeout: float | None) -> float:
    """How long a full state dict's gathers may wait: ``timeout`` where given, else
    ``fxshard.compile``'s ``timeout``, else ``DEFAULT_GATHER_SECONDS``."""
    if timeout is not None:
        return timeout
    world = driver.world.timeout
    return world.total_seconds() if world is not None else DEFAULT_GATHER_SECONDS


DEFAULT_GATHER_SECONDS = 300.0


def full_model_state(module: nn.Module, driver: Driver, rank0_only: bool = False,
                     timeout: float | None = None) -> dict[str, torch.Tensor]:
    """What the unsharded module's own ``state_dict()`` returns (a collective)."""
    timeout = gather_seconds(driver, timeout)
    full = full_parameters(list(driver.shards), driver.plan, driver.world, timeout)
    if rank0_only and driver.world.job_rank != 0:
        return {}
    with materialised(module, full):
        state = module.state_dict()
    meta = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_meta]
    if meta:
        raise FxShardError(
            f"full_state_dict: the module's state_dict() returned meta tensors for {meta}: "
            "a state-dict hook or _save_to_state_dict reads tensors other than the module's "
            "parameters and buffers, which fxshard cannot gather. Compute them from the "
            "parameters in the hook."
        )
    return dict(state)


def load_full_model_state(module: nn.Module, driver: Driver, state_dict: Mapping[str, Any],
                          strict: bool = True, timeout: float | None = None) -> _IncompatibleKeys:
    """Inverse of :func:`full_model_state`, through the module's own ``load_state_dict`` (its
    load hooks run). Checked before anything changes."""
    plan = driver.plan
    full: dict[str, torch.Tensor] = {}
    if strict:  # every parameter will be written, or the load fails
        for group in plan.groups:
            for slot in group.params:
                value = torch.empty(slot.shape, dtype=group.dtype, device=driver.device)
                full.update(dict.fromkeys(slot.names, value))  # ties stay one tensor
    else:
        full = full_parameters(list(driver.shards), plan, driver.world, gather_seconds(driver, timeout))
    problems = []
    result = _IncompatibleKeys([], [])
    with materialised(module, full) as buffers:
        try:
            result = module.load_state_dict(dict(state_dict), strict=strict)
        except RuntimeError as e:
            problems.append(f"{str(e).strip()} Pass a dict from full_state_dict(), or the original "
                            "module's state_dict().")
    # Buffers are each rank's own (full_state_dict returns this rank's): only the rest must agree.
    own = persistent_buffers(module)
    agree_on(problems, driver, "load_full_state_dict",
             why="the state dict does not match the model, nothing was loaded",
             source=lambda: content_source(((k, v) for k, v in state_dict.items() if k not in own),
                                           "a state dict"))
    load_shards(list(driver.shards), plan, full, driver.world.rank)
    with torch.no_grad():
        for name, buffer in module.named_buffers(remove_duplicate=False):
            buffer.copy_(buffers[name])
    return result


# -- the optimizer ----------------------------------------------------------------------------


def _stepped(driver: Driver, optimizer: torch.optim.Optimizer) -> dict[int, tuple[FlatGroup, ParamSlot | None]]:
    """id(parameter) -> its flat group, and the parameter's slot for a view of it
    (``use_orig_params``; None for a flat shard), for every parameter ``optimizer`` steps."""
    index: dict[int, tuple[FlatGroup, ParamSlot | None]] = {
        id(s): (g, None) for g, s in zip(driver.plan.groups, driver.shards)}
    if driver.orig is not None:
        index.update({i: (g, slot) for i, (g, slot) in driver.orig.slot_of.items()})
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            if id(p) not in index:
                raise FxShardError(
                    f"{type(optimizer).__name__} steps a parameter of shape {tuple(p.shape)} that "
                    "is not one of this model's flat shards: build it over sharded.parameters() "
                    "(fxshard.parameters(model) for the torch.compile backend)"
                )
    return index


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's state exist (torch's way: a step with zero gradients, lr 0)."""
    from fxshard.ir.compat import init_optim_state as _init_optim_state

    _init_optim_state(optimizer)


def optimizer_state(driver: Driver, optimizers: Sequence[torch.optim.Optimizer], full: bool = False,
                    timeout: float | None = None) -> dict[str, Any]:
    """torch's FQN-keyed format: ``{"state": {name: {key: value}}, "param_groups": [{..,
    "params": [names]}]}``; sharded values as in :func:`model_state`, or gathered with ``full``."""
    plan = driver.plan
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for optimizer in optimizers:
        where = _stepped(driver, optimizer)
        _init_state(optimizer)
        # use_orig_params: the views' per-element state, by flat group and key, laid out as
        # the shard is, then named as a flat shard's is
        laid_out: dict[int, dict[str, tuple[torch.Tensor, list[ParamSlot]]]] = {}
        for pg in optimizer.param_groups:
            names = []
            for p in pg["params"]:
                group, view_slot = where[id(p)]
                slots = group.params if view_slot is None else (view_slot,)
                entries: dict[str, dict[str, Any]] = {slot.name: {} for slot in slots}
                for key, value in optimizer.state.get(p, {}).items():
                    per_element = isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0
                    if per_element and view_slot is not None:
                        shard = driver.shards[group.index]
                        flat, named = laid_out.setdefault(group.index, {}).setdefault(
                            key, (torch.zeros_like(shard, dtype=value.dtype), []))
                        piece = group.piece(view_slot, driver.world.rank)
                        if piece is not None:
                            flat[piece.shard] = value.detach()
                        named.append(view_slot)
                    elif per_element and full:
                        whole = gather_full(value, group, driver.world, gather_seconds(driver, timeout))
                        for slot in slots:
                            entries[slot.name][key] = \
                                whole[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
                    elif per_element:
                        copied = value.detach().clone()
                        for slot in slots:
                            entries[slot.name][key] = sharded_value(copied, group, slot, driver)
                    elif isinstance(value, torch.Tensor) and value.numel() <= 1:
                        for slot in slots:
                            entries[slot.name][key] = value.detach().clone()
                    elif not isinstance(value, torch.Tensor):
                        for slot in slots:
                            entries[slot.name][key] = copy.deepcopy(value)
                    else:
                        raise FxShardError(
                            f"optimizer state {key!r} of flat group {group.index} has shape "
                            f"{tuple(value.shape)}, neither the shard's {tuple(p.shape)} nor a scalar: "
                            f"fxshard cannot name its parts by parameter ({type(optimizer).__name__})"
                        )
                for name, entry in entries.items():
                    state.setdefault(name, {}).update(entry)
                names += [slot.name for slot in slots]
            groups.append({**{k: copy.deepcopy(v) for k, v in pg.items() if k != "params"},
                           "params": names})
        for g in sorted(laid_out):  # the same order on every rank: gather_full is a collective
            group = plan.groups[g]
            for key in sorted(laid_out[g]):
                flat, named = laid_out[g][key]
                whole = gather_full(flat, group, driver.world, gather_seconds(driver, timeout)) if full else flat
                for slot in named:
                    state[slot.name][key] = (
                        whole[slot.offset:slot.offset + slot.numel].view(slot.shape).clone() if full
                        else sharded_value(flat, group, slot, driver))
    return {"state": state, "param_groups": groups}


OptimizerLoad = list[tuple[torch.optim.Optimizer, dict[str, Any]]]


def load_optimizer_state(driver: Driver, optimizers: Sequence[torch.optim.Optimizer],
                         state_dict: Mapping[str, Any]) -> None:
    """Inverse of :func:`optimizer_state` (sharded or full values). Checked on every rank
    before anything changes; the optimizers' own ``load_state_dict`` then takes it."""
    commit_optimizer_state(prepare_optimizer_state(driver, optimizers, state_dict))


def commit_optimizer_state(loads: OptimizerLoad) -> None:
    for optimizer, sd in loads:
        optimizer.load_state_dict(sd)


def prepare_optimizer_state(driver: Driver, optimizers: Sequence[torch.optim.Optimizer],
                            state_dict: Mapping[str, Any]) -> OptimizerLoad:
    """Each optimizer's own state dict, assembled from ``state_dict`` and checked on every
    rank (every rank raises on a problem anywhere); nothing is changed."""
    problems: list[str] = []
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        problems.append("an optimizer state dict has 'state' and 'param_groups' (from "
                        "fxshard.get_optimizer_state_dict / get_state_dict)")
        agree_on(problems, driver, "loading the optimizer state")
    saved: Mapping[str, Any] = state_dict["state"]
    hyper: dict[str, dict[str, Any]] = {}
    for pg in state_dict["param_groups"]:
        for name in pg.get("params", ()):
            hyper[name] = {k: v for k, v in pg.items() if k != "params"}
    loads: OptimizerLoad = []
    groups_before = 0  # the saved param_groups are every optimizer's, one after the other
    for optimizer in optimizers:
        where = _stepped(driver, optimizer)
        new_state: dict[int, dict[str, Any]] = {}
        new_groups: list[dict[str, Any]] = []
        position = 0
        for pg in optimizer.param_groups:
            positions, found = [], None
            for p in pg["params"]:
                group, view_slot = where[id(p)]
                if view_slot is not None:  # use_orig_params: one parameter's piece
                    view_state = _view_state(group, view_slot, p, saved, driver, problems)
                    if view_state:
                        new_state[position] = view_state
                    positions.append(position)
                    position += 1
                    found = found or hyper.get(view_slot.name)
                    continue
                flat = _flat_state(group, p, saved, driver, problems)
                if flat:
                    new_state[position] = flat
                positions.append(position)
                position += 1
                found = found or next((hyper[s.name] for s in group.params if s.name in hyper), None)
            if not pg["params"]:  # an empty group (the HF Trainer makes one): its saved twin, by position
                saved_groups = state_dict["param_groups"]
                index = groups_before + len(new_groups)
                twin = saved_groups[index] if index < len(saved_groups) else None
                if twin is None or twin.get("params"):
                    problems.append(
                        f"{type(optimizer).__name__}'s param_group {len(new_groups)} holds no parameter, so its "
                        f"hyperparameters are those of the saved group at its position ({index}), which "
                        + ("does not exist" if twin is None else "holds parameters")
                        + ": load with the optimizers and groups the state was saved with")
                    twin = pg
                found = {k: v for k, v in twin.items() if k != "params"}
            if found is None:
                problems.append(f"no saved param_group holds the parameters of {type(optimizer).__name__}'s "
                                f"group {len(new_groups)}")
                found = {}
            new_groups.append({**found, "params": positions})
        loads.append((optimizer, {"state": new_state, "param_groups": new_groups}))
        groups_before += len(optimizer.param_groups)
    agree_on(problems, driver, "loading the optimizer state", source=lambda: content_source(
        [("param_groups", state_dict["param_groups"]), *sorted(saved.items(), key=lambda kv: repr(kv[0]))],
        "optimizer state"))
    return loads


def _view_state(group: FlatGroup, slot: ParamSlot, view: torch.Tensor, saved: Mapping[str, Any],
                driver: Driver, problems: list[str]) -> dict[str, Any]:
    """The optimizer state of one parameter's view (``use_orig_params``), from its saved state."""
    entry = saved.get(slot.name)
    if entry is None:
        problems.append(f"missing optimizer state for parameter {slot.name!r}")
        return {}
    result: dict[str, Any] = {}
    for key, value in entry.items():
        if len(value_shape(value) or ()) > 0:
            local = _local_piece(value, group, slot, driver, f"{slot.name!r} state {key!r}", problems)
            result[key] = (local.to(view.device).clone() if local is not None
                           else torch.zeros_like(view, dtype=value_dtype(value)))
        else:
            result[key] = value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return result


def _flat_state(group: FlatGroup, shard: torch.Tensor, saved: Mapping[str, Any], driver: Driver,
                problems: list[str]) -> dict[str, Any]:
    """One flat shard's optimizer state, assembled from its parameters' saved state."""
    entries = {}
    for slot in group.params:
        entry = saved.get(slot.name)
        if entry is None:
            problems.append(f"missing optimizer state for parameter {slot.name!r}")
        else:
            entries[slot.name] = entry
    if len(entries) < len(group.params):
        return {}
    keys = {name: sorted(e) for name, e in entries.items()}
    first = group.params[0].name
    differing = [n for n, k in keys.items() if k != keys[first]]
    if differing:
        problems.append(f"optimizer state keys differ between {first!r} {keys[first]} and {differing[0]!r} "
                        f"{keys[differing[0]]}, which share flat group {group.index}")
        return {}
    result: dict[str, Any] = {}
    rank = driver.world.rank
    for key in keys[first]:
        values = [entries[s.name][key] for s in group.params]
        if any(len(value_shape(v) or ()) > 0 for v in values):
            flat = torch.zeros_like(shard, dtype=value_dtype(values[0]))
            for slot, value in zip(group.params, values):
                local = _local_piece(value, group, slot, driver, f"{slot.name!r} state {key!r}", problems)
                piece = group.piece(slot, rank)
                if local is not None and piece is not None:
                    flat[piece.shard] = local
            result[key] = flat
        else:
            distinct = {float(v) if isinstance(v, torch.Tensor) else repr(v) for v in values}
            if len(distinct) > 1:
                problems.append(f"optimizer state {key!r} differs between the parameters of flat "
                                f"group {group.index} ({sorted(map(str, distinct))}); they are stepped "
                                "as one tensor")
            v = values[0]
            result[key] = v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
    return result
