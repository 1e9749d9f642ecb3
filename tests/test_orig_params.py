"""use_orig_params=True: optimizer groups chosen per parameter train as DDP with the same groups.

The recipe's two groups (weight decay for matrices, none for biases and norm weights, chosen
by name) and a learning rate per group, 2 gloo ranks against DDP. Under DDP each parameter is
its own tensor; under fxshard each is a view of the flat shard, stepped by the same elementwise
AdamW: the parameters agree to rel 1e-5 (docs/devices.md, "Numerics").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxshard
from fxshard.policies import by_class
from tests.dist_utils import run_ranks
from tests.models import Block, TinyGPT


def _groups(named: Any) -> list[dict[str, Any]]:
    """HF's rule by name: no decay for biases and LayerNorm weights; a second learning rate."""
    decay, plain = [], []
    for name, p in named:
        (plain if name.endswith("bias") or ".ln" in name or name.startswith("ln") else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1, "lr": 1e-2},
            {"params": plain, "weight_decay": 0.0, "lr": 3e-3}]


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, 61, (2, 16), generator=gen), torch.randint(0, 61, (2, 16), generator=gen))
            for _ in range(steps)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, 61), y.reshape(-1))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any, accumulate: int,
           no_sync: Any, clip: Any) -> list[float]:
    """Steps of ``accumulate`` micro-batches each: no_sync for all but the last, then clip."""
    losses = []
    for i in range(0, len(batches), accumulate):
        optimizer.zero_grad()
        for k, (x, y) in enumerate(batches[i:i + accumulate]):
            last = k == accumulate - 1
            with no_sync() if not last else _nothing():
                loss = _loss(model, x, y) / accumulate
                loss.backward()
            losses.append(float(loss))
        clip()
        optimizer.step()
    return losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _groups_against_ddp(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = TinyGPT()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(reference)
    sharded = fxshard.compile(model, policy=by_class(Block), use_orig_params=True)
    names = [n for n, _ in sharded.named_parameters()]
    shapes = {n: tuple(p.full_shape) for n, p in sharded.named_parameters()}
    opt = torch.optim.AdamW(_groups(sharded.named_parameters()))
    ddp_opt = torch.optim.AdamW(_groups(ddp.module.named_parameters()))
    batches = _batches(rank, 8)
    losses = _train(sharded, opt, batches, 2, sharded.no_sync,
                    lambda: sharded.clip_grad_norm_(0.5))
    ddp_losses = _train(ddp, ddp_opt, batches, 2, ddp.no_sync,
                        lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5))
    full = sharded.full_state_dict()
    optim = fxshard.get_optimizer_state_dict(sharded, opt,
                                             options=fxshard.checkpoint.StateDictOptions(full_state_dict=True))
    return {"names": names, "ddp_names": [n for n, _ in ddp.module.named_parameters()],
            "shapes": shapes, "losses": losses, "ddp_losses": ddp_losses,
            "params": {k: v for k, v in full.items()},
            "ddp_params": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()},
            "optim": optim, "ddp_optim": ddp_opt.state_dict()}


@pytest.fixture(scope="module")
def groups_results() -> list[dict[str, Any]]:
    return run_ranks(_groups_against_ddp, 2)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-12)).item())


def test_named_parameters_are_the_original_names_and_shapes(groups_results: list[dict[str, Any]]) -> None:
    for r in groups_results:
        assert r["names"] == r["ddp_names"]
        assert r["shapes"]["blocks.0.mlp.0.weight"] == (128, 32)
        assert r["shapes"]["blocks.0.ln1.bias"] == (32,)


def test_groups_by_name_with_weight_decay_and_two_learning_rates_train_like_ddp(
        groups_results: list[dict[str, Any]]) -> None:
    for r in groups_results:
        for a, b in zip(r["losses"], r["ddp_losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        assert r["params"].keys() == r["ddp_params"].keys()
        for name, value in r["ddp_params"].items():
            assert _close(r["params"][name], value), name


def test_the_optimizer_state_of_the_views_is_named_and_whole_like_ddps(
        groups_results: list[dict[str, Any]]) -> None:
    r = groups_results[0]
    names = r["ddp_names"]
    ddp_state = r["ddp_optim"]["state"]
    assert [g["lr"] for g in r["optim"]["param_groups"]] == [1e-2, 3e-3]
    assert sorted(n for g in r["optim"]["param_groups"] for n in g["params"]) == sorted(names)
    order = [n for g in _groups((n, n) for n in names) for n in g["params"]]  # DDP's state: by position
    for i, name in enumerate(order):
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(r["optim"]["state"][name][key], ddp_state[i][key]), (name, key)
        assert float(r["optim"]["state"][name]["step"]) == float(ddp_state[i]["step"])


def _dim_rule(named: Any, dim: Any) -> list[dict[str, Any]]:
    """nanoGPT's rule: weight decay for every parameter of 2 or more dimensions."""
    params = [p for _, p in named]
    return [{"params": [p for p in params if dim(p) >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if dim(p) < 2], "weight_decay": 0.0}]


def _step_error(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    x, y = _batches(0, 1)[0]
    _loss(model, x, y).backward()
    try:
        optimizer.step()
    except fxshard.FxShardError as e:
        return str(e)
    finally:
        optimizer.zero_grad()
    return None


def _refusals_and_checkpoint(rank: int, world_size: int, path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    flat = fxshard.compile(TinyGPT(), policy=by_class(Block))
    before = [s.detach().clone() for s in flat.parameters()]
    errors = {"dim, flat shards": _step_error(flat, torch.optim.AdamW(_dim_rule(flat.named_parameters(),
                                                                                 lambda p: p.dim()))),
              "name, flat shards": _step_error(flat, torch.optim.AdamW(_groups(flat.named_parameters())))}
    unchanged = all(torch.equal(a, b) for a, b in zip(before, flat.parameters()))

    torch.manual_seed(0)
    sharded = fxshard.compile(TinyGPT(), policy=by_class(Block), use_orig_params=True)
    errors["dim, views"] = _step_error(sharded, torch.optim.AdamW(_dim_rule(sharded.named_parameters(),
                                                                            lambda p: p.dim())))
    errors["views and shards"] = _step_error(sharded, torch.optim.AdamW(
        [*sharded.parameters(), *sharded.flat_params]))
    by_shape = _dim_rule(sharded.named_parameters(), lambda p: len(p.full_shape))
    names = {id(p): n for n, p in sharded.named_parameters()}
    reference = TinyGPT()
    ddp_groups = _dim_rule(reference.named_parameters(), lambda p: p.dim())
    ref_names = {id(p): n for n, p in reference.named_parameters()}

    # A checkpoint of the views' optimizer, loaded into a fresh model and optimizer: both go on alike.
    opt = torch.optim.AdamW(_groups(sharded.named_parameters()))
    batches = _batches(rank, 4)
    _train(sharded, opt, batches[:2], 1, sharded.no_sync, lambda: None)
    fxshard.checkpoint.save(path, sharded, opt)
    torch.manual_seed(1)
    fresh = fxshard.compile(TinyGPT(), policy=by_class(Block), use_orig_params=True)
    fresh_opt = torch.optim.AdamW(_groups(fresh.named_parameters()))
    fxshard.checkpoint.load(path, fresh, fresh_opt)
    _train(sharded, opt, batches[2:], 1, sharded.no_sync, lambda: None)
    _train(fresh, fresh_opt, batches[2:], 1, fresh.no_sync, lambda: None)
    return {"errors": errors, "unchanged": unchanged,
            "by_shape": [[names[id(p)] for p in g["params"]] for g in by_shape],
            "ddp_by_dim": [[ref_names[id(p)] for p in g["params"]] for g in ddp_groups],
            "resumed": fresh.full_state_dict(), "continued": sharded.full_state_dict()}


@pytest.fixture(scope="module")
def refusal_results(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return run_ranks(_refusals_and_checkpoint, 2, str(tmp_path_factory.mktemp("ckpt") / "step"))


@pytest.mark.slow  # the fast tier keeps the DDP parity above
def test_groups_by_p_dim_are_refused_before_the_first_step_naming_the_way(
        refusal_results: list[dict[str, Any]]) -> None:
    for r in refusal_results:
        assert "use_orig_params=True" in r["errors"]["dim, flat shards"]
        assert "use_orig_params=True" in r["errors"]["name, flat shards"]
        assert "len(p.full_shape) >= 2" in r["errors"]["dim, views"]
        assert "stepped twice" in r["errors"]["views and shards"]
        assert r["unchanged"]  # refused before anything changed


@pytest.mark.slow  # the fast tier keeps the DDP parity above
def test_groups_by_full_shape_are_nanogpts_groups(refusal_results: list[dict[str, Any]]) -> None:
    for r in refusal_results:
        assert r["by_shape"] == r["ddp_by_dim"]


@pytest.mark.slow  # the fast tier keeps the DDP parity above
def test_a_checkpoint_of_grouped_views_resumes_where_the_run_goes_on(
        refusal_results: list[dict[str, Any]]) -> None:
    for r in refusal_results:
        assert r["resumed"].keys() == r["continued"].keys()
        for name, value in r["continued"].items():
            assert torch.equal(r["resumed"][name], value), name


def _silent_habits(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    flat = fxshard.compile(TinyGPT(), policy=by_class(Block))
    before = [s.detach().clone() for s in flat.parameters()]
    x, y = _batches(0, 1)[0]

    def lbfgs_error() -> str | None:
        opt = torch.optim.LBFGS(flat.parameters(), max_iter=2)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(flat, x, y)
            loss.backward()
            return loss
        try:
            opt.step(closure)
        except fxshard.FxShardError as e:
            return str(e)
        return None

    errors = {"adafactor": _step_error(flat, torch.optim.Adafactor(flat.parameters(), lr=1e-2)),
              "lbfgs": lbfgs_error()}
    unchanged = all(torch.equal(a, b) for a, b in zip(before, flat.parameters()))
    ok = _step_error(flat, torch.optim.AdamW(flat.parameters(), lr=1e-2))
    return {"errors": errors, "unchanged": unchanged, "elementwise": ok}


def test_optimizers_that_read_more_than_each_element_are_refused_over_flat_shards() -> None:
    """Adafactor and LBFGS read a parameter's rows, columns and norm, or every parameter at
    once; on a flat shard they trained something else, with no error. Each is refused before
    any step changes a weight; an element-wise optimizer steps."""
    [r] = run_ranks(_silent_habits, 1)
    assert "Adafactor is not element-wise" in r["errors"]["adafactor"]
    assert "LBFGS is not element-wise" in r["errors"]["lbfgs"]
    assert r["unchanged"]
    assert r["elementwise"] is None


@pytest.mark.parametrize("option", ["use_orig_params", "broadcast_buffers", "sync_module_states", "verify_passes"])
def test_a_string_for_a_true_or_false_option_is_refused(option: str) -> None:
    """bool("False") is True: a setting read from a config file as text turned the option on."""
    from fxshard.ir.config import CompileConfig

    with pytest.raises(TypeError, match=f"{option} takes True or False, got 'False'"):
        CompileConfig.build("compile", policy=by_class(Block), **{option: "False"})


def _layer_wise(named: Any) -> list[dict[str, Any]]:
    """A learning rate for the final norm of its own, chosen by name."""
    params = list(named)
    return [{"params": [p for n, p in params if n.startswith("ln_f")], "lr": 1e-2},
            {"params": [p for n, p in params if not n.startswith("ln_f")], "lr": 1e-3}]


def test_groups_by_name_over_flat_shards_that_differ_in_lr_are_refused_and_all_empty_groups_too() -> None:
    """Over flat shards (named flat_params.N) the rule finds no ln_f: its group is empty and
    the norm would step at the other group's learning rate. Over the views the same rule finds
    it, and steps. An optimizer whose groups are all empty would step nothing."""
    torch.manual_seed(0)
    flat = fxshard.compile(TinyGPT(), policy=by_class(Block))
    before = [s.detach().clone() for s in flat.parameters()]
    error = _step_error(flat, torch.optim.AdamW(_layer_wise(flat.named_parameters())))
    assert error is not None and "param_groups differ in lr, and group 0 of 2 is empty" in error, error
    assert "use_orig_params=True" in error
    assert all(torch.equal(a, b) for a, b in zip(before, flat.parameters(), strict=True))

    torch.manual_seed(0)
    views = fxshard.compile(TinyGPT(), policy=by_class(Block), use_orig_params=True)
    groups = _layer_wise(views.named_parameters())
    assert [len(g["params"]) for g in groups][0] == 2  # ln_f's weight and bias
    assert _step_error(views, torch.optim.AdamW(groups)) is None

    for empty in ([{"params": []}], [{"params": [], "lr": 1e-2}, {"params": []}]):
        error = _step_error(flat, torch.optim.AdamW(empty))
        assert error is not None and f"has {len(empty)} param_groups and no parameter in any" in error, error
