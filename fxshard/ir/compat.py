"""The one module that reaches into torch beyond its public API.

fxshard is tested on torch 2.11 through 2.15 (``pyproject.toml``). Everything
it takes from torch's internals, or from public names that differ between
those releases, is named here; every other module imports it from here
(``tests/test_compat.py`` fails on a private torch name anywhere else that is
not on its allow-list). A release that moves one of these names is handled in
this file alone.

What differs between the releases:

=================================  ===========================  =====================  =====================
name here (torch's)                2.11                         2.13                   2.15
=================================  ===========================  =====================  =====================
``all_gather_single``              absent: calls                present (and           present
(``dist.all_gather_single``)       ``all_gather_into_tensor``,  ``all_gather_into_
                                   the same collective          tensor`` deprecated)
``compiling``                      absent: sets                 present                present
(``torch.compiler._compile_        ``_is_compiling_flag``
session_context``)                 itself
``inductor_partition_fn``          no override: runs Inductor's present                present
(``partition_fn``'s                joint-graph passes itself,
``partitioner_fn_override``)       then fxshard's partitioner
``BACKWARD_HOLDS_TANGENTS``        True: the tangents live      False: they die at     False
(AOTAutograd's backward)           until the backward graph     their last use
                                   returns; report() counts
                                   them through backward
``no_python_context``              nothing to do: no Context    takes the backward's   as 2.13
(``torch._C._is_key_in_tls``       in the thread-local state    Context out around
and its siblings)                  (and no such functions)      the collectives
``rehearsal_group_methods``        ``_allgather_base``,         ``all_gather_single``, as 2.13, and their
(what c10d calls a Python          ``_reduce_scatter_base``     ``reduce_scatter_      ``_coalesced`` forms
``dist.ProcessGroup``'s                                         single``               (coalescing manager)
collectives by)
=================================  ===========================  =====================  =====================

Why fxshard needs each name (the same on 2.11, 2.13 and 2.15 unless the table says otherwise):

- ``all_gather_single``: the runtime's flat gathers (state dicts, init) and the ranks' agreement.
- ``compiling``: trace as ``torch.compile`` does, with ``torch.compiler.is_compiling()`` true
  around AOTAutograd, so libraries (transformers) take their traceable paths.
- ``aot_module_simplified``, ``functorch_config`` (``torch._functorch``): the joint
  forward+backward trace; ``force_non_lazy_backward_lowering`` compiles backward at trace time,
  where the passes can raise.
- ``default_partition`` (``torch._functorch.partitioners``): fxshard's partitioner hands the
  rewritten joint graph to it.
- ``boxed``, ``is_boxed`` (a function's ``_boxed_call``): AOTAutograd's calling convention
  for compiled graphs, which lets inputs die at their last use.
- ``make_fx`` (``torch.fx.experimental.proxy_tensor``): a lowering's plain torch function traced
  under the graph's fake mode into nodes it splices in (``ChainBuilder.traced``).
- ``detect_fake_mode`` (``torch._guards``), ``fake_tensor`` (``torch._subclasses``): nodes'
  ``meta["val"]`` are computed under the trace's fake mode; its exceptions classify trace failures.
- ``pytree`` (``torch.utils._pytree``): the flattening AOTAutograd and Dynamo use, with the types
  registered there (transformers' ModelOutput); no public module in these releases.
- ``OpOverload``, ``OpOverloadPacket`` (``torch._ops``), ``schema``, ``op_name``: aten nodes'
  targets, their schemas (aliasing, mutation, argument names) and names.
- ``c10d_functional`` (``torch.ops._c10d_functional``), ``resolve_process_group``: the
  functional collectives fxshard emits, and the process group a graph names by string.
- ``rng_prims`` (``torch._prims``): replaying dropout's generator state in recomputed regions.
- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): meta init's write recorder and the
  collective byte counter; ``without_dispatch_modes`` (its ``_disable_current_modes``): the
  CPU's node timing at a step's first forward, unseen by a user's mode around the step;
  ``mem_tracker`` (``torch.distributed._tools``): measured peaks.
- ``DisableTorchFunctionSubclass``, ``foreach_norm``, ``amp_foreach_non_finite_check_and_unscale_``
  (``torch._C``, ``torch``): ShardGrad's global norms inside ``clip_grad_norm_`` and its inf check
  inside GradScaler, which call these.
- ``broadcast_coalesced`` (``torch.distributed``): DDP's buffer broadcast.
- ``DDP_IGNORED`` (a module's ``_ddp_params_and_buffers_to_ignore``): the first thing
  ``DistributedDataParallel.__init__`` reads of the module it wraps, before its parameters
  and before any broadcast; a ShardedModule makes reading it raise (``DDP(sharded)``).
- ``one_thread_gloo``, ``gloo_threads``: fxshard's own gloo groups, made with one worker thread
  each (``ProcessGroupGloo``'s private options), so that no two threads of a group write its
  status at once; see the function.
- ``use_count`` (``Tensor._use_count``): how many C++ references hold a tensor; ``runtime.quiesce``
  waits until a gloo worker thread has let go of a collective's tensor.
- ``rehearsal_group_methods``, ``work_from_future``, ``cuda_sleep``, ``registered_group_name``:
  ``fxshard.rehearse``'s process group, a Python ``dist.ProcessGroup`` (as torch's threaded
  test group is): the names c10d calls its collectives by (the table), a ``Work`` that
  completes with a ``torch.futures.Future`` (c10d's own wrapper), the GPU's spin kernel that
  holds its stream for a collective's time, and the name c10d registered the group under.
- ``clear_cublas_workspaces`` (``torch._C._cuda_clearCublasWorkspaces``): releases the cuBLAS
  workspaces ``calibrate.library_bytes`` made on a stream of its own to measure them.
- ``group_timeout``, ``default_timeout``: the timeout a process group was made with; torch has no
  public getter. ``group_store``: the store a group was made with (``_world.pg_map``), where
  checkpoint agreements mark each rank's arrival.
- ``no_python_context``: the backward's ``contextvars.Context`` that torch (2.13, 2.15) stashes
  in the thread-local state a gloo collective copies into its Work; taken out around the
  collectives of the compiled graphs (``_is_key_in_tls`` and its siblings, absent on 2.11, which
  stashes nothing). Without it a gloo worker could drop the last reference after interpreter
  finalization began: SIGABRT at exit (docs/situations.md, "A clean exit").
- ``lazy_graph_modules``, ``make_graph_module`` (``torch.fx._lazy_graph_module``): graph
  modules that generate their Python code only when it is read or called. The memory budget's
  trials (``GraphCompiler.emit``) never do either: their passes' ``recompile()`` then costs
  nothing, where it was half of each trial. The trace (``trace_step``) runs under it too: a
  step's graphs generate their code once, where they run or are read.
- ``profiler_enabled`` (``torch.autograd.profiler._is_profiler_enabled``): torch's fast check
  that a profiler is recording; the eager graphs then run the copy with named ranges
  (``driver/compile/codegen.py``).
- ``register_backend``, ``optimized_module_class``, ``innermost_backend``, ``original_module``,
  ``dynamo_exc`` (``torch._dynamo``): the torch.compile backend; ``under_dynamo``
  (``torch._C._dynamo.eval_frame.get_eval_frame_callback``): a ShardedModule called inside
  ``torch.compile``, refused; ``wrap_policy_classes`` (FSDP1's ``ModuleWrapPolicy``): the
  classes of a wrap policy given to fxshard, to name the ``by_class`` to write.
- ``inductor_*`` (``torch._inductor``): ``compute="inductor"``.
- ``ShardedTensor`` and its metadata (``torch.distributed._shard``), ``flatten_state_dict``,
  ``load_state_dict_from_keys``, ``init_optim_state`` (``torch.distributed.checkpoint``):
  state dicts for DCP as each rank's boxes of a parameter; loading by keys; optimizer state
  created as torch's ``get_state_dict`` creates it.
- ``IncompatibleKeys``, ``reparametrize_module``, ``BatchNorm`` (``torch.nn``): what
  ``load_state_dict`` returns; running a module on given tensors; every batch norm class.
- ``state_dict_hooked`` (``Module._state_dict_hooks``, ``_state_dict_pre_hooks``): which modules
  have state-dict hooks, which a sharded state dict does not run (it says so).
- ``storage_key`` (``UntypedStorage._cdata``): liveness, one key per storage, on fake and meta
  tensors too (they have no data pointer).
- ``version`` (``Tensor._version``): the version counter of a shard's gradient, which tells
  an optimizer's ``zero_grad(set_to_none=False)`` inside a ``no_sync`` accumulation.

Beyond these names: 2.11's fake ``embedding`` accepts float indices, so the trace checks the
indices that reach ``F.embedding`` itself (``driver/compile/trace.py``), as 2.13's does. The emitted graphs differ
in one way: on 2.15 the reshape
after each ``addmm`` of a linear layer is ``aten._unsafe_view`` where 2.11 and
2.13 emit ``aten.view`` (docs/devices.md: the report is the same).

Replaced by public API (no longer imported): ``FakeStore`` from
``torch.testing._internal`` (``explain`` uses ``dist.HashStore``; the fake
process group never reads its store) and ``torch.fx.graph._BoxedCodeGen``
(``driver/compile/codegen.py`` subclasses the public ``CodeGen``).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition
from torch._guards import detect_fake_mode
from torch._ops import OpOverload, OpOverloadPacket
from torch._prims import rng_prims
from torch._subclasses import fake_tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import _init_optim_state as init_optim_state
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict_from_keys as load_state_dict_from_keys,
)
from torch.fx._lazy_graph_module import _make_graph_module as make_graph_module
from torch.fx._lazy_graph_module import _use_lazy_graph_module as lazy_graph_modules
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.modules.batchnorm import _BatchNorm as BatchNorm
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as without_dispatch_modes

__all__ = [
    "BACKWARD_HOLDS_TANGENTS", "DDP_IGNORED", "RELEASE", "BatchNorm", "DisableTorchFunctionSubclass",
    "IncompatibleKeys", "OpOverload",
    "OpOverloadPacket", "Shard", "ShardMetadata", "ShardedTensor", "ShardedTensorMetadata",
    "TensorProperties", "TorchDispatchMode", "all_gather_single", "boxed", "is_boxed",
    "amp_foreach_non_finite_check_and_unscale_",
    "aot_module_simplified", "broadcast_coalesced", "c10d_functional", "compiling",
    "default_partition", "default_timeout", "detect_fake_mode", "dynamo_exc", "fake_tensor",
    "flatten_state_dict", "foreach_norm", "functorch_config", "gloo_threads", "group_timeout",
    "inductor_compile_fx_inner", "inductor_decompositions", "inductor_partition_fn",
    "inductor_set_fake_mode", "init_optim_state", "innermost_backend", "lazy_graph_modules",
    "load_state_dict_from_keys", "make_fx", "make_graph_module",
    "mem_tracker", "one_thread_gloo", "without_dispatch_modes", "op_name", "optimized_module_class", "original_module",
    "profiler_enabled", "pytree", "under_dynamo", "wrap_policy_classes",
    "register_backend", "reparametrize_module", "resolve_process_group", "rng_prims", "schema",
    "state_dict_hooked",
    "storage_key", "version",
]

RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# Before 2.13 AOTAutograd's backward holds the gradients of the step's outputs (the tangents)
# until the backward graph returns; from 2.13 on they die at their last use in it.
BACKWARD_HOLDS_TANGENTS = RELEASE < (2, 13)

# -- operators ----------------------------------------------------------------------------------

c10d_functional = torch.ops._c10d_functional
foreach_norm = torch._foreach_norm
amp_foreach_non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass

# DDP's constructor reads this attribute of the module it wraps (with hasattr) before anything
# else of it: before its parameters, before broadcasting them.
DDP_IGNORED = "_ddp_params_and_buffers_to_ignore"


def schema(op: OpOverload) -> Any:
    """``op``'s ``torch.FunctionSchema`` (arguments, returns, alias and mutation info)."""
    return op._schema


def op_name(op: OpOverloadPacket) -> str:
    """``aten::mm`` for ``torch.ops.aten.mm``."""
    return str(op._qualified_op_name)


def boxed(fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``fn``, marked as taking its arguments as one list that it clears (AOTAutograd's
    boxed calling convention: inputs die at their last use, not when the graph returns)."""
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn


def is_boxed(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` take the boxed calling convention (Inductor's compiled graphs do)?"""
    return bool(getattr(fn, "_boxed_call", False))


def profiler_enabled() -> bool:
    """Is a torch profiler recording? (A module global that ``torch.profiler.profile`` and
    ``torch.autograd.profiler.profile`` set on entry and clear on exit.)"""
    return torch.autograd.profiler._is_profiler_enabled


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: bumped by every in-place write to it or a view of it."""
    return int(t._version)


def state_dict_hooked(module: nn.Module) -> list[str]:
    """The names of ``module``'s modules (``""`` itself) with state-dict hooks
    (``register_state_dict_pre_hook``'s, ``register_state_dict_post_hook``'s), which
    ``nn.Module.state_dict`` keeps in ``_state_dict_pre_hooks`` and ``_state_dict_hooks``.
    fxshard's own (marked ``fxshard_refusal``: the refusal of a state dict of the stand-ins)
    are not the module's."""
    def own(hooks: Any) -> bool:
        return any(not getattr(h, "fxshard_refusal", False) for h in hooks.values())
    return [name for name, m in module.named_modules() if own(m._state_dict_hooks) or own(m._state_dict_pre_hooks)]


def storage_key(t: torch.Tensor) -> int:
    """One integer per storage, the same for every view of it, on fake and meta tensors too."""
    return int(t.untyped_storage()._cdata)


# -- distributed --------------------------------------------------------------------------------


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> Any:
    """Every rank's ``input`` concatenated into ``output`` (a collective)."""
    gather = getattr(dist, "all_gather_single", None)  # 2.13 on; 2.11 has only the older name
    if gather is None:
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
    return gather(output, input, group=group, async_op=async_op)


def resolve_process_group(name: str) -> dist.ProcessGroup:
    """The process group a functional collective names by string."""
    resolve: Any = dist.distributed_c10d._resolve_process_group  # takes a GroupName (a str)
    group: dist.ProcessGroup = resolve(name)
    return group


def broadcast_coalesced(group: dist.ProcessGroup, tensors: list[torch.Tensor], bucket_bytes: int,
                        src: int) -> None:
    """DDP's buffer broadcast: ``tensors`` coalesced into few messages, copied back in place."""
    dist._broadcast_coalesced(group, tensors, bucket_bytes, src)


@contextlib.contextmanager
def no_python_context() -> Iterator[None]:
    """Issue collectives with no Python object in the thread-local state they copy.

    torch (2.13) stashes ``contextvars.copy_context()`` in the C++ thread-local
    state for every backward (``torch.autograd.graph._engine_run_backward``),
    and a gloo collective copies that state into its Work (``AsyncWork::tls_``).
    Whoever drops the last Work of a backward then decrefs that Context and
    needs the GIL: often a gloo worker thread, just after the collective
    completed. If the main thread is finalizing the interpreter by then,
    ``take_gil`` calls ``pthread_exit``, whose unwind meets the noexcept
    ``~AsyncWork``: std::terminate ("terminate called without an active
    exception", SIGABRT at exit). Collectives issued inside this block hold no
    Context. (Python objects the user put in that state, a TorchFunctionMode or
    saved-tensor hooks, are still copied.)
    """
    key = "context"
    if RELEASE < (2, 13) or not torch._C._is_key_in_tls(key):
        yield  # torch 2.11 stashes no Context (and has no such functions)
        return
    saved = torch._C._get_obj_in_tls(key)
    torch._C._remove_obj_from_tls(key)
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls(key, saved)


def work_from_future(future: torch.futures.Future[Any]) -> dist.Work:
    """A ``Work`` that completes with ``future`` (and, for a CUDA-aware future, makes its waiter's
    stream wait for the stream that set it)."""
    return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]


def cuda_sleep(cycles: int) -> None:
    """A kernel that spins ``cycles`` GPU clock cycles on the current stream (one block)."""
    torch.cuda._sleep(cycles)


def clear_cublas_workspaces() -> None:
    """Release every stream's cuBLAS workspace (each is made again at its stream's next matmul)."""
    torch._C._cuda_clearCublasWorkspaces()


def registered_group_name(group: dist.ProcessGroup) -> str:
    """The name c10d registered ``group`` under (a Python group has none of its own)."""
    return dist.distributed_c10d._world.pg_names[group]


def group_store(group: dist.ProcessGroup) -> dist.Store | None:
    """The store ``group`` was made with (None where torch does not say): ranks leave marks
    there that name who never arrived at a collective."""
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except (KeyError, AttributeError, IndexError):
        return None


ONE_THREAD_GLOO = "fxshard_gloo"


def one_thread_gloo() -> str:
    """The name of a backend for ``dist.new_group``: gloo with one worker thread per group.

    ``ProcessGroupGloo::runLoop`` (every release here) writes the group's status,
    a heap ``std::string`` among it, from its worker thread after the work is
    marked done and without a lock. A rank that waits a collective and issues
    the next on the same group can have a second worker thread finish that one
    and write the same string while the first is still writing it: a double
    free, under load (docs/devices.md). With one worker thread per group the
    writes follow each other. ``init_process_group`` and ``new_group`` ignore
    gloo's options (its thread count) in every release here, so the group is
    made through torch's public backend registry with options of its own.
    """
    if not hasattr(dist.Backend, ONE_THREAD_GLOO.upper()):
        dist.Backend.register_backend(ONE_THREAD_GLOO, _one_thread_gloo, devices=["cpu"])
    return ONE_THREAD_GLOO


def _one_thread_gloo(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    gloo: Any = dist.ProcessGroupGloo
    options = gloo._Options()
    options._threads = 1
    options._timeout = timeout
    options._devices = [gloo.create_default_device()]
    return gloo(store, rank, size, options)


def gloo_threads(group: dist.ProcessGroup) -> int:
    """How many worker threads ``group``'s gloo backend runs collectives on."""
    options: Any = group._get_backend(torch.device("cpu")).options  # gloo's own options type
    threads: int = options._threads
    return threads


def default_timeout(backend: str) -> datetime.timedelta:
    """torch's default timeout for a process group of ``backend``."""
    default: Any = dist.distributed_c10d._get_default_timeout  # takes a Backend (a str)
    timeout: datetime.timedelta = default(backend)
    return timeout


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The timeout ``group`` was created with (torch's default for its backend if unknown)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError):
        return default_timeout(dist.get_backend(group))


# -- tracing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true inside, as during a ``torch.compile``."""
    session = getattr(torch.compiler, "_compile_session_context", None)  # 2.13 on
    if session is not None:
        with session():
            yield
        return
    previous = torch.compiler._is_compiling_flag  # releases without the context manager
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


def mem_tracker() -> Any:
    """torch's ``MemTracker`` class (imported on first use: it loads the FSDP runtime)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


# -- torch.compile ------------------------------------------------------------------------------


def _dynamo() -> Any:
    return importlib.import_module("torch._dynamo")


def register_backend(name: str, backend: Callable[..., Any]) -> None:
    """Make ``torch.compile(model, backend=name)`` call ``backend``."""
    _dynamo().register_backend(name=name)(backend)


def dynamo_exc() -> Any:
    """``torch._dynamo.exc``: the exceptions Dynamo and symbolic shapes raise."""
    return importlib.import_module("torch._dynamo.exc")


def optimized_module_class() -> type[Any]:
    """The class of the module ``torch.compile(module)`` returns."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule



def under_dynamo() -> bool:
    """Is Dynamo tracing this frame, or is its frame callback active (a frame of a
    ``torch.compile``-d call, run eagerly after a graph break)? Through
    ``torch._C._dynamo.eval_frame.get_eval_frame_callback``: a graph break on a raise runs the
    frame again eagerly, where ``is_compiling()`` is False, but the callback is still set."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return bool(torch.compiler.is_compiling()) or get_eval_frame_callback() not in (None, False)


def wrap_policy_classes(policy: Any) -> Any:
    """The module classes of FSDP1's ``ModuleWrapPolicy`` (its ``_module_classes``; no
    public accessor), or None for anything else: read to name fxshard's ``by_class``."""
    return getattr(policy, "_module_classes", None)


def innermost_backend(callback: Any) -> Any:
    """The backend a compiled module's callback wraps (under Dynamo's own wrappers)."""
    from torch._dynamo.eval_frame import innermost_backend as innermost

    return innermost(callback)


def original_module(compiled: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped."""
    original = compiled._orig_mod
    assert isinstance(original, nn.Module)
    return original


# -- compute="inductor" -------------------------------------------------------------------------


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decompositions Inductor applies before it lowers a graph."""
    importlib.import_module("torch._inductor.compile_fx")  # loads the lowerings the table consults
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_partition_fn(joint: Any, joint_inputs: Sequence[Any], *,
                          partitioner_fn_override: Callable[..., Any], **kwargs: Any) -> Any:
    """Inductor's joint-graph passes, then ``partitioner_fn_override`` partitions."""
    from torch._inductor import compile_fx

    if "partitioner_fn_override" in inspect.signature(compile_fx.partition_fn).parameters:
        return compile_fx.partition_fn(joint, joint_inputs,
                                       partitioner_fn_override=partitioner_fn_override, **kwargs)
    # 2.11: partition_fn takes no override; run its joint-graph passes as it does, then ours.
    with compile_fx.get_cuda_device_context(joint):
        devices = compile_fx.get_inputs_devices(joint_inputs, joint)
        joint = compile_fx._recursive_joint_graph_passes(
            joint, skip_invoke_subgraph=True, input_device=next(iter(devices)))
    static = kwargs.pop("static_lifetime_input_indices", None)
    return partitioner_fn_override(joint, joint_inputs, static_lifetime_input_indices=static, **kwargs)


def inductor_set_fake_mode(mode: Any) -> contextlib.AbstractContextManager[Any]:
    """Inductor's passes read the fake mode from its virtualized state."""
    from torch._inductor.virtualized import V

    manager: contextlib.AbstractContextManager[Any] = V.set_fake_mode(mode)
    return manager


def inductor_compile_fx_inner(gm: Any, example_inputs: Any) -> Callable[..., Any]:
    """Inductor compiles one graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    compiled: Callable[..., Any] = compile_fx_inner(gm, example_inputs)
    return compiled


def use_count(tensor: torch.Tensor) -> int:
    """How many C++ references hold ``tensor``'s TensorImpl (``Tensor._use_count``, every
    release here): a Python object alone is one."""
    impl: Any = tensor  # _use_count is not in torch's type stubs
    count: int = impl._use_count()
    return count
