"""This rank's flat shards of a model that is not fully here: built on the meta device, or real
on rank 0 only (``sync_module_states``).

Meta-device init (``with torch.device("meta"): model = Build()``): the ranks
first take rank 0's random generator state, so that they initialise alike.
Then, module by module in ``named_modules()`` order (the order a model built
normally initialises in), each module's own parameters and buffers are made
real on the device and initialised by ``param_init_fn(module)`` or the
module's ``reset_parameters()``; this rank copies its slices of the
parameters into its shards, and the module gets its meta parameters back.
A rank holds its shards plus one module's parameters at a time, never a
whole unit, let alone the model. Buffers stay real on the module, as always.

Every element is first filled with NaN, so a parameter or floating buffer
that the init left alone (a module whose ``reset_parameters`` skips one, a
buffer computed in ``__init__`` such as a rotary table) is an error naming it,
not a silent garbage value.

``sync_module_states``: rank 0's parameters are broadcast one flat group at a
time (each rank keeps its slice), and its buffers one by one; the other ranks'
copies are never read, so they may be built on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxshard.driver.run.runtime import World, comm_device
from fxshard.ir import predicates as P
from fxshard.ir.compat import OpOverload, TorchDispatchMode
from fxshard.ir.errors import FxShardError
from fxshard.ir.plan import ShardPlan

InitFn = Callable[[nn.Module], None]


def _own_tensors(module: nn.Module) -> bool:
    return any(t is not None for t in (*module._parameters.values(), *module._buffers.values()))


def _check_initialisable(module: nn.Module, init_fn: InitFn | None) -> None:
    if init_fn is not None:
        return
    if callable(getattr(module, "_init_weights", None)):
        # Hugging Face's convention: post_init() applies _init_weights to every module
        # after construction; on the meta device it changed nothing, and
        # reset_parameters() would silently give torch's defaults instead.
        raise FxShardError(
            f"{type(module).__name__} initialises its weights with _init_weights() (Hugging Face's "
            "post_init), which did nothing on the meta device. Pass param_init_fn=model._init_weights "
            "to fxshard.compile (called for every module with parameters or buffers of its own), "
            "or param_init_fn=lambda m: m.reset_parameters() for torch's default init."
        )
    lacking = [f"{name or '<root>'} ({type(m).__name__})" for name, m in module.named_modules()
               if _own_tensors(m) and not callable(getattr(m, "reset_parameters", None))]
    if lacking:
        raise FxShardError(
            f"the model is on the meta device, and these modules have parameters or buffers but "
            f"no reset_parameters() to initialise them: {lacking}. Give them a reset_parameters(), "
            "or pass param_init_fn=fn to fxshard.compile: fn(module) initialises that module's own "
            "parameters and buffers in place (they are real, uninitialised tensors when it runs)."
        )


Write = tuple[OpOverload, tuple[Any, ...], dict[str, Any]]


class _LaterWrites(TorchDispatchMode):
    """While a module initialises: its writes to a descendant's tensor (still on the meta
    device) are recorded, to replay after that descendant's own init; a write to a tensor of a
    module already initialised is refused.

    ``nn.MultiheadAttention._reset_parameters`` zeroes ``out_proj.bias``, a parameter of its
    child: built normally, the child exists first and the parent's write wins, so replaying it
    after the child's init gives the same values.
    """

    def __init__(self, path: str, later: dict[int, str], done: dict[int, str]):
        super().__init__()
        self.path, self.later, self.done = path, later, done
        # (qualified name, the meta tensor written, the write), in order.
        self.writes: list[tuple[str, torch.Tensor, Write]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for value in P.written_arguments(func, args):
            if not isinstance(value, torch.Tensor):
                continue
            if id(value) in self.done:
                raise FxShardError(
                    f"initialising the meta-device model: the init of module {self.path or '<root>'!r} "
                    f"wrote to {self.done[id(value)]!r} ({func}), which belongs to a module "
                    "fxshard has already initialised (module by module, in named_modules() "
                    "order), so the write would be lost. Initialise each tensor in the init of "
                    "its own module or of an ancestor, or build the model on a real device."
                )
            if id(value) in self.later:
                others = [a for a in (*args, *kwargs.values())
                          if isinstance(a, torch.Tensor) and a is not value and a.is_meta]
                if others:
                    raise FxShardError(
                        f"initialising the meta-device model: the init of module "
                        f"{self.path or '<root>'!r} wrote to {self.later[id(value)]!r} ({func}) "
                        "from other meta tensors, which fxshard cannot replay later. Write "
                        "constants or random values, or build the model on a real device."
                    )
                self.writes.append((self.later[id(value)], value, (func, args, kwargs)))
        return func(*args, **kwargs)


def _replay(meta: torch.Tensor, writes: list[Write], real: torch.Tensor) -> None:
    with torch.no_grad():
        for func, args, kwargs in writes:
            func(*[real if a is meta else a for a in args],
                 **{k: real if v is meta else v for k, v in kwargs.items()})


def agree_on_rng(world: World, device: torch.device) -> None:
    """Every rank continues with rank 0's random generator state (of ``device``'s generator)."""
    if world.group is None or world.job_size == 1:
        return
    if device.type == "cpu":
        state = torch.get_rng_state()
    else:
        state = torch.get_device_module(device.type).get_rng_state(device)
    comm = comm_device(world.group)
    shared = state.to(comm)
    group = world.job_group
    dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
    if device.type == "cpu":
        torch.set_rng_state(shared.cpu())
    else:
        torch.get_device_module(device.type).set_rng_state(shared.cpu(), device)


def materialise_shards(module: nn.Module, plan: ShardPlan, world: World, device: torch.device,
                       init_fn: InitFn | None, *, shard_device: torch.device | None = None,
                       ) -> list[nn.Parameter]:
    """This rank's flat shards of the meta-device ``module``, initialised module by module on
    ``device``; the shards are kept on ``shard_device`` (the host, under offload)."""
    _check_initialisable(module, init_fn)
    agree_on_rng(world, device)
    where = {}
    for group in plan.groups:
        for slot in group.params:
            for name in slot.names:
                where[name] = (group, slot)
    shards = [torch.zeros(g.shard_numel, dtype=g.dtype, device=shard_device or device) for g in plan.groups]
    written: set[int] = set()  # flat-group slots already copied (a tied parameter: its first init)
    # Writes an ancestor's init made to a tensor still on the meta device, by its qualified
    # name, with the meta tensor they were made to: replayed after the tensor's own init.
    pending: dict[str, tuple[torch.Tensor, list[Write]]] = {}
    done: dict[int, str] = {}  # the meta tensors of modules already initialised
    for path, mod in module.named_modules():
        if not _own_tensors(mod):
            continue
        prefix = f"{path}." if path else ""
        later = {id(t): f"{prefix}{name}" for name, t in
                 [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]
                 if "." in name and t is not None and t.is_meta and id(t) not in done}
        originals = dict(mod._parameters)
        meta_buffers = {name: b for name, b in mod._buffers.items() if b is not None and b.is_meta}
        real: dict[str, torch.Tensor] = {}
        for name, p in originals.items():
            if p is None:
                continue
            value = torch.full(p.shape, float("nan"), dtype=p.dtype, device=device) \
                if p.dtype.is_floating_point else torch.zeros(p.shape, dtype=p.dtype, device=device)
            mod._parameters[name] = real[name] = nn.Parameter(value, requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.full(b.shape, float("nan"), dtype=b.dtype, device=device) \
                    if b.dtype.is_floating_point else torch.zeros(b.shape, dtype=b.dtype, device=device)
        try:
            recorder = _LaterWrites(path, later, done)
            with torch.no_grad(), recorder:
                if init_fn is not None:
                    init_fn(mod)
                else:
                    mod.reset_parameters()
            for name, meta, write in recorder.writes:
                pending.setdefault(name, (meta, []))[1].append(write)
            for name, value in [*real.items(), *((n, mod._buffers[n]) for n in meta_buffers)]:
                if prefix + name in pending:
                    _replay(*pending.pop(prefix + name), value)
            left = [f"parameter {name!r}" for name, t in real.items() if bool(t.isnan().any())]
            left += [f"buffer {name!r}" for name, b in mod._buffers.items()
                     if b is not None and b.dtype.is_floating_point and bool(b.isnan().any())]
            if left:
                how = "param_init_fn" if init_fn is not None else "reset_parameters()"
                raise FxShardError(
                    f"initialising the meta-device model: {how} of module {path or '<root>'!r} "
                    f"({type(mod).__name__}) left {', '.join(left)} uninitialised (NaN). Pass "
                    "param_init_fn=fn to fxshard.compile, where fn(module) also sets those (e.g. "
                    "recomputes a buffer that __init__ computed), or build the model on a real device."
                )
            for name, value in real.items():
                group, slot = where[prefix + name]
                key = id(slot)
                if key in written:
                    continue
                written.add(key)
                piece = group.piece(slot, world.rank)
                if piece is not None:
                    shards[group.index][piece.shard].copy_(value.detach().reshape(-1)[piece.param])
        finally:
            mod._parameters.update(originals)  # the meta parameters again: nothing full stays
            done.update({id(p): prefix + name for name, p in originals.items() if p is not None})
    return [nn.Parameter(s, requires_grad=g.requires_grad) for g, s in zip(plan.groups, shards)]


def broadcast_shards(module: nn.Module, plan: ShardPlan, world: World,
                     device: torch.device) -> list[nn.Parameter]:
    """This rank's flat shards of rank 0's parameters (``sync_module_states``), and rank 0's
    buffers in ``module`` (made real on ``device`` where they are on the meta device)."""
    assert world.group is not None
    job = world.job_group  # every replica gets rank 0's values
    src = dist.get_global_rank(job, 0)
    comm = comm_device(world.group)
    params = dict(module.named_parameters(remove_duplicate=False))
    # Agreed before the first broadcast: a rank 0 that raised alone left the others waiting in
    # it until the group's timeout.
    meta = [n for n, t in [*params.items(), *module.named_buffers(remove_duplicate=False)] if t.is_meta] \
        if world.job_rank == 0 else []
    flag = torch.tensor([len(meta)], device=comm)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=job)
    if int(flag.item()):
        said = [meta]
        dist.broadcast_object_list(said, src=src, group=job)  # rank 0's names, said on every rank
        meta = said[0]
        named = f" ({', '.join(meta[:8])}{', ...' if len(meta) > 8 else ''})" if meta else ""
        raise FxShardError(
            f"sync_module_states=True broadcasts rank 0's parameters and buffers, but rank 0's model "
            f"has tensors on the meta device{named}: build (or load) the real model on rank 0, its "
            "buffers too (a non-persistent buffer, such as rotary embeddings' inv_freq, stays on meta "
            "after load_state_dict(assign=True): compute it on rank 0)")
    shards = []
    for group in plan.groups:
        full = torch.zeros(group.padded_numel, dtype=group.dtype, device=comm)
        if world.job_rank == 0:
            for slot in group.params:
                full[slot.offset:slot.offset + slot.numel].copy_(params[slot.name].detach().reshape(-1))
        dist.broadcast(full, src=src, group=job)
        lo, hi = group.shard_range(world.rank)
        shards.append(nn.Parameter(full[lo:hi].to(device, copy=True), requires_grad=group.requires_grad))
        del full
    for mod in module.modules():
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            value = b.to(comm) if not b.is_meta else torch.empty(b.shape, dtype=b.dtype, device=comm)
            dist.broadcast(value, src=src, group=job)
            mod._buffers[name] = value.to(device)
    return shards
