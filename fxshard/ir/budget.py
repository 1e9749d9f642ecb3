"""The memory budget planner's search: the cheapest schedule whose predicted peak fits.

``fxshard.compile(model, policy, memory_budget=bytes)``. The choices, per unit
and per region, and what each costs:

====================================  ==========================================
choice                                cost
====================================  ==========================================
reshard a unit after forward          one more all_gather of it per step
one gather in flight at most          less overlap of communication
selective recompute of a region       backward reruns its cheap operators
full recompute of a region            backward reruns all of it, matmuls too
====================================  ==========================================

The search walks a ladder of candidates in that order of cost, starting from
the most memory-hungry schedule (every unit kept gathered from forward to
backward, the configured in-flight limit, no recompute). Each step of the ladder adds
one more change of the same kind, first units first; a step that does not
lower the peak even when applied in full is skipped (the unit-by-unit and
region-by-region steps are found by bisection: along a step the predicted peak
only falls). The first candidate whose predicted peak is within the budget
wins: the least communication and recompute that fits. ``evaluate`` predicts
a candidate's peak without running anything (driver/budget.py: the passes and
the liveness of ``report()`` on a copy of the traced graph).

If even the last candidate (everything resharded, one gather in flight, every region fully recomputed) does not fit, the budget
cannot be met: ``BudgetError`` names the smallest peak and what it is made of.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fxshard.ir.checkpointing import Checkpointing
from fxshard.ir.errors import BudgetError
from fxshard.ir.options import ShardingOptions

MIB = 1 << 20


@dataclass(frozen=True)
class Candidate:
    """One schedule the planner considers."""

    resharded: tuple[str, ...]  # units freed after forward ("" the root)
    max_inflight: int
    selective: tuple[str, ...]  # regions recomputed except their matmuls and attention
    full: tuple[str, ...]  # regions recomputed entirely
    step: str  # the ladder step that made it

    def options(self, base: ShardingOptions) -> ShardingOptions:
        return replace(base, reshard_units=frozenset(self.resharded),
                       max_inflight_gathers=self.max_inflight)

    def checkpointing(self, base: Checkpointing | None) -> Checkpointing | None:
        regions = self.selective + self.full
        if not regions:
            return None
        order = {r: i for i, r in enumerate(base.regions)} if base is not None else {}
        ordered = tuple(sorted(regions, key=lambda r: order.get(r, len(order))))
        saved = {} if base is None else {"saved_ops": base.saved_ops}
        return Checkpointing(ordered, frozenset(self.selective), policy="memory_budget", **saved)

    def describe(self) -> str:
        parts = [f"{len(self.resharded)} units resharded"]
        parts.append(f"{self.max_inflight} in flight")
        if self.selective:
            parts.append(f"{len(self.selective)} regions recomputed selectively")
        if self.full:
            parts.append(f"{len(self.full)} regions recomputed fully")
        return ", ".join(parts)


@dataclass(frozen=True)
class UnitChoice:
    unit: str
    gathered_bytes: int
    resharded: bool
    recompute: str  # "none", "selective", "full", or a mix "selective: a; full: b"
    why: str


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    chosen: Candidate
    peak: int  # the chosen candidate's predicted peak
    tried: tuple[tuple[str, int], ...]  # (candidate, predicted peak), in the order evaluated
    units: tuple[UnitChoice, ...]

    def table(self) -> str:
        lines = [f"memory budget {self.budget / MIB:.3f} MiB: predicted peak {self.peak / MIB:.3f} MiB "
                 f"with {self.chosen.describe()} (ladder step: {self.chosen.step})"]
        header = ("unit", "gathered MiB", "after forward", "recompute", "why")
        rows = [(u.unit or "<root>", f"{u.gathered_bytes / MIB:.3f}",
                 "reshard" if u.resharded else "keep", u.recompute, u.why) for u in self.units]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
        for r in [header, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        lines.append("  candidates tried (predicted peak):")
        lines += [f"    {peak / MIB:10.3f} MiB  {what}" for what, peak in self.tried]
        return "\n".join(lines)


@dataclass(frozen=True)
class Prediction:
    """What ``evaluate`` says of a candidate: its peak and, for the error, what makes it up."""

    peak: int
    where: str  # "backward: mm_8"
    parts: dict[str, int]  # "parameter shards", "gathered parameters", ... -> bytes at the peak
    hints: dict[str, str]  # the same keys -> what would lower that part


def search(budget: int, evaluate: Callable[[Candidate], Prediction], units: Sequence[str],
           regions: Sequence[str], max_inflight: int, unit_bytes: dict[str, int]) -> BudgetChoice:
    """The first candidate along the ladder whose predicted peak is within ``budget``."""
    if budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {budget}")
    tried: list[tuple[str, int]] = []
    cache: dict[Candidate, Prediction] = {}

    def peak(c: Candidate) -> Prediction:
        key = replace(c, step="")
        if key not in cache:
            cache[key] = evaluate(c)
            tried.append((c.describe(), cache[key].peak))
        return cache[key]

    resharded = [u for u in units if u != ""] + [u for u in units if u == ""]  # the root last
    start = Candidate((), max_inflight, (), (), "keep every unit gathered")
    ladder: list[tuple[str, Callable[[Candidate, int], Candidate], int]] = [
        ("reshard units after forward",
         lambda c, k: replace(c, resharded=tuple(resharded[:k])), len(resharded)),
        ("one gather in flight",
         lambda c, k: replace(c, max_inflight=1 if k else c.max_inflight), 1 if max_inflight > 1 else 0),
        ("recompute regions selectively",
         lambda c, k: replace(c, selective=tuple(regions[:k])), len(regions)),
        ("recompute regions fully",
         lambda c, k: replace(c, selective=tuple(r for r in c.selective if r not in regions[:k]),
                              full=tuple(regions[:k])), len(regions)),
    ]
    current = start
    if peak(current).peak <= budget:
        return _choice(budget, current, peak(current).peak, tried, units, regions, unit_bytes)
    for step, apply, n in ladder:
        if n == 0:
            continue
        full = replace(apply(current, n), step=step)
        if peak(full).peak > budget:
            if peak(full).peak < peak(current).peak:  # keep a change only if it lowers the peak
                current = full
            continue
        lo, hi = 0, n  # apply(current, lo) misses the budget, apply(current, hi) meets it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak(apply(current, mid)).peak <= budget:
                hi = mid
            else:
                lo = mid
        chosen = replace(apply(current, hi), step=step)
        return _choice(budget, chosen, peak(chosen).peak, tried, units, regions, unit_bytes)
    # The last candidate is not always the lowest (a region recomputed first thing in
    # backward can raise the peak it sits at): report the lowest of all tried.
    best, smallest = min(((c, p) for c, p in cache.items()), key=lambda cp: cp[1].peak)
    parts = sorted(smallest.parts.items(), key=lambda kv: -kv[1])
    dominant = parts[0][0] if parts else "?"
    raise BudgetError(
        f"memory_budget {budget / MIB:.3f} MiB cannot be met: the lowest peak of the schedules "
        f"fxshard tried is {smallest.peak / MIB:.3f} MiB ({best.describe()}), at {smallest.where}. "
        "There it holds " + ", ".join(f"{k} {v / MIB:.3f} MiB" for k, v in parts if v)
        + f". The largest part is {dominant}: {smallest.hints.get(dominant, '')}"
    )


def _choice(budget: int, chosen: Candidate, peak: int, tried: list[tuple[str, int]],
            units: Sequence[str], regions: Sequence[str], unit_bytes: dict[str, int]) -> BudgetChoice:
    rows = []
    n_resharded = len(chosen.resharded)
    for unit in units:
        mine = [r for r in regions if _in_unit(r, unit, units)]
        kinds = sorted({"selective" if r in chosen.selective else "full" if r in chosen.full else "none"
                        for r in mine}) or ["none"]
        recompute = kinds[0] if len(kinds) == 1 else "mixed"
        resharded = unit in chosen.resharded
        if resharded:
            why = f"the budget needs {n_resharded} of {len(units)} units resharded, first units first"
        else:
            why = "the budget holds with it kept: no second gather of it in backward"
        if recompute == "selective":
            why += "; recomputed but its matmuls: resharding and prefetch limits alone do not fit"
        elif recompute != "none":
            why += "; recomputed in full: selective recompute of every region does not fit"
        rows.append(UnitChoice(unit, unit_bytes.get(unit, 0), resharded, recompute, why))
    return BudgetChoice(budget, chosen, peak, tuple(tried), tuple(rows))


def _in_unit(region: str, unit: str, units: Sequence[str]) -> bool:
    """Is module ``region`` in ``unit`` (a module path, merged units joined by "+")?"""
    for path in unit.split("+") if unit else []:
        if region == path or region.startswith(path + "."):
            return True
    if unit == "":  # the root holds what no other unit does
        return not any(_in_unit(region, u, units) for u in units if u != "")
    return False
