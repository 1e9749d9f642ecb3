"""A picture of one rank's step: compute and communication lanes, predicted memory, unit windows.

The x axis is predicted milliseconds when the report has a time (``report.time``:
fxshard/ir/cost.py), the forward graph, then the backward graph; a collective
spans its start to its end on its process group. Without one (``explain`` with
no hardware) it is node order, which does not depend on the machine. Needs
matplotlib (the ``viz`` extra).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.fx as fx  # noqa: E402

from fxshard.driver.report.step_report import Report  # noqa: E402
from fxshard.ir import meta  # noqa: E402
from fxshard.ir import predicates as P  # noqa: E402
from fxshard.ir.analysis import aliases, order_of  # noqa: E402
from fxshard.ir.chains import chains  # noqa: E402
from fxshard.ir.cost import StepTime, node_times  # noqa: E402
from fxshard.ir.plan import ShardPlan  # noqa: E402

Spans = tuple[list[tuple[str, str, float, float]], list[tuple[str, float, float]], list[float]]


def _spans(gm: fx.GraphModule, offset: int, time: StepTime | None = None, graph: str = "") -> Spans:
    """(kind, unit, start, end) per collective (its issue and wait in node order, its start
    and end in predicted ms), and (copy, unit, at, at) per offload copy; (unit, start, end)
    per gathered buffer's use; compute positions. ``time``: ``graph``'s predicted times."""
    if time is None:
        order = order_of(gm.graph, offset)
        at = {n: (float(i), float(i)) for n, i in order.items()}
        ran: dict[str, tuple[float, float]] = {}
    else:
        at = {n: (a * 1e3, b * 1e3) for n, (a, b) in node_times(time, graph, gm).items()}
        ran = {c.node: (c.start * 1e3, c.end * 1e3) for c in time.collectives if c.graph == graph}
    comms, windows = [], []
    found = chains(gm.graph)
    in_chain = {n for c in found for n in c.nodes}
    for chain in found:
        kind = chain.direction.value
        for collective, wait in zip(chain.collectives, chain.waits):
            start, end = ran.get(collective.name, (at[collective][0], at[wait][0]))
            comms.append((kind, chain.unit, start, end))
        for node in chain.nodes:
            if meta.role_of(node) in (meta.Role.TO_DEVICE, meta.Role.TO_HOST):
                comms.append(("copy", chain.unit, at[node][0], at[node][1]))
        if chain.gathers:
            start = at[(chain.waits or (chain.result,))[-1]][1]  # ready: after its last wait (offloaded: the copy)
            uses = [at[u][1] for v in aliases(chain.result) for u in v.users if not P.is_free(u)]
            windows.append((chain.unit, start, max(uses, default=start)))
    compute = [at[n][0] for n in gm.graph.nodes
               if n.op == "call_function" and n not in in_chain and not P.is_view(n)]
    return sorted(comms, key=lambda c: c[2]), windows, compute


def draw_timeline(path: Path, plan: ShardPlan, emitted: dict[str, fx.GraphModule], report: Report,
                  world_size: int, rank: int) -> None:
    graphs = [(name, emitted[name]) for name in ("forward", "backward") if name in emitted]
    units = [u.name for u in plan.units]
    colors = {u: plt.cm.tab20(i % 20) for i, u in enumerate(units)}
    fig, (lanes, mem) = plt.subplots(2, 1, figsize=(14, 6), sharex=True,
                                     gridspec_kw={"height_ratios": [1, 1.4]})
    time = report.time
    # The narrowest bar drawn: one node, or a thousandth of the predicted step.
    least = 0.8 if time is None else time.seconds * 1e3 / 1000
    offset, boundaries = 0, []
    for name, gm in graphs:
        comms, windows, compute = _spans(gm, offset, time, name)
        lanes.vlines(compute, 1.6, 2.4, color="0.35", linewidth=0.6)
        for kind, unit, start, end in comms:
            y = {"gather": 0.75, "copy": 1.25}.get(kind, 0.25)
            lanes.broken_barh([(start, max(end - start, least))], (y - 0.2, 0.4),
                              facecolor=colors.get(unit, "0.5"), edgecolor="black", linewidth=0.4)
        for unit, start, end in windows:
            mem.axvspan(start, end, color=colors.get(unit, "0.5"), alpha=0.18, linewidth=0)
            mem.text((start + end) / 2, 0.98, unit or "<root>", rotation=90, va="top", ha="center",
                     fontsize=7, transform=mem.get_xaxis_transform())
        curve = report.memory_curve.get(name, ())
        if time is None:
            xs: list[float] = [float(x) for x in range(offset, offset + len(curve))]
            offset += len(gm.graph.nodes)
            boundaries.append((name, float(offset)))
        else:  # the live bytes after each node, where the node ends
            xs = [b * 1e3 for _, b in node_times(time, name, gm).values()][:len(curve)]
            boundaries.append((name, next(b for g, _, b in time.graphs if g == name) * 1e3))
        mem.plot(xs, [b / (1 << 20) for b in curve[:len(xs)]], color="C3")
    for _, end in boundaries[:-1]:
        for ax in (lanes, mem):
            ax.axvline(end, color="black", linestyle="--", linewidth=1)
    lanes.set_yticks([0.25, 0.75, 1.25, 2.0], ["reduce", "gather", "host copy", "compute"])
    lanes.set_ylim(0, 2.6)
    axis = "node order" if time is None else f"predicted ms, rates {time.rates}"
    lanes.set_title(f"fxshard step, rank {rank} of {world_size}: "
                    f"{' | '.join(n for n, _ in graphs)} (x: {axis})", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[u]) for u in units]
    lanes.legend(handles, [u or "<root>" for u in units], loc="upper right", fontsize=7, ncol=4)
    mem.set_ylabel("predicted live MiB")
    mem.set_xlabel("node (forward, then backward)" if time is None else
                   "predicted ms (forward, then backward)")
    mem.axhline(report.predicted_peak_bytes / (1 << 20), color="C3", linestyle=":",
                linewidth=1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
