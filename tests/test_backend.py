"""fxshard as a torch.compile backend: the two-line contract, parity with DDP, graph breaks, misuse."""

from __future__ import annotations

import contextlib
import copy
import math
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.driver.run.runtime import full_parameters
from fxshard.ir import predicates as P
from fxshard.ir.errors import FxShardError
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import CASES, MLP, Net, RMSNorm, RotaryBlock, RotaryGPT, TinyGPT

# Dynamo and Inductor, whose internals move between releases: the whole file is in the release tier.
pytestmark = pytest.mark.release("inductor_partition_fn")

STEPS = 4


class Broken(nn.Module):
    """Two blocks with a graph break between them: Dynamo captures two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(12, 24), nn.Tanh())
        self.second = nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h) + self.first[0].bias.sum()  # first's bias is read by both graphs


def _train(name: str, rank: int, compute: str = "eager") -> dict[str, Any]:
    if name == "broken":
        make, policy = Broken, by_class(nn.Sequential)
        inputs = CASES["mlp"].inputs
        loss_fn = CASES["mlp"].loss
    else:
        case = CASES[name]
        make, policy, inputs, loss_fn = case.make, case.policies[0], case.inputs, case.loss
    torch.manual_seed(0)
    model = make()
    ddp = DDP(copy.deepcopy(model), broadcast_buffers=False)
    be = fxshard.backend(policy=policy, compute=compute)
    compiled = torch.compile(model, backend=be, dynamic=False)
    opt = torch.optim.Adam(fxshard.parameters(compiled), lr=1e-3)  # the two changed lines
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        x, y = inputs(gen)
        for m, o, out in ((compiled, opt, losses), (ddp, ref_opt, ref_losses)):
            loss = loss_fn(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    driver = be._modules[0].driver
    full = full_parameters(driver.shards, driver.plan, driver.world, 60)
    ref = dict(ddp.module.named_parameters())
    graphs = be.graphs()
    return {
        "losses": losses, "ref_losses": ref_losses,
        "errors": {k: ((full[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref.items()},
        "n_graphs": len(graphs),
        "gathers": [sum(1 for n in g["forward"].graph.nodes if P.is_all_gather(n)) for g in graphs],
        "frees": sum(1 for g in graphs for gm in g.values() for n in gm.graph.nodes if P.is_free(n)),
    }


def _no_sync(name: str, rank: int, fsdp2_name: bool) -> dict[str, Any]:
    """Three micro-batches per step, the first two inside no_sync, against DDP's no_sync."""
    from fxshard.measure import CommCounter

    case = CASES["mlp" if name == "broken" else name]
    torch.manual_seed(0)
    model = Broken() if name == "broken" else case.make()
    ddp = DDP(copy.deepcopy(model), broadcast_buffers=False)
    be = fxshard.backend(policy=by_class(nn.Sequential) if name == "broken" else case.policies[0])
    compiled = torch.compile(model, backend=be, dynamic=False)
    opt = torch.optim.Adam(fxshard.parameters(compiled), lr=1e-3)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, ref_losses, inside = [], [], []
    for _ in range(2):
        for i in range(3):
            x, y = case.inputs(gen)
            last = i == 2
            if fsdp2_name:
                fxshard.set_requires_gradient_sync(compiled, last)
                context: Any = contextlib.nullcontext()
            else:
                context = contextlib.nullcontext() if last else fxshard.no_sync(compiled)
            with context:
                loss = case.loss(compiled(x), y)
                with CommCounter() as counter:  # around backward only: Dynamo runs a frame
                    loss.backward()             # under a dispatch mode eagerly (refused)
            if not last:
                inside.append(counter.calls["reduce_scatter"] + counter.calls["all_reduce"])
            with contextlib.nullcontext() if last else ddp.no_sync():
                ref_loss = case.loss(ddp(x), y)
                ref_loss.backward()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    driver = be._modules[0].driver
    return {"losses": losses, "ref_losses": ref_losses, "inside": inside,
            "full": full_parameters(driver.shards, driver.plan, driver.world, 60),
            "ref": {k: v.detach() for k, v in ddp.module.named_parameters()}}


def _state_dicts(rank: int) -> dict[str, Any]:
    """fxshard's state-dict functions on a backend-compiled model: full and sharded, get and set."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    full = StateDictOptions(full_state_dict=True)
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model).state_dict()
    other = TinyGPT().state_dict()  # other weights (the generator moved on)
    compiled = torch.compile(model, backend=fxshard.backend(policy=by_class(nn.Linear)), dynamic=False)
    fxshard.parameters(compiled)
    sharded = fxshard.get_model_state_dict(compiled)  # copies of this rank's pieces
    first = fxshard.get_model_state_dict(compiled, options=full)
    fxshard.set_model_state_dict(compiled, other)  # full tensors are accepted too
    after_other = fxshard.get_model_state_dict(compiled, options=full)
    fxshard.set_model_state_dict(compiled, sharded)
    refusals = {}
    for what, call in (("save", compiled.state_dict), ("save a layer", model.blocks[0].state_dict),
                       ("load", lambda: compiled.load_state_dict({f"_orig_mod.{k}": v for k, v in other.items()})),
                       ("load the module", lambda: model.load_state_dict(other))):
        try:
            call()
        except FxShardError as e:
            refusals[what] = str(e)
    return {"reference": reference, "other": other, "first": first, "after_other": after_other,
            "restored": fxshard.get_model_state_dict(compiled, options=full), "refusals": refusals}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("gpt", "mlp", "broken"):
        torch._dynamo.reset()
        out[name] = _train(name, rank)
    if world_size == 2:  # the state dicts and no_sync, in the same spawn
        torch._dynamo.reset()
        out["state_dicts"] = _state_dicts(rank)
        for name, fsdp2_name in (("gpt", False), ("broken", True)):
            torch._dynamo.reset()
            out[f"no_sync_{name}"] = _no_sync(name, rank, fsdp2_name)
    return out


@cache
def results(world_size: int) -> list[dict[str, Any]]:
    return run_ranks(worker, world_size)


def inductor_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch._dynamo.reset()
    return {"inductor": _train("gpt", rank, compute="inductor"), "inductor_dropout": _inductor_dropout(rank)}


@cache
def inductor_results() -> list[dict[str, Any]]:
    """Inductor compute in a spawn of its own: compiling its kernels from a cold cache took most
    of the file's time, and only the slow tier reads it (tests/conftest.py)."""
    return run_ranks(inductor_worker, 2)


@pytest.mark.parametrize("name", ["gpt", "mlp", "broken"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_backend_matches_ddp(world_size: int, name: str) -> None:
    for rank, res in enumerate(results(world_size)):
        r = res[name]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]),
                                   rtol=1e-5, atol=1e-6)
        bad = {k: e for k, e in r["errors"].items() if e > 1e-5}
        assert not bad, f"{name} rank {rank}: {bad}"


def test_graph_break_gives_two_sharded_graphs() -> None:
    r = results(2)[0]["broken"]
    assert r["n_graphs"] == 2
    assert all(g >= 1 for g in r["gathers"])  # each graph gathers the units it reads


@pytest.mark.parametrize("name", ["gpt", "broken"])
def test_no_sync_matches_ddp_and_communicates_no_gradient(name: str) -> None:
    # broken: a unit read by both of Dynamo's graphs; its sum is reduced once,
    # by the first graph to run after no_sync (fxshard.set_requires_gradient_sync).
    for r in (res[f"no_sync_{name}"] for res in results(2)):
        assert r["inside"] == [0, 0, 0, 0]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]),
                                   rtol=1e-5, atol=1e-6)
        for k, v in r["ref"].items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_state_dicts_of_a_backend_compiled_model() -> None:
    for r in (res["state_dicts"] for res in results(2)):
        for key in ("first", "restored"):
            assert r[key].keys() == r["reference"].keys()
            for k, v in r["reference"].items():
                assert torch.equal(r[key][k], v), (key, k)
        for k, v in r["other"].items():
            assert torch.equal(r["after_other"][k], v), k
        # The module's own state_dict() returned the stand-ins (zeros that torch.save kept) and
        # load_state_dict() loaded into them: both raise, naming fxshard's functions, and the
        # refused load left the weights as they were (restored, above, is read after it).
        assert "fxshard.get_model_state_dict(model)" in r["refusals"]["save"]
        assert "fxshard.get_model_state_dict(model)" in r["refusals"]["save a layer"]
        assert "fxshard.set_model_state_dict(model, state_dict)" in r["refusals"]["load"]
        assert "fxshard.set_model_state_dict(model, state_dict)" in r["refusals"]["load the module"]


def test_inductor_compute_matches_ddp() -> None:
    # The GPT segfaulted while fxshard still emitted explicit frees under Inductor,
    # which may move a read of a buffer's view past the free; Inductor frees buffers itself.
    for r in (res["inductor"] for res in inductor_results()):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]),
                                   rtol=1e-4, atol=1e-5)
        assert r["frees"] == 0


class NormBetween(nn.Module):
    """Linear -> RMSNorm (which reads its input's dtype) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = RMSNorm(16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


def _bf16_losses(name: str, front_end: str) -> tuple[list[float], list[torch.dtype]]:
    """Three bf16 mixed-precision steps of ``name`` through ``front_end``, and the dtypes
    of the parameters the model's modules hold."""
    make, policy, inputs = {
        "norm": (NormBetween, None, lambda g: torch.randn(4, 8, generator=g)),
        "rotary": (RotaryGPT, by_class(RotaryBlock), lambda g: torch.randint(0, 61, (2, 16), generator=g)),
    }[name]
    precision = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    if front_end == "backend":
        run: nn.Module = torch.compile(model, backend=fxshard.backend(policy=policy, mixed_precision=precision),
                                       dynamic=False)
        shards = fxshard.parameters(run)
    else:
        run = fxshard.compile(model, policy=policy, mixed_precision=precision)
        shards = list(run.parameters())
    opt = torch.optim.AdamW(shards, lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        loss = run(inputs(gen)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.dtype for p in model.parameters()]


@pytest.mark.parametrize("name", ["norm", "rotary"])
def test_backend_with_mixed_precision_equals_fxshard_compile(name: str) -> None:
    # Dynamo bakes dtypes it reads (RMSNorm's h.dtype) into its graph: it traces stand-ins
    # in param_dtype, and the casts of the model's and the units' inputs (rotary: the
    # root's fp32 table entering each block), so its graph computes in the dtypes it runs
    # with. Before, it traced fp32 and failed at the first step ("mat1 and mat2 must have
    # the same dtype"). The same bf16 arithmetic as fxshard.compile: equal bit for bit.
    backend, stand_ins = _bf16_losses(name, "backend")
    assert backend == _bf16_losses(name, "compile")[0]
    assert set(stand_ins) == {torch.bfloat16}


def _inductor_dropout(rank: int) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()  # the tutorial Net, dropout on
    be = fxshard.backend(policy=CASES["mnist_net"].policies[0], compute="inductor")
    compiled = torch.compile(model, backend=be, dynamic=False)
    opt = torch.optim.Adam(fxshard.parameters(compiled), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    x, y = CASES["mnist_net"].inputs(gen)
    losses = []
    for _ in range(STEPS):
        loss = F.nll_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    driver = be._modules[0].driver
    full = full_parameters(driver.shards, driver.plan, driver.world, 60)
    compiled.eval()
    reference = Net().eval()
    reference.load_state_dict(full)
    return {"losses": losses, "full": full, "eval": compiled(x), "eval_ref": reference(x)}


def test_inductor_compute_trains_with_dropout() -> None:
    # Inductor lowers dropout with its own random ops (its joint-graph passes,
    # run before fxshard partitions): the masks are not eager's, so there is no
    # DDP parity to check; training must still run, agree across ranks, and
    # the sharded eval forward must be the gathered model's.
    r0, r1 = (res["inductor_dropout"] for res in inductor_results())
    assert all(math.isfinite(v) for v in r0["losses"] + r1["losses"])
    assert r0["losses"][-1] < r0["losses"][0]  # the same batch each step: it is learning
    for k, v in r0["full"].items():
        assert torch.equal(v, r1["full"][k]), k
    torch.testing.assert_close(r0["eval"], r0["eval_ref"], rtol=1e-4, atol=1e-5)


def test_optimizer_over_the_original_parameters_is_refused() -> None:
    torch._dynamo.reset()
    model = MLP()
    compiled = torch.compile(model, backend=fxshard.backend(policy=by_class(nn.Linear)), dynamic=False)
    wrong = torch.optim.SGD(model.parameters(), lr=0.1)
    fxshard.parameters(compiled)
    compiled(torch.randn(2, 12)).sum().backward()
    with pytest.raises(FxShardError, match="no longer holds the model.*fxshard.parameters"):
        wrong.step()


def test_requires_grad_changed_after_sharding_is_refused() -> None:
    torch._dynamo.reset()
    model = MLP()
    compiled = torch.compile(model, backend=fxshard.backend(policy=by_class(nn.Linear)), dynamic=False)
    fxshard.parameters(compiled)
    compiled(torch.randn(2, 12)).sum().backward()
    model.head.weight.requires_grad_(False)  # freezing after sharding: would keep training
    with pytest.raises(FxShardError, match="parameter 'head.weight' had requires_grad=True.*before sharding"):
        compiled(torch.randn(2, 12))


def test_broadcast_buffers_is_refused_with_the_reason() -> None:
    with pytest.raises(TypeError, match="does not take \\['broadcast_buffers'\\].*not the module's forward"):
        fxshard.backend(broadcast_buffers=True)


def test_a_forward_dynamo_did_not_compile_is_refused() -> None:
    # Under a dispatch mode Dynamo runs the frame eagerly: the stand-ins acted as
    # zero weights and the loss came out as log(vocab) with no error.
    from fxshard.measure import CommCounter

    torch._dynamo.reset()
    compiled = torch.compile(TinyGPT(), backend=fxshard.backend(), dynamic=False)
    fxshard.parameters(compiled)
    x = torch.randint(0, 61, (2, 16))
    compiled(x)
    with CommCounter(), pytest.raises(FxShardError, match="ran eagerly, outside the graphs"):
        compiled(x)
    with torch.compiler.set_stance("force_eager"), pytest.raises(FxShardError, match="ran eagerly"):
        compiled(x)


def test_calling_before_sharding_is_refused() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(MLP(), backend=fxshard.backend(), dynamic=False)
    with pytest.raises(Exception, match="not sharded.*fxshard.parameters"):
        compiled(torch.randn(2, 12))


def test_parameters_needs_a_compiled_model() -> None:
    with pytest.raises(FxShardError, match="torch.compile returned"):
        fxshard.parameters(MLP())
    compiled = torch.compile(MLP(), backend="eager")
    with pytest.raises(FxShardError, match="not fxshard.backend"):
        fxshard.parameters(compiled)


def test_registered_backend_name() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fxshard", dynamic=False)
    shards = fxshard.parameters(compiled)
    assert len(shards) == 1  # default options: one unit
    x = torch.randint(0, 61, (2, 16))
    torch.testing.assert_close(compiled(x), ref(x))
