"""Dumps: graph code after each pass (with diffs), a timeline picture, the unit graph.

Files written to the dump directory:

    plan.txt, report.txt
    passes/NN-<graph>-<pass>.py      graph code after each pass
    passes/NN-<graph>-<pass>.diff    unified diff against the graph before that pass
    trace.json                       the same step as a Chrome trace (Perfetto); x: node order
    timeline.png, timeline.svg       one rank's step: compute and communication lanes,
                                     predicted live memory, unit windows (needs matplotlib)
    units.graphml, units.dot         the unit graph (execution order, nesting)
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import torch.fx as fx

from fxshard.driver.report.step_report import Report
from fxshard.driver.report.trace_events import write_trace
from fxshard.ir.plan import ShardPlan

log = logging.getLogger("fxshard")


@dataclass
class PassLog:
    """The code of each graph as traced and after each pass, in order: an ``on_pass`` hook."""

    steps: list[tuple[str, str, str]] = field(default_factory=list)  # (graph, pass, code)

    def __call__(self, graph: str, pass_name: str, gm: fx.GraphModule) -> None:
        gm.recompile()
        self.steps.append((graph, pass_name, gm.code))


def pass_diffs(passes: PassLog) -> list[tuple[str, str, str, str]]:
    """(graph, pass, code, unified diff against the previous step of the same graph)."""
    previous: dict[str, str] = {}
    out = []
    for graph, name, code in passes.steps:
        before = previous.get(graph, "")
        diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), code.splitlines(keepends=True),
                                            fromfile=f"{graph} before {name}", tofile=f"{graph} after {name}"))
        out.append((graph, name, code, diff))
        previous[graph] = code
    return out


def _dot(graph: nx.DiGraph) -> str:
    lines = ["digraph units {", "  rankdir=LR;", "  node [shape=box];"]
    for node, data in graph.nodes(data=True):
        lines.append(f'  "{node}" [label="{node}\\n{data.get("numel", 0):,} params"];')
    for a, b, data in graph.edges(data=True):
        style = "solid" if data.get("kind") == "order" else "dashed"
        lines.append(f'  "{a}" -> "{b}" [style={style}, label="{data.get("kind", "")}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dump(directory: Path, *, plan: ShardPlan, graphs: dict[str, fx.GraphModule],
               report: Report, passes: PassLog, world_size: int, rank: int) -> list[Path]:
    """Write one compiled step's dump into ``directory``; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "passes").mkdir(exist_ok=True)
    written: list[Path] = []

    def write(path: Path, text: str) -> None:
        path.write_text(text)
        written.append(path)

    write(directory / "plan.txt", str(plan) + "\n")
    write(directory / "report.txt", str(report) + "\n")
    for i, (graph, name, code, diff) in enumerate(pass_diffs(passes)):
        stem = f"{i:02d}-{graph}-{name}"
        write(directory / "passes" / f"{stem}.py", code)
        write(directory / "passes" / f"{stem}.diff", diff)
    units = plan.unit_graph()
    # GraphML wants scalar attributes.
    for _, data in units.nodes(data=True):
        data["groups"] = ",".join(map(str, data.get("groups", [])))
    nx.write_graphml(units, directory / "units.graphml")
    written.append(directory / "units.graphml")
    write(directory / "units.dot", _dot(units))
    written.append(write_trace(directory / "trace.json", graphs, report))
    try:
        from fxshard.driver.report.timeline import draw_timeline
    except ImportError as e:  # matplotlib is an optional extra
        log.warning("fxshard: no timeline picture (%s); install matplotlib (from a clone: "
                    "pip install -e \".[viz]\")", e)
        return written
    for suffix in ("png", "svg"):
        path = directory / f"timeline.{suffix}"
        draw_timeline(path, plan, graphs, report, world_size, rank)
        written.append(path)
    return written
