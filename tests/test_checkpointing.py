"""Activation checkpointing as a pass (issue 13): the same numbers, one gather per unit,
less memory, and a prediction that holds.

One spawn of 2 gloo ranks trains a dropout GPT three AdamW steps without
checkpointing, with full and with selective checkpointing (fxshard.compile),
and with it through the torch.compile backend; the single-process
tests read the emitted graphs and the front ends' errors.
"""

from __future__ import annotations

import copy
import warnings
from functools import cache
from typing import Any

import pytest
import torch
import torch.fx as fx

import fxshard
from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.checkpointing import plan_checkpointing
from fxshard.measure import peak_memory
from fxshard.policies import by_class, by_size, selective

from dist_utils import run_ranks
from models import Block, TinyGPT, _lm_loss

VARIANTS = {"none": None, "full": by_class(Block), "selective": selective(by_class(Block))}


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=61, dim=32, heads=4, layers=3, seq=32, dropout=0.1)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 61, (8, 33), generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: torch.nn.Module, params: list[torch.nn.Parameter], rank: int) -> dict[str, Any]:
    opt = torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(1000 + rank)  # dropout masks: per rank, the same for every variant
    losses = []
    for step in range(3):
        idx = _batch(rank, step)
        loss = _lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    after = torch.randn(8)  # the generator continues exactly where it would have
    return dict(losses=torch.stack(losses), params=[p.detach().clone() for p in params], after=after)


def _gathers_per_group(gm: fx.GraphModule) -> dict[int, int]:
    counts: dict[int, int] = {}
    for node in gm.graph.nodes:
        info = meta.get_info(node)
        if P.is_all_gather(node):
            assert info is not None
            counts[info.group] = counts.get(info.group, 0) + 1
    return counts


def _step_holding_outputs(model: torch.nn.Module, idx: torch.Tensor) -> None:
    """A step whose caller holds the logits through backward, as report() assumes (a
    caller that drops them before backward peaks lower by their size)."""
    logits = model(idx[:, :-1])
    _lm_loss(logits, idx[:, 1:]).backward()
    del logits


def worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, ac in VARIANTS.items():
        sharded = fxshard.compile(_model(), by_class(Block), activation_checkpointing=ac)
        trained = _train(sharded, list(sharded.parameters()), rank)
        idx = _batch(rank, 9)
        measured = peak_memory(lambda s=sharded, i=idx: _step_holding_outputs(s, i), sharded, idx)
        backward = sharded.graphs["backward"]
        resharded = [g.index for g in sharded.plan.groups if g.unit != ""]
        out[name] = dict(trained, measured=measured, predicted=sharded.report().predicted_peak_bytes,
                         gathers=_gathers_per_group(backward), resharded=resharded,
                         saved=len(sharded.graphs["forward"].graph.output_node().args[0]))
    backend = fxshard.backend(by_class(Block), activation_checkpointing=VARIANTS["full"])
    compiled = torch.compile(_model(), backend=backend)
    out["backend_full"] = _train(compiled, fxshard.parameters(compiled), rank)
    forward = backend.graphs()[0]["forward"]
    out["backend_full"]["saved"] = len(forward.graph.output_node().args[0])
    return out


@cache
def results() -> list[dict[str, Any]]:
    return run_ranks(worker, 2)


@pytest.mark.parametrize("name", ["full", "selective", "backend_full"])
def test_checkpointing_trains_bit_for_bit_like_without(name: str) -> None:
    for r in results():
        base = r["none"]  # the backend trains like fxshard.compile (tests/test_backend.py)
        got = r[name]
        assert torch.equal(got["losses"], base["losses"]), (got["losses"], base["losses"])
        assert all(torch.equal(a, b) for a, b in zip(got["params"], base["params"]))
        assert torch.equal(got["after"], base["after"])  # recompute left the generator alone


def test_the_backend_matches_compile() -> None:
    for r in results():
        assert torch.equal(r["backend_full"]["losses"], r["full"]["losses"])
        # ... and checkpointed: Dynamo's module stack located the regions.
        assert r["backend_full"]["saved"] < r["none"]["saved"] / 2, (r["backend_full"]["saved"],
                                                                    r["none"]["saved"])


@pytest.mark.parametrize("name", ["full", "selective"])
def test_each_resharded_unit_is_gathered_once_in_backward(name: str) -> None:
    for r in results():
        res = r[name]
        # The recompute and the gradient share one gather: three blocks, one group each.
        assert res["gathers"] == {g: 1 for g in res["resharded"]}, res["gathers"]
        assert r["none"]["gathers"] == res["gathers"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_predicted_peak_within_three_percent_of_measured(name: str) -> None:
    for r in results():
        predicted, measured = r[name]["predicted"], r[name]["measured"]
        assert abs(predicted - measured) <= 0.03 * measured, (name, predicted, measured)


def test_checkpointing_saves_less_and_lowers_the_measured_peak() -> None:
    for r in results():
        none, full, sel = r["none"], r["full"], r["selective"]
        assert full["saved"] < sel["saved"] < none["saved"]
        assert full["measured"] < sel["measured"] < none["measured"], (
            full["measured"], sel["measured"], none["measured"])


# -- single process ----------------------------------------------------------------------------


def test_regions_are_the_outermost_modules_the_policy_selects() -> None:
    model = _model()
    plan = plan_checkpointing(model, by_class(Block))
    assert plan is not None and plan.regions == ("blocks.0", "blocks.1", "blocks.2")
    assert plan.region_of("blocks.1.attn.qkv") == "blocks.1" and plan.region_of("lm_head") is None
    nested = plan_checkpointing(model, by_class(Block, torch.nn.Linear))
    assert nested is not None and nested.regions[:3] == ("blocks.0", "blocks.1", "blocks.2")
    assert "lm_head" in nested.regions and not any(r.startswith("blocks.0.") for r in nested.regions)
    with pytest.warns(UserWarning, match=r"activation_checkpointing=by_size\(1_000_000_000\) matched no module .*"
                                         "nothing is recomputed"):
        huge = plan_checkpointing(model, by_size(10**9))  # selects nothing: said, not dropped
    assert huge is not None and not huge.regions


def test_a_replicate_policy_that_selects_no_unit_warns() -> None:
    """replicate= keeps whole units; one that names a layer inside the units (Linear in a
    Block) selected none, and every parameter stayed sharded, silently."""
    from fxshard.ir.plan import make_plan

    with pytest.warns(UserWarning, match=r"replicate=by_class\(Linear\) selected no unit of the plan.*"
                                         "replicate_below="):
        plan = make_plan(_model(), by_class(Block), 4, replicate=by_class(torch.nn.Linear))
    assert not any(g.replicated for g in plan.groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = make_plan(_model(), by_class(Block), 4, replicate=by_class(Block))
    assert any(g.replicated for g in plan.groups)


def test_explain_predicts_less_memory_with_checkpointing() -> None:
    model = TinyGPT(dim=64, layers=2, seq=64, dropout=0.1)
    x = torch.randint(0, 61, (8, 64))
    peaks = {name: fxshard.explain(copy.deepcopy(model), x, by_class(Block), world_size=4,
                                   activation_checkpointing=ac).report.predicted_peak_bytes
             for name, ac in VARIANTS.items()}
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


def test_a_bad_checkpointing_value_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="activation_checkpointing takes a policy"):
        fxshard.compile(_model(), by_class(Block), activation_checkpointing=True)
    with pytest.raises(TypeError, match="selective takes a policy"):
        selective(Block)  # type: ignore[arg-type]


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        for _ in range(400):  # one long chain: every sin's backward reads its input
            x = torch.sin(x)
        return x


def test_a_long_region_is_copied_without_recursion() -> None:
    """A recursive copy would go about four frames deep per operator of the chain."""
    model = torch.nn.Sequential(_Chain(), torch.nn.Linear(8, 8))
    none, full = (fxshard.explain(model, torch.randn(4, 8), by_class(_Chain), world_size=2,
                                  activation_checkpointing=ac).graphs["forward"]
                  for ac in (None, by_class(_Chain)))
    saved = [len(g.graph.output_node().args[0]) for g in (none, full)]
    assert saved[0] > 400 and saved[1] < 10, saved  # every sin's input, or the chain's ends


class _SdpaBlock(torch.nn.Module):
    """Attention through F.scaled_dot_product_attention, a random operator by its tags
    (dropout_p), and a torch.rand with no tensor input."""

    def __init__(self, noise: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.noise = noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(2, 8, 16)
        if self.noise:
            y = y * (torch.rand(y.shape, device=y.device) > 0.1)
        return x + y


def _sdpa_run(ac: Any, noise: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SdpaBlock(noise), _SdpaBlock(noise))
    sharded = fxshard.compile(model, by_class(_SdpaBlock), activation_checkpointing=ac)
    torch.manual_seed(1)
    out = sharded(torch.randn(2, 8, 16))
    out.square().sum().backward()
    return out.detach(), [p.grad for p in sharded.parameters()], torch.randn(4), sharded.graphs


def test_selective_saves_attention_and_replays_torch_rand() -> None:
    base = _sdpa_run(None, noise=True)
    for ac in (by_class(_SdpaBlock), selective(by_class(_SdpaBlock))):
        got = _sdpa_run(ac, noise=True)
        assert torch.equal(got[0], base[0]) and torch.equal(got[2], base[2])
        assert all(torch.equal(a, b) for a, b in zip(got[1], base[1]))
    # Selective: the attention's output is saved, so backward neither reruns it nor needs its
    # generator state; full checkpointing replays it (and torch.rand) under the saved state.
    sel = _sdpa_run(selective(by_class(_SdpaBlock)), noise=False)[3]["backward"].code
    full = _sdpa_run(by_class(_SdpaBlock), noise=False)[3]["backward"].code
    assert "run_with_rng_state" not in sel and "attention.default(" not in sel.replace("_backward", "")
    assert "run_with_rng_state" in full


def test_reshard_units_names_units() -> None:
    with pytest.raises(TypeError, match="reshard_units takes unit names"):
        fxshard.compile(_model(), by_class(Block), reshard_units="blocks.0")
    with pytest.raises(fxshard.FxShardError, match=r"reshard_units names no unit of the plan: \['block.0'\]"):
        fxshard.compile(_model(), by_class(Block), reshard_units={"block.0"})
