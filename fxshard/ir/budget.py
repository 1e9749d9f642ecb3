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
offload a unit (offload_policy=)      its shard copied in before each gather,
                                      its gradient out; its optimizer steps on
                                      the host
====================================  ==========================================

Offload comes first where the optimizer step's phase alone (optimizer=: the
shards, gradients and state) exceeds the budget, since no other choice lowers
it: the fewest units, largest first, that bring that phase within it. After
that it is the last step of the ladder.

The search walks a ladder of candidates in that order of cost, starting from
the most memory-hungry schedule (every unit kept gathered from forward to
backward, the configured in-flight limit, no recompute). Each step of the
ladder adds one more change of the same kind: first units first (the
root last), regions in order of measured benefit (each region's predicted
peak when it alone is recomputed, lowest first; of a run of alike regions only
the ends are measured, the first standing for those between). Where the whole step fits
the budget, bisection finds the fewest changes that fit. Where it does not,
every prefix of the step is evaluated, since the peak need not fall along a
step (recomputing the last block fully puts its recompute at the start of
backward, where the peak is): the first that fits wins, else the search goes
on from the lowest. The reshard step scans only the prefixes that end a run of
alike units (as many bytes gathered, offloaded or not) or start one, and
bisects inside a run: each unit of a run resharded frees as many bytes until
its gather in backward, so the peak falls along it (the root, a run of its own,
may raise it). A smaller budget thus evaluates every schedule a larger
one could accept, or one of no higher peak, so the lowest peak an error names is never beaten by a
schedule some budget accepts. ``evaluate`` predicts a candidate's peak
without running anything (driver/compile/plan_budget.py: the passes and the liveness of
``report()`` on a copy of the traced graph).

The step that fits may not need what an earlier step kept (recomputing every block where
offloading one unit more fits alone): the chosen schedule is then trimmed, each kind of
recomputation and the in-flight limit undone where the rest still fits (``trimmed`` in
``search``; resharding stays).

If even the last candidate (everything resharded, one gather in flight, every region fully recomputed) does not fit, the budget
cannot be met: ``BudgetError`` names the smallest peak and what it is made of.

Under ``auto()`` the ladder also has a time to beat (``outpaced_at``): the step time of a plan
already found that fits. Every step of the ladder adds work to the schedule it starts from
(a gather, a recomputation, a copy to the host, less overlap), so once the schedule it would
build on is predicted slower than that, nothing further along can win: the search stops
with ``Outpaced`` instead of evaluating the rest (driver/compile/plan_auto.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
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
    offloaded: tuple[str, ...] = ()  # units whose shards live on the host (offload_policy=)

    def options(self, base: ShardingOptions) -> ShardingOptions:
        return replace(base, reshard_units=frozenset(self.resharded), max_inflight_gathers=self.max_inflight,
                       offload_units=frozenset(self.offloaded) if base.offload_policy is not None
                       else base.offload_units)

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
        if self.offloaded:
            parts.append(f"{len(self.offloaded)} units offloaded")
        return ", ".join(parts)


@dataclass(frozen=True)
class UnitChoice:
    unit: str
    gathered_bytes: int
    resharded: bool
    recompute: str  # "none", "selective", "full", or a mix "selective: a; full: b"
    why: str
    offloaded: bool = False  # its shards, gradients and optimizer state on the host


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
        header = ("unit", "gathered MiB", "after forward", "recompute", "shards", "why")
        rows = [(u.unit or "<root>", f"{u.gathered_bytes / MIB:.3f}",
                 "reshard" if u.resharded else "keep", u.recompute, "host" if u.offloaded else "device",
                 u.why) for u in self.units]
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
    step_peak: int = 0  # the optimizer step's phase alone (0: not predicted)
    seconds: float | None = None  # the predicted step time, where the search was given a time to beat


class Outpaced(Exception):
    """The ladder stopped: the schedule it would build on (``at``) is predicted to take
    ``seconds``, slower than ``outpaced_at``, and every later step only adds work to it."""

    def __init__(self, at: Candidate, seconds: float, outpaced_at: float):
        super().__init__(f"{at.describe()}: {seconds * 1e3:.3f} ms, slower than {outpaced_at * 1e3:.3f} ms")
        self.at, self.seconds, self.outpaced_at = at, seconds, outpaced_at


def search(budget: int, evaluate: Callable[[Candidate], Prediction], units: Sequence[str],
           regions: Sequence[str], max_inflight: int, unit_bytes: dict[str, int],
           offloadable: Sequence[str] = (), alike: Mapping[str, Hashable] | None = None,
           outpaced_at: float | None = None) -> BudgetChoice:
    """The first candidate along the ladder whose predicted peak is within ``budget``; else
    BudgetError naming the lowest peak tried, which no budget's accepted schedule beats.
    ``offloadable``: the units offload may move to the host, in the order it takes them
    (empty: offload is not allowed). ``alike``: each region's computation (regions with
    equal values compute the same thing on the same shapes, as a stack of transformer
    blocks does); of each run of alike regions only the first and the last are measured
    alone, and the ones between take the first's benefit. ``outpaced_at``: a step time to
    beat (``evaluate`` then predicts ``seconds``); raises ``Outpaced`` once the candidate the
    ladder builds on is predicted slower."""
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

    def building_on(c: Candidate) -> Candidate:
        """``c``, where the ladder goes on from it: stops if nothing from it can beat ``outpaced_at``."""
        seconds = peak(c).seconds
        if outpaced_at is not None and seconds is not None and seconds > outpaced_at:
            raise Outpaced(c, seconds, outpaced_at)
        return c

    def by_benefit(c: Candidate, apply: Callable[[Candidate, Sequence[str]], Candidate]) -> list[str]:
        """The regions in order of measured benefit: each one's peak when it alone changes.
        Alike regions differ in it only by where their recompute runs: the last one's at the
        start of backward, where the peak usually is, the others' after it; so the first of
        them stands for those between it and the last."""
        measured = _ends_of_alike(regions, alike or {})
        alone = {r: peak(apply(c, (r,))).peak for r in regions if measured[r] == r}
        return sorted(regions, key=lambda r: alone[measured[r]])  # stable: ties keep registration order

    def prefixes(c: Candidate, apply: Callable[[Candidate, Sequence[str]], Candidate]) -> list[Candidate]:
        order = by_benefit(c, apply)
        return [apply(c, order[:k]) for k in range(len(order) + 1)]

    def selective(c: Candidate, chosen: Sequence[str]) -> Candidate:
        return replace(c, selective=tuple(chosen))

    def full(c: Candidate, chosen: Sequence[str]) -> Candidate:
        return replace(c, selective=tuple(r for r in c.selective if r not in chosen), full=tuple(chosen))

    def run_ends(c: Candidate) -> list[int] | None:
        return _run_ends([(unit_bytes.get(u), u in c.offloaded) for u in resharded])

    def every(c: Candidate) -> list[int] | None:
        return None

    # Each step: its name, for the current candidate the ordered choices it adds one by one,
    # and which of them a step that misses as a whole scans (None: every one).
    ladder: list[tuple[str, Callable[[Candidate], list[Candidate]], Callable[[Candidate], list[int] | None]]] = [
        ("reshard units after forward",
         lambda c: [replace(c, resharded=tuple(resharded[:k])) for k in range(len(resharded) + 1)], run_ends),
        ("one gather in flight",
         lambda c: [c, replace(c, max_inflight=1)] if max_inflight > 1 else [c], every),
        ("recompute regions selectively", lambda c: prefixes(c, selective), every),
        ("recompute regions fully", lambda c: prefixes(c, full), every),
    ]
    def offload(c: Candidate) -> list[Candidate]:
        return [replace(c, offloaded=tuple(offloadable[:k])) for k in range(len(c.offloaded), len(offloadable) + 1)]

    if offloadable:
        ladder.append(("offload more units", offload, every))

    def trimmed(c: Candidate) -> Candidate:
        """``c`` without what earlier steps of the ladder added and the step that fitted no
        longer needs: each kind of change undone whole where the rest still fits, the costliest
        first (full recompute, selective recompute, the one gather in flight). An earlier
        step's change is kept where it lowered the peak, but a later step (offload) may fit
        without it: Llama-3-8B within 70 GiB recomputed all 32 blocks beside 14 units
        offloaded. Each undo removes work (a recomputation, lost overlap): never slower, never
        above the budget as predicted. Resharding is not undone: units kept gathered to
        backward move the peak into the caller's loss, whose count assumes a caller that drops
        its outputs; TinyGPT's caller that holds its logits then peaked over a budget the
        plan was predicted 2% under (docs/memory.md)."""
        undo: tuple[Callable[[Candidate], Candidate], ...] = (
            lambda k: replace(k, full=()), lambda k: replace(k, selective=()),
            lambda k: replace(k, max_inflight=max_inflight))
        for revert in undo:
            lighter = revert(c)
            if replace(lighter, step="") != replace(c, step="") and peak(lighter).peak <= budget:
                c = lighter
        return c

    def bisect(steps: list[Candidate], lo: int, hi: int) -> Candidate:
        """The first of ``steps`` after ``lo`` that fits, where ``steps[hi]`` fits and ``steps[lo]``
        misses (lo=-1: the candidate the step starts from), assuming the peak falls between."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak(steps[mid]).peak <= budget:
                hi = mid
            else:
                lo = mid
        return steps[hi]

    current = Candidate((), max_inflight, (), (), "keep every unit gathered")
    if peak(current).peak <= budget:
        return _choice(budget, current, peak(current).peak, tried, units, regions, unit_bytes)
    if offloadable and peak(current).step_peak > budget:
        # The optimizer step holds every shard, gradient and state on the device, and only
        # offload lowers it: first the fewest units (in order) whose offload fits that phase.
        lo, hi = 0, len(offloadable)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak(replace(current, offloaded=tuple(offloadable[:mid]))).step_peak <= budget:
                hi = mid
            else:
                lo = mid
        current = replace(current, offloaded=tuple(offloadable[:hi]), step="offload what the optimizer step needs")
        if peak(current).peak <= budget:
            return _choice(budget, current, peak(current).peak, tried, units, regions, unit_bytes)
    if peak(current).step_peak > budget:  # before any time: the error is the answer
        # No schedule changes what the optimizer step holds (the shards, their gradients and
        # state, the inputs): nothing below can fit.
        raise _unmet(budget, current, peak(current), "the optimizer step alone holds")
    building_on(current)
    for step, choices, scan in ladder:
        steps = [replace(c, step=step) for c in choices(current)][1:]  # [0] is current itself
        if not steps:
            continue
        if peak(steps[-1]).peak <= budget:
            # Bisect for the fewest changes that fit (first fitting prefix, assuming the peak
            # falls along the step; a miss is found by the scan below on a smaller budget).
            chosen = trimmed(bisect(steps, -1, len(steps) - 1))
            return _choice(budget, chosen, peak(chosen).peak, tried, units, regions, unit_bytes)
        # The whole step misses. The peak need not fall along it (recomputing the last block
        # fully puts its recompute at the start of backward, where the peak is): scan every
        # prefix (or those ``scan`` names, between which the peak falls), take the first
        # that fits, else go on from the lowest.
        scanned = scan(current)
        indices = range(len(steps)) if scanned is None else scanned
        fits = next((i for i in indices if peak(steps[i]).peak <= budget), None)
        if fits is not None:
            before = max((i for i in indices if i < fits), default=-1)
            chosen = trimmed(bisect(steps, before, fits))
            return _choice(budget, chosen, peak(chosen).peak, tried, units, regions, unit_bytes)
        # Among equal peaks the furthest along the step: what it saves may count later,
        # where the peak has moved.
        lowest = min(reversed([steps[i] for i in indices]), key=lambda c: peak(c).peak)
        if peak(lowest).peak < peak(current).peak:  # keep a change only if it lowers the peak
            current = building_on(lowest)
    # Every prefix of every step was scanned on the way here (of the reshard step, the ends of
    # its runs, along which the peak falls), along the same path any larger budget takes until
    # it fits: no budget accepts a schedule below the lowest tried.
    best, smallest = min(((c, p) for c, p in cache.items()), key=lambda cp: (cp[1].peak, len(cp[0].offloaded)))
    raise _unmet(budget, best, smallest, "the lowest peak of the schedules fxshard tried is")


def _run_ends(keys: Sequence[Hashable]) -> list[int]:
    """The reshard step's prefixes scanned where the whole step misses, by index (index i:
    the first i + 1 units resharded), for units whose ``keys`` (bytes gathered, offloaded or
    not) are given in the order they are resharded: those that end with the first or the
    last unit of a run of consecutive equal keys (why: the module's docstring)."""
    last = len(keys) - 1
    return [i for i in range(len(keys))
            if i in (0, last) or keys[i] != keys[i - 1] or keys[i] != keys[i + 1]]


def _ends_of_alike(regions: Sequence[str], alike: Mapping[str, Hashable]) -> dict[str, str]:
    """For each region, the region measured for it: itself, or for a region between the
    first and the last of its kind (equal ``alike`` values, in registration order), the
    first of its kind."""
    kinds: dict[Hashable, list[str]] = {}
    for r in regions:
        kinds.setdefault(alike.get(r, r), []).append(r)
    measured = {r: r for r in regions}
    for members in kinds.values():
        for r in members[1:-1]:
            measured[r] = members[0]
    return measured


def _unmet(budget: int, best: Candidate, smallest: Prediction, what: str) -> BudgetError:
    parts = sorted(smallest.parts.items(), key=lambda kv: -kv[1])
    dominant = parts[0][0] if parts else "?"
    return BudgetError(
        f"memory_budget {budget / MIB:.3f} MiB cannot be met: {what} {smallest.peak / MIB:.3f} MiB "
        f"({best.describe()}), at {smallest.where}. "
        "There it holds " + ", ".join(f"{k} {v / MIB:.3f} MiB" for k, v in parts if v)
        + f". The largest part is {dominant}: {smallest.hints.get(dominant, '')}",
        peak=smallest.peak,
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
        offloaded = unit in chosen.offloaded
        if offloaded:
            why = (f"offloaded: the budget needs {len(chosen.offloaded)} of {len(units)} units' shards, "
                   f"gradients and optimizer state on the host, the largest first; {why}")
        rows.append(UnitChoice(unit, unit_bytes.get(unit, 0), resharded, recompute, why, offloaded))
    return BudgetChoice(budget, chosen, peak, tuple(tried), tuple(rows))


def _in_unit(region: str, unit: str, units: Sequence[str]) -> bool:
    """Is module ``region`` in ``unit`` (a module path, merged units joined by "+")?"""
    for path in unit.split("+") if unit else []:
        if region == path or region.startswith(path + "."):
            return True
    if unit == "":  # the root holds what no other unit does
        return not any(_in_unit(region, u, units) for u in units if u != "")
    return False
