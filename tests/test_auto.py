"""policy=auto(): toys whose best plan is known by construction, predicted on a named profile.

The toys are in the slow tier (each explain emits every candidate's variants); the refusals are fast.

Every prediction here comes from the cost model on the fixed numbers of the "h100-nvlink" /
"h100-ib" profiles (fxshard.ir.cost.PROFILES), so the choices are deterministic.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.ir.auto import TIE, Trial, fastest
from fxshard.policies import auto, by_class
from tests.dist_utils import run_ranks

MIB = 1 << 20


def _tiny_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(16)])


class Huge(nn.Module):
    """Small layers, then one layer holding nearly all the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)])
        self.huge = nn.Linear(256, 16384)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.huge(self.small(x))


@cache
def _explain(model: str, **options: Any) -> fxshard.Explanation:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model == "tiny":
            return fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto(),
                                   hardware="h100-nvlink", **options)
        return fxshard.explain(Huge(), torch.randn(256, 256), world_size=8, policy=auto(),
                               hardware="h100-ib", **options)


def _trials(e: fxshard.Explanation) -> tuple[Trial, ...]:
    assert e.report.auto is not None
    return e.report.auto.trials


class _Tied(nn.Module):
    """What regrouping must carry: an embedding tied to the head, sizes that pad, a frozen
    block and a frozen norm (groups without gradients), a module the step never reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(101, 24)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 72), nn.ReLU(), nn.Linear(72, 24)) for _ in range(3))
        self.head = nn.Linear(24, 101, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(5, 5)
        self.blocks[1].requires_grad_(False)
        self.blocks[2][0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


@pytest.mark.slow  # one explain per candidate and schedule: seconds
def test_each_candidate_is_predicted_from_the_one_trace_as_from_its_own() -> None:
    """auto() traces the model once, under the finest units, and rewrites that joint graph to
    each candidate's groups (fxshard.passes.regroup). Each trial's prediction must be the one
    the candidate's own trace gives: explain with that policy and schedule, to the byte, and
    its step time the same simulation's."""
    from fxshard.ir import predicates as P
    from fxshard.ir.auto import candidates
    from fxshard.ir.plan import make_plan

    x = torch.randint(0, 101, (4, 16))
    precision = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    common: dict[str, Any] = dict(world_size=4, hardware="h100-ib", mixed_precision=precision,
                                  replicate_below=30)

    def unit_bytes(policy: Any) -> list[int]:
        plan = make_plan(_Tied(), policy, 4)
        return [sum(plan.groups[g].padded_numel * plan.groups[g].dtype.itemsize for g in u.groups)
                for u in plan.units if u.name]

    plans = {c.label: c for c in candidates(_Tied(), None, unit_bytes)}
    schedules = {"resharded after forward, 1 gather in flight": dict(reshard_after_forward=True, max_inflight_gathers=1),
                 "kept gathered to backward, 2 gathers in flight": dict(reshard_after_forward=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trials = _trials(fxshard.explain(_Tied(), x, policy=auto(), **common))
        compared = 0
        for trial in trials:
            if trial.schedule not in schedules:
                continue
            candidate = plans[trial.plan]
            options = dict(schedules[trial.schedule], bucket_bytes=candidate.bucket_bytes)
            own = fxshard.explain(_Tied(), x, policy=candidate.policy, **common, **options)
            issued = sum(1 for gm in own.graphs.values() for node in gm.graph.nodes
                         if P.is_all_gather(node) or P.is_reduce_scatter(node) or P.is_all_reduce(node))
            assert (trial.peak, trial.units, trial.collectives) == \
                (own.report.predicted_peak_bytes, len(own.plan.units), issued), trial.plan
            # A trial's seconds are whole nanoseconds (taken the largest over the ranks as integers).
            assert trial.seconds == pytest.approx(own.report.predicted_step_seconds, abs=0.5e-9), trial.plan
            compared += 1
    assert compared == 2 * len({t.plan for t in trials}) >= 2 * 6


@pytest.mark.slow  # explain: seconds
def test_auto_traces_the_model_once_for_every_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """One trace for all the candidates (under the finest units), one for the plan chosen:
    AOTAutograd's capture is the cost that grows with the model (about 50 s for Llama-3-70B).
    (A stack of 16 blocks is predicted from a few of them by default: the whole graph's path
    is the one asked for here.)"""
    import fxshard.driver.compile.compiler as compiler

    traced = []
    trace_step = compiler.trace_step

    def counting(step: Any, *args: Any, **kwargs: Any) -> Any:
        traced.append(step)
        return trace_step(step, *args, **kwargs)

    monkeypatch.setattr(compiler, "trace_step", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto(extrapolate=False),
                            hardware="h100-nvlink")
    assert e.report.auto is not None and len({t.plan for t in e.report.auto.trials}) >= 5
    assert len(traced) == 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Deep(nn.Module):
    """A stack of 16 identical blocks between an embedding and a head: auto() predicts it from
    its first 3, 4 and 5 blocks. ``by_count``: the forward indexes the blocks by a count of
    its own, so the model cut to a few blocks does not run."""

    def __init__(self, by_count: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList(_Block() for _ in range(16))
        self.head = nn.Linear(64, 100)
        self.count = 16 if by_count else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        blocks = [self.blocks[i] for i in range(self.count)] if self.count else self.blocks
        for block in blocks:
            h = block(h)
        return self.head(h)


_DEEP_INPUT = torch.randint(0, 100, (8, 128))


@pytest.mark.slow  # two explains that emit every candidate's variants: seconds
def test_a_deep_stack_is_predicted_from_a_few_blocks_as_from_the_whole_graph() -> None:
    """Each trial scaled from the first 3, 4 and 5 blocks predicts what the whole model's graph
    predicts (auto(extrapolate=False)): the same peak to the byte, units and collectives,
    and the step time within the rounding of the samples (each a whole nanosecond, the
    step per block multiplied by the 11 blocks not sampled)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampled = fxshard.explain(_Deep(), _DEEP_INPUT, world_size=8, policy=auto(extrapolate=True),
                                  hardware="h100-nvlink")
        whole = fxshard.explain(_Deep(), _DEEP_INPUT, world_size=8, policy=auto(extrapolate=False),
                                hardware="h100-nvlink")
        # By default a graph this small (about 500 nodes) is predicted whole: its budget
        # ladder weighs what scaling does not.
        default = fxshard.explain(_Deep(), _DEEP_INPUT, world_size=8, policy=auto(), hardware="h100-nvlink")
    assert _trials(default) == _trials(whole)
    exact = {(t.plan, t.schedule): t for t in _trials(whole)}
    scaled = [t for t in _trials(sampled) if t.scaled]
    assert {t.plan for t in scaled} >= {"by_class(Linear)", "by_class(_Block)"}
    assert not any(t.scaled for t in _trials(whole))
    for t in scaled:
        own = exact[t.plan, t.schedule]
        assert (t.peak, t.units, t.collectives, t.fits) == (own.peak, own.units, own.collectives, own.fits), t
        assert t.seconds == pytest.approx(own.seconds, abs=(2 * 11 + 1) * 1e-9), t
        assert t.exposed_seconds == pytest.approx(own.exposed_seconds, abs=(2 * 11 + 1) * 1e-9), t
    # The rest (buckets that do not repeat with the blocks, a peak not yet affine) are the
    # whole graph's own.
    for t in _trials(sampled):
        if not t.scaled:
            assert t == exact[t.plan, t.schedule]
    assert sampled.report.auto is not None and whole.report.auto is not None
    assert (sampled.report.auto.chosen.plan, sampled.report.auto.chosen.schedule) == \
        (whole.report.auto.chosen.plan, whole.report.auto.chosen.schedule)
    assert "~: predicted from the first 3, 4 and 5 of the 16 blocks of blocks" in str(sampled.report)


@pytest.mark.slow  # explain: seconds
def test_a_deep_stack_is_traced_whole_only_for_the_plans_that_do_not_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidates are traced on the model cut to 3, 4 and 5 blocks; the whole model once
    more only for those that do not scale (here its buckets of 4 and 16 blocks, which do not
    repeat block by block). The model is unchanged."""
    import fxshard.driver.compile.plan_auto as plan_auto

    depths = []
    trace_finest = plan_auto._trace_finest

    def counting(driver: Any, module: nn.Module, *args: Any) -> Any:
        depths.append(len(module.blocks))  # type: ignore[arg-type]
        return trace_finest(driver, module, *args)

    monkeypatch.setattr(plan_auto, "_trace_finest", counting)
    model = _Deep()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(model, _DEEP_INPUT, world_size=8, policy=auto(units=by_class(_Block), extrapolate=True),
                            hardware="h100-nvlink")
    assert depths == [3, 4, 5, 16]
    assert e.report.auto is not None
    assert len(model.blocks) == 16 and len(e.plan.units) == e.report.auto.chosen.units
    assert {t.plan for t in e.report.auto.trials if t.scaled} == {"by_class(_Block)"}
    assert {t.plan for t in e.report.auto.trials if not t.scaled} == {
        "by_class(_Block), buckets of 4 units", "by_class(_Block), buckets of 16 units"}


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_under_a_budget_a_deep_stack_recomputes_every_block_as_explain_predicts() -> None:
    """Where some variant is over the budget, the scaled plans are also tried recomputing every
    region: each predicts what explain predicts with that activation_checkpointing."""
    x = _DEEP_INPUT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(_Deep(), x, world_size=8, policy=auto(units=by_class(_Block), extrapolate=True), hardware="h100-nvlink",
                            activation_checkpointing=by_class(_Block), memory_budget=43 * MIB)
        recomputing = [t for t in _trials(e) if t.scaled and t.schedule.endswith("by_class(_Block) recomputed")]
        assert {t.schedule for t in recomputing} == {
            "resharded after forward, 2 gathers in flight, by_class(_Block) recomputed",
            "resharded after forward, 1 gather in flight, by_class(_Block) recomputed"}
        for t in recomputing:
            own = fxshard.explain(_Deep(), x, world_size=8, policy=by_class(_Block), hardware="h100-nvlink",
                                  activation_checkpointing=by_class(_Block), reshard_after_forward=True,
                                  max_inflight_gathers=1 if "1 gather" in t.schedule else 2)
            assert t.peak == own.report.predicted_peak_bytes < 43 * MIB
            assert t.seconds == pytest.approx(own.report.predicted_step_seconds, abs=(2 * 11 + 1) * 1e-9)
    assert any(not t.fits for t in _trials(e)) and e.report.auto is not None and e.report.auto.chosen.fits


@pytest.mark.slow  # two explains that emit every candidate's variants: seconds
def test_a_stack_the_forward_cannot_run_cut_is_predicted_whole_and_says_so() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(_Deep(by_count=True), _DEEP_INPUT, world_size=8, policy=auto(units=by_class(_Block), extrapolate=True),
                            hardware="h100-nvlink")
    assert e.report.auto is not None and not any(t.scaled for t in e.report.auto.trials)
    assert "predicted from the whole graph: the model cut to its first 3 blocks of blocks does not trace " \
           "(IndexError" in e.report.auto.table()


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_a_scaled_choice_over_the_budget_by_the_whole_graph_is_a_budget_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scaling trusts the samples' peak to grow by the same step past them. Where the whole
    graph, traced for the plan chosen, predicts more than the budget, the compile stops and
    names the way out, rather than run a plan that does not fit (here the scaling is made to
    halve every peak, and the plans that would be predicted from the whole graph are not tried)."""
    import fxshard.driver.compile.plan_auto as plan_auto

    scale = plan_auto.scaled

    def halved(samples: Any, depths: Any, blocks: int, budget: int | None) -> Trial | None:
        whole = scale(samples, depths, blocks, budget)
        return None if whole is None else replace(whole, peak=whole.peak // 2,
                                                  fits=budget is None or whole.peak // 2 <= budget)

    monkeypatch.setattr(plan_auto, "scaled", halved)
    # The plans that do not scale (its buckets) are not tried: a plan scaled is chosen.
    monkeypatch.setattr(plan_auto, "_whole", lambda *args: ([], None))
    with warnings.catch_warnings(), pytest.raises(fxshard.BudgetError, match=r"auto\(extrapolate=False\)"):
        warnings.simplefilter("ignore")
        fxshard.explain(_Deep(), _DEEP_INPUT, world_size=8, policy=auto(units=by_class(_Block), extrapolate=True),
                        hardware="h100-nvlink", memory_budget=30 * MIB)


def test_scaled_trials_are_affine_in_the_blocks_or_none() -> None:
    """Hand-made samples: a figure that grows by one step per block scales exactly; one that
    does not (a peak that moves) is no prediction."""
    from fxshard.ir.auto import scaled

    def at(k: int, peak: int) -> Trial:
        return Trial("p", "s", 0.001 + k * 0.002, 0.0005, peak, 2 + k, True, 3 * k + 1)

    whole = scaled([at(2, 1000 + 2 * 64), at(3, 1000 + 3 * 64), at(4, 1000 + 4 * 64)], (2, 3, 4), 80, budget=7000)
    assert whole is not None and whole.scaled
    assert (whole.units, whole.collectives, whole.peak) == (82, 241, 1000 + 80 * 64)
    assert whole.seconds == pytest.approx(0.161, abs=1e-9) and whole.fits
    assert scaled([at(2, 1000), at(3, 1000), at(4, 1000)], (2, 3, 4), 80, budget=999) is not None
    assert not scaled([at(2, 1000), at(3, 1000), at(4, 1000)], (2, 3, 4), 80, budget=999).fits  # type: ignore[union-attr]
    assert scaled([at(2, 1000), at(3, 1100), at(4, 1150)], (2, 3, 4), 80, budget=None) is None


def test_a_stack_is_the_largest_container_of_identical_blocks() -> None:
    from fxshard.ir.auto import Stack, cut_matches, find_stack

    assert find_stack(_Deep()) == Stack("blocks", 16)
    assert find_stack(_Deep(), min_blocks=17) is None
    assert find_stack(_tiny_layers()) == Stack("", 16)
    odd = _Deep()
    odd.blocks[3].up = nn.Linear(64, 256, bias=False)  # one block unlike the others: no stack
    assert find_stack(odd) is None

    # Units of a stack of 8 blocks, each of an "a" and an "f" part: Llama-3-70B's buckets of
    # 16 Linear units put a block and the next one's attention together, then each block's
    # feed-forward with the next one's attention, the last block's feed-forward with the head.
    stack = Stack("blocks", 8)

    def buckets(n: int) -> list[str]:
        return ["emb", "blocks.0.a+blocks.0.f+blocks.1.a"] + \
            [f"blocks.{i}.f+blocks.{i + 1}.a" for i in range(1, n - 1)] + [f"blocks.{n - 1}.f+head", ""]

    assert cut_matches(buckets(8), buckets(3), stack, 3) and cut_matches(buckets(8), buckets(5), stack, 5)
    per_block = ["emb"] + [f"blocks.{i}" for i in range(8)] + ["head"]
    assert cut_matches(per_block, per_block[:4] + ["head"], stack, 3)
    assert not cut_matches(per_block, per_block[:3] + ["head"], stack, 3)  # a block missing
    # Buckets of two blocks: the cut to 3 ends in half a bucket, the whole plan in a whole one.
    pairs = ["emb"] + [f"blocks.{i}+blocks.{i + 1}" for i in range(0, 8, 2)] + ["head"]
    assert not cut_matches(pairs, ["emb", "blocks.0+blocks.1", "blocks.2", "head"], stack, 3)
    # The stack claimed whole (a size rule): not the same plan cut.
    whole = ["emb", "+".join(f"blocks.{i}" for i in range(8)), "head"]
    assert not cut_matches(whole, ["emb", "blocks.0+blocks.1+blocks.2", "head"], stack, 3)


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_many_tiny_layers_are_bucketed() -> None:
    """16 layers of 32x32: a collective's latency dwarfs its bytes, so fewer, larger collectives
    win: the chosen plan has far fewer units than layers, and beats one unit per layer."""
    e = _explain("tiny")
    assert e.report.auto is not None
    chosen = e.report.auto.chosen
    per_layer = [t for t in _trials(e) if t.units == 16]
    assert per_layer and chosen.units <= 4
    assert chosen.seconds < min(t.seconds for t in per_layer)
    assert len(e.plan.units) == chosen.units  # the plan compiled is the one chosen


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_one_huge_layer_is_its_own_unit() -> None:
    """One layer holds 91% of the parameters, after the small ones: in a unit of its own its
    gather overlaps their compute; in one unit with them, nothing overlaps it."""
    e = _explain("huge")
    assert "huge" in [u.name for u in e.plan.units]
    one_unit = [t for t in _trials(e) if t.units == 1]
    assert one_unit and e.report.auto is not None
    assert e.report.auto.chosen.seconds < min(t.seconds for t in one_unit)


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_under_a_tight_budget_auto_takes_the_fastest_plan_that_fits() -> None:
    free = _explain("tiny")
    assert free.report.auto is not None
    fastest = free.report.auto.chosen
    budget = fastest.peak - 1  # the unconstrained choice no longer fits
    e = _explain("tiny", memory_budget=budget)
    assert e.report.auto is not None
    chosen = e.report.auto.chosen
    assert chosen.peak <= budget and chosen.fits
    assert e.report.predicted_peak_bytes <= budget  # the compiled plan's own prediction agrees
    assert all(t.peak > budget for t in _trials(e) if t.seconds * (1 + TIE) < chosen.seconds)
    assert chosen.seconds >= fastest.seconds


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_without_a_memory_budget_auto_keeps_within_the_devices_memory() -> None:
    """A profile's device memory is the budget where none is given: on a device just too small
    for the unconstrained choice, auto() chooses as it does with that memory_budget given."""
    from fxshard.ir.cost import PROFILES

    free = _explain("tiny")
    assert free.report.auto is not None
    tight = free.report.auto.chosen.peak - 1
    profile = PROFILES["h100-nvlink"]
    assert profile.device.memory_bytes is not None and profile.device.memory_bytes > free.report.auto.chosen.peak
    small = replace(profile, device=replace(profile.device, memory_bytes=tight))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto(), hardware=small)
    assert e.report.auto is not None
    chosen = e.report.auto.chosen
    assert chosen.fits and chosen.peak <= tight and e.report.predicted_peak_bytes <= tight
    assert "within the device's memory" in e.report.auto.table()
    given = _explain("tiny", memory_budget=tight).report.auto
    assert given is not None and chosen == given.chosen


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_between_zero2_and_zero3_the_budget_ladder_reshards_only_the_first_units() -> None:
    """A budget just under the 4 buckets kept gathered: resharding all of them fits, and so
    does resharding fewer (the budget ladder's choice, tried though a variant fits), which
    re-gathers less in backward and is predicted faster."""
    free = _explain("tiny")
    kept = next(t for t in _trials(free) if t.plan == "by_class(Sequential), buckets of 4 units"
                and t.schedule == "kept gathered to backward, 2 gathers in flight")
    budget = kept.peak - 1
    e = _explain("tiny", memory_budget=budget)
    mine = [t for t in _trials(e) if t.plan == kept.plan]
    zero3 = next(t for t in mine if t.schedule == "resharded after forward, 2 gathers in flight")
    laddered = next(t for t in mine if t.schedule.startswith("memory budget: "))
    assert zero3.fits and laddered.fits and laddered.peak <= budget
    resharded = int(laddered.schedule.removeprefix("memory budget: ").split()[0])
    assert 0 < resharded < laddered.units
    assert laddered.seconds < zero3.seconds
    assert e.report.auto is not None and e.report.auto.chosen == laddered


@pytest.mark.slow  # explain emits every candidate's variants, twice: seconds
def test_a_budget_ladder_that_can_only_be_slower_than_a_plan_that_fits_stops_and_the_choice_stands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Just under the per-layer units kept gathered, their ladder would start slower (1.35 ms)
    than the buckets of 4 that fit (about 1.08): it does not start. Climbed to its end,
    as without the bound, it finds plans that fit but are slower, and auto() chooses the same."""
    from fxshard.driver.compile import plan_auto, plan_budget
    from fxshard.ir import budget as budget_search

    free = _explain("tiny")
    per_layer = next(t for t in _trials(free) if t.plan == "by_class(Sequential)"
                     and t.schedule == "kept gathered to backward, 2 gathers in flight")
    budget = per_layer.peak - 1
    stopped = _explain("tiny", memory_budget=budget).report.auto
    assert stopped is not None
    assert [line.split(":")[0] for line in stopped.outpaced] == ["by_class(Sequential)", "by_class(Linear)"]
    # Where the ladder would start: the per-layer units kept gathered, as predicted without a budget.
    assert all(f"before it starts, its fastest variant {per_layer.seconds * 1e3:.3f} ms" in line
               for line in stopped.outpaced)
    assert "budget ladders stopped where predicted slower than a plan that fits" in stopped.table()
    assert not any(t.plan == "by_class(Sequential)" and t.schedule.startswith("memory budget") for t in stopped.trials)

    climb = plan_auto._climb  # no other plan's time to beat, and the ladder never stops
    monkeypatch.setattr(plan_auto, "_climb", lambda sample, ladder, beat: climb(sample, ladder, None))
    monkeypatch.setattr(plan_budget, "search", lambda *args, outpaced_at=None, **kwargs:
                        budget_search.search(*args, **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        climbed = fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto(),
                                  hardware="h100-nvlink", memory_budget=budget).report.auto
    assert climbed is not None and not climbed.outpaced
    skipped = [t for t in climbed.trials if t.plan == "by_class(Sequential)" and t.schedule.startswith("memory budget")]
    assert skipped and all(t.fits and t.seconds > stopped.chosen.seconds * (1 + TIE) for t in skipped)
    assert climbed.chosen == stopped.chosen


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_a_budget_nothing_meets_is_a_budget_error() -> None:
    with pytest.raises(fxshard.BudgetError, match="cannot be met"):
        _explain("tiny", memory_budget=1024, optimizer=torch.optim.SGD)


def test_when_no_plan_fits_auto_raises_the_error_of_the_plan_that_came_closest() -> None:
    """Each candidate's budget ladder that fits nothing raises a BudgetError naming its lowest
    peak; auto() raises the one whose peak is lowest, whatever the order it tried them in. Every
    such message begins with the budget, so the peak is the error's own number, not its text's
    first."""
    from fxshard.driver.compile.plan_auto import closest
    from fxshard.ir.budget import MIB, Candidate, Prediction, search

    def failure(lowest_mib: int) -> fxshard.BudgetError:
        def evaluate(c: Candidate) -> Prediction:
            peak = (lowest_mib + 20 - 10 * len(c.resharded)) * MIB  # both units resharded: the lowest
            return Prediction(peak, "here", {"activations and temporaries": peak}, {})

        with pytest.raises(fxshard.BudgetError) as raised:
            search(MIB, evaluate, ["a", ""], [], 1, {})
        return raised.value

    far, near = failure(60), failure(40)
    assert (far.peak, near.peak) == (60 * MIB, 40 * MIB)
    assert "40.000 MiB" in str(near)
    assert closest([far, near]) is near and closest([near, far]) is near
    unpredicted = fxshard.BudgetError("memory_budget 1.000 MiB cannot be met: every plan has a unit that alone "
                                      "gathers more")
    assert unpredicted.peak is None and closest([unpredicted, far]) is far


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_report_and_explain_say_what_auto_chose_and_the_runners_up() -> None:
    text = str(_explain("tiny").report)
    assert "auto(): " in text and "predicted fastest" in text
    assert "by_class(Sequential), resharded after forward, 2 gathers in flight" in text  # a runner-up


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_pinned_units_choose_only_buckets_and_the_schedule() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8,
                            policy=auto(units=by_class(nn.Linear)), hardware="h100-nvlink")
    assert {t.plan.split(",")[0] for t in _trials(e)} == {"by_class(Linear)"}
    assert any("buckets" in t.plan for t in _trials(e))


def test_within_a_tie_the_fewer_collectives_win_then_the_lower_peak() -> None:
    """The deep MLP of benchmarks/auto.py: its last 15 units kept gathered (fewer gathers in
    backward), predicted 1% faster than all 48 resharded, measured about 9% faster. Within TIE
    the fewer collectives win, then the lower peak; beyond it, the faster."""
    kept = Trial("by_class(Linear)", "memory budget: 33 units resharded", 0.058029, 0.04, 25_669_712, 48, True,
                 48 + 33 + 48)
    resharded = Trial("by_class(Linear)", "resharded after forward", 0.058606, 0.04, 25_417_808, 48, True,
                      48 + 48 + 48)
    over = Trial("by_size(2 block)", "kept gathered", 0.04, 0.0, 43_380_000, 2, False, 4)
    assert fastest([resharded, kept, over]) == kept
    # The same collectives: the lower peak.
    alike = replace(kept, schedule="another", peak=kept.peak - 1)
    assert fastest([kept, alike, resharded]) == alike
    # Beyond the tie the faster wins, whatever it issues.
    assert resharded.seconds <= kept.seconds * (1 + TIE)  # a tie
    slower = replace(kept, seconds=resharded.seconds * (1 + 2 * TIE))
    assert fastest([slower, resharded, over]) == resharded
    assert fastest([over]) is None


def test_a_transformer_block_is_a_candidate_though_its_layers_outnumber_it() -> None:
    """A GPT's most frequent classes are its Linear and LayerNorm layers; its Block, FSDP2's
    unit, is tried too."""
    from fxshard.ir.auto import block_class, candidates
    from tests.models import Block, TinyGPT

    model = TinyGPT(vocab=64, dim=16, heads=2, layers=3, seq=8)
    assert block_class(model) is Block
    labels = [c.label for c in candidates(model, None, lambda policy: [1])]
    assert labels[:3] == ["by_class(Linear)", "by_class(LayerNorm)", "by_class(Block)"]
    # Where the most frequent class is the block (a stack of layers), it is not tried twice.
    assert [c.label for c in candidates(_tiny_layers(), None, lambda policy: [1])].count("by_class(Sequential)") == 1


def test_buckets_are_sized_by_the_typical_unit_not_a_small_head() -> None:
    """An MLP of 256-wide layers with a 10-wide head: buckets of 4 and 16 of its layers, where
    sizing by the smallest unit (the head) made buckets smaller than one layer (no bucket)."""
    from fxshard.ir.auto import candidates
    from tests.models import MLP

    layer, head = 256 * 257 * 4, 10 * 257 * 4
    sizes = [layer] * 7 + [head]
    buckets = [c for c in candidates(MLP(d_in=256, hidden=256, depth=8, d_out=10), None, lambda policy: sizes)
               if c.bucket_bytes]
    assert [(c.label, c.bucket_bytes) for c in buckets] == [
        ("by_class(Linear), buckets of 4 units", 4 * layer + 1), ("by_class(Linear), buckets of 16 units", 16 * layer + 1)]


def test_auto_without_example_inputs_or_rates_is_refused_naming_what_to_pass() -> None:
    with pytest.raises(fxshard.FxShardError, match="example_inputs="):
        fxshard.compile(_tiny_layers(), policy=auto())
    with pytest.raises(fxshard.FxShardError, match="hardware= one of h100-ib, h100-nvlink"):
        fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto())


def test_an_unknown_hardware_name_lists_the_known_ones() -> None:
    with pytest.raises(fxshard.FxShardError, match="known are h100-ib, h100-nvlink"):
        fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, hardware="x100")


def _compiled_auto(rank: int, world_size: int) -> dict[str, Any]:
    """auto() on 2 gloo ranks: every rank chooses the same plan, which trains like DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _tiny_layers()
    reference = DDP(_tiny_layers())
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 32, generator=gen) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = fxshard.compile(model, policy=auto(), example_inputs=batches[0])
    losses = []
    for net in (sharded, reference):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        mine = []
        for x in batches:
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mine.append(float(loss))
        losses.append(mine)
    report = sharded.report()
    assert report.auto is not None
    return {"chosen": report.auto.chosen.describe(), "losses": losses,
            "params": sharded.full_state_dict(), "ddp": reference.module.state_dict()}


@pytest.mark.slow
def test_auto_through_compile_chooses_alike_on_every_rank_and_trains_like_ddp() -> None:
    r0, r1 = run_ranks(_compiled_auto, 2)
    assert r0["chosen"] == r1["chosen"]
    for r in (r0, r1):
        assert r["losses"][0] == r["losses"][1]
        for name, value in r["ddp"].items():
            assert torch.equal(r["params"][name], value), name


@pytest.mark.slow
def test_auto_through_the_torch_compile_backend_chooses_on_the_example_inputs() -> None:
    import sys

    model = _tiny_layers()
    x = torch.randn(8, 32)
    compiled = torch.compile(model, backend=fxshard.backend(policy=auto()), dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = fxshard.parameters(compiled, example_inputs=x)
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for _ in range(2):
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    _, driver = sys.modules["fxshard.backend"].sharding_of(compiled)
    assert driver.schedule.auto is not None
    assert len(driver.plan.units) == driver.schedule.auto.chosen.units
    assert losses[1] < losses[0]


def test_cli_parses_auto_and_lists_the_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    import types

    from fxshard.cli import main, parse_policy

    assert repr(parse_policy("auto()", types.ModuleType("m"))) == "auto()"
    assert repr(parse_policy("auto(units=by_class(Linear))", types.ModuleType("m"))) == \
        "auto(units=by_class(Linear))"
    assert repr(parse_policy("auto(units=by_class(Linear), extrapolate=False)", types.ModuleType("m"))) == \
        "auto(units=by_class(Linear), extrapolate=False)"
    assert repr(parse_policy("auto(extrapolate=False)", types.ModuleType("m"))) == "auto(extrapolate=False)"
    assert repr(parse_policy("auto(extrapolate=True)", types.ModuleType("m"))) == "auto(extrapolate=True)"
    assert main(["calibrate", "--list"]) == 0
    out = capsys.readouterr().out
    assert "h100-ib" in out and "h100-nvlink" in out
    assert main(["calibrate", "--hardware", "x100"]) == 2
    assert "known are h100-ib, h100-nvlink" in capsys.readouterr().err


def _same_name_classes() -> tuple[type[nn.Module], type[nn.Module], nn.Module]:
    """Three small layers and two large ones of two classes both named ``Layer`` (a model's
    own ``LayerNorm`` beside torch's)."""
    def make(n: int) -> type[nn.Module]:
        class Layer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.randn(n, n) / n)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(x @ self.w)
        return Layer

    small, big = make(64), make(1024)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.s0, self.s1, self.s2 = small(), small(), small()
            self.up = nn.Parameter(torch.randn(64, 1024))
            self.b0, self.b1 = big(), big()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b1(self.b0(self.s2(self.s1(self.s0(x))) @ self.up))

    return small, big, Model()


def test_two_candidate_classes_of_one_name_get_labels_that_tell_them_apart() -> None:
    from fxshard.ir.auto import candidates

    _, _, model = _same_name_classes()
    labels = [c.label for c in candidates(model, None, lambda policy: [1])]
    assert len(labels) == len(set(labels))
    assert labels[:2] == ["by_class(Layer at s0)", "by_class(Layer at b0)"]
    assert "by_class(Layer at s0), buckets of 4 units" in labels


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_auto_compiles_the_plan_it_chose_where_two_classes_share_a_name() -> None:
    """The chosen plan was found again by its label, and both classes were ``by_class(Layer)``:
    the small layers' plan was compiled for the large layers' choice, 27 MiB against a 16 MiB
    budget."""
    _, _, model = _same_name_classes()
    budget = 16 * MIB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(model, torch.randn(256, 64), world_size=8, policy=auto(), hardware="h100-ib",
                            memory_budget=budget)
    assert e.report.auto is not None
    chosen = e.report.auto.chosen
    assert chosen.units == len(e.plan.units)
    assert e.report.predicted_peak_bytes == chosen.peak <= budget


def test_a_pinned_class_that_matches_no_module_warns_as_the_policy_alone_does() -> None:
    class Block(nn.Module):
        pass

    with pytest.warns(UserWarning, match=r"by_class\(Block\) matched no module"):
        fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto(units=by_class(Block)),
                        hardware="h100-nvlink")


@pytest.mark.parametrize("option", ["reshard_units", "offload_units"])
def test_auto_refuses_units_named_before_it_has_chosen_them(option: str) -> None:
    extra: dict[str, Any] = {option: frozenset({"0", "1"})}
    if option == "offload_units":
        extra["offload_policy"] = fxshard.CPUOffloadPolicy()
    with pytest.raises(fxshard.FxShardError, match=f"{option}= cannot name units before it has chosen"):
        fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto(units=by_class(nn.Sequential)),
                        hardware="h100-nvlink", **extra)


@pytest.mark.slow  # explain emits every candidate's variants: seconds
def test_on_an_hpz_job_auto_weighs_hpz_and_compiles_what_it_chose() -> None:
    """``reshard_after_forward=2`` builds the job's groups of 2 for hpZ: auto() weighs it beside
    resharding to the shard group and keeping units gathered, where it was overwritten."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = fxshard.explain(_tiny_layers(), torch.randn(8, 32), world_size=8, policy=auto(units=by_class(nn.Linear)),
                            hardware="h100-nvlink", reshard_after_forward=2)
    trials = _trials(e)
    assert any("within groups of 2 ranks" in t.schedule for t in trials)
    assert any(t.schedule.startswith("resharded after forward") for t in trials)
    assert any(t.schedule.startswith("kept gathered") for t in trials)
    assert e.report.auto is not None
    chosen = e.report.auto.chosen.schedule
    used = e._driver.schedule.config.options.reshard_after_forward
    assert used == (2 if "within groups of 2" in chosen else chosen.startswith("resharded after forward"))
