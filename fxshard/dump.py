"""Dumps: graph code after each pass (with diffs), a timeline picture, the unit graph.

Files written to the dump directory:

    plan.txt, report.txt
    passes/NN-<graph>-<pass>.py      graph code after each pass
    passes/NN-<graph>-<pass>.diff    unified diff against the graph before that pass
    timeline.png, timeline.svg       one rank's step: compute and communication lanes,
                                     predicted live memory, unit windows (needs matplotlib)
    units.graphml, units.dot         the unit graph (execution order, nesting)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from fxshard.explain import Explanation

log = logging.getLogger("fxshard")


def _dot(graph: nx.DiGraph) -> str:
    lines = ["digraph units {", "  rankdir=LR;", "  node [shape=box];"]
    for node, data in graph.nodes(data=True):
        lines.append(f'  "{node}" [label="{node}\\n{data.get("numel", 0):,} params"];')
    for a, b, data in graph.edges(data=True):
        style = "solid" if data.get("kind") == "order" else "dashed"
        lines.append(f'  "{a}" -> "{b}" [style={style}, label="{data.get("kind", "")}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dump(explanation: Explanation, directory: Path) -> list[Path]:
    from fxshard.explain import pass_diffs

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "passes").mkdir(exist_ok=True)
    written: list[Path] = []

    def write(path: Path, text: str) -> None:
        path.write_text(text)
        written.append(path)

    write(directory / "plan.txt", str(explanation.plan) + "\n")
    write(directory / "report.txt", str(explanation.report) + "\n")
    for i, (graph, name, code, diff) in enumerate(pass_diffs(explanation.passes)):
        stem = f"{i:02d}-{graph}-{name}"
        write(directory / "passes" / f"{stem}.py", code)
        write(directory / "passes" / f"{stem}.diff", diff)
    units = explanation.plan.unit_graph()
    # GraphML wants scalar attributes.
    for _, data in units.nodes(data=True):
        data["groups"] = ",".join(map(str, data.get("groups", [])))
    nx.write_graphml(units, directory / "units.graphml")
    written.append(directory / "units.graphml")
    write(directory / "units.dot", _dot(units))
    try:
        from fxshard.timeline import draw_timeline
    except ImportError as e:  # matplotlib is an optional extra
        log.warning("fxshard: no timeline picture (%s); pip install 'fxshard[viz]'", e)
        return written
    for suffix in ("png", "svg"):
        path = directory / f"timeline.{suffix}"
        draw_timeline(explanation, path)
        written.append(path)
    return written
