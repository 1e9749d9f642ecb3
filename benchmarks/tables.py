"""The measured tables in the README and docs, rendered from ``benchmarks/results/*.json``.

A document holds a table between two markers::

    <!-- results:NAME -->
    ...generated, never edited by hand...
    <!-- /results:NAME -->

``python benchmarks/tables.py`` rewrites every such block from the results;
``--check`` changes nothing and exits 1, naming the blocks, when a document
disagrees with the results (``tests/test_docs.py`` runs it). Prose next to a
table describes what it shows without quoting its numbers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "scheduling.md", ROOT / "docs" / "memory.md",
             ROOT / "docs" / "time.md")
sys.path.insert(0, str(HERE))

import run  # noqa: E402  (benchmarks/run.py: the one place that formats a run's tables)

SWEEP_SHAPES = run.SWEEP


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def benchmark() -> str:
    """The main run: every system's step time, peak, bytes; the fwd+bwd peak and overlap."""
    report = _load(RESULTS / "latest.json")
    return run.markdown(report["results"], report["meta"])


def checkpointing() -> str:
    """Activation checkpointing per block against FSDP2 with torch's checkpoint per block."""
    report = _load(RESULTS / "ac" / "latest.json")
    table = run.markdown(report["results"], report["meta"])
    return table[:table.index("\n\n", table.index("| model |"))] + "\n"


def scaling() -> str:
    return run.scaling_markdown(_load(RESULTS / "scaling.json"))


def sweep() -> str:
    """GPT shapes at the defaults against FSDP2, and with the root resharded against FSDP2 whose
    root is resharded too."""
    report = _load(RESULTS / "sweep" / "latest.json")
    rows = {(r["model"], r["system"]): r for r in report["results"] if "failed" not in r}

    def exposed(r: dict[str, Any]) -> str:
        return ", ".join(f"{r['gathers_exposed'][g]}/{r['gathers'][g]}" for g in ("forward", "backward"))

    lines = [f"Machine: {report['meta']['machine']}; torch {report['meta']['torch']}; gloo, world size "
             f"{report['meta']['world_size']}; sequence 64.", "",
             "| shape (width / layers / vocab / batch) | fwd+bwd peak | step peak | step time | "
             "gathers exposed (fwd, bwd) | root resharded: fwd+bwd peak | step time | gathers exposed |",
             "|---|---:|---:|---:|---|---:|---:|---|"]
    for model, shape in SWEEP_SHAPES.items():
        f, rr = rows.get((model, "fxshard")), rows.get((model, "fxshard_reshard_root"))
        if f is None or rr is None:
            continue
        lines.append(
            f"| {' / '.join(map(str, shape))} | {f['fb_peak_bytes_vs_fsdp2']:.2f} | "
            f"{f['peak_bytes_vs_fsdp2']:.2f} | {f['step_s_vs_fsdp2']:.2f} | {exposed(f)} | "
            f"{rr['fb_peak_bytes_vs_fsdp2_reshard_root']:.2f} | "
            f"{rr['step_s_vs_fsdp2_reshard_root']:.2f} | {exposed(rr)} |")
    return "\n".join(lines) + "\n"


def time_prediction() -> str:
    """benchmarks/time.py: the predicted step and large collectives against the measured."""
    import importlib.util

    # By path: "time" is the standard library's module.
    spec = importlib.util.spec_from_file_location("time_benchmark", HERE / "time.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = _load(RESULTS / "time.json")
    return str(module.markdown(report["results"], report["meta"]))


def auto_choice() -> str:
    """benchmarks/auto.py: auto()'s measured step against the fastest alternative within FSDP2's peak."""
    import auto

    report = _load(RESULTS / "auto.json")
    return str(auto.markdown(report["results"], report["meta"]))


BLOCKS: dict[str, Callable[[], str]] = {"benchmark": benchmark, "scaling": scaling, "sweep": sweep,
                                        "checkpointing": checkpointing, "time": time_prediction,
                                        "auto": auto_choice}
_BLOCK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def render(text: str) -> str:
    """``text`` with every results block rendered anew; an unknown block name raises."""
    def replace(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in BLOCKS:
            raise KeyError(f"unknown results block {name!r}; the blocks are {sorted(BLOCKS)}")
        return m.group(1) + BLOCKS[name]().rstrip("\n") + "\n" + m.group(4)

    return _BLOCK.sub(replace, text)


def stale(documents: tuple[Path, ...] = DOCUMENTS) -> list[str]:
    """The blocks whose text differs from the results, as 'file: block' strings."""
    out = []
    for path in documents:
        text = path.read_text()
        fresh = render(text)
        if fresh != text:
            names = [m.group(2) for m, n in zip(_BLOCK.finditer(text), _BLOCK.finditer(fresh))
                     if m.group(0) != n.group(0)]
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            out += [f"{shown}: {name}" for name in names]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = p.parse_args(argv)
    if args.check:
        found = stale()
        for line in found:
            print(f"stale: {line} (run python benchmarks/tables.py)")
        return 1 if found else 0
    for path in DOCUMENTS:
        path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
