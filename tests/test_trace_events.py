"""Traces: ``fxshard explain --trace`` writes the predicted step as a Chrome trace, and a
compiled step run under ``torch.profiler`` names fxshard's collectives by unit.

The predicted trace is checked against the Trace Event Format by a validator
written here, and its collectives and frees are counted from the emitted
graphs' chains, not from the writer.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile

import fxshard
from fxshard.ir import predicates as P
from fxshard.ir.chains import chains
from fxshard.ir.plan import ShardPlan
from fxshard.policies import by_class

from graph_utils import fake_world
from models import Block, TinyGPT

PHASES = {"X", "B", "E", "i", "I", "M", "C"}
METADATA = {"process_name", "thread_name"}


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_chrome_trace(trace: object) -> list[dict[str, Any]]:
    """Raise AssertionError where ``trace`` breaks the Trace Event Format (the JSON object
    form) as Perfetto reads it; returns its events."""
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list), "no traceEvents list"
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    events: list[dict[str, Any]] = trace["traceEvents"]
    for e in events:
        assert isinstance(e, dict), e
        assert isinstance(e.get("name"), str) and e["name"], e
        assert e.get("ph") in PHASES, e
        assert type(e.get("pid")) is int and type(e.get("tid")) is int, e
        if e["ph"] != "M":
            assert _number(e.get("ts")) and e["ts"] >= 0, e
        if "args" in e:
            assert isinstance(e["args"], dict), e
        if e["ph"] == "X":
            assert _number(e.get("dur")) and e["dur"] >= 0, e
        elif e["ph"] == "M":
            assert e["name"] in METADATA and isinstance(e.get("args", {}).get("name"), str), e
        elif e["ph"] in ("i", "I"):
            assert e.get("s", "t") in ("g", "p", "t"), e
        elif e["ph"] == "C":
            assert e.get("args") and all(_number(v) for v in e["args"].values()), e
    # Complete events on one track nest or are disjoint.
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track, spans in tracks.items():
        stack: list[float] = []  # ends of the open spans
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1], f"{e['name']} overlaps its enclosing span on track {track}"
            stack.append(end)
    # Every process and every track with events is named.
    named = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    processes = {e["pid"] for e in events if e["name"] == "process_name"}
    for e in events:
        if e["ph"] in ("X", "i", "I", "B", "E"):
            assert (e["pid"], e["tid"]) in named, f"track of {e['name']} has no thread_name"
        assert e["pid"] in processes, f"process of {e['name']} has no process_name"
    return events


def test_the_validator_rejects_what_perfetto_does() -> None:
    def trace(*events: dict[str, Any]) -> dict[str, Any]:
        names = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "p"}},
                 {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "t"}}]
        return {"traceEvents": names + list(events)}

    def span(ts: int, dur: int) -> dict[str, Any]:
        return {"name": "a", "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": 1}

    check_chrome_trace(trace(span(0, 10), span(2, 3), span(10, 1)))  # nested, then disjoint
    with pytest.raises(AssertionError, match="overlaps"):
        check_chrome_trace(trace(span(0, 10), span(5, 10)))
    with pytest.raises(AssertionError, match="no thread_name"):
        check_chrome_trace(trace({**span(0, 1), "tid": 2}))
    with pytest.raises(AssertionError):
        check_chrome_trace(trace({**span(0, 1), "ts": -1}))


_KINDS: list[tuple[Callable[[fx.Node], bool], str]] = [
    (P.is_all_gather, "all_gather"), (P.is_reduce_scatter, "reduce_scatter"),
    (P.is_all_reduce, "all_reduce"), (P.is_all_to_all, "all_to_all")]


def _label(unit: str) -> str:
    return unit or "<root>"


def _expected(graphs: dict[str, fx.GraphModule]) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    """(kind unit, graph) of every collective, and (free unit, graph) of every free, read off
    the graphs' chains."""
    collectives: Counter[tuple[str, str]] = Counter()
    frees: Counter[tuple[str, str]] = Counter()
    for name, gm in graphs.items():
        for chain in chains(gm.graph):
            for c in chain.collectives:
                kind = next(k for is_kind, k in _KINDS if is_kind(c))
                collectives[(f"{kind} {_label(chain.unit)}", name)] += 1
            frees[(f"free {_label(chain.unit)}", name)] += len(chain.frees)
        assert sum(map(P.is_free, gm.graph.nodes)) == sum(n for (_, g), n in frees.items() if g == name)
    return collectives, +frees


def _check_content(events: list[dict[str, Any]], graphs: dict[str, fx.GraphModule], kinds: set[str]) -> None:
    collectives, frees = _expected(graphs)
    assert {key[0].split()[0] for key in collectives} == kinds
    found = Counter((e["name"], e["args"]["graph"]) for e in events
                    if e["ph"] == "X" and e["cat"].startswith("collective"))
    assert found == collectives  # every collective once, by kind, unit and graph
    assert all(e["args"]["bytes"] > 0 and e["args"]["lowering"] for e in events
               if e["ph"] == "X" and e["cat"].startswith("collective"))
    assert Counter((e["name"], e["args"]["graph"]) for e in events if e["ph"] == "i") == frees
    assert frees  # the forward frees each resharded unit
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "gather", "reduce"} <= tracks
    compute = [e for e in events if e["ph"] == "X" and e["cat"] == "compute"]
    assert any(e["name"] == "aten.mm" for e in compute)


@pytest.mark.parametrize("layout, kinds", [
    ({"world_size": 8}, {"all_gather", "reduce_scatter"}),
    ({"mesh_shape": (2, 4)}, {"all_gather", "reduce_scatter", "all_reduce"}),  # HSDP
    ({"world_size": 4, "reduce_in_rank_order": True}, {"all_gather", "all_to_all"}),
])
def test_explain_trace_has_every_collective_and_free(layout: dict[str, Any], kinds: set[str],
                                                     tmp_path: Path) -> None:
    from fxshard.driver.report.trace_events import write_trace

    with torch.device("meta"):
        model = TinyGPT()
    e = fxshard.explain(model, torch.randint(0, 61, (2, 16)), policy=by_class(Block), **layout)
    path = write_trace(tmp_path / "trace.json", e.graphs, e.report)
    trace = json.loads(path.read_text())
    events = check_chrome_trace(trace)
    _check_content(events, e.graphs, kinds)
    assert "node order" in trace["otherData"]["time_axis"]
    (process,) = [ev["args"]["name"] for ev in events if ev["name"] == "process_name"]
    assert process.startswith(f"rank 0 of {e.report.world_size} (predicted")
    # The memory counter is the report's live bytes after each node (the peak, inside a node, is
    # in otherData).
    memory = [ev["args"]["MiB"] * (1 << 20) for ev in events if ev["ph"] == "C"]
    curve = [b for name in ("forward", "backward") for b in e.report.memory_curve[name]]
    assert memory == [b for i, b in enumerate(curve) if i == 0 or b != curve[i - 1]]
    assert trace["otherData"]["predicted_peak_bytes"] == e.report.predicted_peak_bytes


@pytest.mark.parametrize("world_size", [1, 4])
def test_offloads_copies_have_a_track_of_their_own(world_size: int) -> None:
    """With offload_policy, each host-to-device copy before a gather and device-to-host copy
    after a reduction is on the copy track, named by unit, with its bytes (at world size 1
    the copy is the whole chain)."""
    from fxshard.driver.report.trace_events import chrome_trace
    from fxshard.ir import meta

    with torch.device("meta"):
        model = TinyGPT()
    e = fxshard.explain(model, torch.randint(0, 61, (2, 16)), policy=by_class(Block), world_size=world_size,
                        offload_policy=fxshard.CPUOffloadPolicy())
    expected: Counter[tuple[str, str]] = Counter()
    for name, gm in e.graphs.items():
        for chain in chains(gm.graph):
            for node in chain.nodes:
                way = {meta.Role.TO_DEVICE: "host->device", meta.Role.TO_HOST: "device->host"}.get(
                    meta.role_of(node))  # type: ignore[arg-type]
                if way:
                    expected[(f"{way} {_label(chain.unit)}", name)] += 1
    assert {k[0].split()[0] for k in expected} == {"host->device", "device->host"}
    events = check_chrome_trace(chrome_trace(e.graphs, e.report))
    (copy_tid,) = [ev["tid"] for ev in events if ev["name"] == "thread_name" and ev["args"]["name"] == "copy"]
    copies = [ev for ev in events if ev.get("cat") == "copy"]
    assert Counter((ev["name"], ev["args"]["graph"]) for ev in copies) == expected
    assert all(ev["tid"] == copy_tid and ev["args"]["bytes"] > 0 for ev in copies)
    from fxshard.driver.report.timeline import (
        _spans,  # the picture's "host copy" lane: the same copies
    )

    drawn = [kind for gm in e.graphs.values() for kind, *_ in _spans(gm, 0)[0]]
    assert drawn.count("copy") == sum(expected.values())


def test_collectives_in_flight_together_get_tracks_of_their_own() -> None:
    """fxshard's schedules keep one gather in flight at a time on this model; issued early by
    hand, the second one overlaps the first without nesting, which one track cannot hold."""
    from fxshard.driver.report.trace_events import chrome_trace

    with torch.device("meta"):
        model = TinyGPT()
    e = fxshard.explain(model, torch.randint(0, 61, (2, 16)), policy=by_class(Block), world_size=8)
    forward = e.graphs["forward"]
    first, second = [c for c in forward.graph.nodes if P.is_all_gather(c)][:2]
    assert all(a.op == "placeholder" for a in second.all_input_nodes)  # a shard: it can go first
    first.append(second)
    forward.graph.lint()
    events = check_chrome_trace(chrome_trace(e.graphs, e.report))
    tracks = {ev["args"]["name"] for ev in events if ev["name"] == "thread_name"}
    assert "gather (2)" in tracks
    _check_content(events, e.graphs, {"all_gather", "reduce_scatter"})


def test_cli_explain_writes_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fxshard import cli

    path = tmp_path / "out" / "step.json"
    args = ["explain", "models:TinyGPT", "--world-size", "8", "--policy", "by_class(Block)",
            "--input-shape", "2,16", "--input-dtype", "int64"]
    assert cli.main([*args, "--trace", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    events = check_chrome_trace(json.loads(path.read_text()))
    names = {ev["name"] for ev in events}
    for unit in ("<root>", "blocks.0", "blocks.1"):
        assert {f"all_gather {unit}", f"reduce_scatter {unit}"} <= names, unit
    # A path that cannot be written is an error that names it.
    assert cli.main([*args, "--trace", str(tmp_path)]) == 2
    assert f"cannot write the trace to {tmp_path}" in capsys.readouterr().err


def test_dump_writes_the_trace(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = TinyGPT()
    e = fxshard.explain(model, torch.randint(0, 61, (2, 16)), policy=by_class(Block), world_size=2)
    assert tmp_path / "trace.json" in e.dump(tmp_path)
    check_chrome_trace(json.loads((tmp_path / "trace.json").read_text()))


# -- named ranges at run time -------------------------------------------------------------------


def _profiled_step(**options: Any) -> tuple[Any, list[str], dict[str, fx.GraphModule], ShardPlan]:
    with fake_world(2):  # the fake group runs the step; its collectives move nothing
        torch.manual_seed(0)
        sharded = fxshard.compile(TinyGPT(), policy=by_class(Block), **options)
        x = torch.randint(0, 61, (2, 16))
        sharded(x).sum().backward()  # compiled outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sharded(x).sum().backward()
        return prof, [ev.name for ev in prof.events()], dict(sharded.graphs), sharded.plan


def test_profiled_step_names_every_collective_by_unit(tmp_path: Path) -> None:
    prof, names, graphs, plan = _profiled_step()
    ranges = Counter(n for n in names if n.startswith("fxshard "))
    expected: Counter[str] = Counter()
    for name in ("forward", "backward"):
        for chain in chains(graphs[name].graph):
            for c in chain.collectives:
                kind = next(k for is_kind, k in _KINDS if is_kind(c))
                expected[f"fxshard {kind} {_label(chain.unit)}"] += 1
                expected[f"fxshard wait {kind} {_label(chain.unit)}"] += 1
    assert ranges == expected  # one range per collective and one per wait, each run once
    for unit in plan.units:
        for kind in ("all_gather", "reduce_scatter"):
            assert f"fxshard {kind} {_label(unit.name)}" in ranges, (kind, unit.name)
    # The graphs one inspects (report, verify, sharded.graphs) have no profiler nodes.
    for gm in graphs.values():
        assert not any("record_function" in str(n.target) for n in gm.graph.nodes)
    path = tmp_path / "profile.json"
    prof.export_chrome_trace(str(path))
    exported = {ev.get("name") for ev in json.loads(path.read_text())["traceEvents"]}
    assert set(expected) <= exported
