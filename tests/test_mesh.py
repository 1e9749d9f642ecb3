"""mesh= (a torch DeviceMesh), with FSDP2's conventions: 1-D shards, (N, 1) is NO_SHARD; and
replicate=, NO_SHARD for the units a policy selects.

Graph structure on a fake process group of 4 ranks (in this process); training
on 4 real gloo ranks against DDP.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.ir import predicates as P
from fxshard.policies import by_class, by_predicate

from dist_utils import run_ranks
from graph_utils import fake_world, nodes, units_of
from models import MLP, FrozenNet


def _collectives(sharded: Any) -> dict[str, list[str]]:
    return {kind: [str(n.target) for n in nodes(gm, P.is_collective)]
            for kind, gm in sharded.graphs.items()}


def _compiled(**kw: Any) -> Any:
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), **kw)
    F.mse_loss(sharded(torch.randn(2, 12)), torch.randn(2, 5)).backward()
    return sharded


def test_a_1d_mesh_and_a_1_by_n_mesh_shard_as_the_process_group_does() -> None:
    with fake_world(4):
        default = _collectives(_compiled())
        assert default["forward"] and all("all_gather" in t for t in default["forward"])
        assert _collectives(_compiled(mesh=init_device_mesh("cpu", (4,)))) == default
        assert _collectives(_compiled(mesh=init_device_mesh("cpu", (1, 4)))) == default


def test_an_n_by_1_mesh_is_no_shard_whole_parameters_and_all_reduced_gradients() -> None:
    with fake_world(4):
        sharded = _compiled(mesh=init_device_mesh("cpu", (4, 1)))
        graphs = _collectives(sharded)
        assert graphs["forward"] == []  # nothing gathered
        assert graphs["backward"] and all("all_reduce" in t for t in graphs["backward"])
        assert sum(p.numel() for p in sharded.parameters()) == sum(p.numel() for p in MLP().parameters())


def test_hsdp_meshes_and_bad_arguments_are_refused_with_the_fix() -> None:
    with fake_world(4):
        with pytest.raises(NotImplementedError, match=r"a 2x2 mesh is HSDP .* pass a 1-D mesh .* or "
                                                      r"an \(4, 1\) mesh \(NO_SHARD\)"):
            fxshard.compile(MLP(), mesh=init_device_mesh("cpu", (2, 2)))
        with pytest.raises(TypeError, match="mesh= or process_group=, not both"):
            fxshard.compile(MLP(), mesh=init_device_mesh("cpu", (4,)),
                            process_group=torch.distributed.group.WORLD)
        with pytest.raises(ValueError, match="3 dimensions"):
            fxshard.compile(MLP(), mesh=init_device_mesh("cpu", (1, 2, 2)))
        with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh"):
            fxshard.compile(MLP(), mesh=(4, 1))
    with pytest.raises(TypeError, match="explain does not take .*mesh"):
        fxshard.explain(MLP(), torch.randn(2, 12), world_size=4, mesh=None)


def _against_ddp(model: nn.Module, rank: int, shape: tuple[int, int], front_end: str = "compile",
                 **options: Any) -> dict[str, Any]:
    """Four SGD steps of ``model`` through ``front_end`` with ``options``, and of DDP beside it."""
    ddp = DDP(copy.deepcopy(model))
    if front_end == "compile":
        sharded = fxshard.compile(model, **options)
        params = list(sharded.parameters())
    else:
        sharded = torch.compile(model, backend=fxshard.backend(**options), dynamic=False)
        params = list(fxshard.parameters(sharded))
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, ref_losses = [], []
    for _ in range(4):
        x, y = torch.randn(6, shape[0], generator=gen), torch.randn(6, shape[1], generator=gen)
        for module, optimizer, out in ((sharded, opt, losses), (ddp, ref_opt, ref_losses)):
            loss = F.mse_loss(module(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
    full = StateDictOptions(full_state_dict=True)
    state = {k: v.clone() for k, v in fxshard.get_model_state_dict(sharded, options=full).items()}
    return {"losses": losses, "ref_losses": ref_losses, "state": state,
            "ref_state": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}}


def no_shard_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return _against_ddp(MLP(), rank, (12, 5), policy=by_class(nn.Linear),
                        mesh=init_device_mesh("cpu", (world_size, 1)))


def test_no_shard_on_4_ranks_trains_like_ddp() -> None:
    # Within an ulp-level bound, not bitwise: both all-reduce, but DDP's bucket holds the
    # gradients in reverse parameter order, fxshard's flat group in parameter order, so gloo's
    # ring cuts them into other chunks and adds each element's four terms in another order
    # (tests/test_parity.py bounds world size 3 the same way).
    for r in run_ranks(no_shard_worker, 4):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]),
                                   rtol=1e-5, atol=1e-6)
        assert r["state"].keys() == r["ref_state"].keys()
        for name, value in r["ref_state"].items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


# -- NO_SHARD per unit: replicate= ----------------------------------------------------------------

def _frozen(name: str, module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def test_replicate_keeps_the_selected_units_whole_and_gathers_only_the_others() -> None:
    with fake_world(4):
        torch.manual_seed(0)
        sharded = fxshard.compile(FrozenNet(), policy=by_class(nn.Sequential), replicate=by_predicate(_frozen))
        F.mse_loss(sharded(torch.randn(2, 10)), torch.randn(2, 3)).backward()
        plan = sharded.plan
        assert {plan.groups[g].unit: plan.groups[g].replicated for u in plan.units for g in u.groups} == \
            {"features": True, "head": False}
        assert "(replicated)" in str(plan)
        gathered = units_of(sharded.graphs["forward"], P.is_all_gather)
        assert gathered and set(gathered) == {"head"}  # the frozen backbone is never gathered
        assert set(units_of(sharded.graphs["backward"], P.is_collective)) == {"head"}  # frozen: no gradient
    with pytest.raises(TypeError, match="replicate takes a policy"):
        fxshard.compile(FrozenNet(), replicate=_frozen)


def replicate_worker(rank: int, world_size: int, front_end: str) -> dict[str, Any]:
    torch.manual_seed(0)
    return _against_ddp(FrozenNet(), rank, (10, 3), front_end, policy=by_class(nn.Sequential),
                        replicate=by_predicate(_frozen))


@pytest.mark.parametrize("front_end", ["compile", "backend"])
def test_a_replicated_frozen_backbone_trains_exactly_like_ddp(front_end: str) -> None:
    for r in run_ranks(replicate_worker, 2, front_end):
        assert r["losses"] == r["ref_losses"]
        for name, value in r["ref_state"].items():
            assert torch.equal(r["state"][name], value), name


# -- checkpoints across topologies ---------------------------------------------------------------

def _trained(mesh: Any, steps: int, rank: int) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), mesh=mesh)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        F.mse_loss(sharded(torch.randn(4, 12, generator=gen)), torch.randn(4, 5, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    return sharded, opt


def topology_checkpoint_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    no_shard, full_shard = init_device_mesh("cpu", (world_size, 1)), init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for name, saved_on, loaded_on in (("no_shard_to_full_shard", no_shard, full_shard),
                                      ("full_shard_to_no_shard", full_shard, no_shard)):
        source, source_opt = _trained(saved_on, 3, rank)
        path = f"{root}/{name}"
        fxshard.checkpoint.save(path, source, source_opt)
        target, target_opt = _trained(loaded_on, 0, rank)
        fxshard.checkpoint.load(path, target, target_opt)
        # One more step on both from the same state: the same numbers, optimizer state included.
        x, y = torch.randn(4, 12), torch.randn(4, 5)
        for module, optimizer in ((source, source_opt), (target, target_opt)):
            F.mse_loss(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        out[name] = (source.full_state_dict(), target.full_state_dict())
    return out


def test_a_checkpoint_resumes_across_no_shard_and_full_shard_both_ways() -> None:
    with tempfile.TemporaryDirectory() as root:
        for r in run_ranks(topology_checkpoint_worker, 2, root):
            for name, (source, target) in r.items():
                assert source.keys() == target.keys(), name
                for key in source:
                    assert torch.equal(source[key], target[key]), (name, key)
