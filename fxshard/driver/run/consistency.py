"""Rank agreement: before every forward and every backward, the ranks prove they run the same step.

Each phase of a compiled step starts with one tiny all_gather: every rank
sends 8 bytes, the fingerprint of the collectives it is about to issue in
this phase (kind, shape, dtype, group and unit of each, and the phase). Ranks
whose fingerprints agree proceed, whatever their input shapes: a smaller last
batch issues the same collectives. Ranks that would issue different
collectives (one in eval mode or without grad, another model, a rank that
skipped a backward) learn it before any of them issues one, exchange their
descriptions, and every rank raises ``CollectiveMismatchError`` naming each
rank's step and the first collective that differs. Without this, gloo aborts
the process on mismatched sizes, or mismatched collectives of equal size
exchange the wrong bytes silently.

A rank whose peers never arrive (gone, stalled, in another collective such as
a barrier) raises after the driver's timeout; see ``runtime.with_comm_groups``.

Without stopping the host (``Agreement``). On a device backend (nccl, xccl, a
rehearsal on a GPU) reading the exchange's result on the host would make the host
wait for the device before every phase, so it could never run ahead. There, in
steady state, the comparison runs on the device instead: the rank still exchanges
its fingerprint (every rank exchanges one before every phase, whichever way it
checks), and the result comes back to pinned host memory by itself; the host
reads it at the next phase that finds it arrived, and waits for it only when
``LAG`` phases' results are outstanding. Steady state is a fingerprint equal to
the one this rank sent ``PERIOD`` exchanges earlier on the same job group (a
training step's forward and backward; or forward after forward), counted over
every driver that agrees on that group. Two ranks that both check on the device
therefore send what they both sent ``PERIOD`` exchanges before, which was the same
on every rank or someone raised there: they cannot differ from each other. A rank
whose fingerprint changed (its first steps, a new input signature, eval after
train) checks on the host as before. One bit of each fingerprint says which way
its rank checks:

- every rank on the host: a mismatch raises on every rank with every rank's
  description, before any collective of the phase, as above;
- a rank on the host sees a mismatch with a rank that checks on the device (a
  rank whose step changed while the others ran theirs again): it raises at once,
  naming the ranks whose steps differ; the ranks checking on the device have
  issued the phase's collectives by then, which can never complete (the rank
  that raised issues none), and raise ``CollectiveMismatchError`` at their next
  phase, or when a wait of the phase fails. The groups are unusable afterwards on
  every rank (``Abandoned``).

The host backend (gloo) checks on the host always: the host runs its collectives,
so it waits for them anyway.

What the ranks agree on besides (``Share``). A phase checked on the host may also
carry an exchange of something every rank must hold alike: a rank that has such a
thing to settle sets the fingerprint's second bit (``SHARE``), and when the
fingerprints agree and some rank has set it, every rank, whether it asked or not,
sends its ``payload`` in one ``all_gather_object`` and takes everyone's. The ranks
decide from the same exchanged fingerprints, so all of them make that call or none
does: a rank that has settled its share already (its step compiled before a peer's
was) still takes part, and a rank whose payload fails sends None (with a warning)
rather than leave the others waiting in the exchange. The driver settles this way, at a step's first forward, the
CPU's timed matmuls and convolutions (the slowest rank's, so every rank's report
predicts the same).
"""

from __future__ import annotations

import hashlib
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fxshard.driver.run.runtime import World, comm_device, wait_within
from fxshard.ir import compat
from fxshard.ir.collectives import Collective
from fxshard.ir.errors import CollectiveMismatchError, FxShardError

Description = dict[str, Any]
AGREEMENT_BYTES = 8  # each rank's contribution to the agreement all_gather
ON_DEVICE = 1  # the fingerprint's lowest bit: its rank checks this phase on the device
SHARE = 2  # its second bit: its rank asks every rank to exchange their ``Share`` after the check
FLAGS = ON_DEVICE | SHARE  # not part of what the ranks compare
LAG = 2  # phases whose device-side check may be outstanding before the host waits for one
PERIOD = 2  # a fingerprint sent this many exchanges before on the same group: steady state
# The fingerprints this process last sent on each job group (the last PERIOD of them).
_SENT: weakref.WeakKeyDictionary[dist.ProcessGroup, list[int]] = weakref.WeakKeyDictionary()


def checks_on_device(device: torch.device) -> bool:
    """Whether a job whose steps' backend takes tensors on ``device`` checks steady-state
    phases on the device (a device's backend), not on the host (gloo)."""
    return device.type != "cpu"


@dataclass
class _Outstanding:
    """A phase's exchange checked on the device; its result arrives in ``flag`` when ``done``."""

    phase: str
    mine: int
    everyone: torch.Tensor  # the exchanged fingerprints (on the comm device)
    work: Any  # the exchange (the host backend's: done when it completes)
    event: Any  # recorded after the comparison (a device's; None on the host)
    flag: torch.Tensor | None  # a device's: whether some rank's fingerprint differs (pinned)
    since: float  # time.monotonic() when issued

    def done(self) -> bool:
        return bool(self.event.query()) if self.event is not None else bool(self.work.is_completed())

    def differs(self) -> bool:
        if self.flag is None:
            return _differs(self.everyone, self.mine)
        return bool(self.flag.item())


class Share(Protocol):
    """What every rank exchanges right after a phase's fingerprints agree, when some rank
    ``wants`` to (see the module's docstring): each rank's ``payload()``, everyone's handed
    to ``receive`` in rank order. Only on a phase checked on the host."""

    @property
    def wanted(self) -> bool: ...

    def payload(self) -> Any: ...

    def receive(self, everyone: list[Any]) -> None: ...


class Agreement:
    """The ranks' agreement as a driver runs it: on the host for a new fingerprint, on the
    device (without stopping the host) for one this rank agreed on before; see the module's
    docstring. ``on_device``: whether the steps' backend is a device's (default: the job
    group's ``comm_device`` is not the CPU)."""

    def __init__(self, world: World, on_device: bool | None = None):
        self.world = world
        self.outstanding: list[_Outstanding] = []
        self.active = not (world.group is None or world.job_size == 1
                           or dist.get_backend(world.group) == "fake")
        # torch's fake process group communicates nothing: nobody to agree with
        self.device = comm_device(world.job_group) if self.active else torch.device("cpu")
        self.on_device = checks_on_device(self.device) if on_device is None else on_device

    def agree(self, phase: str, fingerprint: bytes, describe: Callable[[], Description],
              share: Share | None = None) -> None:
        """Every rank about to run ``phase`` with ``fingerprint`` meets here. Raises
        ``CollectiveMismatchError`` unless all agree (at once, or for a phase checked on the
        device, at a later phase: ``settle``). ``share``: what this rank exchanges when some
        rank asks (``Share``); a rank that passes none sends None."""
        if not self.active:
            return
        self.settle(wait=False)
        group = self.world.job_group
        mine = int.from_bytes(fingerprint[:AGREEMENT_BYTES], "little", signed=True) & ~FLAGS
        sent = _SENT.setdefault(group, [])
        lazy = self.on_device and len(sent) == PERIOD and sent[0] == mine
        sent[:] = [*sent, mine][-PERIOD:]
        if lazy:
            mine |= ON_DEVICE
        elif share is not None and not self.on_device and share.wanted:
            mine |= SHARE
        value = torch.full((1,), mine, dtype=torch.int64, device=self.device)  # no copy: no host wait
        everyone = torch.empty(self.world.job_size, dtype=torch.int64, device=self.device)
        with compat.no_python_context():  # the backward's agreement runs inside a backward
            work = compat.all_gather_single(everyone, value, group=group, async_op=True)
        if lazy:
            self._outstanding(phase, mine, everyone, work)
            return
        self._wait(work, phase, time.monotonic())
        if not _differs(everyone, mine):
            if any(f & SHARE for f in everyone.tolist()):  # the same on every rank
                self._exchange(phase, share)
            return
        sent.clear()  # nothing is steady after a mismatch
        fingerprints = everyone.tolist()
        if any(f & ON_DEVICE for f in fingerprints):  # some ranks went on into the phase
            raise self._abandon(phase, mine, fingerprints, describe)
        descriptions: list[Description | None] = [None] * self.world.job_size
        with compat.no_python_context():
            dist.all_gather_object(descriptions, describe(), group=group)
        raise CollectiveMismatchError(_mismatch(descriptions, self.world))

    def _exchange(self, phase: str, share: Share | None) -> None:
        """Every rank's ``share`` (``Share``): each sends its payload, each takes everyone's.
        A rank whose payload fails sends None, with a warning, so that no rank waits on it."""
        try:
            mine = share.payload() if share is not None else None
        except Exception as e:  # noqa: BLE001 - the others are already in the exchange
            warnings.warn(f"fxshard: {self.world.who()} could not prepare what the ranks settle before the "
                          f"{phase} ({type(e).__name__}: {e}); it sent nothing and takes the other ranks'",
                          stacklevel=4)
            mine = None
        payloads: list[Any] = [None] * self.world.job_size
        with compat.no_python_context():
            dist.all_gather_object(payloads, mine, group=self.world.job_group)
        if share is not None:
            share.receive(payloads)

    def settle(self, wait: bool = True) -> None:
        """Read the results of phases checked on the device: those arrived (``wait=False``:
        waiting for the oldest only while more than ``LAG`` are outstanding), or all of them.
        Raises ``CollectiveMismatchError`` for one that found the ranks' fingerprints differ."""
        while self.outstanding:
            first = self.outstanding[0]
            if not first.done():
                if not wait and len(self.outstanding) <= LAG:
                    return
                self._wait(first.work, first.phase, first.since, event=first.event)
            self.outstanding.pop(0)
            if first.differs():
                self.outstanding.clear()
                _SENT.pop(self.world.job_group, None)
                raise self._abandon(first.phase, first.mine, first.everyone.tolist())

    def _outstanding(self, phase: str, mine: int, everyone: torch.Tensor, work: Any) -> None:
        event = flag = None
        if self.device.type != "cpu":
            work.wait()  # the device's current stream waits for the exchange; the host does not
            flag = torch.zeros((), dtype=torch.bool, pin_memory=True)
            flag.copy_(_differs_on_device(everyone, mine), non_blocking=True)
            event = torch.Event(device=self.device)
            event.record()
        self.outstanding.append(_Outstanding(phase, mine, everyone, work, event, flag, time.monotonic()))

    def _wait(self, work: Any, phase: str, since: float, event: Any = None) -> None:
        seconds = self.world.timeout.total_seconds() if self.world.timeout is not None else None

        def error(what: str) -> FxShardError:
            return FxShardError(
                f"{self.world.who()}: the other ranks did not reach the {phase} of this step {what}: "
                "a peer is gone, stalled, or busy elsewhere (validation or a barrier on "
                "some ranks only). Every rank must call the model the same number of times, in the "
                "same order; fxshard.compile(..., timeout=seconds) sets how long to wait (default: the "
                "process group's timeout).")

        if event is None:
            left = None if seconds is None else max(1e-3, seconds - (time.monotonic() - since))
            wait_within(work, left, error, self.world.job_group)
            return
        while not event.query():  # a device's: the exchange, then the comparison
            if seconds is not None and time.monotonic() - since > seconds:
                raise error(f"within {seconds:g}s")
            time.sleep(1e-4)

    def _abandon(self, phase: str, mine: int, fingerprints: list[int],
                 describe: Callable[[], Description] | None = None) -> CollectiveMismatchError:
        """The error of a mismatch that some ranks found after going on into ``phase`` (those
        whose fingerprint has the ``ON_DEVICE`` bit); ``describe``: this rank's step, when it
        checked on the host."""
        members = self.world.job_members()
        same = [r for r, f in zip(members, fingerprints) if (f & ~FLAGS) == (mine & ~FLAGS)]
        other = [r for r in members if r not in same]
        went_on = [r for r, f in zip(members, fingerprints) if f & ON_DEVICE]
        lines = [f"ranks would issue different collectives in the {phase} (seen from "
                 f"{self.world.who()}): {_ranks(same)} would run this rank's step, {_ranks(other)} "
                 "another."]
        if describe is not None:
            d = describe()
            lines.append(f"This rank's step: {d['phase']} of a {d['mode']} step, grad "
                         f"{'on' if d['grad'] else 'off'}, inputs {d['inputs']}, "
                         f"{len(d['collectives'])} collectives.")
        lines.append(
            f"{_ranks(went_on).capitalize()} ran the step {'it' if len(went_on) == 1 else 'they'} "
            "had run before and checked it on the device without stopping the host (a device's "
            "backend), so went on into the phase's collectives, which can never complete: the "
            "process groups are unusable now. Let the process exit (torchrun restarts the job). "
            "Every rank must run the same steps in the same order: the same model, policy and "
            "options, the same mode (train/eval) and grad mode, forward then backward.")
        error = CollectiveMismatchError("\n".join(lines))
        error.groups_unusable = True
        return error


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _differs(everyone: torch.Tensor, mine: int) -> bool:
    return any((f & ~FLAGS) != (mine & ~FLAGS) for f in everyone.tolist())


def _differs_on_device(everyone: torch.Tensor, mine: int) -> torch.Tensor:
    """On the device: whether any rank's fingerprint, its two low bits aside, differs from ``mine``."""
    return ((everyone >> 2) != ((mine & ~FLAGS) >> 2)).any()


def with_buffer_broadcast(fingerprint: bytes) -> bytes:
    """The fingerprint of a phase that starts with the broadcast of rank 0's buffers."""
    return hashlib.sha256(fingerprint + b"broadcast_buffers").digest()[:AGREEMENT_BYTES]


def describe_step(phase: str, graph: str, grad: bool, inputs: list[torch.Tensor],
                  collectives: list[Collective], broadcast: bool = False) -> Description:
    shapes = describe_tensors(inputs)
    issued = (["broadcast of rank 0's buffers"] if broadcast else []) + [str(c) for c in collectives]
    return {"phase": phase, "mode": "train" if graph != "inference" else "eval/inference",
            "grad": grad, "inputs": shapes or "none", "collectives": issued}


def _mismatch(descriptions: list[Description | None], world: World) -> str:
    """The ranks' steps (``descriptions``, in the job group's order), each under its job rank."""
    steps = [d or {} for d in descriptions]
    members = world.job_members()
    lines = [f"ranks would issue different collectives (seen from {world.who()}):"]
    for r, d in zip(members, steps):
        lines.append(f"  rank {r}: {d.get('phase')} of a {d.get('mode')} step, grad "
                     f"{'on' if d.get('grad') else 'off'}, inputs {d.get('inputs')}, "
                     f"{len(d.get('collectives', []))} collectives")
    seqs = [list(d.get("collectives", [])) for d in steps]
    for i in range(max(len(s) for s in seqs)):
        issued = [s[i] if i < len(s) else "(nothing: its phase ends here)" for s in seqs]
        if len(set(issued)) > 1:
            lines.append(f"collective #{i} of the step differs:")
            lines += [f"  rank {r}: {c}" for r, c in zip(members, issued)]
            break
    else:
        lines.append("their collectives print alike but the phases differ")
    lines.append(
        "Every rank must run the same steps in the same order: the same model, policy and "
        "options, the same mode (train/eval) and grad mode, forward then backward. Input "
        "shapes may differ where they change no collective (a smaller last batch)."
    )
    return "\n".join(lines)


def describe_tensors(tensors: Sequence[torch.Tensor]) -> str:
    """"float32[4, 12], int64[4]": dtypes and shapes, as messages and reports show inputs."""
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
