"""fxshard.explain and the CLI: any model, any world size, one process, no real memory."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxshard
from fxshard.ir import predicates as P
from fxshard.ir.errors import FxShardError
from fxshard.policies import by_class

from graph_utils import fake_world
from models import MLP, Attention, Block, TinyGPT

ROOT = Path(__file__).resolve().parents[1]


def test_explain_meta_model_at_world_size_64_follows_zero3() -> None:
    with torch.device("meta"):
        model = TinyGPT(dim=64, layers=4)
    n = 64
    e = fxshard.explain(model, torch.randint(0, 61, (2, 16)), policy=by_class(Block), world_size=n,
                        reshard_root=True)
    assert not dist.is_initialized()  # the fake process group is gone again
    psi = sum(g.padded_numel * g.dtype.itemsize for g in e.plan.groups)
    assert e.report.shard_bytes * n == psi  # each rank holds exactly 1/N
    agreement = e.report.comm_bytes_per_step["agreement"]
    assert agreement == 2 * 8 * (n - 1)  # the ranks' 8-byte agreement before forward and backward
    assert e.report.comm_bytes_per_step["total"] == 3 * psi * (n - 1) // n + agreement
    for gm in e.graphs.values():
        assert all(c.args[-2] == n for c in gm.graph.nodes if P.is_collective(c))
    assert e.report.predicted_peak_bytes > e.report.shard_bytes
    assert all(p.device.type == "meta" for p in model.parameters())  # untouched


def test_explain_lays_fake_ranks_out_on_a_mesh_shape() -> None:
    """mesh_shape=(R, S) is HSDP at any size: this rank holds 1/S, the report splits the bytes
    moved inside the shard group from those moved between replicas, as launching.md's
    formulas say; rank is a rank of the whole mesh."""
    with torch.device("meta"):
        model = TinyGPT(dim=64, layers=2)
    r, s = 16, 4
    e = fxshard.explain(model, torch.randint(0, 61, (2, 16)), policy=by_class(Block),
                        mesh_shape=(r, s), rank=39, reshard_root=True)  # row 9, column 3
    assert not dist.is_initialized()
    psi = sum(g.padded_numel * g.dtype.itemsize for g in e.plan.groups)
    assert e.report.shard_bytes * s == psi
    assert (e.report.rank, e.report.world_size) == (3, s)
    assert "rank 39 of 64 in the job (HSDP, 16 x 4); replica 9 of 16" in str(e.report)
    # The plan's header counts the job's ranks and says how the mesh lays them out.
    assert str(e.plan).startswith("ShardPlan(world_size=64 (16 replicas x 4 shards), policy=by_class(Block)")
    sizes = [g.padded_numel * g.dtype.itemsize for g in e.plan.groups]
    assert e.report.comm_bytes_per_dimension == {
        "shard": sum(2 * p // s * (s - 1) + p * (s - 1) // s for p in sizes),  # 2 gathers, 1 scatter
        "replicate": sum(2 * (p // s) * (r - 1) // r for p in sizes),
    }
    flat = fxshard.explain(model, torch.randint(0, 61, (2, 16)), policy=by_class(Block),
                           mesh_shape=(s,), reshard_root=True)
    assert flat.report.comm_bytes_per_dimension == {"shard": e.report.comm_bytes_per_dimension["shard"]}
    no_shard = fxshard.explain(model, torch.randint(0, 61, (2, 16)), mesh_shape=(s, 1))
    assert no_shard.report.shard_bytes == sum(g.padded_numel * g.dtype.itemsize
                                              for g in no_shard.plan.groups)
    with pytest.raises(FxShardError, match="world_size=8 but mesh_shape=\\(16, 4\\) has 64 ranks"):
        fxshard.explain(model, torch.randint(0, 61, (2, 16)), world_size=8, mesh_shape=(r, s))
    with pytest.raises(FxShardError, match="mesh_shape takes"):
        fxshard.explain(model, torch.randint(0, 61, (2, 16)), mesh_shape=(2, 2, 2))
    with pytest.raises(TypeError, match="pass mesh_shape"):
        fxshard.explain(model, torch.randint(0, 61, (2, 16)), mesh=None)


def test_cli_explain_takes_a_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    from fxshard import cli

    code = cli.main(["explain", "models:TinyGPT", "--mesh", "4x2", "--rank", "5", "--input-shape", "2,16"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "replica 2 of 4" in captured.out and "(between replicas)" in captured.out
    with pytest.raises(SystemExit):
        cli.main(["explain", "models:TinyGPT", "--mesh", "4by2", "--input-shape", "2,16"])
    assert "--mesh takes RxS" in capsys.readouterr().err


@pytest.mark.slow
def test_explain_plans_llama3_70b_on_a_128_by_8_mesh() -> None:
    """Issue's scale: every rank of 1024 holds its 1/8 of Llama-3-70B's parameters.
    (Its time is the benchmark's: benchmarks/run.py's planning rows.)"""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama import LLAMA3_70B, Llama, TransformerBlock

    with torch.device("meta"):
        model = Llama(LLAMA3_70B)
    e = fxshard.explain(model, torch.zeros(1, 2048, dtype=torch.long), policy=by_class(TransformerBlock),
                        mesh_shape=(128, 8), rank=1001, hardware="h100-ib")
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    assert e.report.shard_bytes * 8 == psi  # every unit's numel divides by 8: no padding
    assert set(e.report.comm_bytes_per_dimension) == {"shard", "replicate"}
    # The time at scale: a predicted step, its exposed communication and MFU, on a
    # profile whose replicas talk over InfiniBand (time.md, "At scale", for the numbers).
    r = e.report
    assert r.predicted_step_seconds is not None and r.exposed_comm_seconds is not None and r.mfu is not None
    assert 0 < r.exposed_comm_seconds < r.predicted_step_seconds
    # Against the datasheet's peak: no step beats the matmul fraction the profile assumes.
    assert 0 < r.mfu <= 0.7
    assert r.time is not None and {c.dimension for c in r.time.collectives} >= {"shard", "replicate"}


def _llama3_8b(layers: int) -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama import LLAMA3_8B, Llama

    with torch.device("meta"):
        return Llama(dataclasses.replace(LLAMA3_8B, layers=layers))


@pytest.mark.slow
def test_llama3_8b_at_world_size_1_fits_70_gib_only_with_offload() -> None:
    """32 layers, bf16, AdamW, 70 GiB, sequence 2048, planned for CUDA (on a machine without
    one: meta with CUDA's fused attention): the optimizer step alone holds about 150 GiB (fp32
    shards, gradients, two states and foreach's square roots), which no schedule but offload
    lowers. With offload_policy the planner offloads the fewest units, largest first, and
    says why."""
    model = _llama3_8b(32)
    from llama import TransformerBlock

    def explained(**options: Any) -> Any:
        return fxshard.explain(model, torch.zeros(1, 2048, dtype=torch.long), by_class(TransformerBlock),
                               device="cuda", mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16),
                               optimizer=torch.optim.AdamW, memory_budget=70 << 30, **options).report

    with pytest.raises(fxshard.BudgetError, match="the optimizer step alone holds .* offload_policy="):
        explained()
    report = explained(offload_policy=fxshard.CPUOffloadPolicy())
    assert report.budget is not None and report.predicted_peak_bytes <= 70 << 30
    chosen = report.budget.chosen
    offloaded = chosen.offloaded
    kept = [u.shard_bytes for u in report.units if u.name not in offloaded]
    on_host = sum(u.shard_bytes for u in report.units if u.name in offloaded)
    assert report.host_bytes == 4 * on_host  # fp32 shard, gradient, exp_avg, exp_avg_sq
    # With units on the host, torch's AdamW steps in its for-loop (foreach takes no step that
    # holds host tensors): what stays on the device steps one shard's root and quotient at a
    # time, after what backward leaves.
    assert report.memory_curve["optimizer step"] == (report.memory_curve["backward"][-1] + 2 * max(kept),)
    # The fewest: the same schedule with one unit fewer offloaded was tried and did not fit.
    fewer = chosen.describe().replace(f"{len(offloaded)} units offloaded", f"{len(offloaded) - 1} units offloaded")
    assert dict(report.budget.tried)[fewer] > 70 << 30
    rows = [u for u in report.budget.units if u.offloaded]
    assert {u.unit for u in rows} == set(offloaded) and offloaded[0] == ""  # the root: the largest
    assert all(u.why.startswith("offloaded: the budget needs") for u in rows)


@pytest.mark.slow
def test_offload_lowers_llama3_8bs_peak_at_world_size_8() -> None:
    """8 layers, world size 8, bf16, AdamW: the shards, gradients and state move to the host
    (the report's host bytes). The device peak is in backward, where the state is on the
    device (it is from the first step on): offload lowers it by more than the parameter and
    gradient shards."""
    model = _llama3_8b(8)
    from llama import TransformerBlock

    def explained(**options: Any) -> Any:
        return fxshard.explain(model, torch.zeros(1, 2048, dtype=torch.long), by_class(TransformerBlock),
                               world_size=8, device="cuda",
                               mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16),
                               optimizer=torch.optim.AdamW, **options).report

    on_device, offloaded = explained(), explained(offload_policy=fxshard.CPUOffloadPolicy())
    params = on_device.shard_bytes
    assert params * 8 == sum(p.numel() * 4 for p in model.parameters())  # fp32, no padding
    assert offloaded.host_bytes == 4 * params  # shards, gradients and AdamW's two states
    assert on_device.predicted_peak_bytes - offloaded.predicted_peak_bytes >= params + on_device.grad_shard_bytes
    assert "on the host" in str(offloaded)


def test_explain_leaves_a_real_model_untouched() -> None:
    torch.manual_seed(0)
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    e = fxshard.explain(model, torch.randn(4, 12), policy=by_class(nn.Linear), world_size=3)
    assert [u.name for u in e.plan.units] == ["layers.0", "layers.1", "head"]
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, before[k])
    inference = fxshard.explain(model, torch.randn(4, 12), world_size=3, train=False)
    assert "backward" not in inference.graphs


class _DeviceLessAttention(Attention):
    """Attention as most models write it: the causal mask made without a device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class _DeviceLessGPT(TinyGPT):
    """TinyGPT whose forward makes its positions and masks without a device, as ordinary
    models do (it trains on CPU as it is)."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            attn = _DeviceLessAttention(32, 4)
            attn.load_state_dict(block.attn.state_dict())
            block.attn = attn

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def test_explain_creates_a_forwards_device_less_tensors_on_meta_beside_the_parameters() -> None:
    """torch.arange(n) and torch.ones(t, t) with no device land where the parameters are
    during the trace (meta), so explain plans such a model as it plans TinyGPT at world size 8."""
    idx = torch.randint(0, 61, (2, 16))
    devless, reference = (fxshard.explain(m, idx, policy=by_class(Block), world_size=8)
                          for m in (_DeviceLessGPT(), TinyGPT()))
    assert devless.report.predicted_peak_bytes == reference.report.predicted_peak_bytes > 0
    for name in ("forward", "backward"):
        assert devless.graphs[name].code == reference.graphs[name].code
    torch.manual_seed(0)
    model = _DeviceLessGPT()
    assert model(idx).shape == (2, 16, 61)  # the model itself still runs on CPU, on its own


def test_explain_refuses_inside_a_job() -> None:
    with fake_world(2), pytest.raises(FxShardError, match="without a cluster"):
        fxshard.explain(MLP(), torch.randn(2, 12), world_size=4)


def test_cli_explain_writes_every_dump_file(tmp_path: Path) -> None:
    out = tmp_path / "dump"
    proc = subprocess.run(
        [sys.executable, "-m", "fxshard.cli", "explain", "tests/models.py:TinyGPT", "--world-size", "16",
         "--policy", "by_class(Block) | by_size(1e3)", "--input-shape", "2,16", "--input-dtype", "int64",
         "--option", "reshard_root=true", "--dump", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ShardPlan(world_size=16" in proc.stdout and "predicted peak" in proc.stdout
    for name in ("plan.txt", "report.txt", "timeline.png", "timeline.svg", "units.graphml", "units.dot"):
        assert (out / name).stat().st_size > 0, name
    passes = sorted(p.name for p in (out / "passes").iterdir())
    for graph, name in [("joint", "rematerialize_params_pass"), ("forward", "insert_free_pass"),
                        ("backward", "schedule_reduce_scatter_pass")]:
        assert any(p.endswith(f"-{graph}-{name}.py") for p in passes), passes
        assert any(p.endswith(f"-{graph}-{name}.diff") for p in passes), passes
    gather_diff = next(p for p in passes if p.endswith("-forward-insert_all_gather_pass.diff"))
    assert "+    all_gather_into_tensor" in (out / "passes" / gather_diff).read_text()
    # The picture shows the units: its SVG carries their labels.
    svg = (out / "timeline.svg").read_text()
    for unit in ("blocks.0", "blocks.1", "&lt;root&gt;"):
        assert unit in svg, unit
    assert (out / "timeline.png").stat().st_size > 20_000
    assert "blocks.0" in (out / "units.dot").read_text()


def test_cli_reports_bad_input_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    from fxshard import cli

    code = cli.main(["explain", str(ROOT / "tests" / "models.py") + ":TinyGPT", "--world-size", "4",
                     "--policy", "by_class(Blok)", "--input-shape", "2,16", "--input-dtype", "int64"])
    assert code == 2
    assert "no nn.Module class 'Blok'" in capsys.readouterr().err
    # Two dtypes for one input, and a shape that is not numbers: named, not silently cut.
    for extra, said in ((["--input-shape", "2,16", "--input-dtype", "int64", "--input-dtype", "float32",
                          "--input-dtype", "int64"], "3 --input-dtype for 1 --input-shape"),
                        (["--input-shape", "2,x"], "--input-shape '2,x': comma-separated whole numbers")):
        code = cli.main(["explain", str(ROOT / "tests" / "models.py") + ":TinyGPT", "--world-size", "4",
                         "--policy", "by_class(Block)", *extra])
        assert code == 2
        assert said in capsys.readouterr().err



def _explain_commands(doc: Path) -> list[list[str]]:
    """The ``fxshard explain`` commands in ``doc``'s code blocks, continuation lines joined."""
    text = doc.read_text().replace("\\\n", " ")
    return [shlex.split(line.partition("#")[0])[1:] for line in text.splitlines()
            if line.startswith("fxshard explain ")]


@pytest.mark.parametrize("doc", ["README.md", "docs/inspecting.md"])
def test_the_docs_explain_command_runs_on_the_gpt_example(
        doc: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the command is run from the clone, as the docs say
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts examples/ first
    monkeypatch.delitem(sys.modules, "gpt", raising=False)  # and registers the module: undone after
    from fxshard import cli

    (args,) = _explain_commands(ROOT / doc)
    assert args[1] == "examples/gpt.py:build"
    args[args.index("--dump") + 1] = str(tmp_path)
    code = cli.main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    world_size = args[args.index("--world-size") + 1]
    assert f"ShardPlan(world_size={world_size}, policy=by_class(Block)" in captured.out
    assert "blocks.3" in captured.out and "predicted peak" in captured.out
    assert (tmp_path / "plan.txt").exists()


@pytest.mark.parametrize("spec, expected", [
    ("nope.py:build", ["no file", "nope.py", "e.g. examples/gpt.py:build"]),
    ("no_such_pkg:thing", ["no module named 'no_such_pkg'", "install it", "examples/gpt.py:build"]),
    ("no_such_pkg.models:build", ["no module named 'no_such_pkg'"]),
    ("examples/gpt.py:GPT", ["examples/gpt.py:GPT needs arguments (vocab, dim, heads, layers, seq)",
                             "def build(): return GPT(...)"]),
    ("examples/gpt.py:buidl", ["has no callable 'buidl'"]),
])
def test_cli_explain_reports_a_bad_factory_in_one_line(
        spec: str, expected: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "gpt", raising=False)
    from fxshard import cli

    code = cli.main(["explain", spec, "--world-size", "8", "--input-shape", "1,64"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("fxshard explain: error: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err


class ThreeInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.tok = nn.Embedding(10, 2)
        self.seg = nn.Embedding(2, 2)

    def forward(self, feats: torch.Tensor, ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        return self.lin(feats).sum() + self.tok(ids.view(-1)).sum() + self.seg(segments + 0).sum()


def test_embedding_inputs_are_those_an_embedding_gets_as_they_are_or_viewed() -> None:
    from fxshard.explain import embedding_inputs

    model = ThreeInputs()
    inputs = (torch.randn(2, 3), torch.zeros(2, 4), torch.zeros(2, 4))  # all float, as the CLI's default
    assert embedding_inputs(model, inputs) == {1: "tok"}  # segments + 0 is not the input
    assert all(p.device.type == "cpu" for p in model.parameters())  # ran on a meta copy


def test_cli_explain_infers_int64_token_ids(capsys: pytest.CaptureFixture[str]) -> None:
    from fxshard import cli

    code = cli.main(["explain", "models:TinyGPT", "--world-size", "2", "--input-shape", "2,16"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "no --input-dtype given: input 0 indexes nn.Embedding 'tok', so it is int64" in captured.err
    assert "ShardPlan(world_size=2" in captured.out


SHIFTED_IDS = """
import torch.nn as nn


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids):
        return self.emb(ids + 1)
"""


def test_cli_explain_asks_for_the_input_dtype_it_cannot_infer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The embedding gets ids + 1, not the input: no inference, and tracing float ids fails.
    path = tmp_path / "fxshard_test_shifted_ids.py"
    path.write_text(SHIFTED_IDS)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the file's folder first
    monkeypatch.setitem(sys.modules, path.stem, None)  # and registers the module: undone after
    from fxshard import cli

    code = cli.main(["explain", f"{path}:Shifted", "--world-size", "2", "--input-shape", "2,3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "indices must be integer tensors" in err and "pass --input-dtype int64" in err
    assert "no --input-dtype was given, so the inputs were float32" in err
    line = 1 + SHIFTED_IDS.splitlines().index("        return self.emb(ids + 1)")
    assert f"at {path.resolve()}:{line} in forward: return self.emb(ids + 1)" in err


def test_logging_is_silent_by_default_and_goes_through_one_logger(
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("fxshard")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    with caplog.at_level(logging.DEBUG, logger="fxshard"):
        fxshard.compile(MLP(), policy=by_class(nn.Linear), example_inputs=torch.randn(2, 12))
    # Records emitted from fxshard's own code (torch may log too, depending on
    # what ran before in this process) all go through the one logger.
    here = str(ROOT / "fxshard")
    ours = [r for r in caplog.records if r.pathname.startswith(here)]
    assert any("insert_all_gather_pass" in r.getMessage() for r in ours)
    assert all(r.name == "fxshard" for r in ours), {r.name for r in ours}
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_cli_explain_counts_the_optimizer_named(capsys: pytest.CaptureFixture[str]) -> None:
    from fxshard import cli

    args = ["explain", str(ROOT / "tests" / "models.py") + ":TinyGPT", "--world-size", "4",
            "--policy", "by_class(Block)", "--input-shape", "2,16", "--input-dtype", "int64"]
    expected = {name: fxshard.explain(TinyGPT(), torch.zeros(2, 16, dtype=torch.long), by_class(Block), 4,
                                      optimizer=opt).report.optimizer_state_bytes
                for name, opt in (("AdamW", torch.optim.AdamW),
                                  ("SGD(momentum=0.9)", functools.partial(torch.optim.SGD, momentum=0.9)))}
    assert expected["AdamW"] == 2 * expected["SGD(momentum=0.9)"] > 0
    for name, states in (("AdamW", "AdamW (2 states per parameter)"),
                         ("SGD(momentum=0.9)", "SGD (1 state per parameter)")):
        assert cli.main([*args, "--optimizer", name]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "optimizer state" in x)
        assert f"{expected[name] / 2**20:.3f} MiB" in line and states in line
    for bad, message in (("Foo", "torch.optim has no optimizer 'Foo'"), ("SGD(0.1)", "with keywords if")):
        assert cli.main([*args, "--optimizer", bad]) == 2
        assert message in capsys.readouterr().err


def test_cli_explain_shows_the_memory_budget_choice(capsys: pytest.CaptureFixture[str]) -> None:
    from fxshard import cli

    args = ["explain", str(ROOT / "tests" / "models.py") + ":TinyGPT", "--world-size", "4",
            "--policy", "by_class(Block)", "--input-shape", "8,16", "--input-dtype", "int64",
            "--activation-checkpointing", "selective(by_class(Block))"]
    assert cli.main([*args, "--memory-budget", "600KiB"]) == 0
    out = capsys.readouterr().out
    assert "memory budget 0.586 MiB: predicted peak" in out
    assert "after forward" in out and "candidates tried" in out
    assert cli.main([*args, "--memory-budget", "10KiB"]) == 2
    assert "memory_budget 0.010 MiB cannot be met" in capsys.readouterr().err
    assert cli.main([*args, "--memory-budget", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_explain_plans_for_a_devices_kernels_on_fake_tensors() -> None:
    """device="cpu": the trace takes the CPU's fused attention (no score matrix kept for
    backward), so the plan's peak is below meta's; the units and collectives are the same.
    A device this machine lacks is refused with the way out, before any tensor is made."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama import Llama, LlamaConfig, TransformerBlock

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=128, layers=1, heads=4, kv_heads=2, ffn=256, vocab=256))
    tokens = torch.zeros(2, 64, dtype=torch.long)

    def planned(device: str | None) -> Any:
        return fxshard.explain(model, tokens, by_class(TransformerBlock), world_size=4, device=device,
                               optimizer=torch.optim.AdamW)

    on_meta, on_cpu = planned(None), planned("cpu")
    fused = {str(n.target) for g in on_cpu.graphs.values() for n in g.graph.nodes if "flash" in str(n.target)}
    assert fused and not any("flash" in str(n.target) for g in on_meta.graphs.values() for n in g.graph.nodes)
    assert on_cpu.report.predicted_peak_bytes < on_meta.report.predicted_peak_bytes
    assert [u.name for u in on_cpu.plan.units] == [u.name for u in on_meta.plan.units]
    assert on_cpu.report.comm_bytes_per_step == on_meta.report.comm_bytes_per_step
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())  # untouched
    if not torch.xpu.is_available():
        with pytest.raises(fxshard.FxShardError, match=r"device=None \(the meta device"):
            planned("xpu")
    with pytest.raises(fxshard.FxShardError, match="names no device torch knows"):
        planned("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans on fake CUDA tensors there (test_cuda.py)")
def test_explain_for_cuda_without_a_device_takes_cudas_fused_attention_on_meta() -> None:
    """No CUDA device here: explain(device="cuda") traces on meta with the fused attention
    CUDA would choose. Its memory is checked against an independent trace: torch's own
    choice on fake CPU tensors, the CPU's flash attention, which keeps the same output and
    log-sum-exp for backward (its peak equals to the philox seed and offset CUDA's keeps)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama import Llama, LlamaConfig, TransformerBlock

    with torch.device("meta"):
        model = Llama(LlamaConfig(dim=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512))
    tokens = torch.zeros(2, 256, dtype=torch.long)

    def planned(device: str | None, **options: Any) -> Any:
        return fxshard.explain(model, tokens, by_class(TransformerBlock), world_size=4, device=device,
                               **options)

    def attention(e: Any) -> set[str]:
        return {str(n.target) for g in e.graphs.values() for n in g.graph.nodes if "attention" in str(n.target)}

    bf16 = fxshard.MixedPrecision(param_dtype=torch.bfloat16)
    on_cuda, on_cpu, on_meta = (planned(d, mixed_precision=bf16) for d in ("cuda", "cpu", None))
    assert attention(on_cuda) == {"aten._scaled_dot_product_flash_attention.default",
                                  "aten._scaled_dot_product_flash_attention_backward.default"}
    assert not attention(on_meta)  # the math kernel, decomposed
    assert abs(on_cuda.report.predicted_peak_bytes - on_cpu.report.predicted_peak_bytes) <= 1024
    assert on_cuda.report.peak_phase == on_cpu.report.peak_phase
    # The (256 x 256) fp32 scores of 4 heads, kept by the math kernel, are gone.
    assert on_meta.report.predicted_peak_bytes - on_cuda.report.predicted_peak_bytes >= 2 * 4 * 256 * 256 * 4
    assert "planned for cuda (no CUDA device here" in str(on_cuda)
    # fp32 attention: flash attention refuses it, the memory-efficient kernel takes it.
    assert "aten._scaled_dot_product_efficient_attention.default" in attention(planned("cuda"))


LLAMA = """
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def build():
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
"""


def _llama(**config: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        **config))


def test_explain_plans_a_hugging_face_model_at_its_default_config() -> None:
    """A from_config Llama keeps use_cache=True: its forward builds a DynamicCache, whose
    empty keys, torch.tensor([], device=...) on the meta device, were a real meta tensor
    among the fake ones ("Please convert all Tensors to FakeTensors"). It plans as with
    use_cache=False: the cache is no output of the traced step."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ids = torch.zeros(2, 8, dtype=torch.long)
    cached = _llama()
    assert cached.config.use_cache
    default, uncached = (fxshard.explain(m, ids, by_class(LlamaDecoderLayer), world_size=2)
                         for m in (cached, _llama(use_cache=False)))
    assert default.plan == uncached.plan and len(default.plan.units) == 3
    assert default.report.comm_bytes_per_step == uncached.report.comm_bytes_per_step
    assert default.report.predicted_peak_bytes > 0 and set(default.graphs) == {"forward", "backward"}


@pytest.mark.slow  # the Python API's test above covers the fast tier
def test_cli_explain_plans_a_hugging_face_model_at_its_default_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fxshard_test_hf_llama.py"
    path.write_text(LLAMA)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the file's folder first
    monkeypatch.setitem(sys.modules, path.stem, None)  # and registers the module: undone after
    from fxshard import cli

    code = cli.main(["explain", f"{path}:build", "--world-size", "2", "--input-shape", "2,8",
                     "--policy", "by_class(LlamaDecoderLayer)"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "ShardPlan(world_size=2, policy=by_class(LlamaDecoderLayer), units=3" in captured.out
