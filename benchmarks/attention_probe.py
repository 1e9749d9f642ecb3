"""Which attention kernel a CUDA plan traces on this machine, and how long a 2-layer explain takes.

    python benchmarks/attention_probe.py

On a machine without CUDA, ``explain(device="cuda")`` traces CUDA's fused (flash)
attention on meta. Where the math kernel is traced instead, every layer keeps its
2048 x 2048 scores for backward, and a memory budget searches far longer (it must
recompute): benchmarks/gpu_check.sh's ``plan70`` mode runs this first.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]


def main() -> None:
    import fxshard
    from fxshard.policies import by_class
    from tests.test_explain import _llama3_8b

    from llama import TransformerBlock

    start = time.perf_counter()
    e = fxshard.explain(_llama3_8b(2), torch.zeros(1, 2048, dtype=torch.long), by_class(TransformerBlock),
                        device="cuda", mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16))
    ops = collections.Counter(f"{name}: {n.target}" for name, g in e.graphs.items() for n in g.graph.nodes
                              if any(k in str(n.target) for k in ("attention", "softmax", "bmm")))
    print(f"cuda available: {torch.cuda.is_available()}; torch {torch.__version__}; "
          f"explain of 2 layers: {time.perf_counter() - start:.1f} s")
    for op, count in sorted(ops.items()):
        print(f"  {count:3d}  {op}")


if __name__ == "__main__":
    main()
