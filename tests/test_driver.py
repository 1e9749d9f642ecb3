"""One driver behind three front ends: the same passes, options, hooks and collectives everywhere."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fxshard
from fxshard.driver.compile import compiler as driver_compiler
from fxshard.ir import predicates as P
from fxshard.ir.collectives import step_collectives
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError, GraphInvariantError
from fxshard.ir.nodes import call
from fxshard.passes import all_pass_names, build_pipeline, describe
from fxshard.passes import pipeline as pipeline_module
from fxshard.policies import by_class

from graph_utils import fake_world
from models import MLP, Block, TinyGPT

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, graph: str, pass_name: str, gm: fx.GraphModule) -> None:
        self.seen.append((graph, pass_name))


def _backend_step(policy: Any, **options: Any) -> fxshard.FxShardBackend:
    """TinyGPT through the torch.compile backend, one training step (on the current world)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    be = fxshard.backend(policy=policy, **options)
    compiled = torch.compile(TinyGPT(), backend=be, dynamic=False)
    fxshard.parameters(compiled)
    compiled(TOKENS).sum().backward()
    return be


def test_front_ends_run_the_same_passes_and_emit_the_same_collectives() -> None:
    policy = by_class(Block)
    with fake_world(2):
        compiled_hook, backend_hook = Recorder(), Recorder()
        torch.manual_seed(0)
        sm = fxshard.compile(TinyGPT(), policy=policy, example_inputs=TOKENS, on_pass=compiled_hook)
        be = _backend_step(policy, on_pass=backend_hook)
    explain_hook = Recorder()
    e = fxshard.explain(TinyGPT(), TOKENS, policy=policy, world_size=2, on_pass=explain_hook)

    passes = [p for p in compiled_hook.seen if p[1] != "traced"]
    assert ("backward", "sink_allocations_pass") in passes and ("joint", "rematerialize_params_pass") in passes
    assert backend_hook.seen == compiled_hook.seen == explain_hook.seen
    assert list(e.pass_names) == passes == be.steps()[0].passes
    dimensions = {"0": ("shard", 0)}  # the fake group's one group: no in-flight slots there
    expected = step_collectives(sm.graphs, dimensions)
    assert len(expected) == 8  # 3 units: 3 gathers forward, 2 backward, 3 reduce-scatters
    assert be.steps()[0].collectives == expected
    assert step_collectives(e.graphs, dimensions) == expected


def _timeouts(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """The timeout each driver creates its communication groups with."""
    seen: list[float | None] = []
    real = driver_compiler.with_comm_groups

    def spy(world: Any, slots: int, timeout: float | None, hsdp: Any = None, hpz: Any = None) -> Any:
        seen.append(timeout)
        return real(world, slots, timeout, hsdp, hpz)

    monkeypatch.setattr(driver_compiler, "with_comm_groups", spy)
    return seen


def _verify_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per verify call the pass runner makes: False after a pass, True on an emitted graph."""
    calls: list[bool] = []
    real = pipeline_module.verify

    def spy(gm: fx.GraphModule, ctx: Any = None, *, final: bool = False) -> None:
        calls.append(final)
        real(gm, ctx, final=final)

    monkeypatch.setattr(pipeline_module, "verify", spy)
    return calls


@pytest.mark.parametrize("front_end", ["compile", "backend"])
def test_every_front_end_honours_fxshard_verify(monkeypatch: pytest.MonkeyPatch, front_end: str) -> None:
    counts = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FXSHARD_VERIFY", flag)
        calls = _verify_calls(monkeypatch)
        if front_end == "compile":
            sm = fxshard.compile(TinyGPT(), policy=by_class(Block))
            sm(TOKENS).sum().backward()
        else:
            _backend_step(by_class(Block))
        counts[flag] = (calls.count(False), calls.count(True))
    n_graphs = 2  # forward and backward are verified as emitted; the joint graph is not emitted
    assert counts["0"] == (0, n_graphs)
    assert counts["1"][1] == n_graphs and counts["1"][0] >= 12  # after every pass of all three graphs


@pytest.mark.parametrize("front_end", ["compile", "backend"])
def test_every_front_end_takes_the_same_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                front_end: str) -> None:
    timeouts = _timeouts(monkeypatch)
    hook = Recorder()
    options: dict[str, Any] = dict(on_pass=hook, timeout=7.5, dump_dir=tmp_path,
                                   disable_passes=("sink_allocations_pass",), verify_passes=True,
                                   max_inflight_gathers=1)
    if front_end == "compile":
        sm = fxshard.compile(TinyGPT(), policy=by_class(Block), **options)
        assert sm.config.timeout == 7.5
        sm(TOKENS).sum().backward()
        sm(TOKENS[:1]).sum().backward()  # a second signature dumps into step-1
    else:
        be = _backend_step(by_class(Block), **options)
        assert be.config == sm_config(options)
    assert timeouts and set(timeouts) == {7.5}
    names = [p for _, p in hook.seen]
    assert "sink_allocations_pass" not in names and "insert_free_pass" in names
    for name in ("plan.txt", "report.txt", "units.dot", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert any(p.name.endswith("-backward-insert_free_pass.py") for p in (tmp_path / "passes").iterdir())
    if front_end == "compile":
        assert (tmp_path / "step-1" / "report.txt").exists()


def sm_config(options: dict[str, Any]) -> CompileConfig:
    return CompileConfig.build("compile", policy=by_class(Block), **options)


def test_dump_setting_comes_from_the_environment_for_every_front_end(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FXSHARD_DUMP", str(tmp_path / "env"))
    for front_end in ("compile", "backend", "explain"):
        assert CompileConfig.build(front_end).dump_dir == str(tmp_path / "env")  # type: ignore[arg-type]
    assert CompileConfig.build("compile", dump_dir=tmp_path / "arg").dump_dir == str(tmp_path / "arg")


def test_options_a_front_end_cannot_honour_are_refused_with_the_reason() -> None:
    with pytest.raises(TypeError, match="explain does not take \\['process_group'\\].*fake process group"):
        fxshard.explain(MLP(), torch.randn(2, 12), process_group=None)
    with pytest.raises(TypeError, match="explain does not take \\['timeout'\\].*runs nothing"):
        fxshard.explain(MLP(), torch.randn(2, 12), timeout=5)
    for make in (lambda **kw: fxshard.compile(MLP(), **kw), lambda **kw: fxshard.backend(**kw),
                 lambda **kw: fxshard.explain(MLP(), torch.randn(2, 12), **kw)):
        with pytest.raises(TypeError, match="unknown fxshard option.*did you mean 'on_pass' for 'on_pas'\\?"):
            make(on_pas=print)
        with pytest.raises(TypeError, match="did you mean 'reshard_after_forward' for 'reshard_after_foward'\\?"):
            make(reshard_after_foward=False)
    # The list of what each takes leaves out what it refuses.
    for make, refused in ((lambda **kw: fxshard.backend(**kw), ["broadcast_buffers"]),
                          (lambda **kw: fxshard.explain(MLP(), torch.randn(2, 12), **kw),
                           ["process_group", "timeout", "param_init_fn", "sync_module_states", "mesh"])):
        with pytest.raises(TypeError, match="also takes") as caught:
            make(foo=1)
        listed = str(caught.value).split("also takes", 1)[1]
        assert "'policy'" in listed and not any(f"'{name}'" in listed for name in refused), listed
        assert "did you mean" not in str(caught.value)


@pytest.mark.parametrize("option, value, words", [
    ("forward_prefetch", "no", "forward_prefetch takes True or False, got 'no'"),
    ("reshard_root", 1, "reshard_root takes True or False"),
    ("max_inflight_gathers", 2.5, "max_inflight_gathers takes a whole number \\(at least 1\\), got 2.5"),
    ("bucket_bytes", "64MiB", "bucket_bytes takes a whole number .*got '64MiB': a number of bytes, e.g. 64 << 20"),
    ("max_inflight_bytes", 1.5e6, "max_inflight_bytes takes a whole number"),
    ("replicate_below", True, "replicate_below takes a whole number"),
    ("timeout", "30", "timeout takes seconds \\(a number\\) or a datetime.timedelta, got '30'"),
])
def test_an_option_of_the_wrong_type_is_refused_naming_it(option: str, value: Any, words: str) -> None:
    """A truthy string turned prefetch on, a float in-flight limit failed deep in a pass, and a
    string of bytes raised a comparison's TypeError that named no option."""
    with pytest.raises(TypeError, match=words):
        CompileConfig.build("compile", **{option: value})


def test_a_dump_dir_process_group_size_or_world_size_of_the_wrong_type_is_refused_naming_it() -> None:
    """Before, each failed deep inside with a message that named no option: os.fspath's, a
    c10d lookup of an uninitialised default group, int('1e6'), and the fake group's binding."""
    from fxshard.policies import by_size

    with pytest.raises(TypeError, match="dump_dir takes a folder's path .*not 3 \\(int\\)"):
        CompileConfig.build("compile", dump_dir=3)
    with pytest.raises(TypeError, match="process_group takes a torch.distributed.ProcessGroup .*not 0 \\(int\\)"):
        fxshard.compile(MLP(), process_group=0)
    with pytest.raises(TypeError, match="by_size takes a number of parameters, .*not '1e6' \\(str\\)"):
        by_size("1e6")  # type: ignore[arg-type]
    assert by_size(1e3) == by_size(1000)
    for option, value in (("world_size", 2.5), ("world_size", True), ("rank", "0")):
        with pytest.raises(fxshard.FxShardError, match=f"explain: {option} takes a whole number.*not {value!r}"):
            fxshard.explain(MLP(), torch.randn(2, 12), **{option: value})


def test_a_timeout_may_be_a_timedelta_as_init_process_groups() -> None:
    import datetime

    assert CompileConfig.build("compile", timeout=datetime.timedelta(minutes=2)).timeout == 120.0


def test_fsdp1s_backward_prefetch_enum_is_taken_as_its_names() -> None:
    from torch.distributed.fsdp import BackwardPrefetch

    pre = CompileConfig.build("compile", backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    post = CompileConfig.build("compile", backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    assert (pre.options.backward_prefetch, post.options.backward_prefetch) == ("pre", "post")


def test_a_step_generates_python_code_only_for_the_graphs_that_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pass ends with ``recompile()``; under lazy graph modules that only marks the code
    stale, and it is generated where it is read or called: the forward's and backward's boxed
    copies and a few of AOTAutograd's. Eager recompiles generated 21 programs for this MLP's
    first step (about a fifth of a small model's compile), lazy ones 7."""
    generated = []
    python_code = fx.Graph.python_code

    def counted(self: fx.Graph, *args: Any, **kwargs: Any) -> Any:
        generated.append(self)
        return python_code(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counted)
    sm = fxshard.compile(MLP(), policy=by_class(torch.nn.Linear))
    sm(torch.randn(6, 12)).sum().backward()
    assert len(generated) <= 8, len(generated)
    before = len(generated)
    assert "def forward" in sm.graphs["backward"].code  # read: generated now
    assert len(generated) <= before + 1


@pytest.mark.release("inductor_partition_fn")
def test_compile_runs_inductor_compute_like_the_backend() -> None:
    """The MLP, one unit per layer. From a cold cache Inductor compiles its kernels in 20-30 s
    where the GPT's took 45-65 s of the fast tier's 8 minutes on a fresh machine; the GPT through
    Inductor trains against DDP in the slow tier (test_backend's test_inductor_compute_matches_ddp)."""
    from fxshard.driver.compile import inductor

    before = sum(inductor._outcome_counts())
    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    sm = fxshard.compile(model, policy=by_class(torch.nn.Linear), compute="inductor")
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(0))
    out = sm(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    assert len(sm.plan.units) == 3  # two layers and the head
    # Forward and backward went through Inductor's compile (its FX graph cache, hit or miss).
    assert sum(inductor._outcome_counts()) - before == 2
    # Inductor frees buffers itself: the pipeline has no explicit frees.
    assert not [n for gm in sm.graphs.values() for n in gm.graph.nodes if P.is_free(n)]


def _accumulating_graph(flush: bool) -> tuple[fx.GraphModule, torch.Tensor]:
    """``add_(acc, grad)`` (inside no_sync) or ``add(grad, acc); free(acc)`` (the step that
    reduces the sum), ``acc`` a get_attr of a real tensor, as insert_reduce_scatter_pass emits."""
    acc = torch.ones(4)
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    graph = gm.graph
    with FakeTensorMode() as mode:
        grad = graph.placeholder("grad")
        grad.meta["val"] = torch.empty(4)
    gm.register_buffer("fxshard_accumulated_0", acc, persistent=False)
    attr = graph.get_attr("fxshard_accumulated_0")
    attr.meta["val"] = mode.from_tensor(acc)
    if flush:
        total = call(graph, torch.ops.aten.add.Tensor, (grad, attr))
        call(graph, torch.ops.fxshard.free.default, (attr,))
        graph.output((total,))
    else:
        call(graph, torch.ops.aten.add_.Tensor, (attr, grad))
        graph.output((None,))
    gm.recompile()
    return gm, acc


@pytest.mark.parametrize("flush", [False, True])
def test_inductor_takes_no_syncs_accumulators_as_inputs(flush: bool) -> None:
    # Inductor compiles a get_attr as a constant (a real tensor in its fake run failed); the
    # compiled copy reads the accumulator as its last input and writes it in place, and the
    # free of the step that reduces the sum runs after the graph.
    from fxshard.driver.compile.codegen import finish_with_attributes_as_inputs

    gm, acc = _accumulating_graph(flush)
    seen: list[tuple[fx.GraphModule, list[Any]]] = []

    def finish(lifted: fx.GraphModule, example_inputs: Any) -> Any:
        seen.append((lifted, list(example_inputs)))
        return lifted.forward  # unboxed, as a compiler may return

    run = finish_with_attributes_as_inputs(finish, gm, [gm.graph.find_nodes(op="placeholder")[0].meta["val"]])
    (lifted, example_inputs), = seen
    ops = [n.op for n in lifted.graph.nodes]
    assert ops.count("placeholder") == 2 and "get_attr" not in ops and len(example_inputs) == 2
    assert not [n for n in lifted.graph.nodes if P.is_free(n)]
    assert [n.op for n in gm.graph.nodes].count("get_attr") == 1  # the emitted graph is kept
    out = run([torch.full((4,), 2.0)])
    if flush:
        assert torch.equal(out[0], torch.full((4,), 3.0))
        assert acc.untyped_storage().nbytes() == 0  # freed once the graph returned
    else:
        assert torch.equal(acc, torch.full((4,), 3.0))  # the driver's tensor, added into


def test_pipeline_is_built_from_the_configuration() -> None:
    def names(graph: str, **kw: Any) -> list[str]:
        return [s.name for s in build_pipeline(graph, CompileConfig.build("compile", **kw))]  # type: ignore[arg-type]

    assert names("forward") == ["eliminate_dead_code_pass", "insert_all_gather_pass", "place_gathers_pass",
                                "prefetch_gathers_pass", "topological_sort_pass", "insert_free_pass"]
    assert "prefetch_gathers_pass" not in names("forward", forward_prefetch=False)
    assert "prefetch_gathers_pass" in names("backward", forward_prefetch=False)
    assert "prefetch_gathers_pass" not in names("backward", backward_prefetch=None)
    assert "insert_free_pass" not in names("backward", compute="inductor")
    assert names("joint") == ["rematerialize_params_pass"]
    assert names("inference") == names("forward")
    # Every position has its reason, printable.
    text = describe(CompileConfig())
    assert "6. schedule_reduce_scatter_pass: after the gathers are positioned" in text
    # Rewrites in place come right after the sort.
    assert names("backward")[-4:] == ["topological_sort_pass", "accumulate_in_place_pass",
                                      "scale_in_place_pass", "insert_free_pass"]
    assert all(s.why for g in ("joint", "forward", "backward") for s in build_pipeline(g, CompileConfig()))


def test_disabling_passes_by_name() -> None:
    config = CompileConfig.build("compile", disable_passes="sink_allocations_pass")
    assert "sink_allocations_pass" not in [s.name for s in build_pipeline("backward", config)]
    with pytest.raises(FxShardError, match="no pass named \\['sink_pass'\\].*sink_allocations_pass"):
        fxshard.compile(MLP(), disable_passes=["sink_pass"])
    with pytest.raises(FxShardError, match="insert_all_gather_pass cannot be disabled.*place_gathers_pass, "
                                           "insert_free_pass need it.*fxshard.unshard markers"):
        fxshard.compile(MLP(), disable_passes=["insert_all_gather_pass"])
    with pytest.raises(FxShardError, match="place_gathers_pass cannot be disabled.*prefetch_gathers_pass, "
                                           "topological_sort_pass need it"):
        fxshard.backend(disable_passes=["place_gathers_pass"])
    # Without its dependent (no prefetch) the reason it is required remains.
    with pytest.raises(FxShardError, match="place_gathers_pass cannot be disabled.*in-flight limit"):
        fxshard.compile(MLP(), disable_passes=["place_gathers_pass"], forward_prefetch=False,
                        backward_prefetch=None)


def test_every_pass_of_the_package_can_be_named_to_disable_passes() -> None:
    # all_pass_names is what disable_passes accepts: every pass some configuration runs,
    # including those only an option switches on (checkpoint_activations_pass, under
    # activation_checkpointing or memory_budget, was once refused as unknown).
    import importlib
    import pkgutil

    import fxshard.passes

    defined = {name for info in pkgutil.iter_modules(fxshard.passes.__path__)
               for name, value in vars(importlib.import_module(f"fxshard.passes.{info.name}")).items()
               if name.endswith("_pass") and callable(value)}
    assert len(defined) >= 16 and sorted(defined - set(all_pass_names())) == []
    budget = CompileConfig(memory_budget=1 << 30)
    assert "checkpoint_activations_pass" in [s.name for s in build_pipeline("joint", budget)]
    disabled = CompileConfig(memory_budget=1 << 30, disable_passes=("checkpoint_activations_pass",))
    assert [s.name for s in build_pipeline("joint", disabled)] == ["rematerialize_params_pass"]


def test_new_nodes_get_their_value_from_the_fake_mode() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, 3)
    cast = call(graph, torch.ops.aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    gathered = call(graph, P.ALL_GATHER, (cast, 4, "pg"))
    assert cast.meta["val"].dtype == torch.bfloat16 and cast.meta["val"].shape == (4, 3)
    assert gathered.meta["val"].dtype == torch.bfloat16 and gathered.meta["val"].shape == (16, 3)
    bare = graph.placeholder("bare")
    with pytest.raises(GraphInvariantError, match="bare has no meta\\['val'\\]"):
        call(graph, torch.ops.aten.relu.default, (bare,))


# -- layers ------------------------------------------------------------------------------------

LAYERS = {"fxshard.ir": 0, "fxshard.passes": 1, "fxshard.driver": 2}  # everything else: 3


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> nx.DiGraph:
    files = sorted((ROOT / "fxshard").rglob("*.py"))
    modules = {_module_name(f): f for f in files}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target)
    return graph


def _layer(module: str) -> int:
    return next((v for k, v in LAYERS.items() if module == k or module.startswith(k + ".")), 3)


def test_layers_import_one_way_and_no_module_imports_in_a_circle() -> None:
    graph = _import_graph()
    assert "fxshard.ir.plan" in graph and "fxshard.passes.schedule_gathers" in graph
    # Nothing inside imports the facade: it imports everything.
    assert not list(graph.predecessors("fxshard")), list(graph.predecessors("fxshard"))
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles
    upward = [(a, b) for a, b in graph.edges if _layer(b) > _layer(a)]
    assert not upward, f"imports from a lower layer into a higher one: {upward}"
    # Package level: ir, passes, driver and the front ends form no circle either.
    packages = nx.DiGraph()
    for a, b in graph.edges:
        pa, pb = _layer(a), _layer(b)
        if pa != pb:
            packages.add_edge(pa, pb)
    assert nx.is_directed_acyclic_graph(packages)


def test_cli_prints_the_pass_list_for_the_options_given(capsys: pytest.CaptureFixture[str]) -> None:
    from fxshard import cli

    assert cli.main(["passes", "--option", "compute=inductor"]) == 0
    out = capsys.readouterr().out
    assert "place_gathers_pass: first scheduling constraint" in out and "insert_free_pass" not in out
    assert cli.main(["passes", "--option", "disable_passes=insert_all_gather_pass"]) == 2
    assert "insert_all_gather_pass cannot be disabled" in capsys.readouterr().err


def test_collectives_run_on_the_accelerator_whose_backend_the_group_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """One path for every accelerator (torch.accelerator): XPU with xccl as CUDA with nccl;
    gloo, or a backend that is not the accelerator's, communicates from the CPU."""
    import torch.distributed as dist

    from fxshard.driver.run import runtime

    for accelerator, backend, expected in (("xpu", "xccl", torch.device("xpu", 3)),
                                           ("cuda", "nccl", torch.device("cuda", 3)),
                                           ("xpu", "gloo", torch.device("cpu")),
                                           ("cuda", "xccl", torch.device("cpu"))):
        monkeypatch.setattr(torch.accelerator, "current_accelerator",
                            lambda check_available=False, a=accelerator: torch.device(a))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert runtime.comm_device(None) == expected, (accelerator, backend)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    assert runtime.comm_device(None) == torch.device("cpu")  # type: ignore[arg-type]


def test_no_two_modules_of_the_package_share_a_name() -> None:
    """A module's name says what it does wherever it is read: ``ir/budget.py`` searches the
    ladder, ``driver/compile/plan_budget.py`` runs its trials on a trace (docs/architecture.md)."""
    package = Path(fxshard.__file__).resolve().parent
    by_name: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, []).append(str(path.relative_to(package)))
        elif path.parent != package:  # a package's name counts too: driver/report/ is not report.py
            by_name.setdefault(path.parent.name, []).append(str(path.parent.relative_to(package)) + "/")
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, shared
