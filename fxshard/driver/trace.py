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
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_module_simplified
from torch.func import functional_call

from fxshard.ir import meta
from fxshard.ir.errors import FxShardError, TraceError
from fxshard.ir.plan import ShardPlan

_DATA_DEPENDENT_HINT = (
    "fxshard captures one static graph per input signature, so Python control flow may not "
    "depend on tensor values (if x.sum() > 0, .item(), .tolist(), .numpy()). Express it with "
    "tensor ops (torch.where, masking), or move it out of the model's forward."
)
_DYNAMIC_SHAPE_HINT = (
    "this operator's output shape depends on tensor values (nonzero, boolean-mask indexing, "
    "unique), which a static graph cannot hold. Use a fixed-shape form: torch.where, or "
    "multiply by a mask instead of selecting."
)
_UNSUPPORTED_HINT = (
    "this operator cannot run on fake tensors (it has no meta/fake implementation), so it "
    "cannot be traced. Register one with torch.library.register_fake, or replace the operator."
)


def _hint(e: BaseException) -> str:
    from torch._subclasses import fake_tensor

    if isinstance(e, fake_tensor.DynamicOutputShapeException):
        return _DYNAMIC_SHAPE_HINT
    if isinstance(e, fake_tensor.UnsupportedOperatorException):
        return _UNSUPPORTED_HINT
    return _DATA_DEPENDENT_HINT


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


class _ModuleScopes:
    """Forward hooks that annotate every traced node with its module path."""

    def __init__(self, root: nn.Module):
        self.stack: list[tuple[str, contextlib.AbstractContextManager[None]]] = []
        self.handles = []
        for name, mod in root.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
            self.handles.append(mod.register_forward_hook(self._exit))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            cm = torch.fx.traceback.annotate({meta.MODULE_ANNOTATION: name})
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


def parameter_views(plan: ShardPlan, shards: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter (under every name) as a view of its group's unsharded flat buffer.

    ``shards`` maps flat-group indices to the shard tensors to unshard; each
    enters through its marker, so this is where parameters enter a trace.
    """
    views: dict[str, torch.Tensor] = {}
    for index, shard in shards.items():
        group = plan.groups[index]
        marker = torch.ops.fxshard.replicate if group.replicated else torch.ops.fxshard.unshard
        full = marker(shard, group.index, group.world_size)
        sizes = [slot.numel for slot in group.params] + ([group.pad] if group.pad else [])
        for slot, piece in zip(group.params, torch.split(full, sizes)):
            view = piece.view(slot.shape)
            for name in slot.names:
                views[name] = view
    return views


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
    ):
        super().__init__()
        # A plain attribute, not a submodule: its (meta) parameters must not be lifted.
        object.__setattr__(self, "skeleton", skeleton)
        self.plan = plan
        for group, shard in zip(plan.groups, shards):
            self.register_parameter(f"shard{group.index}", shard)
        self.buffer_names = list(buffers)
        for i, buf in enumerate(buffers.values()):
            self.register_buffer(f"buffer{i}", buf)
        self.rebuild_inputs = rebuild_inputs
        self.output_spec: OutputSpec | None = None
        self.failed_in: str | None = None

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = parameter_views(
            self.plan, {g.index: getattr(self, f"shard{g.index}") for g in self.plan.groups}
        )
        for i, name in enumerate(self.buffer_names):
            tensors[name] = getattr(self, f"buffer{i}")
        args, kwargs = self.rebuild_inputs(inputs)
        scopes = _ModuleScopes(self.skeleton)
        try:
            out = functional_call(self.skeleton, tensors, args, kwargs)
        except Exception:
            self.failed_in = scopes.innermost()
            raise
        finally:
            scopes.close()
        flat, self.output_spec = flatten_outputs(out)
        return tuple(flat)


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
    try:
        with torch.fx.traceback.preserve_node_meta(), torch._functorch.config.patch(
            force_non_lazy_backward_lowering=True
        ), _compiling():
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
        op = getattr(e, "func", None)
        op_name = str(op) if op is not None else None
        location = f"module {where or '<root>'!r} ({_module_type(skeleton, where)})" if where is not None else "the model"
        raise TraceError(
            f"fxshard could not trace {model_name}: failed in {location}"
            + (f" at operator {op_name}" if op_name else "")
            + f": {type(e).__name__}: {_first_line(e)}\nHint: {_hint(e)}",
            module=where,
            op=op_name,
        ) from e


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """Trace as ``torch.compile`` traces: ``torch.compiler.is_compiling()`` is true throughout.

    Libraries take their compile-time paths then: Hugging Face transformers
    skips data-dependent checks of attention masks and picks a traceable
    experts implementation. ``torch.compile`` holds this same context around
    its whole compile, AOTAutograd included; AOTAutograd alone does not.
    """
    session = getattr(torch.compiler, "_compile_session_context", None)
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
