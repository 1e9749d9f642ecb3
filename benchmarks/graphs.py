"""The benchmark GPT's emitted graphs and report on the installed torch, to compare releases.

    python benchmarks/graphs.py OUT/      # OUT/forward.py, OUT/backward.py, OUT/report.txt
    diff -r out-2.11/ out-2.13/           # the same files from another release

What the benchmark's ``fxshard`` system compiles (GPT 12 x 512, ``by_class(Block)``,
2 ranks), through ``fxshard.explain`` on meta tensors: rank 0's graphs as fx
prints them, and ``report()``. docs/devices.md lists what differs between
the supported releases.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import model_spec  # noqa: E402

import fxshard  # noqa: E402
from fxshard.policies import by_class  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="gpt")
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    spec = model_spec(args.model, quick=False)
    with torch.device("meta"):
        model = spec["make"]()
    x, _ = spec["inputs"](torch.Generator().manual_seed(0))
    policy = by_class(spec["block"])
    explained = fxshard.explain(model, (x,), policy, world_size=args.world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in ("forward", "backward"):
        (args.out / f"{kind}.py").write_text(explained.graphs[kind].code.strip() + "\n")
    (args.out / "report.txt").write_text(f"{explained.report}\n")
    print(f"torch {torch.__version__}: wrote {args.out}/forward.py, backward.py, report.txt")


if __name__ == "__main__":
    main()
