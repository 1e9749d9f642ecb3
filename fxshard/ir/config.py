"""One frozen configuration value per compile: everything a front end was told.

``fxshard.compile``, ``fxshard.backend`` and ``fxshard.explain`` each turn
their arguments into a ``CompileConfig`` with :func:`CompileConfig.build`, so
every option is named, defaulted, validated and read from the environment in
this one place. The driver (``fxshard.driver.compile.compiler``) takes nothing else;
the pass list is built from it (``fxshard.passes.pipeline.build_pipeline``).

An option a front end cannot honour is refused here, with the reason.
"""

from __future__ import annotations

import datetime
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch.distributed as dist
import torch.fx as fx

from fxshard.ir.optimizer import OptimizerState, optimizer_state
from fxshard.ir.options import ShardingOptions
from fxshard.ir.precision import MixedPrecision
from fxshard.ir.spellings import ForeignOption, fsdp1_precision_hint, policy_hint, precision_from
from fxshard.ir.wrapping import Policy

FrontEnd = Literal["compile", "backend", "explain"]
Compute = Literal["eager", "inductor"]
# on_pass(graph, pass_name, gm): graph is "joint", "forward", "backward" or
# "inference"; pass_name is "traced" for the graph as traced.
PassHook = Callable[[str, str, fx.GraphModule], None]

# Options a front end cannot honour, and why.
_NOT_FOR: dict[str, dict[str, str]] = {
    "backend": {
        "broadcast_buffers": "the backend runs each graph Dynamo captured, not the module's "
                             "forward, so it has no one point per forward to broadcast at; use "
                             "fxshard.compile, or broadcast the buffers yourself between steps",
    },
    "explain": {
        "process_group": "explain runs on a fake process group of its own, of world_size ranks",
        "timeout": "explain runs nothing, so no collective can time out",
        "param_init_fn": "explain initialises nothing: its model stays on the meta device",
        "sync_module_states": "explain has no real ranks to broadcast between",
        "mesh": "explain runs on a fake process group of its own: pass mesh_shape=(R, S) "
                "(or (S,)) instead, and it lays the fake ranks out on that mesh",
    },
}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class CompileConfig:
    policy: Policy | None = None
    # None: the default (WORLD) group if one is initialised, else world size 1.
    # A mesh= argument sets it (from_mesh).
    process_group: dist.ProcessGroup | None = None
    # FSDP's NO_SHARD (a (N, 1) mesh): every parameter whole on every rank, the
    # gradients all-reduced, as DDP does.
    no_shard: bool = False
    # HSDP (an (R, S) mesh, both above 1): the global ranks of the mesh, R rows of S.
    # Each row shards (``process_group`` is this rank's row); each column replicates.
    hsdp: tuple[tuple[int, ...], ...] | None = None
    # NO_SHARD per unit: the units whose modules this policy selects (never the
    # root) keep their parameters whole on every rank, the rest are sharded.
    replicate: Policy | None = None
    options: ShardingOptions = ShardingOptions()
    # "inductor": Inductor compiles the emitted graphs (its decompositions and
    # joint-graph passes run first; fxshard emits no explicit frees).
    compute: Compute = "eager"
    # Check the invariants of fxshard/passes/README.md after every pass (always on the
    # emitted graphs). Default: the FXSHARD_VERIFY environment variable.
    verify: bool = False
    on_pass: PassHook | None = field(default=None, compare=False)
    # Seconds any collective of a compiled step (and the ranks' agreement
    # before each step) may wait for the other ranks before every rank raises.
    # None: the process group's own timeout (torch's default: 30 min on gloo,
    # 10 min on nccl). Also bounds how long one rank may trace alone.
    timeout: float | None = None
    # Collectives that are in flight together go on different process groups
    # (one per in-flight slot): two in flight on one gloo group corrupt its
    # heap (torch 2.13). None: on gloo only.
    inflight_groups: bool | None = None
    # Regions whose activations backward recomputes instead of saving: a
    # policy value (by_class(Block); selective(by_class(Block)) saves matmul
    # and attention outputs). fxshard/passes/checkpoint_activations.py.
    activation_checkpointing: Policy | None = None
    # Bytes the predicted peak of a training step (forward, backward and, with
    # optimizer=, the optimizer step, as report() counts it) must stay within.
    # The planner (fxshard.ir.budget) picks, per unit, resharding, prefetch,
    # recompute and, with offload_policy=, offload at the first training trace;
    # activation_checkpointing then names the regions it may recompute
    # (default: the units' modules).
    memory_budget: int | None = None
    # The optimizer the step will use (torch.optim.AdamW, or a functools.partial
    # of a class): its state per parameter shard is counted in the optimizer
    # step's phase of the predicted peak (fxshard.ir.optimizer). None: that
    # phase is not predicted.
    optimizer: OptimizerState | None = None
    # FSDP2's MixedPrecisionPolicy semantics (fxshard.ir.precision).
    mixed_precision: MixedPrecision | None = None
    # FSDP1's option: the module's parameters() are the original parameters, by their
    # names, each a 1-D view of the part this rank's flat shard holds, so optimizer
    # groups can be chosen per parameter (fxshard/driver/run/orig_params.py). False: one
    # flat shard per unit and group.
    use_orig_params: bool = False
    # DDP's broadcast_buffers: rank 0's buffers (BatchNorm running statistics)
    # are copied to every rank before the first forward and before each forward
    # that follows a forward with grad enabled, as DDP does. False (the
    # default, as FSDP1 and FSDP2): each rank keeps its own buffers.
    broadcast_buffers: bool = False
    # A model on the meta device is initialised module by module, each
    # module's own tensors by param_init_fn(module) or its reset_parameters()
    # (fxshard/driver/state/init.py), on the process group's device.
    param_init_fn: Callable[[Any], None] | None = field(default=None, compare=False)
    # FSDP1's option: rank 0's parameters and buffers are broadcast to every
    # rank at compile (the others' may be on the meta device).
    sync_module_states: bool = False
    # Write plan, report, per-pass graphs, timeline and unit graph of every
    # compiled step here. Default: the FXSHARD_DUMP environment variable.
    dump_dir: str | None = None
    # Pass names (e.g. "sink_allocations_pass") left out of every pipeline, for
    # debugging; a string is split at commas.
    disable_passes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("use_orig_params", "broadcast_buffers", "sync_module_states", "verify"):
            if not isinstance(getattr(self, name), bool):  # bool("False") is True: a string is refused
                raise TypeError(f"{'verify_passes' if name == 'verify' else name} takes True or False, "
                                f"got {getattr(self, name)!r}")
        if self.inflight_groups is not None and not isinstance(self.inflight_groups, bool):
            raise TypeError(f"inflight_groups takes True, False or None (on gloo only), got {self.inflight_groups!r}")
        if self.policy is not None and not isinstance(self.policy, Policy):
            hint = policy_hint(self.policy)
            raise TypeError(
                f"policy must be built with fxshard.policies (by_size, by_class, by_predicate, auto), "
                f"got {self.policy!r}" + (f": write {hint}" if hint else "")
            )
        if self.replicate is not None and not isinstance(self.replicate, Policy):
            raise TypeError(
                "replicate takes a policy built with fxshard.policies, selecting the units kept "
                f"whole on every rank (by_class(...), by_predicate(...)), got {self.replicate!r}"
            )
        if self.activation_checkpointing is not None and not isinstance(self.activation_checkpointing, Policy):
            hint = policy_hint(self.activation_checkpointing)
            raise TypeError(
                "activation_checkpointing takes a policy built with fxshard.policies "
                "(by_class(Block), selective(by_class(Block)), ...), "
                f"got {self.activation_checkpointing!r}"
                + (f": write activation_checkpointing={hint.removeprefix('policy=')}" if hint else "")
            )
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool)
                                                or not isinstance(self.memory_budget, int)
                                                or self.memory_budget <= 0):
            raise ValueError(f"memory_budget must be a positive number of bytes (an int), "
                             f"got {self.memory_budget!r}")
        object.__setattr__(self, "optimizer", optimizer_state(self.optimizer))
        if self.compute not in ("eager", "inductor"):
            raise ValueError(f"compute must be 'eager' or 'inductor', got {self.compute!r}")
        if isinstance(self.timeout, datetime.timedelta):  # init_process_group's and Lightning's spelling
            object.__setattr__(self, "timeout", self.timeout.total_seconds())
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))):
            raise TypeError(f"timeout takes seconds (a number) or a datetime.timedelta, got {self.timeout!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            taken = precision_from(self.mixed_precision)  # FSDP2's MixedPrecisionPolicy: the same fields
            if taken is None:
                raise TypeError(fsdp1_precision_hint(self.mixed_precision)
                                or "mixed_precision must be a fxshard.MixedPrecision(param_dtype=..., ...) "
                                   f"or FSDP2's MixedPrecisionPolicy, got {self.mixed_precision!r}")
            object.__setattr__(self, "mixed_precision", taken)
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(f"param_init_fn must be callable as fn(module), got {self.param_init_fn!r}")
        if self.on_pass is not None and not callable(self.on_pass):
            raise TypeError(f"on_pass must be callable as on_pass(graph, pass_name, gm), got {self.on_pass!r}")

    @classmethod
    def build(cls, front_end: FrontEnd, **kwargs: Any) -> CompileConfig:
        """The configuration for ``front_end`` from its keyword arguments.

        Takes ``policy``, ``process_group`` or ``mesh``, ``compute``, ``verify_passes``,
        ``on_pass``, ``timeout``, ``dump_dir``, ``disable_passes``, ``inflight_groups``,
        ``broadcast_buffers``, ``param_init_fn``, ``sync_module_states``,
        ``mixed_precision``, ``activation_checkpointing``, ``memory_budget``, ``optimizer``,
        ``replicate``, ``use_orig_params``, and
        every field of :class:`ShardingOptions` by name.
        """
        refused = {k: why for k, why in _NOT_FOR.get(front_end, {}).items() if k in kwargs}
        if refused:
            reasons = "; ".join(f"{k}: {why}" for k, why in refused.items())
            raise TypeError(f"fxshard.{front_end} does not take {sorted(refused)}: {reasons}")
        own = {f.name for f in fields(cls)} - {"options", "verify", "no_shard", "hsdp"}
        mine = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
        if "mesh" in kwargs:
            mesh = kwargs.pop("mesh")
            if mesh is not None:
                if mine.get("process_group") is not None:
                    raise TypeError("pass mesh= or process_group=, not both: a mesh names its "
                                    "process groups")
                mine["process_group"], mine["no_shard"], mine["hsdp"] = from_mesh(mesh)
        verify = kwargs.pop("verify_passes", None)
        mine["verify"] = env_flag("FXSHARD_VERIFY") if verify is None else verify
        if mine.get("dump_dir") is None:
            mine["dump_dir"] = os.environ.get("FXSHARD_DUMP") or None
        elif isinstance(mine["dump_dir"], (str, os.PathLike)):
            mine["dump_dir"] = os.fspath(mine["dump_dir"])
        else:
            raise TypeError(f"dump_dir takes a folder's path (a str or os.PathLike), not {mine['dump_dir']!r} "
                            f"({type(mine['dump_dir']).__name__}): each step's graphs and report are written there")
        disabled = mine.get("disable_passes", ())
        if isinstance(disabled, str):  # "a,b" from a command line
            disabled = [n.strip() for n in disabled.split(",") if n.strip()]
        mine["disable_passes"] = tuple(disabled)
        try:
            options = ShardingOptions.from_kwargs(**kwargs)
        except ForeignOption:
            raise  # it names the one option to write
        except TypeError as e:
            known = sorted((own | {"verify_passes", "mesh"}) - set(_NOT_FOR.get(front_end, {})))
            everything = [*known, *(f.name for f in fields(ShardingOptions))]
            near = [f"did you mean {close[0]!r} for {name!r}?" for name in sorted(kwargs)
                    if name not in everything
                    and (close := difflib.get_close_matches(name, everything, n=1, cutoff=0.75))]
            raise TypeError("; ".join([str(e), *near, f"fxshard.{front_end} also takes {known}"])) from None
        return cls(options=options, **mine)

    def with_options(self, **changes: Any) -> CompileConfig:
        return replace(self, **changes)


def from_mesh(mesh: Any) -> tuple[dist.ProcessGroup, bool, tuple[tuple[int, ...], ...] | None]:
    """The process group a ``DeviceMesh`` shards over, whether it means NO_SHARD, and for
    HSDP the mesh's global ranks (rows shard, columns replicate).

    FSDP2's conventions: a 1-D mesh shards over its ranks; a 2-D mesh
    replicates over dim 0 and shards over dim 1 (HSDP). A 2-D mesh whose shard
    dimension has one rank, ``(N, 1)``, is NO_SHARD; one whose replicate
    dimension has one rank, ``(1, N)``, is FULL_SHARD over dim 1.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh "
                        f"(init_device_mesh(device_type, shape)), got {type(mesh).__name__}")
    shape = tuple(mesh.shape)
    if len(shape) == 1:
        return mesh.get_group(), False, None
    if len(shape) == 2 and shape[1] == 1:
        return mesh.get_group(0), True, None
    if len(shape) == 2 and shape[0] == 1:
        return mesh.get_group(1), False, None
    if len(shape) == 2:
        rows = tuple(tuple(int(r) for r in row) for row in mesh.mesh.tolist())
        return mesh.get_group(1), False, rows
    raise ValueError(f"mesh has {len(shape)} dimensions {shape}: fxshard takes a 1-D mesh "
                     "(shard) or a 2-D one (replicate, shard), as FSDP2 does")
