"""Meta-device init of a module whose own init writes to its child's parameters
(nn.MultiheadAttention zeroes out_proj.bias): honoured, as building the model normally does."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.ir.errors import FxShardError
from fxshard.policies import by_class


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def mha_init(m: nn.Module) -> None:
    """What docs/recipe.md tells users to pass for a model with nn.MultiheadAttention."""
    if isinstance(m, nn.MultiheadAttention):
        m._reset_parameters()
    else:
        m.reset_parameters()  # type: ignore[operator]


def test_multihead_attentions_init_of_its_child_bias_is_honoured() -> None:
    torch.manual_seed(0)
    eager = Net()
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(0)
    state = fxshard.compile(model, by_class(nn.MultiheadAttention), param_init_fn=mha_init).full_state_dict()
    # The biases MHA's own init zeroes are zero, as in eager (out_proj.bias: a child's).
    for name in ("attn.in_proj_bias", "attn.out_proj.bias"):
        assert torch.equal(state[name], torch.zeros_like(state[name])), name
        assert torch.equal(eager.state_dict()[name], state[name])
    # Every other parameter comes from its eager init function: xavier_uniform_ for
    # in_proj_weight, Linear's kaiming_uniform_ and uniform bias for the rest.
    bound = math.sqrt(6 / (16 + 48))
    assert state["attn.in_proj_weight"].abs().max() <= bound
    assert state["attn.in_proj_weight"].std() > bound / 3
    for name in ("inp.weight", "out.weight", "attn.out_proj.weight"):
        fan_in = state[name].shape[1]
        assert state[name].abs().max() <= 1 / math.sqrt(fan_in)
    # The modules initialised in the same order as eager draw the same numbers.
    assert torch.equal(eager.state_dict()["inp.weight"], state["inp.weight"])
    assert torch.equal(eager.state_dict()["inp.bias"], state["inp.bias"])


def test_an_init_that_writes_to_a_module_already_initialised_is_refused() -> None:
    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    def init(m: nn.Module) -> None:
        m.reset_parameters()  # type: ignore[operator]
        if m is model.b:
            nn.init.zeros_(model.a.bias)  # a sibling, initialised before b

    with torch.device("meta"):
        model = Late()
    with pytest.raises(FxShardError, match="module 'b' wrote to 'a.bias'.*already initialised"):
        fxshard.compile(model, by_class(nn.Linear), param_init_fn=init)
