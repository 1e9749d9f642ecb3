"""Other libraries' spellings (FSDP1, FSDP2, Lightning's FSDPStrategy, torch.compile): each
gets the exact replacement in its error, or is taken where it means the same to the letter."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecision as FSDP1MixedPrecision
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import fxshard
from fxshard.ir.config import CompileConfig
from fxshard.ir.errors import FxShardError
from fxshard.policies import by_class

from models import MLP

FRONT_ENDS: dict[str, Callable[..., Any]] = {
    "compile": lambda **kw: fxshard.compile(MLP(), **kw),
    "backend": lambda **kw: fxshard.backend(**kw),
    "explain": lambda **kw: fxshard.explain(MLP(), torch.randn(2, 12), **kw),
}


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("option, value, words", [
    ("auto_wrap_policy", ModuleWrapPolicy({nn.Linear}), r"policy=fxshard\.policies\.by_class\(Linear\)"),
    ("auto_wrap_policy", functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}),
     r"policy=fxshard\.policies\.by_class\(Linear\)"),
    ("auto_wrap_policy", functools.partial(size_based_auto_wrap_policy, min_num_params=1000),
     r"policy=fxshard\.policies\.by_size\(1000\)"),
    ("auto_wrap_policy", {nn.Linear}, r"policy=fxshard\.policies\.by_class\(Linear\)"),  # Lightning's
    ("auto_wrap_policy", lambda *a: True, r"by_class\(Block\) wraps each Block .*auto\(\) chooses"),
    ("sharding_strategy", ShardingStrategy.SHARD_GRAD_OP, r"SHARD_GRAD_OP \(ZeRO-2\) is reshard_after_forward=False"),
    ("sharding_strategy", "HYBRID_SHARD", r"HYBRID_SHARD is a 2-D mesh=init_device_mesh"),
    ("sharding_strategy", ShardingStrategy.NO_SHARD, r"NO_SHARD is mesh=init_device_mesh\(device_type, \(world_size, 1\)\)"),
    ("sharding_strategy", ShardingStrategy.FULL_SHARD, r"FULL_SHARD is what fxshard.compile does by default"),
    ("device_id", 0, r"move the model there before fxshard.compile"),
    ("mp_policy", MixedPrecisionPolicy(param_dtype=torch.bfloat16), r"mp_policy= is fxshard's mixed_precision="),
    ("device_mesh", None, r"device_mesh= is fxshard's mesh="),
    ("limit_all_gathers", True, r"limit_all_gathers=True is fxshard's default, max_inflight_gathers=2"),
    ("ignored_modules", [], r"no ignored modules: .* replicate=fxshard.policies.by_class"),
    ("activation_checkpointing_policy", {nn.Linear},
     r"activation_checkpointing=fxshard.policies.by_class\(Block\)"),
])
def test_another_librarys_option_names_fxshards(front_end: str, option: str, value: Any, words: str) -> None:
    with pytest.raises(TypeError, match=words) as caught:
        FRONT_ENDS[front_end](**{option: value})
    assert "also takes" not in str(caught.value)  # the one replacement, not the list of every option


@pytest.mark.parametrize("given, written", [
    (ModuleWrapPolicy({nn.Linear}), r"policy=fxshard\.policies\.by_class\(Linear\)"),
    (nn.Linear, r"policy=fxshard\.policies\.by_class\(Linear\)"),
    ("Linear", r"got 'Linear'$"),  # nothing to translate: no guess
])
def test_a_wrap_policy_of_fsdp_given_as_policy_names_fxshards(given: Any, written: str) -> None:
    with pytest.raises(TypeError, match=r"policy must be built with fxshard.policies .*" + written):
        fxshard.compile(MLP(), policy=given)
    if not isinstance(given, str):
        with pytest.raises(TypeError, match=r"write activation_checkpointing=fxshard\.policies\.by_class\(Linear\)"):
            fxshard.compile(MLP(), activation_checkpointing=given)


@pytest.mark.release  # FSDP2's MixedPrecisionPolicy, read field by field on every release
def test_fsdp2s_mixed_precision_policy_is_taken_as_fxshards() -> None:
    given = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                 output_dtype=torch.float16, cast_forward_inputs=False)
    config = CompileConfig.build("compile", mixed_precision=given)
    assert config.mixed_precision == fxshard.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float16, cast_forward_inputs=False)
    # And a step with it computes what the same step with fxshard's own value computes.
    x = torch.randn(4, 12)
    results = []
    for mp in (MixedPrecisionPolicy(param_dtype=torch.bfloat16),
               fxshard.MixedPrecision(param_dtype=torch.bfloat16)):
        torch.manual_seed(0)
        sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), mixed_precision=mp)
        out = sharded(x)
        out.float().sum().backward()
        assert out.dtype == torch.bfloat16
        results.append((out.detach(), [p.grad.clone() for p in sharded.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_fsdp1s_mixed_precision_names_the_replacement_and_what_has_none() -> None:
    with pytest.raises(TypeError, match=r"replace FSDP1's MixedPrecision\(\.\.\.\) with fxshard.MixedPrecision"
                                        r"\(param_dtype=torch.bfloat16, reduce_dtype=torch.float32\)") as caught:
        fxshard.compile(MLP(), mixed_precision=FSDP1MixedPrecision(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32))
    assert "no counterpart" not in str(caught.value)
    with pytest.raises(TypeError, match=r"buffer_dtype=torch.bfloat16 and keep_low_precision_grads=True "
                                        r"have no counterpart"):
        fxshard.compile(MLP(), mixed_precision=FSDP1MixedPrecision(
            param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, keep_low_precision_grads=True))


class Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.release  # Dynamo's OptimizedModule on every release
def test_a_torch_compiled_module_is_refused_naming_the_module_underneath() -> None:
    with pytest.raises(FxShardError, match=r"the model is a torch.compile-d module .* \(model._orig_mod is it\)"):
        fxshard.compile(torch.compile(MLP()))
    with pytest.raises(FxShardError, match=r"submodule 'inner' is a torch.compile-d module .* \(inner._orig_mod is it\)"):
        fxshard.compile(Holder(torch.compile(MLP())))


@pytest.mark.release  # Dynamo's frame callback (compat.under_dynamo) on every release
def test_a_sharded_module_called_inside_torch_compile_is_refused_and_runs_after() -> None:
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    x = torch.randn(4, 12)
    with pytest.raises(FxShardError, match=r"called inside torch.compile .* compute='inductor'"):
        torch.compile(sharded, backend="eager")(x)

    @torch.compile(backend="eager")
    def step(inputs: torch.Tensor) -> torch.Tensor:
        return sharded(inputs).sum()

    with pytest.raises(FxShardError, match=r"called inside torch.compile"):
        step(x)
    torch.manual_seed(0)
    expected = MLP()
    assert torch.equal(sharded(x), expected(x))  # nothing of it was left half-traced


@pytest.mark.parametrize("method, words", [
    ("set_reshard_after_forward", r"an option of fxshard.compile: reshard_after_forward="),
    ("set_modules_to_forward_prefetch", r"forward_prefetch= and max_inflight_gathers="),
    ("unshard", r"sharded.full_state_dict\(\)"),
    ("set_is_last_backward", r"sharded.no_sync\(\)"),
    ("set_custom_all_gather", r"no counterpart"),
])
def test_fsdp2s_methods_on_a_sharded_module_name_what_fxshard_has(method: str, words: str) -> None:
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    with pytest.raises(AttributeError, match=rf"ShardedModule has no {method}\(\) \(FSDP2's FSDPModule method\): "
                                             rf".*{words}"):
        getattr(sharded, method)(False)
    # Everything else nn.Module finds, it still finds; an unknown name is nn.Module's error.
    assert isinstance(sharded.module, nn.Module) and callable(sharded.set_requires_gradient_sync)
    with pytest.raises(AttributeError, match="'ShardedModule' object has no attribute 'frobnicate'"):
        sharded.frobnicate  # noqa: B018
    assert not hasattr(sharded, "frobnicate")
