"""The predicted timeline of one rank's step as a Chrome trace (Trace Event Format).

The same step as ``timeline.py``'s picture, as JSON that Perfetto
(ui.perfetto.dev) and chrome://tracing open, without matplotlib:

    process  "rank 0 of 8 (predicted)"
      compute            forward graph [ aten.mm | aten.add | ... ]  backward graph [ ... ]
                         free blocks.0 (instant)
      gather             all_gather blocks.0 [issue ... wait]   all_gather blocks.1 [...]
      gather (2)         a gather in flight while another one is (prefetch, fp8's scales)
      reduce             reduce_scatter blocks.1 [issue ... wait]  all_reduce ... (HSDP)
      copy               offload: host->device blocks.0 before its gather, device->host after
                         its reduction (only with offload_policy)
      predicted live memory  (counter, MiB: the report's live bytes after each node; the
                             predicted peak, reached inside a node, is in otherData)

The time axis is predicted microseconds when the report has a time
(``report.time``: rates measured on the live group, or a hardware profile; see
``fxshard.ir.cost``): each node spans its predicted start to end on the compute
stream, each collective its group's start to end, and a wait the compute stream
sat through is drawn there as a span of its own. Without one (``explain`` with
no hardware), it is node order: node ``i`` of the forward graph spans
``[i, i + 1)`` µs and the backward graph's nodes follow the forward's, so a
collective's span counts the nodes from it to its wait. ``otherData`` says which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from fxshard.driver.report.step_report import Report
from fxshard.ir import meta
from fxshard.ir import predicates as P
from fxshard.ir.analysis import order_of
from fxshard.ir.chains import chains
from fxshard.ir.collectives import KINDS
from fxshard.ir.cost import StepTime, node_times

TIME_AXIS = ("node order, not time: each node of the emitted graphs takes 1 us, the forward "
             "graph's nodes first, then the backward graph's; a collective spans its issue to its wait")
PREDICTED_AXIS = ("predicted microseconds (rates: {rates}): the compute stream runs the forward graph, then "
                  "the backward graph; a collective spans its start to its end on its process group")
COMPUTE_TID = 1  # the communication tracks follow: gather's lanes, then reduce's


def unit_label(unit: str) -> str:
    return unit or "<root>"


def _nbytes(node: object) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _op_name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return str(packet) if packet is not None else getattr(target, "__name__", str(target))


def _lane(lanes: list[float], start: float, end: float) -> int:
    """The first lane free from ``start`` on (spans on one track must nest or be disjoint)."""
    for i, busy_until in enumerate(lanes):
        if busy_until <= start:
            lanes[i] = end
            return i
    lanes.append(end)
    return len(lanes) - 1


def _clock(name: str, gm: fx.GraphModule, offset: float,
           time: StepTime | None) -> dict[fx.Node, tuple[float, float]]:
    """Each node's start and end on the trace's axis: node order from ``offset``, or the
    predicted microseconds (a node that costs nothing sits where the previous one ended)."""
    if time is None:
        return {n: (offset + i, offset + i + 1.0) for n, i in order_of(gm.graph).items()}
    return {n: (start * 1e6, end * 1e6) for n, (start, end) in node_times(time, name, gm).items()}


def chrome_trace(graphs: dict[str, fx.GraphModule], report: Report) -> dict[str, Any]:
    """The Trace Event Format object of one rank's predicted step: ``graphs`` are the emitted
    ``"forward"`` (or ``"inference"``) and ``"backward"`` graphs, ``report`` their report."""
    names = [name for name in ("forward", "inference", "backward") if name in graphs]
    if not names:
        raise ValueError(f"chrome_trace: no forward, inference or backward graph in {sorted(graphs)}")
    pid = report.rank
    events: list[dict[str, Any]] = []
    spans: list[tuple[str, float, float, dict[str, Any]]] = []  # direction, start, end, event
    copies: list[dict[str, Any]] = []
    time = report.time
    at = {(c.graph, c.node): c for c in time.collectives} if time is not None else {}
    offset, last = 0.0, -1
    for name in names:
        gm = graphs[name]
        clock = _clock(name, gm, offset, time)
        start, end = (offset, offset + len(clock)) if time is None else \
            next((a * 1e6, b * 1e6) for g, a, b in time.graphs if g == name)
        events.append({"name": f"{name} graph", "cat": "graph", "ph": "X", "ts": start, "dur": end - start,
                       "pid": pid, "tid": COMPUTE_TID, "args": {"nodes": len(clock)}})
        found = chains(gm.graph)
        in_chain = {n for c in found for n in c.nodes}
        for node in gm.graph.nodes:
            if node.op == "call_function" and node not in in_chain and not P.is_view(node):
                args: dict[str, Any] = {"graph": name, "node": node.name, "op": str(node.target)}
                module = meta.module_path(node)
                if module is not None:
                    args["module"] = unit_label(module)
                begin, finish = clock[node]
                events.append({"name": _op_name(node), "cat": "compute", "ph": "X", "ts": begin,
                               "dur": finish - begin, "pid": pid, "tid": COMPUTE_TID, "args": args})
        for chain in found:
            direction = chain.direction.value
            for collective in chain.collectives:
                (wait,) = collective.users  # invariant 3: a collective's one user is its wait
                kind = KINDS[collective.target]  # type: ignore[index]
                span = at.get((name, collective.name))
                if span is not None:
                    begin, finish = span.start * 1e6, span.end * 1e6
                    if span.exposed > 0:  # the compute stream waits for it
                        events.append({"name": f"wait {kind} {unit_label(chain.unit)}", "cat": "wait", "ph": "X",
                                       "ts": span.waited * 1e6, "dur": span.exposed * 1e6, "pid": pid,
                                       "tid": COMPUTE_TID, "args": {"graph": name, "wait": wait.name}})
                else:
                    begin, finish = clock[collective][0], clock[wait][1]
                extra = {} if span is None else {"issued_us": span.issued * 1e6, "exposed_us": span.exposed * 1e6}
                spans.append((direction, begin, finish, {
                    "name": f"{kind} {unit_label(chain.unit)}", "cat": f"collective,{direction}",
                    "ph": "X", "ts": begin, "dur": finish - begin, "pid": pid,
                    "args": {"graph": name, "unit": unit_label(chain.unit), "kind": kind,
                             "bytes": _nbytes(P.collective_args(collective).input), "lowering": chain.lowering,
                             "group": P.group_name(collective), "issue": collective.name,
                             "wait": wait.name, **extra}}))
            for node in chain.nodes:
                role = meta.role_of(node)
                if role in (meta.Role.TO_DEVICE, meta.Role.TO_HOST):
                    way = "host->device" if role is meta.Role.TO_DEVICE else "device->host"
                    begin, finish = clock[node]
                    copies.append({"name": f"{way} {unit_label(chain.unit)}", "cat": "copy", "ph": "X",
                                   "ts": begin, "dur": finish - begin, "pid": pid,
                                   "args": {"graph": name, "unit": unit_label(chain.unit),
                                            "bytes": _nbytes(node), "lowering": chain.lowering,
                                            "node": node.name}})
            for free in chain.frees:
                events.append({"name": f"free {unit_label(chain.unit)}", "cat": "free", "ph": "i",
                               "s": "t", "ts": clock[free][0], "pid": pid, "tid": COMPUTE_TID,
                               "args": {"graph": name, "unit": unit_label(chain.unit),
                                        "bytes": _nbytes(free.args[0]), "node": free.name}})
        curve = report.memory_curve.get("forward" if name == "inference" else name, ())
        ends = [finish for _, finish in clock.values()]
        for i, live in enumerate(curve):
            if live != last:  # a counter holds its value until the next sample
                events.append({"name": "predicted live memory", "cat": "memory", "ph": "C",
                               "ts": ends[i] if i < len(ends) else end, "pid": pid, "tid": COMPUTE_TID,
                               "args": {"MiB": live / (1 << 20)}})
                last = live
        offset = end
    lanes: dict[str, list[float]] = {"gather": [], "reduce": []}  # per direction: each lane's end
    placed = [(direction, _lane(lanes[direction], start, end), event)
              for direction, start, end, event in sorted(spans, key=lambda s: (s[1], -s[2]))]
    where = f", {report.topology}" if report.topology else ""
    tracks = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
               "args": {"name": f"rank {report.rank} of {report.world_size} (predicted{where})"}},
              {"name": "thread_name", "ph": "M", "pid": pid, "tid": COMPUTE_TID, "args": {"name": "compute"}}]
    tids: dict[tuple[str, int], int] = {}
    for direction, ends in lanes.items():
        for i in range(len(ends)):
            tids[(direction, i)] = COMPUTE_TID + 1 + len(tids)
            tracks.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tids[(direction, i)],
                           "args": {"name": direction if i == 0 else f"{direction} ({i + 1})"}})
    for direction, lane, event in placed:
        events.append({**event, "tid": tids[(direction, lane)]})
    if copies:  # one node each, in graph order: they never overlap
        copy_tid = COMPUTE_TID + 1 + len(tids)
        tracks.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": copy_tid, "args": {"name": "copy"}})
        events.extend({**event, "tid": copy_tid} for event in copies)
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    return {
        "traceEvents": tracks + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "fxshard: predicted from the emitted graphs; nothing ran",
            "time_axis": TIME_AXIS if time is None else PREDICTED_AXIS.format(rates=time.rates),
            **({} if time is None else {"predicted_step_seconds": report.predicted_step_seconds,
                                        "exposed_comm_seconds": report.exposed_comm_seconds}),
            "graphs": ", ".join(names),
            "rank": report.rank,
            "world_size": report.world_size,
            "predicted_peak_bytes": report.predicted_peak_bytes,
            "peak_phase": report.peak_phase,
        },
    }


def write_trace(path: str | Path, graphs: dict[str, fx.GraphModule], report: Report) -> Path:
    """Write ``chrome_trace(graphs, report)`` to ``path`` (its directory is made); returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(graphs, report)) + "\n")
    return path
