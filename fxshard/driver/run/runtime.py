"""Runtime state: the flat shards each rank owns, and moving between full and sharded.

Everything here is eager tensor code around c10d; the step itself runs inside
the compiled graphs.
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from fxshard.driver.run import rehearsal
from fxshard.ir import compat
from fxshard.ir.errors import FxShardError
from fxshard.ir.layout import CommGroup, Layout
from fxshard.ir.plan import FlatGroup, ShardPlan


@dataclass(frozen=True)
class World:
    """Where this rank sits. ``group`` is None when no process group is initialised.

    ``rank`` and ``size`` are this rank's place in the group a flat group is
    sharded over, ``group``. ``comm`` are the process groups the compiled steps'
    collectives run on, in slot order (``with_comm_groups``): fxshard's own
    groups over the same ranks, or ``group`` itself. ``timeout`` is how long any
    of them waits. ``layout`` is the job's topology (``fxshard.ir.layout``), built
    once with the groups: the shard group, HSDP's replicas, hpZ's partition, this
    rank's place in each and the names of their groups. ``job`` is HSDP's group
    over every rank of the mesh (None: the shard group is the job).
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None
    comm: tuple[dist.ProcessGroup, ...] = ()
    timeout: datetime.timedelta | None = None
    layout: Layout = field(default=None)  # type: ignore[assignment]  # a flat one by default
    job: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.layout is None:  # one flat group: the steps' slots, or the group itself
            if self.comm:
                shard = _dimension(self.size, self.rank, self.comm)
            elif self.group is not None:
                shard = replace(_dimension(self.size, self.rank, (self.group,)), slots=())
            else:
                shard = CommGroup(self.size, None, rank=self.rank)
            object.__setattr__(self, "layout", Layout(shard))
        if (self.layout.shard.size, self.layout.shard.rank) != (self.size, self.rank):
            raise ValueError(f"a layout of rank {self.layout.shard.rank} of {self.layout.shard.size} for "
                             f"rank {self.rank} of {self.size}")

    @property
    def comm_group(self) -> dist.ProcessGroup:
        """The group the compiled steps and full state dicts gather on (the first slot). Only
        where there is a process group."""
        group = self.comm[0] if self.comm else self.group
        assert group is not None, "no process group: nothing to communicate on"
        return group

    @property
    def job_group(self) -> dist.ProcessGroup:
        """The group over every rank of the job: the agreement, broadcasts, the memory budget's
        maximum and checkpoints. The shard group itself without replicas."""
        return self.job if self.job is not None else self.comm_group

    @property
    def job_rank(self) -> int:
        """This rank's place in :attr:`job_group`."""
        return dist.get_rank(self.job) if self.job is not None else self.rank

    @property
    def job_size(self) -> int:
        """Ranks in the job: the shard group's, times the replicas."""
        return self.layout.world_size

    @property
    def global_rank(self) -> int:
        """This rank as the job numbers it (``torch.distributed.get_rank()``, what torchrun's logs
        and RANK say), whatever group it shards over; messages name ranks by it."""
        return dist.get_rank() if self.group is not None else self.rank

    def job_members(self) -> list[int]:
        """The job's ranks (``global_rank``s) in :attr:`job_group`'s order: what the index of a
        rank's row in a gather over the job names."""
        if self.group is None:
            return [self.rank]
        return dist.get_process_group_ranks(self.job_group)

    def who(self, row: bool = False) -> str:
        """This rank, for a message: the job's rank; with ``row``, where a message is about its
        shard group and that differs from the job (HSDP, process_group=), its place there too."""
        named = f"rank {self.global_rank}"
        if row and self.group is not None and (self.job is not None or self.rank != self.global_rank):
            ranks = dist.get_process_group_ranks(self.comm_group)
            named += f" (rank {self.rank} of its shard group, ranks {ranks})"
        return named

    @property
    def group_name(self) -> str | None:
        return None if self.group is None else self.comm_group.group_name

    def groups(self, dimension: CommGroup | None) -> tuple[dist.ProcessGroup, ...]:
        """The process groups of one of the layout's dimensions, in slot order (none for None)."""
        return tuple(compat.resolve_process_group(name) for name in dimension.groups) if dimension else ()

    @property
    def all_comm(self) -> tuple[dist.ProcessGroup, ...]:
        """Every group the compiled steps' collectives run on: the shard group's slots, then
        HSDP's replicas' and hpZ's partition's."""
        return (*self.comm, *self.groups(self.layout.replicate), *self.groups(self.layout.partition))

    def topology(self) -> str:
        """Where this rank sits beyond its shard group, for reports; "" on one flat group."""
        job = (f"rank {self.job_rank} of {self.job_size} in the job (HSDP, "
               f"{self.layout.replicate.size} x {self.size})") if self.layout.replicate is not None else ""
        return "; ".join(part for part in (job, self.layout.describe()) if part)


def _dimension(size: int, rank: int, groups: tuple[dist.ProcessGroup, ...]) -> CommGroup:
    """One dimension of the layout over ``groups`` (its slots, all over the same ranks): its
    first group's name, every slot's, this rank's place and the job's ranks of the group."""
    names = tuple(g.group_name for g in groups)
    return CommGroup(size, names[0], names, rank, tuple(dist.get_process_group_ranks(groups[0])))


def agree_on_mesh(mesh: Any, front_end: str = "fxshard.compile") -> None:
    """Before any group is made from ``mesh``: every rank of the job is in the mesh it passed,
    and ranks that share a mesh passed the same one (sliced meshes, one row per rank, agree).
    Else raise on every rank, naming who passed what, where the groups' creation would fail
    with an ``IndexError`` on one rank and a store timeout on the others. A collective over
    the job, as the groups' creation is (``with_comm_groups``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    mine = (tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    me, size = dist.get_rank(), len(every)

    def said(r: int) -> str:
        shape, ranks = every[r]
        return f"a {shape} mesh over ranks {list(ranks)}"

    outside = [r for r, (_, ranks) in enumerate(every) if r not in ranks]
    if outside:
        raise FxShardError(
            f"rank {me}: rank(s) {outside} are outside the mesh they passed to {front_end} "
            f"(rank {outside[0]}: {said(outside[0])}). Every rank of the job takes part in "
            f"fxshard's process groups: build the mesh over all {size} ranks, e.g. "
            f"init_device_mesh(device_type, ({size},)) or (R, S) with R * S = {size}, and pass "
            "it on every rank."
        )
    differ = sorted({(r, s) for r, (_, ranks) in enumerate(every) for s in ranks if every[s] != every[r]})
    if differ:
        r, s = differ[0]
        raise FxShardError(
            f"rank {me}: the ranks passed different meshes to {front_end}: rank {r} passed "
            f"{said(r)}, rank {s} passed {said(s)}. Every rank must pass the same mesh: build it "
            "once with init_device_mesh(device_type, shape), the same shape on every rank, and "
            "pass that."
        )


def resolve_world(process_group: dist.ProcessGroup | None) -> World:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group takes a torch.distributed.ProcessGroup (dist.group.WORLD, or one from "
            f"dist.new_group(ranks)), not {process_group!r} ({type(process_group).__name__}); for a "
            "DeviceMesh pass mesh=, and for the default group leave process_group out")
    if process_group is not None:
        return World(dist.get_rank(process_group), dist.get_world_size(process_group), process_group)
    if dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
        assert group is not None
        return World(dist.get_rank(group), dist.get_world_size(group), group)
    env_size = int(os.environ.get("WORLD_SIZE", "1") or "1")
    if env_size > 1:
        raise FxShardError(
            f"WORLD_SIZE={env_size} but no process group is initialised: call "
            "torch.distributed.init_process_group(backend) (gloo on CPU, nccl on CUDA, xccl on "
            "XPU) before fxshard.compile, or pass process_group=. Refusing to train unsharded."
        )
    return World(0, 1, None)


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group``'s backend takes its tensors: the current accelerator's device when the
    backend is torch's for it (nccl for CUDA, xccl for XPU), else the CPU (gloo)."""
    rehearsed = rehearsal.of(group)
    if rehearsed is not None:  # a rehearsal's groups take the tensors of the device it runs on
        return rehearsed.device
    backend = dist.get_backend(group)
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and backend == dist.get_default_backend_for_device(accelerator):
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The timeout ``group`` was created with (torch's default for its backend if unknown)."""
    return compat.group_timeout(group)


def with_comm_groups(world: World, slots: int, timeout: float | None,
                     hsdp: tuple[tuple[int, ...], ...] | None = None, hpz: int | None = None) -> World:
    """``world`` with ``slots`` process groups of fxshard's own over the same ranks.

    A collective: every rank creates them, in the same order, when it builds
    a driver (``fxshard.compile``, ``fxshard.parameters``). Each waits
    ``timeout`` seconds (default: ``world.group``'s timeout) at the transport
    level too, so a rank whose peer is gone or stalled gets an error and its
    process can exit. Over gloo each has one worker thread
    (``compat.one_thread_gloo``), always: every collective fxshard issues runs on
    them, and at exit :func:`quiesce` makes sure their threads hold nothing.
    Elsewhere, with one slot and no timeout of its own, the steps use
    ``world.group`` itself.

    ``hsdp`` (the global ranks of an (R, S) mesh, rows shard) adds the
    replicas: ``slots`` groups over this rank's column and one over the whole
    mesh. Every rank creates every row's and column's groups, in the same
    order (``new_group``'s rule), and keeps its own.

    ``hpz`` (``reshard_after_forward=h``) adds ``slots`` groups over each block of
    h consecutive ranks of every shard group (the layout's ``partition``).
    """
    fake = world.group is not None and dist.get_backend(world.group) == "fake"
    if world.group is None or fake and hsdp is None and hpz is None:
        return world  # torch's fake process group: the graphs name its groups, nothing runs
    # One rank too: its gathers and reduce-scatters are gloo collectives all the same, and
    # on the default group's two worker threads they race as on many ranks.
    limit = datetime.timedelta(seconds=timeout) if timeout is not None else group_timeout(world.group)
    # gloo's: one worker thread each, so that a group's status is never written by two at once.
    backend = compat.one_thread_gloo() if dist.get_backend(world.group) == "gloo" else None
    if fake:
        slots = 1
    if slots == 1 and timeout is None and backend is None and hsdp is None and hpz is None:
        return replace(world, comm=(world.group,), timeout=limit,
                       layout=Layout(_dimension(world.size, world.rank, (world.group,))))

    def own(ranks: list[int]) -> dist.ProcessGroup | None:
        group = dist.new_group(ranks, timeout=limit, backend=backend, use_local_synchronization=False)
        if backend is not None and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            _OWN_GROUPS.add(group)
        return group if dist.get_rank() in ranks else None

    def mine(groups_of: list[list[int]]) -> tuple[dist.ProcessGroup, ...]:
        kept = [[own(ranks) for ranks in groups_of] for _ in range(slots)]
        return tuple(g for slot in kept for g in slot if g is not None)

    rows = [list(row) for row in hsdp] if hsdp is not None else [dist.get_process_group_ranks(world.group)]
    comm = mine(rows)
    shard = _dimension(world.size, world.rank, comm)
    partition = None
    if hpz is not None:  # blocks of h consecutive ranks of each row, in the row's rank order
        blocks = [row[i:i + hpz] for row in rows for i in range(0, len(row), hpz)]
        partition = _dimension(hpz, world.rank % hpz, mine(blocks))
        assert len(partition.groups) == slots
    if hsdp is None:
        return replace(world, comm=comm, timeout=limit, layout=Layout(shard, partition=partition))
    columns = [list(column) for column in zip(*hsdp)]
    replica_comm = mine(columns)
    job = own(sorted(r for row in rows for r in row))
    me = dist.get_rank()
    replica = next(i for i, row in enumerate(rows) if me in row)
    assert job is not None and len(comm) == len(replica_comm) == slots
    replicate = _dimension(len(rows), replica, replica_comm)
    return replace(world, comm=comm, timeout=limit, layout=Layout(shard, replicate, partition), job=job)


def make_shards(module: nn.Module, plan: ShardPlan, rank: int, device: torch.device) -> list[nn.Parameter]:
    """This rank's flat shard of every group, copied from ``module``'s parameters.

    Copies only the overlap of each parameter with the shard, so the full flat
    buffer is never built.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    shards = []
    for group in plan.groups:
        shard = torch.zeros(group.shard_numel, dtype=group.dtype, device=device)
        for slot in group.params:
            piece = group.piece(slot, rank)
            if piece is not None:
                shard[piece.shard].copy_(params[slot.name].detach().reshape(-1)[piece.param])
        shards.append(nn.Parameter(shard, requires_grad=group.requires_grad))
    return shards


# Parameters fxshard took the data out of, and what to build an optimizer over
# instead: an optimizer stepping over one of them is a mistake.
_RETIRED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # by identity: tensors have no truth value
_HOOK: list[Any] = []
# shard -> a check that raises when an optimizer step over it would be wrong now
_STEP_CHECKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


# The local optimizers torch's ZeroRedundancyOptimizer steps (its ``optim``): each holds this
# rank's partition of the groups, which may be empty (fewer parameters than ranks). They are
# checked as the ZeroRedundancyOptimizer over all of them, which steps first.
_ZERO_LOCAL: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        local = getattr(optimizer, "optim", None)  # made at its first step under overlap_with_ddp
        if local is not None:
            _ZERO_LOCAL.add(local)
    elif optimizer in _ZERO_LOCAL:
        return None
    if not any(group["params"] for group in optimizer.param_groups):
        # torch refuses an empty parameter list, but not groups that are all empty: a rule by
        # name over sharded.named_parameters() that matched nothing steps nothing, silently.
        raise FxShardError(
            f"{type(optimizer).__name__} has {len(optimizer.param_groups)} param_groups and no "
            "parameter in any: its step would change nothing. Build it over sharded.parameters() "
            "(with use_orig_params=True, choose groups from sharded.named_parameters(), whose "
            "names are the model's)."
        )
    checks: dict[int, Callable[[torch.optim.Optimizer], None]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            check = _STEP_CHECKS.get(p)
            if check is not None:
                checks.setdefault(id(check), check)
            use = _RETIRED.get(p)
            if use is not None:
                raise FxShardError(
                    f"{type(optimizer).__name__} was built over a parameter of shape "
                    f"{tuple(p.shape)} that fxshard has sharded: it no longer holds the model, "
                    f"so it would never change. Build the optimizer over {use}, e.g. "
                    f"torch.optim.AdamW({use}, lr=...)."
                )
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args: (optimizer, ...)
    if closure is None:
        for check in checks.values():
            check(optimizer)
        return None
    if not checks:
        return None

    # step(closure) runs the forward and backward itself (Lightning steps this way): the
    # gradients to check exist once the closure has run, just before the update.
    def checked() -> Any:
        result = closure()
        for check in checks.values():
            check(optimizer)
        return result

    return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": checked}


def retire(params: list[nn.Parameter], use: str) -> None:
    """Refuse any optimizer step over ``params``; ``use`` is what to step over instead."""
    for p in params:
        _RETIRED[p] = use
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def refuse_state_dicts_of_stand_ins(module: nn.Module, save: str, load: str) -> None:
    """``module.state_dict()`` and ``load_state_dict`` of a module whose parameters are
    fxshard's stand-ins (the shards hold the model) raise, naming ``save`` and ``load``: the
    one returned the stand-ins (zeros, or meta tensors that fail only when loaded), the
    other loaded into them and left the shards as they were, both without an error. Every
    submodule is hooked, for a state dict of one layer. fxshard's own state dicts run the
    module's with its full parameters in place, which these hooks let through."""
    def own_stand_ins(mod: nn.Module) -> list[str]:
        return [name for name, p in mod._parameters.items() if p is not None and p in _RETIRED]

    def saving(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        names = own_stand_ins(mod)
        if names:
            raise FxShardError(
                f"{type(mod).__name__}.state_dict() would return fxshard's stand-ins for "
                f"{prefix}{names[0]}, not the model: its parameters live in this rank's shards now. "
                f"Use {save}.")

    def loading(mod: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
        names = [name for name in own_stand_ins(mod) if prefix + name in state_dict]
        if names:
            raise FxShardError(
                f"{type(mod).__name__}.load_state_dict() would load {prefix}{names[0]} into fxshard's "
                "stand-ins and leave the shards, which hold the model, as they are. "
                f"Use {load}.")

    saving.fxshard_refusal = loading.fxshard_refusal = True  # type: ignore[attr-defined]  # not the module's own
    for sub in module.modules():
        sub.register_state_dict_pre_hook(saving)
        sub.register_load_state_dict_pre_hook(loading)


def check_steps(params: list[nn.Parameter], check: Callable[[torch.optim.Optimizer], None]) -> None:
    """Before any optimizer step over one of ``params``, call ``check(optimizer)`` (once per step)."""
    for p in params:
        _STEP_CHECKS[p] = check
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def refuse_ddp(module: nn.Module) -> NoReturn:
    """``DistributedDataParallel(module)`` over a module whose parameters are this rank's shards."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise FxShardError(
        f"rank {rank}: DistributedDataParallel over a {type(module).__name__}: fxshard already "
        "reduces the gradients across ranks, and each rank's parameters are a different shard of "
        "the model. DDP would broadcast rank 0's shards over every other rank's and all-reduce "
        "different shards' gradients, corrupting the model. Do not wrap it: "
        "sharded = fxshard.compile(model) takes the place of DDP(model), and has DDP's no_sync() "
        "and clip_grad_norm_()."
    )


def refuse_fully_shard(cls: type) -> NoReturn:
    """FSDP2's ``fully_shard`` over a module whose parameters are this rank's shards (``cls``:
    the class it was making, a subclass of the module's and of ``FSDPModule``)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise FxShardError(
        f"rank {rank}: fully_shard over a ShardedModule (making {cls.__name__}): fxshard already "
        "shards the parameters and reduces the gradients, and each rank's parameters are a "
        "different shard of the model. FSDP2 would shard each shard again and gather pieces of "
        "different ranks' shards into one parameter, corrupting the model. FSDP2 made the "
        "parameters its DTensors before this check could run: build the model again and "
        "compile it without fully_shard; fxshard.compile(model, policy=by_class(Block)) takes "
        "the place of fully_shard on each block and the root."
    )


def _trainer_moving() -> tuple[str, str] | None:
    """The trainer on the call stack that is moving a module, if it is one fxshard has its own
    for: ("lightning", its strategy's class) or ("transformers", the Trainer's class). Read from
    the frames' modules, so a moved import path or a subclass is still recognised; fxshard's
    own strategy and trainer are not."""
    here = inspect.currentframe()
    frame: FrameType | None = here.f_back if here is not None else None
    found: tuple[str, str] | None = None
    while frame is not None:
        package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
        kind = type(frame.f_locals.get("self"))
        trainer = "lightning" if package in ("lightning", "pytorch_lightning") and \
            kind.__name__.endswith("Strategy") else \
            "transformers" if package == "transformers" and kind.__name__.endswith("Trainer") else None
        if trainer is not None:
            if any(c.__module__.startswith("fxshard.") for c in kind.__mro__):
                return None  # FxShardStrategy's or FxShardTrainer's (or a subclass's) own move
            found = found or (trainer, kind.__name__)
        frame = frame.f_back
    return found


def refuse_move(module: nn.Module) -> NoReturn:
    """``module.to(...)``, ``.cpu()``, ``.half()`` ... on a module whose parameters are this rank's
    shards, placed by fxshard.compile. Lightning's strategies and the Hugging Face Trainer
    move their model themselves: for them the fix is fxshard's own strategy and trainer."""
    head = (f"rank {_job_rank()}: a {type(module).__name__} cannot be moved or cast after "
            "compile (its parameters are this rank's flat shards, placed by fxshard.compile)")
    moving = _trainer_moving()
    if moving is not None and moving[0] == "lightning":
        raise FxShardError(
            f"{head}, and Lightning's {moving[1]} moves the LightningModule to its device. "
            "Lightning's own strategies do not know fxshard: use Trainer(strategy=\"fxshard\") "
            "(after import fxshard.lightning; or strategy=fxshard.lightning.FxShardStrategy(...)) "
            "and keep the model unsharded in the LightningModule (self.model = Model(), not "
            "fxshard.compile(Model())): the strategy compiles it at setup, on its device."
        )
    if moving is not None:
        raise FxShardError(
            f"{head}, and the Hugging Face {moving[1]} moves its model to args.device (and would "
            "wrap it in DDP). Use fxshard.hf.FxShardTrainer in place of Trainer, with the model "
            "unsharded: FxShardTrainer(model=model, args=args, ...) compiles it itself, on its "
            "device, and keeps the Trainer's loop."
        )
    raise FxShardError(
        f"{head}: move the model with .to(device / dtype) before fxshard.compile. Under Lightning "
        "use Trainer(strategy=\"fxshard\"), under the Hugging Face Trainer "
        "fxshard.hf.FxShardTrainer: they compile the unsharded model on its device."
    )


_STRIPPED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> what sharded it


_STAND_INS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # stand-in -> (what sharded it, its model)


def mark_sharded(module: nn.Module, by: str) -> None:
    """``module``'s parameters now live in shards ``by`` made (e.g. "fxshard.compile"); its
    parameters are the stand-ins."""
    _STRIPPED[module] = by
    for p in module.parameters():
        _STAND_INS[p] = (by, type(module).__name__)


def refuse_compiled(module: nn.Module) -> None:
    """A module ``torch.compile`` returned (an ``OptimizedModule``), or a model holding one:
    fxshard traces the forward itself, and tracing into Dynamo's frames fails deep inside
    (a RecursionError). Refused, naming the module and what to write instead."""
    compiled = compat.optimized_module_class()
    found = next((name for name, m in module.named_modules() if isinstance(m, compiled)), None)
    if found is None:
        return
    where = "the model" if found == "" else f"submodule {found!r}"
    raise FxShardError(
        f"{where} is a torch.compile-d module (an OptimizedModule): fxshard traces and compiles the "
        f"step itself. Give fxshard the module before torch.compile ({'model' if found == '' else found}"
        "._orig_mod is it), and for Inductor's kernels pass compute='inductor'; or compile the "
        "unsharded model with torch.compile(model, backend=fxshard.backend(policy=...)) (docs/backend.md)"
    )


def refuse_sharded_again(module: nn.Module) -> None:
    """Sharding a module whose parameters are already stand-ins would take the meta-init
    path and initialise new weights: refuse, naming what sharded it. So for a new model
    holding a submodule of a sharded one (its stand-ins beside fresh parameters, or alone)."""
    by = _STRIPPED.get(module)
    if by is not None:
        raise FxShardError(
            f"this {type(module).__name__} was sharded already by {by}: its parameters are "
            "stand-ins now and the shards that call made hold the model. Sharding it again "
            "would initialise new weights. Use what the first call returned, or build the "
            "model anew to shard it another way."
        )
    reused = [(name, _STAND_INS[p]) for name, p in module.named_parameters() if p in _STAND_INS]
    if reused:
        name, (by, owner) = reused[0]
        more = f" (and {len(reused) - 1} more)" if len(reused) > 1 else ""
        raise FxShardError(
            f"rank {_job_rank()}: parameter {name!r} of this {type(module).__name__}{more} "
            f"belongs to the {owner} sharded already by {by}: it is a stand-in on the meta "
            "device, without data (the shards that call made hold the weights), so sharding it "
            "again would initialise new weights. A submodule of a sharded model cannot go into "
            "another sharded model: compile the whole model once and train what fxshard.compile "
            "returned, or build the new model from fresh modules; to start it from the trained "
            "weights, load the sharded model's full_state_dict() into the fresh modules before "
            "compiling them."
        )


def refuse_eager_calls(module: nn.Module, message: Callable[[nn.Module], str]) -> None:
    """A forward of ``module`` or of a submodule with parameters, run outside a trace (where
    its parameters are stand-ins and would act as zero weights), raises ``message(mod)``.
    Traces run with ``torch.compiler.is_compiling()`` true (Dynamo's, and fxshard's own)."""

    def check(mod: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            raise FxShardError(message(mod))

    for mod in module.modules():
        if any(True for _ in mod.parameters(recurse=False)):
            mod.register_forward_pre_hook(check)


def _job_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def no_gradient_message(use: str, what: str) -> str:
    """A stand-in's gradient was used (``what``): it has none; the shards ``use`` have."""
    fix = f"torch.nn.utils.clip_grad_norm_({use}, max_norm)"
    if use == "sharded.parameters()":
        fix = f"sharded.clip_grad_norm_(max_norm) or {fix}"
    return (
        f"rank {_job_rank()}: {what} on the gradient of a parameter of the module given to "
        "fxshard: its parameters are stand-ins now and get no gradient (the flat shards do), so "
        f"clipping or measuring them would see nothing and return 0. Use the shards: {fix}; "
        f"for anything else read the gradients of {use}."
    )


class _NoGrad(torch.Tensor):
    """What a stand-in's ``.grad`` reads: a zero-size-in-memory tensor that refuses to be
    used as a gradient (norms, clipping, arithmetic), so ``clip_grad_norm_(model.parameters())``
    raises instead of clipping nothing. Its metadata can be read, and zeroing it is a no-op
    (``model.zero_grad()``, an optimizer's ``zero_grad(set_to_none=False)``)."""

    use_instead: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in _NO_GRAD_READS:  # properties (.device, .shape), sizes
            return super().__torch_function__(func, types, args, kwargs or {})
        if name in _NO_GRAD_NO_OPS:
            return args[0] if isinstance(args[0], torch.Tensor) else None
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
        use = next((a.use_instead for a in flat if isinstance(a, _NoGrad)), "sharded.parameters()")
        raise FxShardError(no_gradient_message(use, f"{name or func}()"))


_NO_GRAD_READS = frozenset({"size", "dim", "numel", "nelement", "element_size", "__hash__",
                            "is_floating_point", "is_complex", "stride", "is_contiguous"})
_NO_GRAD_NO_OPS = frozenset({"zero_", "_foreach_zero_", "requires_grad_", "detach_"})


class StandIn(nn.Parameter):
    """A meta stand-in of a parameter fxshard sharded. It gets no gradient; reading ``.grad``
    gives a ``_NoGrad`` that refuses to be clipped or measured, where ``None`` would make
    ``clip_grad_norm_(model.parameters())`` clip nothing and return 0. Setting it to None
    (``zero_grad``) does nothing."""

    @property
    def grad(self) -> torch.Tensor:
        standin = torch.zeros((), dtype=self.dtype).expand(self.shape).as_subclass(_NoGrad)
        standin.use_instead = _RETIRED.get(self, "sharded.parameters()")
        return standin

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise FxShardError(no_gradient_message(_RETIRED.get(self, "sharded.parameters()"),
                                                   "setting .grad"))


def strip_parameters(module: nn.Module, device: torch.device | None = None,
                     dtypes: dict[int, torch.dtype] | None = None) -> None:
    """Replace every parameter by a stand-in that holds no data, keeping ties.

    The module stays as the skeleton that ``functional_call`` runs; its real
    parameters live only in the flat shards from here on. Stand-ins live on
    the meta device, or with a ``device`` on it as one element broadcast to the
    parameter's shape (for Dynamo, which bakes the device of tensors computed
    from parameters into its graphs). ``dtypes`` maps ``id(parameter)`` to the
    stand-in's dtype, the one the graphs compute with (mixed precision's
    ``param_dtype``): Dynamo bakes dtypes read from tensors (``h.dtype``) too.
    """
    stand_ins: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in stand_ins:
                dtype = (dtypes or {}).get(id(p), p.dtype)
                if device is not None:
                    data = torch.zeros((), dtype=dtype, device=device).expand(p.shape)
                else:
                    data = torch.empty(p.shape, dtype=dtype, device="meta")
                kind = nn.Parameter if device is not None else StandIn  # Dynamo traces the former
                stand_ins[id(p)] = kind(data, requires_grad=p.requires_grad)
            mod._parameters[name] = stand_ins[id(p)]


def broadcast_buffers(buffers: list[torch.Tensor], world: World) -> None:
    """Copy rank 0's ``buffers`` to every rank, in place (a collective; DDP's broadcast_buffers)."""
    if world.group is None or world.job_size == 1 or not buffers:
        return
    if dist.get_backend(world.group) == "fake":
        return  # nothing is communicated on torch's fake process group
    group = world.job_group
    with torch.no_grad():
        # What DDP calls: the buffers coalesced into few messages, copied back in place.
        compat.broadcast_coalesced(group, buffers, _BROADCAST_BUCKET_BYTES, 0)


_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size


def wait_within(work: dist.Work | None, timeout: float | None, error: Callable[[str], Exception],
                group: dist.ProcessGroup | None = None) -> None:
    """Wait for an async collective; past ``timeout`` seconds (None: the group's own) raise
    ``error(what)`` instead of hanging.

    ``what`` says truthfully how the wait ended, to complete a sentence such as "the
    other ranks did not answer {what}": "within 60s" when ``timeout`` fired, the
    process group's own timeout when that fired first, or how soon it failed and why
    (a peer that died closes the connection at once).
    """
    assert work is not None
    start = time.monotonic()
    try:
        if timeout is None or rehearsal.of(group) is not None:  # a rehearsal has no peers to wait for
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        settle(work, group)
        raise error(how_the_wait_ended(time.monotonic() - start, timeout, group, e)) from e


# Collectives whose wait failed, for the life of the process: see settle.
_FAILED: list[dist.Work] = []

# fxshard's own one-thread gloo groups still alive: quiesced when the interpreter exits.
_OWN_GROUPS: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def settle(work: dist.Work | None, *groups: dist.ProcessGroup | None) -> None:
    """After a collective on ``groups`` failed: let it end, and let their worker threads let go.

    A wait that timed out leaves the collective running on a gloo worker thread
    until the group's own (transport) timeout, which fxshard's groups share with
    the wait's. So: wait for ``work`` to end (at most the groups' timeout and a
    little more: never a hang), then :func:`quiesce` the groups. What this
    thread waited on is kept here, where only this thread drops it. Afterwards
    the groups are out of step with the peers' (quiesce's empty collectives took
    sequence numbers): only for groups that are unusable already.
    """
    present = [g for g in groups if g is not None]
    if not present:
        return
    if work is not None:
        _FAILED.append(work)
        limit = max(group_timeout(g).total_seconds() for g in present) + 5.0
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError:
            pass  # it ended with its error, or is past every timeout: nothing more to do
    quiesce(*present)


def quiesce(*groups: dist.ProcessGroup, within: float = 5.0) -> bool:
    """Return once the worker thread of each of ``groups`` holds no collective any more.

    A gloo worker thread drops each collective it ran a moment after the
    collective is marked done. Dropping it releases its tensors, and torch needs
    the GIL for that: a worker thread that does it while the interpreter exits
    calls ``pthread_exit`` through a noexcept destructor (std::terminate,
    SIGABRT, after a run that succeeded). On each group with one worker thread
    (fxshard's own over gloo, ``with_comm_groups``) this runs an empty
    all-reduce, which needs no peer, and waits until the thread has let go of
    it: having taken it last, the thread holds nothing from before. All within
    one deadline of ``within`` seconds; True if every group got there. Other
    groups are skipped.
    """
    deadline = time.monotonic() + within
    pending = []
    for group in groups:
        if group not in _OWN_GROUPS:  # fxshard's own: one worker thread each
            continue
        empty = torch.empty(0)
        try:
            # The group's own method: it also runs on a group destroy_process_group dropped.
            work = group.allreduce([empty])
        except (RuntimeError, ValueError):
            continue
        pending.append((work, empty))
    done = True
    while pending:
        work, empty = pending.pop(0)  # no reference to the Work left behind
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
        except RuntimeError:
            _FAILED.append(work)  # still running: never dropped here, and not waited for
            done = False
            continue
        del work
        # 1: only this frame's reference is left (the Work, the thread's and c10d's are gone).
        while compat.use_count(empty) > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        done = done and compat.use_count(empty) == 1
    return done


@atexit.register
def _quiesce_own_groups() -> None:
    """At exit, before the interpreter finalises: no worker thread of fxshard's holds anything."""
    quiesce(*list(_OWN_GROUPS))


def how_the_wait_ended(waited: float, timeout: float | None, group: dist.ProcessGroup | None,
                       e: BaseException) -> str:
    """"within 60s", "within 15s (the process group's timeout; ...)", or "(the wait failed
    after 0.0s: ...)": what ended a wait for a collective that failed after ``waited`` s."""
    limits = [t for t in (timeout, group_timeout(group).total_seconds() if group is not None else None)
              if t is not None]
    fired = min(limits, key=lambda t: abs(t - waited)) if limits else None
    # By the time waited, not the text: a group left broken by an earlier timeout fails at
    # once with that timeout's message.
    if fired is not None and waited >= 0.9 * fired:
        if timeout is None or abs(fired - timeout) < 1e-9:
            return f"within {fired:g}s"
        return (f"within {fired:g}s (the process group's own timeout, which is shorter than "
                f"the {timeout:g}s asked for, fired first)")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"(the wait failed after {waited:.1f}s: {first})"


_COMM_FAILURE = ("timed out", "connection closed", "connection reset", "watchdog", "nccl error",
                 "gloo", "broken pipe")


def collective_failure(e: BaseException, world: World, where: str) -> FxShardError | None:
    """A clear error for a collective of a compiled step that failed (a peer gone or stalled),
    or None if ``e`` is something else."""
    text = str(e)
    if isinstance(e, FxShardError):
        return None  # already says what failed
    if not isinstance(e, RuntimeError) or not any(k in text.lower() for k in _COMM_FAILURE):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return FxShardError(
        f"{world.who()}: a collective of the {where} failed: {first}. A peer is gone or stalled, "
        "or the ranks stopped running the same steps. The process group is unusable now: let "
        "the process exit (torchrun restarts the job; resume from the last checkpoint)."
    )


class Abandoned:
    """Whether a phase of a step (a forward or a backward) was left by an exception on this rank.

    Its peers may still be inside that phase's collectives, and this rank may have
    collectives of it in flight. A further collective on the steps' process groups
    would pair with one of those: gloo then aborts the process natively on the size
    mismatch (``gloo::EnforceNotMet``), or exchanges the wrong bytes when the sizes
    agree. So once a phase is abandoned, every later step on this rank raises before
    it communicates; the peers get an error from their own waits, within the timeout.
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        # Raises the error that says why a phase raised the given exception, when one is
        # known (the ranks' agreement checked on the device found their steps differ).
        self.explain: Callable[[BaseException], None] = lambda e: None

    def leave(self, where: str, e: BaseException) -> None:
        """``where`` (e.g. "the forward graph") raised ``e``; the first reason is kept."""
        if self.reason is None:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.reason = f"{where} raised {type(e).__name__}: {first}"[:500]

    def check(self, world: World) -> None:
        if self.reason is not None:
            raise FxShardError(
                f"{world.who()}: no step can run after an earlier one was abandoned on this rank "
                f"({self.reason}). Its peers may still be inside that step's collectives, so "
                "the steps' process groups are out of step for good. Let the exception end the "
                "process (torchrun restarts the job; resume from the last checkpoint); catching "
                "an exception from a step and going on cannot work with collectives in flight."
            )


def gather_full(shard: torch.Tensor, group: FlatGroup, world: World, timeout: float) -> torch.Tensor:
    """All-gather one flat group (a collective). Raises instead of hanging past ``timeout`` s."""
    if world.group is None or group.replicated:
        return shard.detach().clone()
    # An offloaded shard lives on the host; the collective runs where the backend takes
    # its tensors (nccl: the GPU), and the full value goes back beside the shard.
    comm = comm_device(world.comm_group)
    out = torch.empty(group.padded_numel, dtype=shard.dtype, device=comm)
    work = compat.all_gather_single(out, shard.detach().to(comm).contiguous(), group=world.comm_group,
                                    async_op=True)
    wait_within(work, timeout, lambda what: FxShardError(
        f"{world.who(row=True)}: gathering flat group {group.index} (unit {group.unit or '<root>'!r}): "
        f"the other ranks did not answer {what}. full_state_dict / load_full_state_dict are "
        "collectives: every rank of the process group must call them, in the same order."
    ), world.comm_group)
    return out.to(shard.device)


def full_parameters(shards: list[nn.Parameter], plan: ShardPlan, world: World,
                    timeout: float) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, under each of its names (a collective)."""
    result: dict[str, torch.Tensor] = {}
    for group, shard in zip(plan.groups, shards):
        full = gather_full(shard, group, world, timeout)
        for slot in group.params:
            value = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            for name in slot.names:
                result[name] = value
    return result


def load_shards(shards: list[nn.Parameter], plan: ShardPlan, full: dict[str, torch.Tensor],
                rank: int) -> None:
    """Copy this rank's part of the full parameters in ``full`` into the shards, in place."""
    with torch.no_grad():
        for group, shard in zip(plan.groups, shards):
            for slot in group.params:
                piece = group.piece(slot, rank)
                if piece is None:
                    continue
                src = full[slot.name].detach().reshape(-1)[piece.param]
                shard[piece.shard].copy_(src.to(shard.device, shard.dtype))
