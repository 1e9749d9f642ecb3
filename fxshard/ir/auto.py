"""``policy=auto()``: the plans the planner compares, and what it chose (pure).

The driver (``fxshard.driver.compile.plan_auto``) traces the model once, rewrites that joint graph
to each plan candidate's flat groups (``fxshard.passes.regroup``) and emits each schedule
variant from it; the cost model (``fxshard.ir.cost``) predicts each
variant's step time and the memory model its peak. The fastest whose peak is within
``memory_budget`` wins; where none is, the memory budget's ladder (``fxshard.ir.budget``:
resharding, prefetch limits, recompute, offload) lowers the candidate until it fits.

Plan candidates, each a wrapping policy (units), and how units merge into buckets:

=====================================  ==============================================
candidate                              why
=====================================  ==============================================
``by_class(C)``                        the two classes repeated most often in the model
                                       (a layer), and the outermost repeated class that
                                       holds others (a transformer block): FSDP2's one
                                       unit per block
one unit                               the whole model in one collective each way
``by_size(N/2)``, ``(N/8)``, ``(N/32)``  FSDP's size rule over the parameters' count N:
                                       a module whose unclaimed parameters reach it
``by_class(C)`` with ``bucket_bytes``   the first class's units merged into buckets of
                                       about 4 and 16 of its typical (median) unit
                                       (one collective each)
``units``, alone and bucketed          ``auto(units=...)``: the given units, and the
                                       same buckets of them
=====================================  ==============================================

Candidates that make the same units are tried once. Schedule variants of each: resharded
after forward or kept gathered (ZeRO-3 or ZeRO-2), and one or two gathers in flight
(the prefetch depth); under a ``memory_budget`` that one of them exceeds, also the budget
ladder's choice (the first units resharded, the rest kept gathered, as few as fit).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch.nn as nn

from fxshard.ir.options import ShardingOptions
from fxshard.ir.wrapping import Policy, by_class, by_size

MIB = 1 << 20
# Predicted step times this close are a tie, which the fewer collectives break, then the lower
# peak: the cost model is not that exact (docs/time.md), and where it errs on 2 gloo ranks it
# under-counts each collective's cost in the step (about 1 ms against a calibrated 0.3-0.6 ms),
# so of two plans predicted a sliver apart, the one that issues fewer is the faster measured
# (the deep MLP of benchmarks/auto.py: its last 15 units kept gathered, predicted 1% faster
# than all resharded, measured about 9% faster).
TIE = 0.01
# A stack of at least this many identical blocks is predicted from its first SAMPLES blocks
# and scaled (``auto(extrapolate=True)``): below it the whole graph costs little more.
MIN_BLOCKS = 16
SAMPLES = (3, 4, 5)
# ... by default only where the whole model's joint graph would have more nodes than this
# (estimated from the cut models'): below it the whole graph is seconds' work, and its
# budget ladder weighs choices that scaling does not (the deep MLP of benchmarks/auto.py:
# 1200 nodes; a Llama block about 250, so Llama-3-8B's 32 about 8000, 70B's 80 about 20000).
MIN_NODES = 5000
# How far a step's seconds may move from one sampled depth to the next and still be one
# step: the simulation's schedule of a block is the same in every middle block.
SCALE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Candidate:
    """A plan the planner traces: a wrapping policy and the bucket size that merges its units."""

    label: str
    policy: Policy | None
    bucket_bytes: int = 0


@dataclass(frozen=True)
class Trial:
    """One plan and schedule, as predicted (the largest over the ranks)."""

    plan: str  # the candidate's label
    schedule: str  # the variant's label
    seconds: float
    exposed_seconds: float
    peak: int
    units: int
    fits: bool
    collectives: int = 0  # issued in one step (this rank's; every rank issues the same)
    scaled: bool = False  # predicted from a few of the model's blocks (``scaled``)

    def describe(self) -> str:
        return f"{self.plan}, {self.schedule}"


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto()`` chose, and every trial, fastest first."""

    chosen: Trial
    trials: tuple[Trial, ...]
    budget: int | None
    rates: str  # the rates the times were predicted with
    device_memory: bool = False  # no memory_budget was given: the budget is the device's memory
    # How the trials were predicted where not from the whole graph (``scaled``), one line.
    sampled: str = ""
    # Candidates left untraced: their largest unit alone, gathered, is over the budget.
    over: tuple[tuple[str, int], ...] = ()
    # A scaled choice's peak and step seconds as the whole graph predicts them (``report()``).
    whole: tuple[int, float | None] | None = None
    # The budget ladders stopped early, predicted slower than a plan that fits: one line each.
    outpaced: tuple[str, ...] = ()

    def table(self) -> str:
        within = "" if self.budget is None else \
            f" within {'the device' + chr(39) + 's memory' if self.device_memory else 'memory_budget'} {self.budget / MIB:.3f} MiB"
        tie = min((t.seconds for t in self.trials if t.fits), default=self.chosen.seconds) < self.chosen.seconds
        lines = [f"auto(): {self.chosen.describe()} predicted fastest{within} "
                 f"({self.chosen.seconds * 1e3:.3f} ms a step; rates {self.rates})"
                 + (f"; within {TIE:.0%} of the fastest, the fewest collectives" if tie else ""),
                 "  predicted ms  exposed ms    peak MiB  units  plan, schedule"]
        for t in self.trials:
            mark = "*" if t == self.chosen else " " if t.fits else "x"
            lines.append(f"{mark}{'~' if t.scaled else ' '}{t.seconds * 1e3:11.3f} {t.exposed_seconds * 1e3:11.3f} "
                         f"{t.peak / MIB:11.3f} {t.units:6d}  {t.describe()}")
        if any(not t.fits for t in self.trials):
            lines.append("  (x: over the memory budget)")
        if self.sampled:
            lines.append(f"  {self.sampled}")
        if self.whole is not None:
            peak, seconds = self.whole
            lines.append(f"  the plan chosen, from the whole graph: {peak / MIB:.3f} MiB"
                         + (f", {seconds * 1e3:.3f} ms a step" if seconds is not None else ""))
        if self.outpaced:
            lines.append("  budget ladders stopped where predicted slower than a plan that fits and its tie "
                         "(each later step only adds work):")
            lines += [f"    {line}" for line in self.outpaced]
        if self.over:
            lines.append("  not traced, their largest unit alone gathering more than the budget: "
                         + "; ".join(f"{label} ({nbytes / MIB:.3f} MiB)" for label, nbytes in self.over))
        return "\n".join(lines)


@dataclass(frozen=True)
class Stack:
    """A container of identical blocks: ``path`` (``""`` the root) holds ``blocks`` of them."""

    path: str
    blocks: int

    def block_of(self, name: str) -> int | None:
        """The block a module path is in (None: outside the stack)."""
        prefix = f"{self.path}." if self.path else ""
        if not name.startswith(prefix):
            return None
        head = name[len(prefix):].split(".", 1)[0]
        return int(head) if head.isdigit() else None


def find_stack(module: nn.Module, min_blocks: int = MIN_BLOCKS) -> Stack | None:
    """The ``ModuleList`` or ``Sequential`` of at least ``min_blocks`` identical blocks (one
    class; the same parameters and buffers by name, shape, dtype and ``requires_grad``) that
    holds the most parameters, or None."""
    def signature(m: nn.Module) -> tuple[object, ...]:
        return (type(m), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()),
                tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))

    found: list[tuple[int, int, str, int]] = []
    for i, (name, m) in enumerate(module.named_modules()):
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < min_blocks:
            continue
        children = list(m.children())
        if len(children) != len(m) or len({signature(b) for b in children}) != 1:
            continue
        numel = sum(p.numel() for p in m.parameters())
        if numel:
            found.append((-numel, i, name, len(children)))
    if not found:
        return None
    _, _, path, count = min(found)
    return Stack(path, count)


def cut_matches(whole: Sequence[str], cut: Sequence[str], stack: Stack, blocks: int) -> bool:
    """Is ``cut``, the units of the model cut to its stack's first ``blocks``, the whole plan's
    (``whole``) with blocks missing from its middle? Its units within the first ``blocks - 1``
    blocks (and those outside the stack) must be the whole plan's, and those that reach its
    last block the whole plan's that reach the last, block numbers shifted: what lies
    between repeats (the figures' growth by one step checks that it does). A bucket may
    span blocks, as long as it spans them alike all along the stack."""
    def parts(unit: str) -> list[int | None]:
        return [stack.block_of(part) for part in unit.split("+")]

    def head(units: Sequence[str], end: int) -> list[str]:
        return [u for u in units if all(b is None or b < end for b in parts(u))]

    def tail(units: Sequence[str], last: int) -> list[str]:
        return [u for u in units if last in parts(u)]

    def shifted(unit: str, by: int) -> str:
        prefix = f"{stack.path}." if stack.path else ""
        out = []
        for part in unit.split("+"):
            b = stack.block_of(part)
            out.append(part if b is None else prefix + str(b + by) + part[len(prefix) + len(str(b)):])
        return "+".join(out)

    return head(cut, blocks - 1) == head(whole, blocks - 1) and \
        [shifted(u, stack.blocks - blocks) for u in tail(cut, blocks - 1)] == tail(whole, stack.blocks - 1)


def scaled(samples: Sequence[Trial], depths: Sequence[int], blocks: int, budget: int | None) -> Trial | None:
    """The trial of a stack of ``blocks`` from the same plan and schedule predicted on its
    first ``depths`` blocks (three, one apart): each figure is affine in the blocks, so
    grows by the same step from each depth to the next (the peak, units and collectives
    exactly; the seconds within ``SCALE_TOLERANCE`` of a step, or 1 µs), and the last plus
    that step per block missing is the whole stack's (within ``budget`` or not). None where
    a figure is not affine."""
    a, b, c = depths
    assert b - a == c - b == 1 and len(samples) == 3
    first, middle, last = samples
    figures = []
    for name in ("seconds", "exposed_seconds", "peak", "units", "collectives"):
        x, y, z = (getattr(t, name) for t in samples)
        if name.endswith("seconds"):
            x, y, z = (round(v * 1e9) for v in (x, y, z))
            if abs((z - y) - (y - x)) > max(1000, SCALE_TOLERANCE * abs(z - y)):
                return None
        elif z - y != y - x:
            return None
        figures.append(z + (blocks - c) * (z - y))
    seconds, exposed, peak, units, collectives = figures
    return replace(last, seconds=seconds / 1e9, exposed_seconds=exposed / 1e9, peak=peak, units=units,
                   collectives=collectives, fits=budget is None or peak <= budget, scaled=True)


def repeated_classes(module: nn.Module) -> list[type[nn.Module]]:
    """The module classes that hold parameters and occur more than once below the root, most
    frequent first (ties: the outermost first, then in registration order)."""
    count: dict[type[nn.Module], int] = {}
    depth: dict[type[nn.Module], int] = {}
    for name, m in module.named_modules():
        if name and any(True for _ in m.parameters()):
            count[type(m)] = count.get(type(m), 0) + 1
            depth.setdefault(type(m), name.count("."))
    repeated = [c for c, n in count.items() if n > 1]
    return sorted(repeated, key=lambda c: (-count[c], depth[c]))


def block_class(module: nn.Module) -> type[nn.Module] | None:
    """The outermost repeated class whose instances hold other modules with parameters (a
    transformer block, which the most frequent classes, its layers and norms, outnumber), or
    None (ties: the first registered)."""
    repeated = repeated_classes(module)
    found = [(name.count("."), i, type(m)) for i, (name, m) in enumerate(module.named_modules())
             if name and type(m) in repeated
             and any(any(True for _ in c.parameters(recurse=False)) for c in m.modules() if c is not m)]
    return min(found, key=lambda f: f[:2])[2] if found else None


def candidates(module: nn.Module, pinned: Policy | None,
               unit_bytes: Callable[[Policy], list[int]]) -> list[Candidate]:
    """The plans to trace, in a fixed order (every rank the same). ``unit_bytes``: the bytes of
    each of a policy's units but the root (none: it makes none); buckets are sized by their
    median, so that one small unit (an MLP's narrow head) does not make buckets smaller than
    the units they should merge."""
    numel = sum(p.numel() for p in module.parameters())
    if pinned is not None:
        found = [Candidate(repr(pinned), pinned)]
        bucketed = [pinned]
    else:
        repeated = repeated_classes(module)[:2]
        block = block_class(module)
        types = repeated + ([block] if block is not None and block not in repeated else [])
        classes = [by_class(c) for c in types]
        found = [Candidate(_class_label(module, c, types), p) for c, p in zip(types, classes)]
        found.append(Candidate("one unit", None))
        found += [Candidate(f"by_size(N/{k})", by_size(max(1, numel // k))) for k in (2, 8, 32)]
        bucketed = classes[:1]
    for candidate, policy in list(zip(found, bucketed)):  # the first candidates: the bucketed policies'
        sizes = unit_bytes(policy)
        typical = statistics.median_low(sizes) if sizes else 0
        if typical > 0:
            found += [Candidate(f"{candidate.label}, buckets of {k} units", policy, k * typical + 1)
                      for k in (4, 16)]
    return found


def _class_label(module: nn.Module, cls: type, classes: Sequence[type]) -> str:
    """``by_class(Name)``; where another candidate class has the same name (a model's own
    ``LayerNorm`` beside torch's), with the first module of this one: ``by_class(Name at
    path)``. The chosen plan is found again by its label, so no two may share one."""
    if sum(c.__name__ == cls.__name__ for c in classes) == 1:
        return f"by_class({cls.__name__})"
    first = next(name for name, m in module.named_modules() if type(m) is cls)
    return f"by_class({cls.__name__} at {first or '<root>'})"


def variants(options: ShardingOptions) -> list[tuple[str, ShardingOptions]]:
    """The schedules tried for each plan: resharded after forward, resharded within groups of
    h ranks where ``options`` asks for hpZ (``reshard_after_forward=h``: the job's groups are
    made for it), or kept gathered; one or two gathers in flight (never more than ``options``
    allow: its process groups are made for them)."""
    depths = sorted({1, min(2, options.max_inflight_gathers)}, reverse=True)
    h = options.reshard_after_forward
    reshards: tuple[bool | int, ...] = (True, h, False) if options.partitions else (True, False)
    found = []
    for reshard in reshards:
        for depth in depths:
            label = ("resharded after forward" if reshard is True else
                     f"resharded within groups of {reshard} ranks after forward (hpZ)" if reshard else
                     "kept gathered to backward") + f", {depth} gather{'s' if depth > 1 else ''} in flight"
            found.append((label, replace(options, reshard_after_forward=reshard, reshard_units=None,
                                         max_inflight_gathers=depth)))
    return found


def fastest(trials: Sequence[Trial]) -> Trial | None:
    """The fastest trial that fits; of those predicted within ``TIE`` of it, the one that issues
    the fewest collectives (then the lower peak, then the faster, then the earlier)."""
    fitting = [t for t in trials if t.fits]
    if not fitting:
        return None
    best = min(t.seconds for t in fitting)
    return min((t for t in fitting if t.seconds <= best * (1 + TIE)),
               key=lambda t: (t.collectives, t.peak, t.seconds))
