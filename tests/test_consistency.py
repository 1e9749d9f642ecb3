"""Ranks agree before every forward and backward: divergence raises on every rank, never a hang,
a native abort or a wrong number; a smaller last batch trains exactly like DDP."""

from __future__ import annotations

import copy
import datetime
import time
from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.ir.errors import CollectiveMismatchError, FxShardError
from fxshard.policies import by_class

from dist_utils import run_ranks
from models import CASES, MLP, BNNet

RANKS_START_METHOD = "spawn"  # ranks exit through interpreter teardown (tests/dist_utils.py)


def _divergent(rank: int) -> str:
    torch.manual_seed(0)
    # Rank 1 builds its hidden layer one unit wider: different shard shapes.
    sharded = fxshard.compile(MLP(hidden=24 + rank), policy=by_class(nn.Linear))
    try:
        sharded(torch.randn(4, 12)).sum().backward()
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def _partial_last_batch(rank: int) -> dict[str, Any]:
    """A DataLoader without drop_last: the last batch is 4 samples on rank 0 and 3 on rank 1."""
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(copy.deepcopy(model))
    sharded = fxshard.compile(model, policy=by_class(nn.Linear))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    losses, ref_losses = [], []
    for batch in (4, 4, 4 - rank, 4):
        x, y = torch.randn(batch, 12, generator=gen), torch.randn(batch, 5, generator=gen)
        for m, o, out in ((sharded, opt, losses), (ddp, ref_opt, ref_losses)):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    state = sharded.full_state_dict()
    return {"losses": losses, "ref_losses": ref_losses,
            "errors": [(state[k] - v).abs().max().item() for k, v in ddp.module.state_dict().items()]}


def _batch_sizes(full: int, rank: int) -> list[int]:
    """Every step's batch differs between the ranks, and the last is smaller on rank 1 (a
    DataLoader without drop_last); 2 at least (BatchNorm needs two samples in training)."""
    return [[full, 2, full - 1, full], [full - 1, full, 2, full - 1]][rank]


def _every_model_with_varying_batches(rank: int) -> dict[str, Any]:
    """Each model of the suite, default options: ranks with different batch sizes on every step
    issue the same collectives (the schedule never reads a rank's activation sizes)."""
    out = {}
    for name, case in CASES.items():
        torch.manual_seed(0)
        model = case.make()
        ddp = DDP(copy.deepcopy(model), broadcast_buffers=False)
        sharded = fxshard.compile(model, policy=case.policies[0])
        opt = torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(rank)
        x0, _ = case.inputs(torch.Generator().manual_seed(0))
        for batch in _batch_sizes(x0.shape[0], rank):
            x, y = case.inputs(gen)
            for m, o in ((sharded, opt), (ddp, ref_opt)):
                case.loss(m(x[:batch]), y[:batch]).backward()
                o.step()
                o.zero_grad()
        state = sharded.full_state_dict()
        out[name] = max((state[k] - v).abs().max().item() for k, v in ddp.module.state_dict().items())
    return out


def _rank1_evaluates_while_rank0_trains(sharded: nn.Module, rank: int,
                                        x: torch.Tensor) -> CollectiveMismatchError | None:
    """Rank 1 validates (eval, no grad) while rank 0 trains: the same gathers, another step."""
    try:
        if rank == 1:
            sharded.eval()
            with torch.no_grad():
                sharded(x)
        else:
            sharded(x).sum().backward()
    except CollectiveMismatchError as e:
        return e
    return None


def _one_rank_evaluates(rank: int) -> str:
    error = _rank1_evaluates_while_rank0_trains(fxshard.compile(MLP(), policy=by_class(nn.Linear)),
                                                rank, torch.randn(4, 12))
    return str(error) if error is not None else "no error"


def _one_rank_skips_backward(rank: int) -> str:
    """Rank 1 skips a backward (say its loss was not finite); rank 0 does not."""
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))
    x = torch.randn(4, 12)
    try:
        loss = sharded(x).sum()
        if rank == 0:
            loss.backward()
        sharded(x).sum().backward()
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def _buffers(rank: int) -> dict[str, Any]:
    """BatchNorm statistics: broadcast_buffers=True against DDP's default, train then eval."""
    torch.manual_seed(0)
    model = BNNet()
    ddp = DDP(copy.deepcopy(model))  # broadcast_buffers=True
    sharded = fxshard.compile(model, policy=by_class(nn.BatchNorm2d), broadcast_buffers=True)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)  # each rank's own data: its own statistics
    losses, ref_losses = [], []
    for _ in range(3):
        x, y = torch.randn(5, 3, 6, 6, generator=gen), torch.randn(5, 4, generator=gen)
        for m, o, out in ((sharded, opt, losses), (ddp, ref_opt, ref_losses)):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    report = sharded.report()
    sharded.eval()
    ddp.eval()
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(99))  # the same on every rank
    with torch.no_grad():  # DDP broadcasts before this one too (the forward before had grad)
        evals = [sharded(x), sharded(x)]
        ref_evals = [ddp(x), ddp(x)]
    state = sharded.full_state_dict()
    return {"losses": losses, "ref_losses": ref_losses, "evals": evals, "ref_evals": ref_evals,
            "state": state, "ref_state": ddp.module.state_dict(), "comm": report.comm_bytes_per_step,
            "buffer_bytes": sum(b.numel() * b.element_size() for b in ddp.module.buffers())}


@torch.library.custom_op("fxshard_test::tls_probe", mutates_args=())
def tls_probe(x: torch.Tensor) -> torch.Tensor:
    """Records whether a Python Context is in the thread-local state that collectives issued
    here would copy into their Works."""
    has_key = getattr(torch._C, "_is_key_in_tls", None)
    tls_probe.seen.append(bool(has_key("context")) if has_key is not None else False)  # type: ignore[attr-defined]
    return x.clone()


tls_probe.seen = []  # type: ignore[attr-defined]


@tls_probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


tls_probe.register_autograd(lambda ctx, grad: torch.ops.fxshard_test.tls_probe(grad))


class ProbesItsBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.ops.fxshard_test.tls_probe(self.a(x)))


def _collectives_of_a_backward_hold_no_python_context(rank: int, world_size: int) -> list[bool]:
    sharded = fxshard.compile(ProbesItsBackward(), policy=by_class(nn.Linear))
    for _ in range(2):
        sharded(torch.randn(2, 8)).sum().backward()
    return list(tls_probe.seen)  # type: ignore[attr-defined]


def _checked_on_the_device(rank: int) -> dict[str, Any]:
    """The agreement as a device's backend runs it (gloo's ranks made to check on the
    "device"), on a process group of its own that the last case leaves unusable: steady-state
    phases are checked without the host waiting; rank 1 then evaluates while rank 0 trains."""
    from fxshard.driver.run import consistency

    consistency.checks_on_device = lambda device: True  # type: ignore[assignment]
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT))
    torch.manual_seed(0)
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), process_group=group)
    agreement = sharded._driver.state.agreement
    x = torch.randn(4, 12)
    outstanding, losses = [], []
    for _ in range(3):
        loss = sharded(x).sum()
        outstanding.append(len(agreement.outstanding))  # after the forward's agreement
        loss.backward()
        losses.append(loss.item())
    out: dict[str, Any] = {"outstanding": outstanding, "losses": losses}
    start = time.monotonic()
    error = _rank1_evaluates_while_rank0_trains(sharded, rank, x)
    out["seconds"] = time.monotonic() - start
    out["error"] = str(error) if error is not None else "no error"
    out["unusable"] = error is not None and error.groups_unusable
    return out


def worker(rank: int, world_size: int) -> dict[str, Any]:
    # Each case leaves the process group usable: a mismatch is found by
    # collectives every rank takes part in (the last case breaks a group of its own).
    return {"partial": _partial_last_batch(rank), "eval": _one_rank_evaluates(rank),
            "skip": _one_rank_skips_backward(rank), "buffers": _buffers(rank),
            "no_python_context": _collectives_of_a_backward_hold_no_python_context(rank, world_size),
            "on_device": _checked_on_the_device(rank)}


@cache
def results() -> list[dict[str, Any]]:
    return run_ranks(worker, 2)


def slow_tier_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {"divergent": _divergent(rank), "varying": _every_model_with_varying_batches(rank)}


@cache
def slow_tier_results() -> list[dict[str, Any]]:
    """The cases only the slow tier's tests read (tests/conftest.py), in ranks of their own: every
    model of the suite trained at varying batch sizes took most of the file's time."""
    return run_ranks(slow_tier_worker, 2)


def test_divergent_ranks_raise_instead_of_hanging() -> None:
    for msg in (r["divergent"] for r in slow_tier_results()):
        assert "collective #0 of the step differs" in msg, msg
        assert "rank 0: forward: all_gather(float32[156]" in msg
        assert "rank 1: forward: all_gather(float32[163]" in msg
        assert "unit 'layers.0'" in msg


def test_partial_last_batch_trains_exactly_like_ddp() -> None:
    for r in (res["partial"] for res in results()):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        assert max(r["errors"]) < 1e-5


def test_every_model_trains_like_ddp_when_batch_sizes_differ_per_rank_every_step() -> None:
    for rank, result in enumerate(slow_tier_results()):
        assert result["varying"].keys() == CASES.keys()
        for name, error in result["varying"].items():
            assert error <= 1e-5, (rank, name, error)


def test_broadcast_buffers_trains_and_evaluates_like_ddp() -> None:
    ranks = [r["buffers"] for r in results()]
    for r in ranks:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        for ours, theirs in zip(r["evals"], r["ref_evals"]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert r["state"].keys() == r["ref_state"].keys()
        for k, v in r["ref_state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    # Rank 0's statistics everywhere at eval time: the same outputs for the same input.
    torch.testing.assert_close(ranks[0]["evals"][0], ranks[1]["evals"][0])
    for r in ranks:  # the report counts what each step's forward receives from rank 0
        assert r["comm"]["broadcast"] == r["buffer_bytes"] > 0


def test_one_rank_in_eval_mode_raises_on_every_rank_naming_each_step() -> None:
    for msg in (r["eval"] for r in results()):
        assert "rank 0: forward of a train step, grad on, inputs float32[4, 12]" in msg, msg
        assert "rank 1: forward of a eval/inference step, grad off" in msg, msg
        assert "rank 0: forward: all_gather" in msg and "rank 1: inference: all_gather" in msg


def test_steady_steps_are_checked_on_the_device_and_a_changed_step_still_raises_on_every_rank() -> None:
    r0, r1 = (r["on_device"] for r in results())
    # A step's first phases are checked on the host; from the second step on (the fingerprints
    # sent two exchanges before) the host goes on and reads the result at a later phase.
    for r in (r0, r1):
        assert r["outstanding"] == [0, 1, 1], r
    assert r0["losses"] == r1["losses"]
    # Rank 1's step changed: it checks on the host, sees rank 0 went on, and raises at once,
    # saying what it ran.
    assert r1["unusable"] and "Rank 0 ran the step it had run before" in r1["error"], r1
    assert "rank 1 would run this rank's step, rank 0 another" in r1["error"], r1
    assert "This rank's step: forward of a eval/inference step, grad off" in r1["error"], r1
    # Rank 0 went on into its forward, whose gather never completes; it raises the mismatch,
    # not a timeout, when that gather fails.
    assert r0["unusable"] and "rank 0 would run this rank's step, rank 1 another" in r0["error"], r0
    assert r0["seconds"] < TIMEOUT + 5, r0


def test_a_skipped_backward_raises_on_every_rank() -> None:
    for msg in (r["skip"] for r in results()):
        # A backward runs with grad mode off; its step is still a grad-on training step.
        assert "rank 0: backward of a train step, grad on" in msg, msg
        assert "rank 1: forward of a train step, grad on" in msg, msg


@pytest.mark.release("no_python_context")
def test_collectives_of_the_compiled_graphs_hold_no_python_context() -> None:
    # torch stashes a contextvars.Context in the thread-local state of every backward, and a
    # gloo collective copies that state into its Work. A gloo worker that then drops the last
    # Work after the interpreter began finalizing died in std::terminate at exit ("terminate
    # called without an active exception"). The compiled graphs run without it.
    for seen in (r["no_python_context"] for r in results()):  # ranks that exit through teardown
        assert len(seen) == 4 and not any(seen), seen  # forward and backward, two steps


# -- timeouts: each case breaks its process group, so it gets its own ranks ----------------------

TIMEOUT = 4.0


def _validation_on_rank0_only(rank: int, world_size: int) -> dict[str, Any]:
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear), timeout=TIMEOUT)
    sharded(torch.randn(4, 12)).sum().backward()  # one good step
    start = time.monotonic()
    try:
        if rank == 0:
            sharded.eval()
            with torch.no_grad():
                sharded(torch.randn(4, 12))
        else:
            dist.barrier()  # waits for rank 0, which never arrives
    except (FxShardError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"error": "no error", "seconds": time.monotonic() - start}


def test_validation_on_one_rank_ends_every_rank_within_the_timeout() -> None:
    start = time.monotonic()
    r0, r1 = run_ranks(_validation_on_rank0_only, 2)
    assert r0["error"].startswith("FxShardError: rank 0: the other ranks did not reach the forward"), r0
    assert TIMEOUT <= r0["seconds"] < TIMEOUT + 10
    # Rank 0's process then exits, which ends rank 1's barrier (gloo: connection closed).
    assert r1["error"].startswith("RuntimeError") and r1["seconds"] < TIMEOUT + 20, r1
    assert time.monotonic() - start < 90  # both processes ended: nothing hangs at exit


@torch.library.custom_op("fxshard_test::stall", mutates_args=())
def stall(x: torch.Tensor, rank: int) -> torch.Tensor:
    if dist.get_rank() == rank:
        time.sleep(3 * TIMEOUT)
    return x.clone()


@stall.register_fake
def _(x: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.empty_like(x)


stall.register_autograd(lambda ctx, grad: (grad, None))


class Stalls(nn.Module):
    """Rank 1 stalls between two units, inside the compiled forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.ops.fxshard_test.stall(self.a(x), 1))


def _peer_stalls_inside_a_step(rank: int, world_size: int) -> dict[str, Any]:
    sharded = fxshard.compile(Stalls(), policy=by_class(nn.Linear), timeout=TIMEOUT,
                              forward_prefetch=False)
    start = time.monotonic()
    try:
        sharded(torch.randn(2, 4)).sum().backward()
    except (FxShardError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"error": "no error", "seconds": time.monotonic() - start}


def test_a_peer_stalled_inside_a_step_gives_a_clear_error_within_the_timeout() -> None:
    r0, _ = run_ranks(_peer_stalls_inside_a_step, 2)
    assert r0["error"].startswith("FxShardError: rank 0: a collective of the forward"), r0
    assert "peer is gone or stalled" in r0["error"]
    assert r0["error"].count("a collective of the") == 1, r0  # said once, not wrapped twice
    assert r0["seconds"] < 3 * TIMEOUT


@torch.library.custom_op("fxshard_test::fail_on", mutates_args=())
def fail_on(x: torch.Tensor, rank: int) -> torch.Tensor:
    if dist.get_rank() == rank and getattr(fail_on, "armed", False):
        raise ValueError("a failure on this rank only")
    return x.clone()


@fail_on.register_fake
def _(x: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.empty_like(x)


fail_on.register_autograd(lambda ctx, grad: (grad, None))


class FailsBetweenUnits(nn.Module):
    """Rank 0 raises between two units of the compiled forward, once ``fail_on.armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.ops.fxshard_test.fail_on(self.a(x), 0)))


def _catch_a_failure_and_go_on(rank: int, world_size: int) -> list[str]:
    sharded = fxshard.compile(FailsBetweenUnits(), policy=by_class(nn.Linear), timeout=TIMEOUT)
    sharded(torch.randn(2, 32)).sum().backward()  # one good step
    fail_on.armed = True  # type: ignore[attr-defined]
    seen = []
    for _ in range(3):  # the loop a user writes who catches everything and goes on
        start = time.monotonic()
        try:
            sharded(torch.randn(2, 32)).sum().backward()
            seen.append("ok")
        except Exception as e:
            seen.append(f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}")
        fail_on.armed = False  # type: ignore[attr-defined]
    return seen


@pytest.mark.release  # runtime.settle: a failed gloo collective quiesced
def test_a_rank_that_catches_a_failed_step_and_goes_on_gets_errors_not_a_native_abort() -> None:
    # Rank 0's prefetched gathers are in flight when it raises; its next step's collectives
    # would pair with rank 1's still-waiting ones (gloo::EnforceNotMet: SIGABRT) unless
    # the driver refuses every step after an abandoned one.
    r0, r1 = run_ranks(_catch_a_failure_and_go_on, 2)  # a native abort raises here
    assert r0[0].startswith("ValueError") and "a failure on this rank only" in r0[0], r0
    for later in r0[1:] + r1[1:]:
        assert later.startswith("FxShardError") and "no step can run after an earlier one was " \
            "abandoned" in later, (r0, r1)
    assert "ValueError: a failure on this rank only" in r0[1]  # names the cause
    assert r1[0].startswith("FxShardError") and "a collective of the forward graph failed" in r1[0], r1
    assert float(r1[0].split(" after ")[1].split("s:")[0]) < TIMEOUT + 5


def _peer_left_before_the_step(rank: int, world_size: int) -> dict[str, Any]:
    sharded = fxshard.compile(MLP(), policy=by_class(nn.Linear))  # the group's 30-minute timeout
    if rank == 1:
        return {}  # this process ends: its connections close
    start = time.monotonic()
    try:
        sharded(torch.randn(4, 12))
    except FxShardError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": "no error"}


def test_a_peer_that_died_is_reported_at_once_without_claiming_a_timeout() -> None:
    r0, _ = run_ranks(_peer_left_before_the_step, 2)
    assert r0["seconds"] < 60, r0
    assert "did not reach the forward of this step (the wait failed after" in r0["error"], r0
    assert "1800s" not in r0["error"], r0
