"""``sharded.report()``: predicted peak memory, communication and time of one step, per rank.

Everything here is read off the emitted graphs (``meta["val"]`` sizes, the
collective nodes), so it is known before the step first runs. The time comes
from the same graphs and a set of rates (``fxshard.ir.cost``: measured on the
live group, or a named hardware profile). The measured counterparts live in
fxshard.measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from fxshard.ir import compat, meta
from fxshard.ir.auto import AutoChoice
from fxshard.ir.budget import BudgetChoice
from fxshard.ir.chains import COLLECTIVE_ROLES
from fxshard.ir.collectives import Collective, bytes_per_dimension, bytes_per_kind
from fxshard.ir.cost import StepTime
from fxshard.ir.memory import simulate
from fxshard.ir.optimizer import OptimizerState
from fxshard.ir.plan import ShardPlan


@dataclass(frozen=True)
class UnitReport:
    name: str
    padded_bytes: int  # the unit's full (gathered) flat buffers
    shard_bytes: int  # what this rank holds
    gathers: int  # all_gathers of its parameters per step
    comm_bytes: int  # bus bytes per step, all kinds
    # Predicted seconds per step (None: no rates): its nodes on the compute stream, its
    # collectives from start to end, and how long compute waited for them.
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    exposed_comm_seconds: float | None = None


@dataclass(frozen=True)
class Report:
    world_size: int
    rank: int
    # One steady-state training step: forward + backward, gradients cleared beforehand,
    # and with optimizer= its state on the device throughout and the optimizer step after.
    predicted_peak_bytes: int
    peak_phase: str  # "forward" or "backward", and the node at the peak; or "optimizer step"
    shard_bytes: int  # parameters held by this rank
    grad_shard_bytes: int
    buffer_bytes: int  # module buffers (BatchNorm statistics)
    input_bytes: int
    # Bus bytes per rank, per kind and "total". "agreement" is the ranks' 8-byte
    # all_gather before each phase (driver/run/consistency.py); "broadcast" is rank
    # 0's buffers, with broadcast_buffers (what each other rank receives).
    comm_bytes_per_step: dict[str, int]
    units: tuple[UnitReport, ...]
    # The steps' collectives' bus bytes per layout dimension: "shard", under HSDP
    # "replicate" (between replicas, what crosses nodes), under hpZ "partition"
    # (backward's gathers); the agreement is not counted.
    comm_bytes_per_dimension: dict[str, int] = field(default_factory=dict)
    # no_sync: the unsharded gradient sums (one full gradient per flat group) that
    # a step inside no_sync, or the first after, keeps; counted in the peak.
    accumulator_bytes: int = 0
    # Offload: the parameter and gradient shards on the host, not in the device peak, and
    # with optimizer= their optimizer state, which follows them there.
    host_bytes: int = 0
    offloaded_shard_bytes: int = 0  # the part of shard_bytes on the host
    # optimizer=: the optimizer's state on the device (its shards' states), alive through
    # every phase of a steady-state step (it exists from the first step on); the optimizer
    # step's phase adds the step's temporaries. 0 without optimizer=.
    optimizer_state_bytes: int = 0
    optimizer: str = ""
    # Predicted live bytes after each node of the forward, then the backward graph.
    memory_curve: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    # At the peak, in the graph of ``peak_phase``: bytes of each storage alive, by owning node.
    at_peak: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    # ``at_peak`` by what owns it, as the chains declare it: units' gathered parameters (a
    # gather chain's all_gather outputs, or its dequantized buffers), gradients in their
    # reductions (a reduction chain's collective outputs), and the rest: activations
    # (saved for backward, or made in this graph) and temporaries. 0 at the optimizer step.
    gathered_bytes_at_peak: int = 0
    reducing_bytes_at_peak: int = 0
    activation_bytes_at_peak: int = 0
    # memory_budget=: what the planner chose per unit, and why, and the inputs of the
    # step it planned on (the first training step; later ones keep its choice).
    budget: BudgetChoice | None = field(default=None, compare=False)
    budget_inputs: str = field(default="", compare=False)
    # policy=auto(): the plan and schedule it chose, and every trial with its predicted time
    # and peak (fxshard.ir.auto).
    auto: AutoChoice | None = field(default=None, compare=False)
    step: str = field(default="", compare=False)  # which step this describes
    # Where this rank sits beyond its shard group: "rank 3 of 4 in the job; replica 1
    # of 2" under HSDP, hpZ's partition; "" on one flat group.
    topology: str = field(default="", compare=False)
    # The device type a running step computes on ("" for explain): offload to the host moves
    # nothing when it is "cpu".
    compute_device: str = field(default="", compare=False)
    # Time (None: no rates; explain without hardware=). The step: forward then backward on
    # one compute stream, the collectives on their process groups (fxshard.ir.cost), plus
    # with optimizer= its step. The compute stream computes or waits, so
    # predicted_step_seconds == compute + exposed communication (+ the optimizer step).
    predicted_step_seconds: float | None = None
    exposed_comm_seconds: float | None = None
    predicted_compute_seconds: float | None = None
    predicted_optimizer_seconds: float = 0.0
    time: StepTime | None = field(default=None, repr=False, compare=False)

    @property
    def mfu(self) -> float | None:
        """The step's FLOPs utilisation: the seconds its graphs' FLOPs take at the device's peak
        rate (recomputation included), over the predicted step. None: no time."""
        if self.time is None or not self.predicted_step_seconds:
            return None
        return self.time.peak_seconds / self.predicted_step_seconds

    @property
    def within_budget(self) -> bool | None:
        """Whether this step's predicted peak is within ``memory_budget`` (None: no budget)."""
        return None if self.budget is None else self.predicted_peak_bytes <= self.budget.budget

    def __str__(self) -> str:
        mib = 1 << 20
        lines = [
            f"fxshard report: rank {self.rank} of {self.world_size}"
            + (" in the shard group" if self.topology else "")
            + (f", the latest {self.step}" if self.step else ""),
            *([f"  topology            {self.topology}"] if self.topology else []),
            f"  predicted peak      {self.predicted_peak_bytes / mib:10.3f} MiB  (at {self.peak_phase})",
            *self._time_lines(),
            f"  parameter shards    {self.shard_bytes / mib:10.3f} MiB",
            f"  gradient shards     {self.grad_shard_bytes / mib:10.3f} MiB",
            f"  buffers, inputs     {(self.buffer_bytes + self.input_bytes) / mib:10.3f} MiB",
            *([f"  at the peak: gathered units {self.gathered_bytes_at_peak / mib:.3f} MiB, gradients "
               f"being reduced {self.reducing_bytes_at_peak / mib:.3f} MiB, activations and "
               f"temporaries {self.activation_bytes_at_peak / mib:.3f} MiB"] if self.at_peak else []),
            *([f"  optimizer state     {self.optimizer_state_bytes / mib:10.3f} MiB  ({self.optimizer}, "
               "on the device)"] if self.optimizer else []),
            *([f"  on the host         {self.host_bytes / mib:10.3f} MiB  (offloaded parameter and "
               "gradient shards" + (", and their optimizer state" if self.optimizer else
                                    "; the optimizer state follows them") + "; not in the peak)"]
              if self.host_bytes else []),
            *(["  (the step computes on the CPU: offload moved nothing, the host is the device; "
               "the peak above leaves those bytes out as it would on an accelerator)"]
              if self.host_bytes and self.compute_device == "cpu" else []),
            "  communication per step (bytes each rank sends):",
        ]
        for kind, value in self.comm_bytes_per_step.items():
            lines.append(f"    {kind:<16}{value / mib:10.3f} MiB")
        if set(self.comm_bytes_per_dimension) - {"shard"}:
            lines.append("  the steps' collectives per mesh dimension:")
            for dim, value in self.comm_bytes_per_dimension.items():
                lines.append(f"    {dim:<16}{value / mib:10.3f} MiB  ({_WHERE[dim]})")
        header: tuple[str, ...] = ("unit", "gathered MiB", "shard MiB", "gathers", "comm MiB")
        rows: list[tuple[str, ...]] = [
            (u.name or "<root>", f"{u.padded_bytes / mib:.3f}", f"{u.shard_bytes / mib:.3f}",
             str(u.gathers), f"{u.comm_bytes / mib:.3f}") for u in self.units]
        if self.time is not None:
            header += ("compute ms", "comm ms", "exposed ms")
            rows = [(*r, *(f"{(s or 0.0) * 1e3:.3f}" for s in (u.compute_seconds, u.comm_seconds,
                                                               u.exposed_comm_seconds)))
                    for r, u in zip(rows, self.units)]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            lines.append("  " + "  ".join(c.rjust(w) if i else c.ljust(w)
                                          for i, (c, w) in enumerate(zip(r, widths))))
        if self.auto is not None:
            lines += ["  " + line for line in self.auto.table().splitlines()]
        if self.budget is not None:
            lines += ["  " + line for line in self.budget.table().splitlines()]
            if self.budget_inputs:
                lines.append(f"  (planned on the first training step, inputs {self.budget_inputs})")
            if not self.within_budget:
                lines.append(
                    f"  this step exceeds the memory budget: predicted peak "
                    f"{self.predicted_peak_bytes / mib:.3f} MiB > {self.budget.budget / mib:.3f} MiB. "
                    "The budget plans once, on the first training step, and every later step keeps "
                    "that schedule (so every rank issues the same collectives). Make the largest "
                    "batch the first: call the model with it first, or pass it as example_inputs= "
                    "to fxshard.compile.")
        return "\n".join(lines)


    def _time_lines(self) -> list[str]:
        if self.time is None or self.predicted_step_seconds is None:
            return []
        t, ms = self.time, 1e3
        parts = [f"compute {t.compute_seconds * ms:.3f} ms",
                 f"exposed communication {t.exposed_comm_seconds * ms:.3f} ms"
                 + (f" (the agreement {t.agreement_seconds * ms:.3f})" if t.agreement_seconds else "")]
        if self.predicted_optimizer_seconds:
            parts.append(f"optimizer step {self.predicted_optimizer_seconds * ms:.3f} ms")
        named = {u.name for u in self.units} | {"agreement"}
        outside = sum(u.compute_seconds for u in t.units if u.name not in named)
        return [f"  predicted step      {self.predicted_step_seconds * ms:10.3f} ms   ({'; '.join(parts)})",
                f"  communication       {t.comm_seconds * ms:10.3f} ms   (the collectives start to end, "
                "overlapped or not)",
                *([f"  FLOPs utilisation   {self.mfu:10.1%}      ({t.flops / 1e12:.4g} TFLOP per step at the "
                   "device's peak rate, recomputation included)"] if self.mfu is not None and t.flops else []),
                *([f"  compute outside the units' modules {outside * ms:.3f} ms"] if outside else []),
                *([f"  fresh pages         {t.fresh_bytes / 2 ** 20:10.3f} MiB  faulted in a step, in the "
                   f"compute (glibc's mmap threshold taken at {t.mmap_threshold / 2 ** 20:.3g} MiB)"]
                  if t.mmap_threshold is not None else []),
                f"  rates               {t.rates}"]


def timed(report: Report, time: StepTime, optimizer_seconds: float = 0.0) -> Report:
    """``report`` with the predicted ``time`` of its step (and its optimizer step's seconds)."""
    per_unit = {u.name: u for u in time.units}
    units = tuple(replace(u, compute_seconds=per_unit[u.name].compute_seconds if u.name in per_unit else 0.0,
                          comm_seconds=per_unit[u.name].comm_seconds if u.name in per_unit else 0.0,
                          exposed_comm_seconds=per_unit[u.name].exposed_comm_seconds
                          if u.name in per_unit else 0.0)
                  for u in report.units)
    return replace(report, units=units, predicted_step_seconds=time.seconds + optimizer_seconds,
                   exposed_comm_seconds=time.exposed_comm_seconds,
                   predicted_compute_seconds=time.compute_seconds,
                   predicted_optimizer_seconds=optimizer_seconds, time=time)


_WHERE = {"shard": "inside the shard group", "replicate": "between replicas",
          "partition": "inside hpZ's partitions"}


def _tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# Where a step's peak is in the caller's loss (build_report): after forward, before backward.
LOSS_PHASE = "forward: the caller's loss, between forward and backward"
# The loss between the graphs, where the graphs do not compute it, is taken to be a
# cross-entropy over the largest output: in its backward, log_softmax's saved result and
# the two gradients (of that result, then of the output) are alive at once, three tensors
# of the output's size, while the output itself is dropped by a caller that keeps only the
# loss (``loss = F.cross_entropy(model(x), y)``): two more than forward left.
LOSS_COPIES = 2


def loss_bytes(backward: fx.GraphModule) -> int:
    """The bytes the caller's loss holds above what forward left (``LOSS_COPIES``): none where
    an output is a scalar that needs a gradient (the loss is in the graphs), else that many
    copies of the largest output with a gradient (a backward's tangents are those outputs')."""
    vals = [n.meta.get("val") for n in backward.graph.nodes if meta.is_tangent(n)]
    vals = [v for v in vals if isinstance(v, torch.Tensor)]
    if not vals or any(v.dim() == 0 for v in vals):
        return 0
    return LOSS_COPIES * max(_tensor_bytes([v]) for v in vals)


def build_report(
    plan: ShardPlan,
    rank: int,
    graphs: dict[str, fx.GraphModule],
    sequence: list[Collective],
    shards: list[torch.Tensor],
    buffer_bytes: int,
    input_bytes: int,
    num_user_outputs: int | None = None,
    agreement_bytes: int = 0,
    broadcast_bytes: int = 0,
    accumulator_bytes: int = 0,
    host_groups: frozenset[int] = frozenset(),
    optimizer: OptimizerState | None = None,
    library_bytes: int = 0,
    compute_device: torch.device | None = None,
) -> Report:
    shard_bytes = _tensor_bytes(shards)
    grad_bytes = _tensor_bytes([s for s in shards if s.requires_grad])
    # Offload: these groups' shards and gradient shards live on the host; the graphs copy
    # them in and out (the copies to the host count nothing on the device: fxshard.ir.memory).
    host = [s for g, s in enumerate(shards) if g in host_groups]
    host_grads = _tensor_bytes([s for s in host if s.requires_grad])
    host_bytes = _tensor_bytes(host) + host_grads
    # optimizer=: the state of the shards on the device. It exists from the first step on,
    # so a steady-state step holds it through forward and backward too.
    state_bytes = 0 if optimizer is None else optimizer.states * (grad_bytes - host_grads)
    # library_bytes: what the device's math libraries hold for the compute stream, no tensor of
    # the step's (cuBLAS's workspaces: calibrate.library_bytes), there through the whole step.
    base = (shard_bytes - _tensor_bytes(host) + buffer_bytes + input_bytes + accumulator_bytes + state_bytes
            + library_bytes)
    forward = graphs.get("forward", graphs.get("inference"))
    assert forward is not None
    persistent = {n.name for n in forward.graph.nodes if n.op == "placeholder"}
    fw, outs = simulate(forward, {}, persistent, base)
    peak, phase, at_peak = fw.peak, f"forward: {fw.peak_at}", fw.at_peak
    curves = {"forward": tuple(fw.curve)}
    if "backward" in graphs and num_user_outputs is not None:
        backward = graphs["backward"]
        # Backward's inputs are the forward's outputs past the user outputs, in order.
        fw_out = next(n for n in forward.graph.nodes if n.op == "output").args[0]
        saved_names = [a.name if isinstance(a, fx.Node) else None
                       for a in fw_out[num_user_outputs:]]
        bw_inputs = [n for n in backward.graph.nodes
                     if n.op == "placeholder" and not meta.is_tangent(n)]
        as_forward = dict(zip([n.name for n in bw_inputs], saved_names))
        # Saved tensors carry their forward storage into backward (views of
        # one storage share it); tangents (gradients of the outputs) arrive fresh.
        tangents = {n.name for n in backward.graph.nodes if meta.is_tangent(n)}
        inputs: dict[str, int] = {}
        shared: dict[str, str] = {}
        owners: dict[str, str] = {}
        for n in backward.graph.nodes:
            if n.op != "placeholder":
                continue
            if meta.is_tangent(n):
                inputs[n.name] = _tensor_bytes([n.meta["val"]])
            elif as_forward.get(n.name) in outs:
                owner, nbytes = outs[as_forward[n.name]]
                if owner in owners:
                    shared[n.name] = owners[owner]
                else:
                    owners[owner] = n.name
                    inputs[n.name] = nbytes
        # The caller's loss runs between the graphs, outside them.
        loss = loss_bytes(backward)
        if loss:
            curves["loss"] = (fw.end + loss,)
            if fw.end + loss > peak:
                peak, phase, at_peak = fw.end + loss, LOSS_PHASE, fw.at_end
        carried = {k for k in inputs if k not in tangents}
        # The backward graph is called in the boxed convention (codegen._boxed):
        # a saved tensor dies after its last use there, unless it is also a
        # user output, which the caller still holds.
        user_outputs = {a.name for a in fw_out[:num_user_outputs] if isinstance(a, fx.Node)}
        held = {k for k in carried if as_forward.get(k) in user_outputs}
        if compat.BACKWARD_HOLDS_TANGENTS:  # torch 2.11: the tangents live through backward
            held |= tangents
        bw, _ = simulate(backward, inputs, held, fw.end - sum(inputs[k] for k in carried), shared)
        curves["backward"] = tuple(bw.curve)
        if bw.peak > peak:
            peak, phase, at_peak = bw.peak, f"backward: {bw.peak_at}", bw.at_peak
        if optimizer is not None:
            # The optimizer step: what backward leaves (the shards, their gradients, the
            # state) and the step's temporaries; the host's shards step on the host.
            host_bytes += optimizer.states * host_grads
            # compute_device: where the shards compute when the driver holds them elsewhere
            # (under offload, every shard on the host until placed); else their own device.
            on_device = [s for g, s in enumerate(shards) if g not in host_groups and s.requires_grad]
            device = compute_device or (on_device[0].device if on_device else torch.device("meta"))
            step = bw.end + optimizer.step_temporary_bytes([_tensor_bytes([s]) for s in on_device], device,
                                                           with_host=host_grads > 0)
            curves["optimizer step"] = (step,)
            if step > peak:
                peak, phase, at_peak = step, "optimizer step", {}
    peak_graph = forward if phase.startswith("forward") else graphs.get("backward", forward)
    node_of: dict[str, fx.Node] = {n.name: n for n in peak_graph.graph.nodes} if at_peak else {}
    # The buffers at the peak by their chain's declaration: a gather chain's gathered (or
    # decoded) buffer, a reduction chain's collective results.
    def held_by(name: str) -> str:
        info = meta.get_info(node_of[name])
        if info is None or info.chain is None:
            return "activations"
        if info.chain.direction is meta.Direction.GATHER:
            return "gathered" if info.role in (meta.Role.ALL_GATHER, meta.Role.DECODE) else "activations"
        return "reducing" if info.role in COLLECTIVE_ROLES else "activations"

    owners = {name: held_by(name) for name in at_peak}
    gathered = sum(b for name, b in at_peak.items() if owners[name] == "gathered")
    reducing = sum(b for name, b in at_peak.items() if owners[name] == "reducing")
    units = []
    for unit in plan.units:
        groups = [plan.groups[g] for g in unit.groups]
        mine = [c for c in sequence if c.unit == unit.name]
        units.append(UnitReport(
            unit.name,
            sum(g.padded_numel * g.dtype.itemsize for g in groups),
            sum(g.shard_numel * g.dtype.itemsize for g in groups),
            sum(1 for c in mine if c.kind == "all_gather" and c.direction == "gather"),
            sum(c.bus_bytes for c in mine),
        ))
    return Report(plan.world_size, rank, peak, phase, shard_bytes, grad_bytes, buffer_bytes,
                  input_bytes, bytes_per_kind(sequence, agreement_bytes, broadcast_bytes), tuple(units),
                  bytes_per_dimension(sequence), accumulator_bytes=accumulator_bytes, host_bytes=host_bytes,
                  offloaded_shard_bytes=_tensor_bytes(host),
                  optimizer_state_bytes=state_bytes,
                  optimizer=str(optimizer) if "optimizer step" in curves else "",
                  memory_curve=curves, at_peak=at_peak, gathered_bytes_at_peak=gathered,
                  reducing_bytes_at_peak=reducing,
                  activation_bytes_at_peak=sum(at_peak.values()) - gathered - reducing)
