"""Tracing: capture one training (or inference) step as aten graphs.

The traced function takes the flat shards, the buffers and the user's tensor
inputs. Each shard enters through an ``fxshard.unshard`` marker whose result
is split and viewed back to the original parameter shapes; the original
module then runs through ``torch.func.functional_call`` on those views::

    shard_g -> fxshard.unshard -> split_with_sizes -> view -> module forward -> outputs

AOTAutograd (``aot_module_simplified``) traces that under fake tensors, builds
the joint forward+backward graph (the marker's autograd rule puts an
``fxshard.reduce_grad`` on each shard's gradient), partitions it and wraps the
compiled graphs in its own autograd.Function. fxshard supplies only the
partition function and the compilers (codegen.py), which run the passes.

A trace that fails raises ``TraceError`` with the hint of its cause (``CAUSES``,
a table of recognisers tried in order) and the line of the user's code that
failed (``user_source``: the innermost frame outside torch, fxshard and the
standard library).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from fxshard.driver.compile.guards import Recorder, recording
from fxshard.ir import compat, meta
from fxshard.ir.compat import aot_module_simplified, pytree
from fxshard.ir.errors import FxShardError, SourceLine, TraceError
from fxshard.ir.plan import ROOT, ShardPlan
from fxshard.ir.precision import MixedPrecision


@dataclasses.dataclass
class OutputSpec:
    """How to rebuild the module's outputs from the graph's flat tensor outputs."""

    spec: pytree.TreeSpec
    constants: list[Any]  # leaves; None where a tensor goes
    is_tensor: list[bool]

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.is_tensor, self.constants)]
        return pytree.tree_unflatten(leaves, self.spec)


def flatten_outputs(out: Any) -> tuple[list[torch.Tensor], OutputSpec]:
    _register_dataclasses(out)
    leaves, spec = pytree.tree_flatten(out)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    consts = [None if t else x for t, x in zip(is_tensor, leaves)]
    return [x for x in leaves if isinstance(x, torch.Tensor)], OutputSpec(spec, consts, is_tensor)


def _register_dataclasses(obj: Any) -> None:
    """Let pytree see through dataclass outputs (model-output objects)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)
        for f in dataclasses.fields(obj):
            _register_dataclasses(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _register_dataclasses(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            _register_dataclasses(x)


# Where each embedding function takes its indices: (position, keyword).
_INDICES: dict[Callable[..., Any], tuple[int, str]] = {
    F.embedding: (0, "input"),
    F.embedding_bag: (0, "input"),
    torch.embedding: (1, "indices"),
    torch.embedding_bag: (1, "indices"),
}


class _CheckIndices(TorchFunctionMode):
    """Embedding indices must be integers. torch's fake embedding says so from 2.13 on; on 2.11
    it traces float indices, and the step would fail only when it runs.

    Checked on the tensor that reaches the embedding function, not on the argument of an
    ``nn.Embedding``'s forward: a subclass may take a float tensor and compute the integer
    positions itself (OPT's and BART's learned positional embeddings).
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        where = _INDICES.get(func)
        if where is not None:
            pos, name = where
            indices = args[pos] if len(args) > pos else kwargs.get(name)
            if isinstance(indices, torch.Tensor) and indices.dtype not in (torch.int64, torch.int32):
                raise RuntimeError("Expected tensor for argument #1 'indices' to have one of the "
                                   f"following scalar types: Long, Int; but got {indices.dtype} instead")
        return func(*args, **kwargs)


class _ModuleScopes:
    """Forward hooks that annotate every traced node with its module path.

    The entry hook runs first (prepended), so what the other pre-hooks trace,
    a unit's input casts included, belongs to the module they run for.
    """

    def __init__(self, root: nn.Module):
        self.stack: list[tuple[str, contextlib.AbstractContextManager[None]]] = []
        self.handles = []
        for name, mod in root.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter(name), prepend=True))
            self.handles.append(mod.register_forward_hook(self._exit))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            cm = meta.annotate_module(name)
            cm.__enter__()
            self.stack.append((name, cm))

        return hook

    def _exit(self, mod: nn.Module, args: Any, out: Any) -> None:
        _, cm = self.stack.pop()
        cm.__exit__(None, None, None)

    def innermost(self) -> str | None:
        return self.stack[-1][0] if self.stack else None

    def close(self) -> None:
        while self.stack:
            self.stack.pop()[1].__exit__(None, None, None)
        for h in self.handles:
            h.remove()


def parameter_views(plan: ShardPlan, shards: dict[int, torch.Tensor],
                    device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Each parameter (under every name) as a view of its group's unsharded flat buffer.

    ``shards`` maps flat-group indices to the shard tensors to unshard; each
    enters through its marker, so this is where parameters enter a trace.
    ``device``: where the buffers compute, when the shards live elsewhere (offload;
    ``Driver.offloaded_to``); None: where the shards are.
    """
    views: dict[str, torch.Tensor] = {}
    for index, shard in shards.items():
        group = plan.groups[index]
        marker = torch.ops.fxshard.replicate if group.replicated else torch.ops.fxshard.unshard
        full = marker(shard, group.index, group.world_size, group.param_dtype, group.reduce_dtype, device)
        spans = group.spans()  # the padding's pieces are split off and never read
        for (slot, _), piece in zip(spans, torch.split(full, [n for _, n in spans])):
            if slot is None:
                continue
            view = piece.view(slot.shape)
            for name in slot.names:
                views[name] = view
    return views


def cast_inputs(inputs: Sequence[torch.Tensor], precision: MixedPrecision | None) -> list[torch.Tensor]:
    """Floating-point inputs in ``param_dtype`` (``cast_forward_inputs``), as traced."""
    if precision is None or not precision.cast_forward_inputs or precision.param_dtype is None:
        return list(inputs)
    dtype = precision.param_dtype
    return [x.to(dtype) if x.is_floating_point() else x for x in inputs]


def cast_unit_inputs(root: nn.Module, plan: ShardPlan, precision: MixedPrecision | None, *,
                     include_root: bool) -> list[RemovableHandle]:
    """Cast the floating-point forward inputs of every unit's modules to ``param_dtype``.

    FSDP2 casts them in the pre-forward hook of every ``fully_shard`` module
    (``cast_forward_inputs``), so a tensor the root computes in fp32 (a rotary
    table) enters each block in the dtype the block computes in. The hooks are
    prepended, as FSDP2's are: they run before the user's own pre-hooks. Units
    of ``full_precision_modules`` compute in their own dtype and are not cast;
    the root is cast only with ``include_root`` (``fxshard.compile`` casts the
    model's inputs itself, ``cast_inputs``). Returns the hooks' handles.
    """
    if precision is None or not precision.cast_forward_inputs or precision.param_dtype is None:
        return []
    dtype = precision.param_dtype

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))

    paths = dict.fromkeys([*(p for unit in plan.units for p in unit.modules if p != ROOT),
                           *((ROOT,) if include_root else ())])
    handles = []
    for path in paths:
        mod = root.get_submodule(path)
        if not isinstance(mod, precision.full_precision_modules):
            handles.append(mod.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
    return handles


def cast_outputs(outputs: Sequence[torch.Tensor], precision: MixedPrecision | None) -> list[torch.Tensor]:
    """Floating-point outputs in ``output_dtype``, as traced."""
    if precision is None or precision.output_dtype is None:
        return list(outputs)
    dtype = precision.output_dtype
    return [x.to(dtype) if x.is_floating_point() else x for x in outputs]


class TracedStep(nn.Module):
    """What ``trace_step`` traces: a module whose parameters are flat shards.

    ``forward`` returns the user outputs as a flat tuple of tensors and sets
    ``output_spec`` to rebuild them; ``skeleton`` (the model, or Dynamo's
    graph) and ``failed_in`` (the module path being traced when it failed)
    locate a failure.
    """

    skeleton: nn.Module
    output_spec: OutputSpec | None
    failed_in: str | None


class StepFunction(TracedStep):
    """The function AOTAutograd traces: shards and buffers in, module outputs out.

    Its parameters are exactly the flat shards and its buffers the module's
    buffers, which AOTAutograd lifts to graph inputs in that order.
    """

    def __init__(
        self,
        skeleton: nn.Module,
        plan: ShardPlan,
        shards: Sequence[nn.Parameter],
        buffers: dict[str, torch.Tensor],
        rebuild_inputs: Callable[[Sequence[torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]],
        precision: MixedPrecision | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.device = device  # where compute runs, when the shards live elsewhere (offload)
        # A plain attribute, not a submodule: its (meta) parameters must not be lifted.
        object.__setattr__(self, "skeleton", skeleton)
        self.plan = plan
        for group, shard in zip(plan.groups, shards):
            self.register_parameter(f"shard{group.index}", shard)
        self.buffer_names = list(buffers)
        for i, buf in enumerate(buffers.values()):
            self.register_buffer(f"buffer{i}", buf)
        self.rebuild_inputs = rebuild_inputs
        self.precision = precision
        self.output_spec: OutputSpec | None = None
        self.failed_in: str | None = None
        self.reads = Recorder()  # the constant attributes the forward read (fxshard.driver.compile.guards)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = parameter_views(
            self.plan, {g.index: getattr(self, f"shard{g.index}") for g in self.plan.groups}, self.device
        )
        for i, name in enumerate(self.buffer_names):
            tensors[name] = getattr(self, f"buffer{i}")
        args, kwargs = self.rebuild_inputs(cast_inputs(inputs, self.precision))
        casts = cast_unit_inputs(self.skeleton, self.plan, self.precision, include_root=False)
        scopes = _ModuleScopes(self.skeleton)
        try:
            with recording(self.skeleton, self.reads), _CheckIndices():
                out = functional_call(self.skeleton, tensors, args, kwargs)
        except Exception:
            self.failed_in = scopes.innermost()
            raise
        finally:
            scopes.close()
            for handle in casts:
                handle.remove()
        flat, self.output_spec = flatten_outputs(out)
        return tuple(cast_outputs(flat, self.precision))


# Operators whose floating-point operands must share a dtype: eager torch refuses the mix
# ("mat1 and mat2 must have the same dtype"), their meta kernels, which fxshard traces with,
# do not.
_ONE_DTYPE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default)


def refuse_mixed_dtype_matmuls(gm: torch.fx.GraphModule) -> None:
    """Raise ``TraceError`` (kind "dtype") where a matmul or convolution of ``gm`` (a traced
    joint or inference graph) takes floating-point operands of two dtypes: the trace accepts
    them, and the step would fail while running, after its collectives began, which leaves
    every later step refused (``Abandoned``). A float64 batch from NumPy into a float32 model
    is the usual cause. Raised here, at the trace, the module goes on with the right inputs."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _ONE_DTYPE:
            continue
        dtypes = sorted({str(a.meta["val"].dtype) for a in node.args if isinstance(a, torch.fx.Node)
                         and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype.is_floating_point})
        if len(dtypes) > 1:
            stack = node.meta.get("nn_module_stack") or {}
            where = next(reversed(stack.values()))[0] if stack else None
            raise TraceError(
                f"fxshard could not trace the step: {node.target} "
                + (f"in module {where!r} " if where else "")
                + f"takes operands of {' and '.join(dtypes)}, which torch does not multiply together "
                "(eager raises 'mat1 and mat2 must have the same dtype'); the step would fail while "
                f"running.\nHint: {next(c.hint for c in CAUSES if c.kind == 'dtype')}",
                module=where, op=str(node.target), kind="dtype")


def trace_step(
    step: TracedStep,
    example_inputs: Sequence[torch.Tensor],
    *,
    partition_fn: Callable[..., Any],
    fw_compiler: Callable[..., Any],
    bw_compiler: Callable[..., Any],
    inference_compiler: Callable[..., Any],
    model_name: str,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """Trace and compile ``step``; returns AOTAutograd's callable over the user inputs.

    ``step`` is a module whose parameters are the flat shards (StepFunction,
    or the backend's per-graph step); its ``failed_in`` and ``skeleton``
    attributes locate a failure.
    """
    symbolic = _symbolic_inputs(example_inputs)
    if symbolic:
        source = user_source(traceback.extract_stack()[:-1])
        raise TraceError(
            f"fxshard could not trace {model_name}: its inputs have symbolic (dynamic) sizes: "
            + "; ".join(symbolic)
            + (f"\n  called at {source}" if source else "")
            + f"\nHint: {DYNAMIC_SHAPES.hint}",
            kind=DYNAMIC_SHAPES.kind,
            source=source,
        )
    try:
        with torch.fx.traceback.preserve_node_meta(), compat.functorch_config.patch(
            force_non_lazy_backward_lowering=True
        ), _compiling(), compat.lazy_graph_modules(True):
            # Graph modules generate their Python code when it is first read or called, not
            # at each pass's recompile (the passes' and AOTAutograd's recompiles cost a fifth
            # of a small model's compile).
            # Typed for GraphModules, but lifts the parameters and buffers of any module.
            module: Any = step
            return aot_module_simplified(
                module,
                list(example_inputs),
                fw_compiler=fw_compiler,
                bw_compiler=bw_compiler,
                inference_compiler=inference_compiler,
                partition_fn=partition_fn,
                decompositions=decompositions,
                keep_inference_input_mutations=True,
            )
    except FxShardError:
        raise
    except Exception as e:
        where = getattr(step, "failed_in", None)
        skeleton = getattr(step, "skeleton", step)
        module_type = _module_type(skeleton, where)
        op = getattr(e, "func", None)
        op_name = str(op) if op is not None else None
        location = f"module {where or '<root>'!r} ({module_type})" if where is not None else "the model"
        cause = diagnose(e, module_type)
        source = failure_source(e)
        at = f"at {source}" if source else ""
        if source is None:  # not raised in the user's code: name the line that called fxshard
            source = user_source(traceback.extract_stack()[:-1])
            at = f"called at {source}" if source else ""
        raise TraceError(
            f"fxshard could not trace {model_name}: failed in {location}"
            + (f" at operator {op_name}" if op_name else "")
            + (f"\n  {at}" if at else "")
            + f"\n{type(e).__name__}: {_first_line(e)}\nHint: {cause.hint}",
            module=where,
            op=op_name,
            kind=cause.kind,
            source=source,
        ) from e


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """Trace as ``torch.compile`` traces: ``torch.compiler.is_compiling()`` is true throughout.

    Libraries take their compile-time paths then: Hugging Face transformers
    skips data-dependent checks of attention masks and picks a traceable
    experts implementation. ``torch.compile`` holds this same context around
    its whole compile, AOTAutograd included; AOTAutograd alone does not.
    """
    with compat.compiling():
        yield


def _module_type(root: nn.Module, path: str | None) -> str:
    if path is None:
        return "?"
    try:
        return type(root.get_submodule(path)).__name__
    except AttributeError:
        return "?"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


# -- why a trace failed -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cause:
    """One cause of a failed trace: how to recognise it and the hint that goes with it.

    ``matches`` is asked about each exception of the failure's chain (the
    error, then what it was raised from) with the class name of the module
    that was running, "?" when unknown.
    """

    kind: str  # TraceError.kind
    hint: str
    matches: Callable[[BaseException, str], bool]


_DTYPE_WORDS = re.compile(
    r"\bdtypes?\b|\bscalar types?\b|\btorch\.(?:b?float\d*|half|double|u?int\d+|long|short|bool|complex\d*)\b"
    r"|\b(?:BFloat16|Half|Float|Double|Long)\b"
)
_INDEX_WORDS = re.compile(r"\bind(?:ex|ices)\b", re.IGNORECASE)
_READS_DATA = re.compile(r"\.(?:numpy|tolist|item)\(\)|\bdata pointer\b|\bdata_ptr\b")
_NO_FAKE_IMPL = re.compile(r"\bfake impl|'Meta' backend|\bno (?:meta|fake) (?:kernel|implementation)", re.IGNORECASE)
_EMBEDDINGS = ("Embedding", "EmbeddingBag")


def _is_symbolic_shape_error(e: BaseException, module_type: str) -> bool:
    dynamo_exc = compat.dynamo_exc()
    from torch.fx.experimental import symbolic_shapes

    restart = getattr(dynamo_exc, "TensorifyScalarRestartAnalysis", None)
    return isinstance(e, symbolic_shapes.ConstraintViolationError) or (
        restart is not None and isinstance(e, restart))


def _is_data_dependent(e: BaseException, module_type: str) -> bool:
    fake_tensor = compat.fake_tensor
    from torch.fx.experimental import symbolic_shapes

    if isinstance(e, (fake_tensor.DataDependentOutputException,
                      symbolic_shapes.GuardOnDataDependentSymNode)):
        return True
    return bool(_READS_DATA.search(str(e)))  # .numpy() on a fake tensor, a C extension reading data


def _is_dynamic_output_shape(e: BaseException, module_type: str) -> bool:
    fake_tensor = compat.fake_tensor

    return isinstance(e, fake_tensor.DynamicOutputShapeException)


def _is_unsupported_operator(e: BaseException, module_type: str) -> bool:
    fake_tensor = compat.fake_tensor

    return isinstance(e, fake_tensor.UnsupportedOperatorException) or bool(_NO_FAKE_IMPL.search(str(e)))


def _is_index_dtype(e: BaseException, module_type: str) -> bool:
    text = str(e)
    return bool(_DTYPE_WORDS.search(text)) and (
        module_type in _EMBEDDINGS or bool(_INDEX_WORDS.search(text)))


def _is_dtype(e: BaseException, module_type: str) -> bool:
    return bool(_DTYPE_WORDS.search(str(e)))


def _is_tensor_attribute(e: BaseException, module_type: str) -> bool:
    # FakeTensorMode's refusal of a real tensor the trace did not make fake: not an input,
    # parameter or buffer, so a plain attribute (self.x = torch.ones(...)) or a global.
    return "convert all Tensors to FakeTensors" in str(e)


DYNAMIC_SHAPES = Cause(
    "dynamic-shapes",
    "fxshard compiles one static graph per input shape and cannot trace symbolic (dynamic) "
    "sizes. Dynamo passes them under torch.compile(..., dynamic=True), and by default once an "
    "input's shape has changed: use torch.compile(model, backend=fxshard.backend(...), "
    "dynamic=False), which compiles each new shape as a static graph of its own, or "
    "torch._dynamo.mark_static(x) on each input.",
    _is_symbolic_shape_error,
)

# In order: the first cause that matches names the failure (an index dtype is also a dtype).
CAUSES: tuple[Cause, ...] = (
    DYNAMIC_SHAPES,
    Cause(
        "tensor-attribute",
        "the forward used a tensor that is neither a parameter nor a buffer nor an input (a plain "
        "tensor attribute, self.x = torch.ones(...), or a global tensor): the trace sees only "
        "what the module registers. Register it as a buffer in __init__, "
        'self.register_buffer("name", tensor) (persistent=False keeps it out of state dicts), '
        "or pass it to forward as an input.",
        _is_tensor_attribute,
    ),
    Cause(
        "data-dependent",
        "fxshard captures one static graph per input signature, so Python control flow may not "
        "depend on tensor values (if x.sum() > 0, .item(), .tolist(), .numpy()). Express it with "
        "tensor ops (torch.where, masking), or move it out of the model's forward.",
        _is_data_dependent,
    ),
    Cause(
        "dynamic-output-shape",
        "this operator's output shape depends on tensor values (nonzero, boolean-mask indexing, "
        "unique), which a static graph cannot hold. Use a fixed-shape form: torch.where, or "
        "multiply by a mask instead of selecting.",
        _is_dynamic_output_shape,
    ),
    Cause(
        "unsupported-operator",
        "this operator cannot run on fake tensors (it has no meta/fake implementation), so it "
        "cannot be traced. Register one with torch.library.register_fake, or replace the operator.",
        _is_unsupported_operator,
    ),
    Cause(
        "index-dtype",
        "indices must be integer tensors: token ids fed to an nn.Embedding (or the index of "
        "gather or index_select, or a class-index target) must be torch.long, e.g. ids.long(), "
        "not float. With `fxshard explain`, pass --input-dtype int64 for that input.",
        _is_index_dtype,
    ),
    Cause(
        "dtype",
        "an operator does not accept the dtype of its inputs: its kernel, or the meta/fake "
        "implementation fxshard traces with, takes only some dtypes (a bfloat16-only kernel given "
        "float32, float32 inputs into a model cast with model.to(torch.bfloat16)). Give the inputs "
        "the dtype the model expects (x.to(dtype)), or cast the model before fxshard.compile; with "
        "`fxshard explain`, pass --input-dtype.",
        _is_dtype,
    ),
)

UNKNOWN = Cause(
    "unknown",
    "the model's forward raised while fxshard traced it with AOTAutograd under fake tensors "
    "(shapes and dtypes, no data). Check that it runs eagerly on inputs of these shapes and "
    "dtypes; the original exception, with its traceback, is chained to this one.",
    lambda e, module_type: True,
)


def diagnose(e: BaseException, module_type: str = "?") -> Cause:
    """The first cause in ``CAUSES`` that matches an exception of ``e``'s chain, else ``UNKNOWN``."""
    chain = _exception_chain(e)
    return next((c for c in CAUSES if any(c.matches(x, module_type) for x in chain)), UNKNOWN)


def _exception_chain(e: BaseException) -> list[BaseException]:
    """``e``, the exception it was raised from or while handling, and so on."""
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and all(x is not y for y in chain):
        chain.append(x)
        x = x.__cause__ if x.__cause__ is not None else (
            None if x.__suppress_context__ else x.__context__)
    return chain


def _symbolic_inputs(inputs: Sequence[Any]) -> list[str]:
    """What makes ``inputs`` dynamic: symbolic sizes (Dynamo's dynamic shapes), or ``[]``."""
    found = []
    for i, x in enumerate(inputs):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            found.append(f"input {i} is the symbolic size {x}")
        elif isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape):
            found.append(f"input {i} has shape ({', '.join(str(d) for d in x.shape)})")
    return found


# -- the user's line --------------------------------------------------------------------------

# Packages whose frames are not the user's: torch and what it runs on, and fxshard itself.
_LIBRARIES = ("torch", "functorch", "sympy", "triton", "optree", "fxshard", "fxshard.passes")
_SITE_PACKAGES = re.compile(r"[/\\](?:site|dist)-packages[/\\]")


def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(directories of the library packages loaded here, of the standard library)."""
    roots = []
    for name in _LIBRARIES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            roots.append(os.path.dirname(os.path.realpath(file)) + os.sep)
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths}
    return tuple(roots), tuple(stdlib)


def _is_library(filename: str, roots: tuple[str, ...], stdlib: tuple[str, ...]) -> bool:
    if filename.startswith("<"):  # generated code (fx graphs, exec), frozen modules
        return True
    path = os.path.realpath(filename)
    # site-packages lies under the standard library's directory; the packages there are not it.
    return path.startswith(roots) or (path.startswith(stdlib) and not _SITE_PACKAGES.search(path))


def _is_dispatch(filename: str) -> bool:
    """torch's Python dispatcher: what calls an operator's registered implementations."""
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    path = os.path.realpath(filename)
    return path == os.path.join(torch_dir, "_ops.py") or path.startswith(
        os.path.join(torch_dir, "_library") + os.sep)


def user_source(frames: Sequence[traceback.FrameSummary]) -> SourceLine | None:
    """The innermost of ``frames`` (outermost first) in the user's code: not in torch (or a
    package it runs on), fxshard or the standard library; site-packages are user code
    (a Hugging Face model's modeling file). A user's function that torch's dispatcher
    called (a fake implementation registered with torch.library) is an operator's
    implementation: the line is then the one that called the operator."""
    roots, stdlib = _library_roots()
    found: traceback.FrameSummary | None = None
    dispatched = False  # whether torch's dispatcher lies between ``found`` and the next user frame
    for frame in reversed(frames):
        if _is_library(frame.filename, roots, stdlib):
            dispatched = dispatched or (found is not None and _is_dispatch(frame.filename))
            continue
        if found is not None and not dispatched:
            break
        found, dispatched = frame, False
    if found is None or found.lineno is None:
        return None
    return SourceLine(found.filename, found.lineno, found.name, (found.line or "").strip())


def failure_source(e: BaseException) -> SourceLine | None:
    """The user's line where ``e`` was raised: searched in ``e``'s own traceback, then in those
    of the exceptions it was raised from (a wrapper raised in torch holds only torch frames)."""
    for x in _exception_chain(e):
        source = user_source(traceback.extract_tb(x.__traceback__))
        if source is not None:
            return source
    return None
