"""Codegen: the hooks AOTAutograd calls, which run the passes and recompile.

AOTAutograd calls ``partition`` with the joint graph of a training step, then
``compile_forward`` and ``compile_backward`` with the two halves; an inference
step (no gradient needed) goes straight to ``compile_inference``. Each hook
runs the pipeline the driver built for its graph, recompiles the GraphModule and
returns it as a boxed callable, so AOTAutograd's own runtime (the
autograd.Function around the graphs, buffer mutation write-back) runs it.

Under a torch profiler the eager graphs run a copy with named ranges around
each collective and each wait (``with_profiler_ranges``); the graphs that
``sharded.graphs``, the report and ``verify`` read have none. Inductor removes
``record_function`` ops from the graphs it compiles, so ``compute="inductor"``
runs without them: its collectives keep torch's own names only.

Inductor compiles a copy of each emitted graph that reads ``no_sync``'s
accumulators as inputs rather than attributes (``finish_with_attributes_as_inputs``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxshard.driver.compile.steps import Schedule
from fxshard.driver.compile.trace import refuse_mixed_dtype_matmuls
from fxshard.driver.run.runtime import Abandoned, World, collective_failure, settle
from fxshard.ir import compat, meta
from fxshard.ir import predicates as P
from fxshard.ir.chains import chains
from fxshard.ir.checkpointing import Checkpointing
from fxshard.ir.compat import default_partition
from fxshard.ir.config import CompileConfig, PassHook
from fxshard.ir.errors import FxShardError
from fxshard.ir.layout import Layout
from fxshard.ir.ops import FREE
from fxshard.ir.plan import ShardPlan
from fxshard.passes import GraphKind, PassContext, run_passes
from fxshard.passes.context import REDUCE, GradSync
from fxshard.passes.lowering import LoweringKey, Site, lowering_for

log = logging.getLogger("fxshard")


class GraphCompiler:
    """One per traced signature; records the emitted graphs in ``graphs``.

    ``pipelines`` maps each graph kind to its passes (``build_pipeline``);
    ``on_pass(graph, pass_name, gm)`` sees each graph as traced and after every
    pass; ``finish`` turns an emitted graph into what runs it (default: the
    GraphModule itself, in the boxed calling convention).
    """

    def __init__(self, plan: ShardPlan, world: World, layout: Layout, schedule: Schedule,
                 on_pass: PassHook | None = None,
                 finish: Callable[[fx.GraphModule, Any], Callable[..., Any]] | None = None,
                 grad_sync: GradSync = REDUCE,
                 accumulators: Mapping[int, torch.Tensor] | None = None,
                 abandoned: Abandoned | None = None):
        self.plan = plan
        self.world = world
        self.layout = layout  # the driver's, built once (Driver.layout)
        self.world_size = world.size
        self.group_name = world.group_name
        self.schedule = schedule  # what the passes run with: given, never replaced
        self.on_pass = on_pass
        self.finish = finish
        self.grad_sync = grad_sync
        self.accumulators = accumulators or {}
        self.abandoned = abandoned or Abandoned()  # the driver's: a graph that raises marks it
        self.emit_only = False  # emit(): run the passes, compile nothing to run
        self.saved_buffers: dict[str, int] = {}  # backward input name -> flat group
        self.graphs: dict[str, fx.GraphModule] = {}
        self.num_user_outputs: int | None = None

    @property
    def config(self) -> CompileConfig:
        return self.schedule.config

    @property
    def checkpointing(self) -> Checkpointing | None:
        return self.schedule.checkpointing

    def context(self, graph: GraphKind, num_user_outputs: int | None = None) -> PassContext:
        return PassContext(self.plan, self.layout, graph,
                           num_user_outputs=num_user_outputs, verify=self.config.verify,
                           options=self.config.options, grad_sync=self.grad_sync, accumulators=self.accumulators,
                           checkpointing=self.checkpointing, compute=self.config.compute)

    def _run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        hook = self.on_pass
        on_pass = None if hook is None else (lambda name, g: hook(ctx.graph, name, g))
        if on_pass is not None:
            on_pass("traced", gm)
        try:
            return run_passes(gm, ctx, self.schedule.pipelines[ctx.graph], on_pass=on_pass)
        except FxShardError:
            raise
        except Exception as e:
            # Not the model's fault: keep it apart from TraceError.
            raise FxShardError(
                f"internal error in fxshard's passes on the {ctx.graph} graph: "
                f"{type(e).__name__}: {e}. Please report it with the model; "
                "FXSHARD_VERIFY=1 checks the graph after every pass."
            ) from e

    def partition(self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                  **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        refuse_mixed_dtype_matmuls(joint)
        joint = self._run(joint, self.context("joint"))
        self.graphs["joint"] = joint
        self.num_user_outputs = num_fwd_outputs
        fw, bw = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        # Buffers of units that are not resharded cross to backward as the
        # unshard marker's value; backward sees them as inputs of the same name.
        # Without a process group the "buffer" is the shard itself: never freed.
        output = next(n for n in fw.graph.nodes if n.op == "output")
        for node in output.args[0][num_fwd_outputs:] if self.group_name is not None else ():
            m = P.marker(node) if isinstance(node, fx.Node) else None
            if m is not None and m.kind is P.MarkerKind.UNSHARD:
                self.saved_buffers[node.name] = m.group
        return fw, bw

    def _compile(self, kind: GraphKind, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        num_user_outputs = self.num_user_outputs if kind == "forward" else None
        ctx = self.context(kind, num_user_outputs)
        if kind == "backward":  # each buffer kept from forward: a chain of the lowering table's
            for node in gm.graph.nodes:
                if node.op == "placeholder" and node.name in self.saved_buffers:
                    group = self.saved_buffers[node.name]
                    key = LoweringKey.of(meta.Direction.GATHER, ctx.holding(group), "saved")
                    lowering_for(key)(Site(gm, group, node, node, node), ctx)
        gm = self._run(gm, ctx)
        gm.recompile()
        self.graphs[kind] = gm
        if self.emit_only:
            return gm
        if self.finish is None:
            return _guarded(_boxed(gm), self.world, kind, self.abandoned, boxed=True)
        if kind == "backward" and example_inputs is not None:  # hpZ's pieces are smaller
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            example_inputs = [n.meta["val"] if (info := meta.get_info(n)) is not None
                              and info.role is meta.Role.PIECE else x
                              for n, x in zip(placeholders, example_inputs)]
        try:
            compiled = finish_with_attributes_as_inputs(self.finish, gm, example_inputs)
        except Exception as e:
            raise FxShardError(
                f"compiling fxshard's emitted {kind} graph failed: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. "
                "compute='eager' runs the same graph without Inductor."
            ) from e
        return _guarded(compiled, self.world, kind, self.abandoned,
                        boxed=compat.is_boxed(compiled))

    def compile_forward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return self._compile("forward", gm, example_inputs)

    def compile_backward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return self._compile("backward", gm, example_inputs)

    def compile_inference(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        refuse_mixed_dtype_matmuls(gm)
        return self._compile("inference", gm, example_inputs)

    def emit(self, joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
             partition_kwargs: dict[str, Any], partitioned: Partitioned | None = None) -> dict[str, fx.GraphModule]:
        """The emitted graphs of a copy of ``joint``, as AOTAutograd's calls would make them,
        with nothing compiled to run: a trial of this configuration (the budget planner).
        ``partitioned``: this configuration's ``split`` of ``joint`` made already (by a
        compiler whose configuration differs only in the forward's and backward's passes)."""
        self.emit_only = True
        # Nothing reads a trial's Python code: its graph modules generate none (compat).
        with compat.lazy_graph_modules(True):
            if partitioned is None:
                partitioned = self.split(joint, joint_inputs, num_fwd_outputs, partition_kwargs)
            self.graphs["joint"] = partitioned.joint
            self.num_user_outputs = partitioned.num_user_outputs
            self.saved_buffers = dict(partitioned.saved_buffers)
            self.compile_forward(copy_graph_module(partitioned.forward), None)
            self.compile_backward(copy_graph_module(partitioned.backward), None)
        return dict(self.graphs)

    def split(self, joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
              partition_kwargs: dict[str, Any]) -> Partitioned:
        """A copy of ``joint`` through the joint graph's passes and the partition, before the
        forward's and backward's passes: what every emit of this joint pipeline starts from."""
        self.emit_only = True
        with compat.lazy_graph_modules(True):
            fw, bw = self.partition(copy_graph_module(joint), joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                    **partition_kwargs)
        return Partitioned(self.graphs["joint"], fw, bw, num_fwd_outputs, dict(self.saved_buffers))


def split_key(schedule: Schedule) -> tuple[Any, ...]:
    """What a schedule's joint graph passes and partition read: all of it but the prefetch
    depth, which only the forward's and backward's passes read."""
    config = schedule.config
    return (dataclasses.replace(config.options, max_inflight_gathers=1), schedule.checkpointing,
            config.compute, config.mixed_precision, config.verify)


class Splits:
    """The partitions made of one joint graph under one plan, for trials: a schedule's emit
    reuses the one made for a schedule with the same ``split_key`` (auto()'s variants that
    differ in the prefetch depth alone, the budget ladder's prefetch limits)."""

    def __init__(self) -> None:
        self.made: list[tuple[tuple[Any, ...], Partitioned]] = []

    def emit(self, compiler: GraphCompiler, joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
             partition_kwargs: dict[str, Any]) -> dict[str, fx.GraphModule]:
        key = split_key(compiler.schedule)
        partitioned = next((p for k, p in self.made if k == key), None)
        if partitioned is None:
            partitioned = compiler.split(joint, joint_inputs, num_fwd_outputs, partition_kwargs)
            self.made.append((key, partitioned))
        return compiler.emit(joint, joint_inputs, num_fwd_outputs, partition_kwargs, partitioned)


@dataclass(frozen=True)
class Partitioned:
    """A joint graph after its passes and AOTAutograd's partition: the forward and backward
    graphs before their own passes. Schedules that differ only in what those passes read
    (the prefetch depth, ``max_inflight_gathers``) emit from one (``GraphCompiler.emit``);
    each emit copies the two graphs."""

    joint: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    num_user_outputs: int
    saved_buffers: dict[str, int]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph passes may rewrite; node names and metadata (fake
    values included, shared: they are never changed in place) are kept."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}), type_expr=None)
    return compat.make_graph_module(gm, graph)


def finish_with_attributes_as_inputs(finish: Callable[[fx.GraphModule, Any], Callable[..., Any]],
                                     gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """``finish(gm, example_inputs)`` for a compiler that takes tensors only as inputs (Inductor).

    The only tensor attributes of an emitted graph are ``no_sync``'s accumulators: ``get_attr``s
    of the driver's unsharded sums, which backward adds into in place and, in the step that
    reduces them, frees. Inductor takes a ``get_attr`` for a constant of the graph it compiles
    (it runs the graph on fake tensors, where a real constant fails; one it folded or copied
    would not be written back). So ``finish`` compiles a copy that reads each as one more input,
    which Inductor writes in place (an input mutation, as it does AOTAutograd's ``copy_``
    epilogues), and the compiled graph is called with the accumulators after AOTAutograd's
    arguments. Their frees run when the graph returns: Inductor frees no input, and may move a
    read past an explicit free (``insert_free_pass`` is left out under Inductor for that)::

        emitted:   acc = get_attr(fxshard_accumulated_0) ... add_(acc, cat)
        compiled:  def graph(*args, acc): ... add_(acc, cat)               graph(*args, accumulator)
        emitted:   ... s = add(cat, acc); free(acc); div_(s, N) ...
        compiled:  def graph(*args, acc): ... s = add(cat, acc); div_(s, N) ...
                                                                  graph(*args, accumulator); free(accumulator)

    ``gm`` itself (``sharded.graphs``, the report, ``verify``) keeps the attributes and frees.
    """
    emitted = [n for n in gm.graph.nodes
               if n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None), torch.Tensor)]
    if not emitted:
        return finish(gm, example_inputs)
    tensors = [getattr(gm, str(n.target)) for n in emitted]
    fakes = [n.meta["val"] for n in emitted]
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies), type_expr=None)  # names and metadata kept
    attributes = [copies[n] for n in emitted]
    freed = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    for node, tensor in zip(attributes, tensors):
        with graph.inserting_after(last) if last is not None else graph.inserting_before():
            last = graph.placeholder(str(node.target))
        last.meta.update(node.meta)
        for free in [u for u in node.users if P.is_free(u)]:
            graph.erase_node(free)
            freed.append(tensor)
        node.replace_all_uses_with(last)
        graph.erase_node(node)
    graph.lint()
    compiled = finish(fx.GraphModule(gm, graph), [*example_inputs, *fakes])
    boxed = compat.is_boxed(compiled)

    def run(args: list[Any]) -> Any:
        args.extend(tensors)
        outputs = compiled(args) if boxed else compiled(*args)
        for tensor in freed:
            FREE(tensor)
        return outputs

    return compat.boxed(run)


def _boxed(gm: fx.GraphModule) -> Callable[..., Any]:
    """A copy of ``gm`` in torch's boxed calling convention, which AOTAutograd calls.

    The generated code takes the argument list and clears it, so each input
    (a saved activation, a tangent) dies after its last use in the graph
    rather than when the graph returns. ``gm`` itself keeps the plain
    signature, for reading and for calling by hand. While a profiler records,
    a second copy runs instead, with ``with_profiler_ranges``, made at the first
    call under a profiler; without one, the ranges cost a flag read per call.
    """
    plain = _boxed_copy(gm, copy.deepcopy(gm.graph)).forward
    if not any(P.is_collective(n) for n in gm.graph.nodes):
        return plain
    ranged: list[Callable[[list[Any]], Any]] = []

    def run(args: list[Any]) -> Any:
        if not compat.profiler_enabled():
            return plain(args)
        if not ranged:
            ranged.append(_boxed_copy(gm, with_profiler_ranges(gm.graph)).forward)
        return ranged[0](args)

    return run


def _boxed_copy(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    runnable = fx.GraphModule(gm, graph)
    runnable.graph.set_codegen(BoxedCodeGen())
    runnable.recompile()
    return runnable


RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
RANGE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


def range_name(kind: str, unit: str, wait: bool = False) -> str:
    """``fxshard all_gather blocks.0``, ``fxshard wait reduce_scatter <root>``: a profiler range."""
    return f"fxshard {'wait ' if wait else ''}{kind} {unit or '<root>'}"


def with_profiler_ranges(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with a ``record_function`` range around each collective and each
    wait, named by ``range_name``.

        all_gather(shard)  ->  enter("fxshard all_gather blocks.0") -> all_gather(shard) -> exit
        wait(ag)           ->  enter("fxshard wait all_gather blocks.0") -> wait(ag) -> exit

    The issue and the wait get a range each, not one from issue to wait: ranges on one
    thread must nest, and collectives in flight together (prefetch, reductions waited late)
    overlap without nesting. For running only: the new nodes carry no metadata.
    """
    ranged = copy.deepcopy(graph)
    for chain in chains(ranged):
        for collective in chain.collectives:
            kind = P.collective_args(collective).kind
            (wait,) = collective.users  # invariant 3: a collective's one user is its wait
            for node, is_wait in ((collective, False), (wait, True)):
                with ranged.inserting_before(node):
                    enter = ranged.call_function(RANGE_ENTER, (range_name(kind, chain.unit, is_wait), None))
                with ranged.inserting_after(node):
                    ranged.call_function(RANGE_EXIT, (enter,))
    ranged.lint()
    return ranged


class BoxedCodeGen(fx.graph.CodeGen):
    """``def forward(self, args_list)``: the placeholders are taken from the list, which is
    then cleared (torch's boxed calling convention, written on fx's public ``CodeGen``)."""

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **kwargs: Any) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        lines = [f"def forward(self, args_list){maybe_return_annotation}:"]
        if names:
            lines += ["    args_iter = iter(args_list)"]
            lines += [f"    {name} = next(args_iter)" for name in names]
            lines += ["    args_list.clear()"]
        return "\n".join(lines)


def _guarded(compiled: Callable[..., Any], world: World, kind: str, abandoned: Abandoned,
             boxed: bool) -> Callable[..., Any]:
    """``compiled`` (boxed), marking the step abandoned when it raises: its collectives may be
    in flight, its peers inside them (``runtime.Abandoned``), and no gloo worker thread may be
    left holding one when the process exits (``runtime.settle``). A collective that failed (a
    peer gone or stalled) raises a clear FxShardError."""

    def run(args: list[Any]) -> Any:
        try:
            with compat.no_python_context():  # its collectives' Works: nothing a gloo thread must decref
                return compiled(args) if boxed else compiled(*args)
        except BaseException as e:
            abandoned.leave(f"the {kind} graph", e)
            settle(None, *world.all_comm)
            abandoned.explain(e)
            failure = collective_failure(e, world, f"{kind} graph")
            if failure is None:
                raise
            raise failure from e

    return compat.boxed(run)
