"""A picture of one rank's step: compute and communication lanes, predicted memory, unit windows.

The x axis is node order: the forward graph, then the backward graph. Time
on a real machine depends on it; order does not. Needs matplotlib (the
``viz`` extra).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch.fx as fx  # noqa: E402

from fxshard.driver.report import Report  # noqa: E402
from fxshard.ir import meta  # noqa: E402
from fxshard.ir import predicates as P  # noqa: E402
from fxshard.ir.analysis import aliases, order_of  # noqa: E402
from fxshard.ir.chains import chains  # noqa: E402
from fxshard.ir.plan import ShardPlan  # noqa: E402


def _spans(gm: fx.GraphModule, offset: int) -> tuple[list[tuple[str, str, int, int]], list[tuple[str, int, int]], list[int]]:
    """(kind, unit, issue, wait) per collective, and (copy, unit, at, at) per offload copy;
    (unit, start, end) per gathered buffer's use; compute positions."""
    order = order_of(gm.graph, offset)
    comms, windows = [], []
    found = chains(gm.graph)
    in_chain = {n for c in found for n in c.nodes}
    for chain in found:
        kind = chain.direction.value
        for collective, wait in zip(chain.collectives, chain.waits):
            comms.append((kind, chain.unit, order[collective], order[wait]))
        for node in chain.nodes:
            if meta.role_of(node) in (meta.Role.TO_DEVICE, meta.Role.TO_HOST):
                comms.append(("copy", chain.unit, order[node], order[node]))
        if chain.gathers:
            start = order[(chain.waits or (chain.result,))[0]]  # one offloaded rank: the copy
            uses = [order[u] for v in aliases(chain.result) for u in v.users if not P.is_free(u)]
            windows.append((chain.unit, start, max(uses, default=start)))
    compute = [order[n] for n in gm.graph.nodes
               if n.op == "call_function" and n not in in_chain and not P.is_view(n)]
    return sorted(comms, key=lambda c: c[2]), windows, compute


def draw_timeline(path: Path, plan: ShardPlan, emitted: dict[str, fx.GraphModule], report: Report,
                  world_size: int, rank: int) -> None:
    graphs = [(name, emitted[name]) for name in ("forward", "backward") if name in emitted]
    units = [u.name for u in plan.units]
    colors = {u: plt.cm.tab20(i % 20) for i, u in enumerate(units)}
    fig, (lanes, mem) = plt.subplots(2, 1, figsize=(14, 6), sharex=True,
                                     gridspec_kw={"height_ratios": [1, 1.4]})
    offset, boundaries = 0, []
    for name, gm in graphs:
        comms, windows, compute = _spans(gm, offset)
        lanes.vlines(compute, 1.6, 2.4, color="0.35", linewidth=0.6)
        for kind, unit, start, end in comms:
            y = {"gather": 0.75, "copy": 1.25}.get(kind, 0.25)
            lanes.broken_barh([(start, max(end - start, 0.8))], (y - 0.2, 0.4),
                              facecolor=colors.get(unit, "0.5"), edgecolor="black", linewidth=0.4)
        for unit, start, end in windows:
            mem.axvspan(start, end, color=colors.get(unit, "0.5"), alpha=0.18, linewidth=0)
            mem.text((start + end) / 2, 0.98, unit or "<root>", rotation=90, va="top", ha="center",
                     fontsize=7, transform=mem.get_xaxis_transform())
        curve = report.memory_curve.get(name, ())
        mem.plot(range(offset, offset + len(curve)), [b / (1 << 20) for b in curve], color="C3")
        offset += len(gm.graph.nodes)
        boundaries.append((name, offset))
    for _, end in boundaries[:-1]:
        for ax in (lanes, mem):
            ax.axvline(end, color="black", linestyle="--", linewidth=1)
    lanes.set_yticks([0.25, 0.75, 1.25, 2.0], ["reduce", "gather", "host copy", "compute"])
    lanes.set_ylim(0, 2.6)
    lanes.set_title(f"fxshard step, rank {rank} of {world_size}: "
                    f"{' | '.join(n for n, _ in graphs)} (x: node order)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[u]) for u in units]
    lanes.legend(handles, [u or "<root>" for u in units], loc="upper right", fontsize=7, ncol=4)
    mem.set_ylabel("predicted live MiB")
    mem.set_xlabel("node (forward, then backward)")
    mem.axhline(report.predicted_peak_bytes / (1 << 20), color="C3", linestyle=":",
                linewidth=1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
