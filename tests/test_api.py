"""The user-facing contract of fxshard.compile and ShardedModule (world size 1, in process)."""

from __future__ import annotations

import copy
import io
import pickle
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.ir import predicates as P
from fxshard.ir.errors import FxShardError
from fxshard.policies import by_class, by_size

from graph_utils import fake_world
from models import MLP, BNNet, TinyGPT


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, mode: str = "dict"):  # type: ignore[no-untyped-def]
        h = torch.relu(self.a(x)) * scale
        y = self.b(h)
        if mode == "dict":
            return {"y": y, "aux": (h, None, 3)}
        return Output(y, h, "ok")


def test_structured_outputs_and_kwargs() -> None:
    torch.manual_seed(0)
    model = Structured()
    ref = copy.deepcopy(model)
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    x = torch.randn(2, 4)
    out = sharded(x, scale=2.0)
    expected = ref(x, scale=2.0)
    assert out["aux"][1:] == (None, 3)
    torch.testing.assert_close(out["y"], expected["y"])
    torch.testing.assert_close(out["aux"][0], expected["aux"][0])
    dc = sharded(x, mode="dc")
    assert isinstance(dc, Output) and dc.note == "ok"
    torch.testing.assert_close(dc.logits, ref(x, mode="dc").logits)
    dc.logits.sum().backward()
    assert all(p.grad is not None for p in sharded.parameters())


def test_one_trace_per_signature_mode_and_grad_mode() -> None:
    sharded = fxshard.compile(MLP(), policy=by_size(300))
    x = torch.randn(4, 12)
    sharded(x)
    sharded(torch.randn(4, 12))
    assert len(sharded._driver.cache) == 1
    sharded(torch.randn(5, 12))  # a new shape
    assert len(sharded._driver.cache) == 2
    sharded.eval()
    with torch.no_grad():
        sharded(x)
    assert len(sharded._driver.cache) == 3 and "backward" not in sharded.graphs
    sharded.train()
    sharded(x)
    assert len(sharded._driver.cache) == 3 and "backward" in sharded.graphs


def test_example_inputs_trace_at_once() -> None:
    with fake_world(2):
        sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), example_inputs=torch.randn(4, 12))
        code = sharded.graphs["forward"].code
    for op in ("all_gather_into_tensor", "wait_tensor", "fxshard.free"):
        assert op in code
    assert "reduce_scatter_tensor" in sharded.graphs["backward"].code


def test_only_flat_shards_are_parameters_and_adamw_works() -> None:
    with fake_world(4):
        torch.manual_seed(0)
        model = TinyGPT()
        numel = sum(p.numel() for p in model.parameters())
        sharded = fxshard.compile(model, policy=by_class(nn.Linear))
        params = list(sharded.parameters())
        assert len(params) == len(sharded.plan.groups)
        assert sum(p.numel() for p in params) * 4 == sharded.plan.padded_numel
        assert sharded.plan.padded_numel - numel < 4 * len(sharded.plan.groups)
        torch.optim.AdamW(sharded.parameters())  # right after compile
        # The original module now holds no parameter storage.
        assert all(p.device.type == "meta" for p in model.parameters())


def test_compile_frees_the_models_parameters_by_reference_counting_alone() -> None:
    """Once compiled and stripped, the model's own parameters are gone as soon as the caller
    drops them, without waiting for the cyclic collector: on a GPU they are the whole
    unsharded model. (The planner's recursive walk of the module tree was a closure that
    referenced itself and held every parameter: a cycle, freed only when gc next ran.)"""
    import gc
    import weakref

    with fake_world(4):
        model = TinyGPT()
        params = [weakref.ref(p) for p in model.parameters()]
        gc.collect()
        gc.disable()
        try:
            sharded = fxshard.compile(model, policy=by_class(nn.Linear))
            del model
            alive = sum(p() is not None for p in params)
        finally:
            gc.enable()
        assert sharded.plan.units and alive == 0


def test_state_dict_round_trip_and_buffers() -> None:
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    sharded = fxshard.compile(model, policy=by_size(100))
    x = torch.randn(5, 3, 6, 6)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    sharded(x).sum().backward()
    opt.step()
    trained = sharded.full_state_dict()
    assert trained.keys() == ref.state_dict().keys()
    assert trained["bn.num_batches_tracked"].item() == 1  # buffers updated as in eager
    sharded.load_full_state_dict(ref.state_dict())
    sharded.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), ref(x))
    back = sharded.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(back[k], v)


def test_plan_and_graph_text_are_printable() -> None:
    with fake_world(2):
        sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), example_inputs=torch.randn(3, 12))
    table = str(sharded.plan)
    assert table.splitlines()[1].split() == ["unit", "group", "dtype", "grad", "numel", "padded", "shard", "params"]
    assert "layers.0" in table and "weight, bias" in table
    fw = sharded.graphs["forward"]
    # Forward nodes keep the module they came from.
    paths = {fxshard.meta.module_path(n) for n in fw.graph.nodes if n.target is torch.ops.aten.addmm.default}
    assert paths == {"layers.0", "layers.1", "head"}
    assert sum(1 for n in fw.graph.nodes if P.is_free(n)) == 3


def test_state_dict_is_the_full_model_under_the_original_names() -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    state = sharded.state_dict()
    assert list(state) == list(ref.state_dict())  # never flat shards under made-up names
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v), k
    assert list(sharded.state_dict(prefix="m.")) == [f"m.{k}" for k in ref.state_dict()]


def test_load_state_dict_strict_false_loads_what_matches_and_reports_the_rest() -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    result = sharded.load_state_dict({"head.bias": torch.ones(5), "extra": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["extra"]
    assert result.missing_keys == [k for k in ref.state_dict() if k != "head.bias"]
    state = sharded.state_dict()
    assert torch.equal(state["head.bias"], torch.ones(5))
    assert torch.equal(state["layers.0.weight"], ref.layers[0].weight)
    with pytest.raises(fxshard.FxShardError, match="Missing key"):
        sharded.load_state_dict({"head.bias": torch.ones(5)})  # strict by default


def test_requires_grad_changed_after_compile_is_refused() -> None:
    model = MLP()
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    x = torch.randn(3, 12)
    sharded(x).sum().backward()
    model.layers[0].weight.requires_grad_(False)  # the original module's parameter
    with pytest.raises(fxshard.FxShardError, match="parameter 'layers.0.weight' had requires_grad=True"):
        sharded(x)
    model.layers[0].weight.requires_grad_(True)  # changed back: runs again
    sharded(x).sum().backward()
    shard = next(iter(sharded.parameters()))
    shard.requires_grad_(False)
    with pytest.raises(fxshard.FxShardError, match="flat shard 0 .* had requires_grad=True"):
        sharded(x)


def test_pickling_saving_and_deepcopy_point_to_the_state_dict() -> None:
    sharded = fxshard.compile(MLP())
    for attempt in (lambda: torch.save(sharded, io.BytesIO()), lambda: pickle.dumps(sharded)):
        with pytest.raises(fxshard.FxShardError, match="cannot be pickled.*state_dict"):
            attempt()
    with pytest.raises(fxshard.FxShardError, match="cannot be deep-copied.*state_dict"):
        copy.deepcopy(sharded)


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_optimizer_over_the_original_module_is_refused(when: str) -> None:
    model = MLP()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    opt = early if when == "before" else torch.optim.SGD(model.parameters(), lr=0.1)
    sharded(torch.randn(2, 12)).sum().backward()
    with pytest.raises(fxshard.FxShardError, match="no longer holds the model.*sharded.parameters\\(\\)"):
        opt.step()
    torch.optim.SGD(sharded.parameters(), lr=0.1).step()  # the right one steps


def test_compiling_a_compiled_module_again_raises_instead_of_reinitialising_it() -> None:
    model = MLP()
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    x = torch.randn(4, 12)
    before = sharded(x)
    with pytest.raises(FxShardError, match="sharded already by fxshard.compile.*initialise new weights"):
        fxshard.compile(model, policy=by_class(nn.Linear))
    with pytest.raises(FxShardError, match="given a ShardedModule, which is sharded already"):
        fxshard.compile(sharded)
    torch.testing.assert_close(sharded(x), before, rtol=0, atol=0)  # the first one is untouched


def test_calling_the_original_module_after_compile_raises_naming_what_to_call() -> None:
    model = MLP()
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    with pytest.raises(FxShardError, match=r"called on the module passed to fxshard.compile.*"
                                           r"sharded\(inputs\)"):
        model(torch.randn(4, 12))
    sharded(torch.randn(4, 12)).sum().backward()  # the sharded module traces and runs the same model


def test_a_plain_checkout_on_sys_path_imports_the_whole_package(tmp_path: Any) -> None:
    """``fxshard/`` copied alone (a checkout with no install) imports with its passes: the
    passes live inside the package, not beside it behind the editable install's mapping."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "fxshard", tmp_path / "fxshard", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import fxshard, fxshard.passes; "
            "from fxshard.passes.pipeline import build_pipeline; "
            "print(fxshard.__file__); print(fxshard.passes.__file__); print(callable(fxshard.compile))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    package, passes, compiles = out.stdout.split()
    assert package.startswith(str(tmp_path)) and passes.startswith(str(tmp_path)), out.stdout
    assert compiles == "True"
