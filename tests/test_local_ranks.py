"""Many world sizes in one process: the emitted graphs run on simulated ranks.

The graphs are compiled against a fake process group of N ranks, then run
under ``LocalTensorMode``, where every tensor holds one value per rank and the
c10d functional collectives compute what N real ranks would. The oracle is
plain autograd on each rank's data, gradients averaged over ranks (DDP's
definition of the gradient).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode, enabled_local_tensor_mode

import fxshard

from graph_utils import fake_world
from models import CASES


def rank_map(cb: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """One tensor per simulated rank (torch 2.13's module-level rank_map; 2.11 has only the mode's)."""
    mode = enabled_local_tensor_mode()
    assert mode is not None, "rank_map outside LocalTensorMode"
    return mode.rank_map(cb)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t._local_tensors[rank]  # type: ignore[attr-defined]


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow), 5,
                                        pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case_name", ["mlp", "gpt", "shared_use"])
def test_graphs_on_simulated_ranks_match_autograd(case_name: str, world_size: int) -> None:
    case = CASES[case_name]
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    data = [case.inputs(torch.Generator().manual_seed(r)) for r in range(world_size)]
    with fake_world(world_size):
        sm = fxshard.compile(model, policy=case.policies[0], example_inputs=data[0][0])
        outs, grads, ref_outs, full = _run_graphs(sm, case, data, ref, world_size)
    _check(sm, outs, grads, ref_outs, full, world_size)


def _run_graphs(sm, case, data, ref, world_size):  # type: ignore[no-untyped-def]
    fw, bw, plan = sm.graphs["forward"], sm.graphs["backward"], sm.plan
    # Oracle: per-rank outputs and dloss/doutput, gradients averaged over ranks.
    ref_outs, tangents = [], []
    for x, y in data:
        out = ref(x)
        loss = case.loss(out, y) / world_size
        (tangent,) = torch.autograd.grad(loss, out, retain_graph=True)
        loss.backward()
        ref_outs.append(out.detach())
        tangents.append(tangent * world_size)  # the graph averages; undo the 1/N here
    full = dict(ref.named_parameters())

    with LocalTensorMode(world_size):
        shards = []
        for g in plan.groups:
            flat = _flat(g, lambda name: full[name].detach())
            shards.append(rank_map(lambda r, g=g, flat=flat: flat[slice(*g.shard_range(r))].clone()))
        x = rank_map(lambda r: data[r][0])
        outs = fw(*shards, x)
        saved = outs[1:]
        grads = bw(*saved, rank_map(lambda r: tangents[r]))
    return outs, grads, ref_outs, full


def _flat(group, value):  # type: ignore[no-untyped-def]
    """The group's flat layout of ``value(name)`` per parameter, zeros in its gaps and padding."""
    return torch.cat([value(slot.name).reshape(-1) if slot is not None else torch.zeros(length)
                      for slot, length in group.spans()])


def _check(sm, outs, grads, ref_outs, full, world_size):  # type: ignore[no-untyped-def]
    plan = sm.plan
    for r in range(world_size):
        torch.testing.assert_close(_local(outs[0], r), ref_outs[r], rtol=1e-5, atol=1e-6)
        for g, grad in zip(plan.groups, grads):
            expected = _flat(g, lambda name: full[name].grad)
            torch.testing.assert_close(_local(grad, r), expected[slice(*g.shard_range(r))],
                                       rtol=1e-5, atol=1e-6, msg=lambda m, g=g, r=r: f"rank {r}, unit {g.unit!r}: {m}")
