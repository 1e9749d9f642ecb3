"""Bad input: a clear error that names the problem and hints at the fix, and nothing lost."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.ir.errors import FxShardError, TraceError
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import MLP


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l(x)
        return y * 2 if y.sum() > 0 else y


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = DataDependent()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


class Selects(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x)[torch.nonzero(x[:, 0] > 0)[:, 0]]


def test_data_dependent_control_flow_names_module_and_op() -> None:
    model = Outer()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError) as info:
        fxshard.compile(model, policy=by_class(nn.Linear), example_inputs=torch.randn(3, 4))
    err = info.value
    assert err.module == "block" and err.op == "aten._local_scalar_dense.default"
    assert "module 'block' (DataDependent)" in str(err) and "torch.where" in str(err)
    # Nothing lost: the model still holds its parameters.
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_dynamic_output_shape_gets_its_own_hint() -> None:
    sharded = fxshard.compile(Selects())
    with pytest.raises(TraceError, match="(?s)aten.nonzero.*output shape depends on tensor values"):
        sharded(torch.randn(3, 4))
    # The shards still hold the parameters.
    assert set(sharded.full_state_dict()) == {"l.weight", "l.bias"}


def test_world_size_without_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(FxShardError, match="WORLD_SIZE=2 but no process group.*init_process_group"):
        fxshard.compile(MLP())


def test_input_on_the_wrong_device() -> None:
    sharded = fxshard.compile(MLP())
    with pytest.raises(FxShardError, match="is on meta.*shards are on cpu.*\\.to\\('cpu'\\)"):
        sharded(torch.randn(2, 12, device="meta"))


def test_parameters_on_several_devices() -> None:
    model = MLP()
    model.head.to("meta")
    with pytest.raises(FxShardError, match="several devices"):
        fxshard.compile(model)


def test_policy_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="fxshard.policies"):
        fxshard.compile(MLP(), policy=nn.Linear)  # type: ignore[arg-type]


def test_moving_after_compile_is_refused() -> None:
    sharded = fxshard.compile(MLP())
    with pytest.raises(FxShardError, match="before fxshard.compile"):
        sharded.to(torch.float64)


def test_graphs_before_any_trace() -> None:
    with pytest.raises(FxShardError, match="nothing traced yet"):
        fxshard.compile(MLP()).graphs  # noqa: B018


def test_load_full_state_dict_checks_before_changing_anything() -> None:
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    good = sharded.full_state_dict()
    bad = dict(good)
    bad.pop("head.bias")
    bad["layers.0.weight"] = torch.zeros(3, 3)
    bad["extra"] = torch.zeros(1)
    before = [p.detach().clone() for p in sharded.parameters()]
    with pytest.raises(FxShardError, match='(?s)nothing was loaded.*Missing key.*"head.bias".*Unexpected key.*"extra".*size mismatch for layers.0.weight'):
        sharded.load_full_state_dict(bad)
    for p, b in zip(sharded.parameters(), before):
        assert torch.equal(p, b)


def _only_rank0_gathers(rank: int, world_size: int) -> str:
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    if rank == 0:
        try:
            sharded.full_state_dict(timeout=3)
        except FxShardError as e:
            return str(e)
        return "no error"
    return "skipped"


def test_full_state_dict_on_one_rank_times_out_instead_of_hanging() -> None:
    messages = run_ranks(_only_rank0_gathers, 2)
    assert "timed out after 3s" in messages[0] and "every rank" in messages[0]
    assert messages[1] == "skipped"
