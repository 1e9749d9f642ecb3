"""Bad input: a clear error that names the problem and hints at the fix, and nothing lost."""

from __future__ import annotations

import copy
import datetime
import inspect
import time
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxshard
from fxshard.ir.errors import FxShardError, TraceError
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import MLP

RANKS_START_METHOD = "spawn"  # ranks exit through interpreter teardown (tests/dist_utils.py)


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


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


# A kernel whose fake implementation, like many fused kernels', takes bfloat16 only.
@torch.library.custom_op("fxshard_test_errors::bf16_only", mutates_args=())
def bf16_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@bf16_only.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    torch._check(x.dtype == torch.bfloat16, lambda: f"bf16_only takes bfloat16, got {x.dtype}")
    return torch.empty_like(x)


@torch.library.custom_op("fxshard_test_errors::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class Calls(nn.Module):
    """A Linear, then a function of its output."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.l(x))


class WrongWidth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x[:, :3])


def _line(fn: Callable[..., Any], text: str) -> int:
    """The number of the line of ``fn``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _assert_source(err: TraceError, fn: Callable[..., Any], text: str) -> None:
    """``err`` names the line of ``fn`` (in this file) that contains ``text``."""
    line = _line(fn, text)
    assert f"\n  at {__file__}:{line} in {fn.__name__}: " in str(err), str(err)
    assert err.source is not None
    assert (err.source.filename, err.source.lineno) == (__file__, line), err.source
    assert text in err.source.code


def _trace_error(e: BaseException) -> TraceError:
    """The TraceError in ``e``'s chain (Dynamo wraps a backend's errors)."""
    x: BaseException | None = e
    while x is not None and not isinstance(x, TraceError):
        x = getattr(x, "inner_exception", None) or x.__cause__ or x.__context__
    assert x is not None, repr(e)
    return x


def _compile_error(model: nn.Module, x: torch.Tensor) -> TraceError:
    with pytest.raises(TraceError) as info:
        fxshard.compile(model, example_inputs=x)
    return info.value


@pytest.mark.release  # 2.11's fake embedding accepts float indices: the trace checks them
def test_float_token_ids_into_an_embedding() -> None:
    err = _compile_error(TokenModel(), torch.zeros(2, 3))
    assert "module 'emb' (Embedding)" in str(err)
    assert "indices must be integer tensors" in str(err) and "ids.long()" in str(err)
    assert "--input-dtype int64" in str(err)
    assert "tensor values" not in str(err)  # not the data-dependent hint
    _assert_source(err, TokenModel.forward, "self.head(self.emb(ids))")
    assert err.kind == "index-dtype" and err.module == "emb"


def test_a_kernel_that_takes_only_bfloat16() -> None:
    model = Calls(bf16_only)
    err = _compile_error(model, torch.randn(3, 4))
    assert "bf16_only takes bfloat16, got torch.float32" in str(err)
    assert "does not accept the dtype of its inputs" in str(err) and "x.to(dtype)" in str(err)
    assert "tensor values" not in str(err)
    # The model's line that called the operator, not the line of its fake implementation.
    _assert_source(err, Calls.forward, "self.fn(self.l(x))")
    assert err.kind == "dtype"


def test_an_operator_without_a_fake_implementation() -> None:
    err = _compile_error(Calls(no_fake), torch.randn(3, 4))
    assert "torch.library.register_fake" in str(err) and "tensor values" not in str(err)
    _assert_source(err, Calls.forward, "self.fn(self.l(x))")
    assert err.kind == "unsupported-operator"


def test_any_other_failure_gets_a_hint_that_claims_no_cause() -> None:
    err = _compile_error(WrongWidth(), torch.randn(3, 4))
    assert "runs eagerly on inputs of these shapes and dtypes" in str(err)
    assert "tensor values" not in str(err) and "dtype the model expects" not in str(err)
    _assert_source(err, WrongWidth.forward, "self.l(x[:, :3])")
    assert err.kind == "unknown" and err.module == "l"


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo remembers the shapes each forward's code has seen, across torch.compile calls."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [True, None])
def test_dynamic_shapes_under_torch_compile(dynamic: bool | None, fresh_dynamo: None) -> None:
    """dynamic=True, or the default once a shape changes: Dynamo passes symbolic sizes."""
    model = torch.compile(MLP(), backend=fxshard.backend(), dynamic=dynamic)
    fxshard.parameters(model)
    if dynamic is None:
        model(torch.randn(3, 12))  # static; the next shape makes Dynamo go dynamic
    with pytest.raises(Exception) as info:
        model(torch.randn(5, 12))
    err = _trace_error(info.value)
    assert "its inputs have symbolic (dynamic) sizes: input 0 is the symbolic size s" in str(err)
    assert "dynamic=False" in str(err) and "torch._dynamo.mark_static(x)" in str(err)
    assert "tensor values" not in str(err)
    # No line of the model failed: the line that called it.
    line = _line(test_dynamic_shapes_under_torch_compile, "model(torch.randn(5, 12))")
    assert f"called at {__file__}:{line} in test_dynamic_shapes_under_torch_compile" in str(err)
    assert err.source is not None and (err.source.filename, err.source.lineno) == (__file__, line)
    assert err.kind == "dynamic-shapes"


def test_data_dependent_control_flow_names_module_and_op() -> None:
    model = Outer()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError) as info:
        fxshard.compile(model, policy=by_class(nn.Linear), example_inputs=torch.randn(3, 4))
    err = info.value
    assert err.module == "block" and err.op == "aten._local_scalar_dense.default"
    assert "module 'block' (DataDependent)" in str(err) and "torch.where" in str(err)
    _assert_source(err, DataDependent.forward, "if y.sum() > 0")
    assert err.kind == "data-dependent"
    # Nothing lost: the model still holds its parameters.
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_dynamic_output_shape_gets_its_own_hint() -> None:
    sharded = fxshard.compile(Selects())
    with pytest.raises(TraceError, match="(?s)aten.nonzero.*output shape depends on tensor values") as info:
        sharded(torch.randn(3, 4))
    _assert_source(info.value, Selects.forward, "torch.nonzero")
    assert info.value.kind == "dynamic-output-shape"
    # The shards still hold the parameters.
    assert set(sharded.full_state_dict()) == {"l.weight", "l.bias"}


def _raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


@pytest.mark.parametrize(("error", "module_type", "kind"), [
    (RuntimeError("Expected tensor for argument #1 'indices' to have one of the following scalar "
                  "types: Long, Int; but got torch.float32 instead"), "Embedding", "index-dtype"),
    (RuntimeError("gather(): Expected dtype int32/int64 for index, but got torch.float32"), "?",
     "index-dtype"),
    (RuntimeError("expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"),
     "Linear", "dtype"),
    (RuntimeError(".numpy() is not supported for tensor subclasses."), "?", "data-dependent"),
    (RuntimeError("There was no fake impl registered for <CustomOpDef(lib::op)>."), "?",
     "unsupported-operator"),
    (torch._dynamo.exc.TensorifyScalarRestartAnalysis(), "?", "dynamic-shapes"),
    # The cause of a wrapper raised from it counts.
    (_raised_from(RuntimeError("while tracing"), RuntimeError("mat1 has dtype torch.float32")),
     "?", "dtype"),
    (RuntimeError("a and b must have same reduction dim, but got [3, 3] X [4, 4]."), "Linear",
     "unknown"),
])
def test_each_cause_is_recognised(error: BaseException, module_type: str, kind: str) -> None:
    from fxshard.driver.compile.trace import diagnose

    assert diagnose(error, module_type).kind == kind


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


def test_state_dict_takes_nn_modules_positional_arguments_and_refuses_keep_vars() -> None:
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    full = sharded.state_dict()
    into: dict[str, Any] = {}
    assert sharded.state_dict(into, "m.") is into and set(into) == {"m." + k for k in full}
    with pytest.raises(TypeError, match="keep_vars=True\\) asks for the module's own Parameter objects"):
        sharded.state_dict(keep_vars=True)
    with pytest.raises(TypeError, match="keep_vars=True"):
        sharded.state_dict(None, "", True)


def test_a_full_state_dicts_gathers_wait_as_long_as_compiles_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """fxshard.compile(timeout=) bounds every wait of the job: the full state dict's gathers
    too (they waited 300 s whatever it said), unless the call names its own."""
    import dataclasses

    from fxshard.driver.state import state_dicts

    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    driver = sharded._driver
    waited: list[float] = []
    gather = state_dicts.full_parameters

    def recorded(shards: Any, plan: Any, world: Any, timeout: float) -> Any:
        waited.append(timeout)
        return gather(shards, plan, world, timeout)

    monkeypatch.setattr(state_dicts, "full_parameters", recorded)
    sharded.full_state_dict()
    driver.world = dataclasses.replace(driver.world, timeout=datetime.timedelta(seconds=7))
    state = sharded.full_state_dict()
    sharded.full_state_dict(timeout=3)
    sharded.load_full_state_dict(state, strict=False)
    assert waited == [300.0, 7.0, 3.0, 7.0]


def _rank0_buffer_on_meta(rank: int, world_size: int) -> str:
    from models import BNNet

    if rank == 0:
        model = BNNet()
        model.bn.register_buffer("running_mean", torch.empty(8, device="meta"))  # never computed
    else:
        with torch.device("meta"):
            model = BNNet()
    try:
        fxshard.compile(model, sync_module_states=True, timeout=20)
    except FxShardError as e:
        return str(e)
    return "compiled"


def test_sync_module_states_with_a_meta_buffer_on_rank_0_raises_on_every_rank_naming_it() -> None:
    """It broadcast rank 0's uninitialised memory as the buffer; and a rank 0 whose parameters
    were on meta raised alone, leaving the other ranks in the broadcast until the timeout."""
    for message in run_ranks(_rank0_buffer_on_meta, 2):
        assert "rank 0's model has tensors on the meta device (bn.running_mean)" in message, message


def _one_rank_passes_nothing(rank: int, world_size: int) -> str:
    """Rank 0 passes the full state dict, rank 1 an empty one (strict=False): rank 1 read
    nothing to compare, rank 0 the model's parameters."""
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), timeout=20)
    full = sharded.full_state_dict()
    try:
        sharded.load_full_state_dict(full if rank == 0 else {}, strict=False)
    except FxShardError as e:
        return str(e)
    return "loaded"


def test_ranks_that_pass_different_full_state_dicts_all_raise_even_one_that_passed_nothing() -> None:
    """Rank 1's dict had nothing to compare, so it had no words for the error and returned,
    while rank 0 raised: its next collective waited out the timeout."""
    messages = run_ranks(_one_rank_passes_nothing, 2)
    for message in messages:
        assert "the ranks passed different state dicts, nothing was changed" in message, message
        assert "rank 1: nothing to compare" in message, message


def _only_rank0_gathers(rank: int, world_size: int, stay: float, group_timeout: float | None,
                        timeout: float) -> str:
    """Rank 0 gathers the full state; rank 1 never does: it leaves at once (``stay=0``), or
    stays ``stay`` seconds first, so the wait ends by a timeout."""
    group = None if group_timeout is None else dist.new_group(
        timeout=datetime.timedelta(seconds=group_timeout))
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), process_group=group)
    if rank == 0:
        try:
            sharded.full_state_dict(timeout=timeout)
        except FxShardError as e:
            return str(e)
        return "no error"
    time.sleep(stay)
    return "skipped"


@pytest.mark.parametrize("stay, group_timeout, timeout, said", [
    (0.0, None, 30, "the other ranks did not answer (the wait failed after"),  # rank 1 left
    # The two timeouts in the slow tier: each waits out its seconds.
    pytest.param(8.0, None, 3, "the other ranks did not answer within 3s.",  # timeout= fired
                 marks=pytest.mark.slow),
    pytest.param(8.0, 2.0, 60, "the other ranks did not answer within 2s (the process group's own "
                 "timeout, which is shorter than the 60s asked for, fired first).", marks=pytest.mark.slow),
])
def test_full_state_dict_on_one_rank_raises_instead_of_hanging_and_says_what_ended_the_wait(
        stay: float, group_timeout: float | None, timeout: float, said: str) -> None:
    messages = run_ranks(_only_rank0_gathers, 2, stay, group_timeout, timeout)
    assert said in messages[0] and "every rank" in messages[0], messages[0]
    if not stay:  # said as what it was, a closed connection, and not as a timeout
        assert "Connection closed by peer" in messages[0] and "within" not in messages[0]
    assert messages[1] == "skipped"


def _ddp_over_sharded(rank: int, world_size: int) -> tuple[str, str, bool]:
    """DDP(sharded) on every rank: the error, and whether this rank's shards are unchanged
    (DDP's constructor would have broadcast rank 0's shards over them)."""
    torch.manual_seed(rank)  # different weights per rank: a broadcast would show
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    before = [p.detach().clone() for p in sharded.parameters()]
    try:
        torch.nn.parallel.DistributedDataParallel(sharded)
    except Exception as e:  # noqa: BLE001 - the type is the result
        error, message = type(e).__name__, str(e)
    else:
        error, message = "none", ""
    unchanged = all(torch.equal(p, b) for p, b in zip(sharded.parameters(), before))
    return error, message, unchanged


@pytest.mark.release  # reads the attribute DDP's constructor reads first
def test_ddp_over_a_sharded_module_is_refused_before_anything_is_broadcast() -> None:
    for rank, (error, message, unchanged) in enumerate(r["ddp"] for r in refusals()):
        assert error == "FxShardError", (rank, error, message)
        assert "DistributedDataParallel" in message and "already reduces" in message, message
        assert "fxshard.compile(model)" in message, message
        assert unchanged, rank


@pytest.mark.release  # FSDP2 makes a subclass of the module's class (ShardedModule.__init_subclass__)
def test_fully_shard_over_a_sharded_module_is_refused_on_every_rank() -> None:
    for rank, (error, message) in enumerate(r["fully_shard"] for r in refusals()):
        assert error == "FxShardError", (rank, error, message)
        assert f"rank {rank}: fully_shard over a ShardedModule" in message, message
        assert "build the model again" in message and "by_class(Block)" in message, message


def _clip_the_original(rank: int, world_size: int) -> tuple[list[tuple[str, str]], bool]:
    """A DDP script's clipping over the unwrapped model after a step: each call's error, and
    whether the shards' gradients are unchanged."""
    model = MLP()
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    sharded(torch.randn(4, 12)).square().sum().backward()
    before = [p.grad.clone() for p in sharded.parameters() if p.grad is not None]
    model.zero_grad()  # harmless: no gradient to drop
    results = []
    for clip in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
                 lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, foreach=True),
                 lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)):
        try:
            clip()
        except Exception as e:  # noqa: BLE001 - the type is the result
            results.append((type(e).__name__, str(e)))
        else:
            results.append(("none", ""))
    after = [p.grad for p in sharded.parameters() if p.grad is not None]
    return results, len(after) == len(before) > 0 and all(torch.equal(a, b) for a, b in zip(after, before))


def _fully_shard_over_sharded(rank: int, world_size: int) -> tuple[str, str]:
    """FSDP2's fully_shard over a ShardedModule, on every rank: the error each raises."""
    from torch.distributed.fsdp import fully_shard

    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    try:
        fully_shard(sharded)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return "none", ""


def refusals_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {"ddp": _ddp_over_sharded(rank, world_size), "clip": _clip_the_original(rank, world_size),
            "fully_shard": _fully_shard_over_sharded(rank, world_size)}


@cache
def refusals() -> list[dict[str, Any]]:
    """Both refusals in one spawn: each leaves the process group as it found it."""
    return run_ranks(refusals_worker, 2)


def test_clipping_the_original_modules_parameters_is_refused() -> None:
    for rank, (results, unchanged) in enumerate(r["clip"] for r in refusals()):
        for error, message in results:
            assert error == "FxShardError", (rank, error, message)
            assert f"rank {rank}" in message and "no gradient" in message, message
            assert "sharded.clip_grad_norm_(" in message, message
            assert "clip_grad_norm_(sharded.parameters(), " in message, message
        assert unchanged, rank


class PlainTensorAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.scale = torch.ones(4)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) * self.scale


def test_a_plain_tensor_attribute_read_in_forward_is_told_to_become_a_buffer() -> None:
    err = _compile_error(PlainTensorAttribute(), torch.randn(2, 4))
    assert err.kind == "tensor-attribute", err
    assert "neither a parameter nor a buffer" in str(err) and "Register it as a buffer" in str(err), err
    assert 'self.register_buffer("name", tensor)' in str(err), err
    _assert_source(err, PlainTensorAttribute.forward, "self.l(x) * self.scale")


class _Reuses(nn.Module):
    """A new model around a block of a model fxshard sharded already."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.head = nn.Linear(24, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(x)))


@pytest.mark.parametrize("new", ["around a block", "the block alone"])
def test_compiling_a_submodule_of_a_sharded_model_names_the_stand_ins_and_the_fix(new: str) -> None:
    model = MLP()
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    block = model.layers[1]
    reused = _Reuses(block) if new == "around a block" else block
    before = [p.detach().clone() for p in sharded.parameters()]
    with pytest.raises(FxShardError) as raised:
        fxshard.compile(reused)
    message = str(raised.value)
    assert message.startswith("rank 0: parameter 'weight' of this Linear") or \
        message.startswith("rank 0: parameter 'block.weight' of this _Reuses"), message
    assert "belongs to the MLP sharded already by fxshard.compile" in message, message
    assert "a stand-in on the meta device" in message and "move the whole model" not in message, message
    assert "compile the whole model once" in message and "full_state_dict()" in message, message
    assert all(torch.equal(p, b) for p, b in zip(sharded.parameters(), before))
    assert all(p.is_meta for p in block.parameters())  # nothing changed


def test_a_batch_of_another_float_dtype_is_a_trace_error_and_the_module_goes_on() -> None:
    """A float64 batch (from NumPy) into a float32 model: the trace accepted the mixed matmul
    (meta kernels check no dtypes), the step failed inside its forward graph with torch's
    'mat1 and mat2 must have the same dtype', and every later step was refused as abandoned.
    Refused at the trace instead, in training and under no_grad, the module runs on."""
    torch.manual_seed(0)
    sharded = fxshard.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), policy=by_class(nn.Linear))
    x = torch.randn(4, 8)
    sharded(x).sum().backward()
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(TraceError, match=r"(?s)operands of torch.float32 and "
                                                                           r"torch.float64.*Hint: .*x.to\(dtype\)") as e:
            sharded(x.double())
        assert e.value.kind == "dtype"
    sharded(x).sum().backward()  # not abandoned
