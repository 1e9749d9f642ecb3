"""Which attention kernel a CUDA plan traces on this machine, what each kernel costs the plan,
and what the 70 GiB plan's memory budget tries.

    python benchmarks/attention_probe.py                 # the kernel a 2-layer plan traces
    python benchmarks/attention_probe.py --kernels       # each kernel forced, 2 and 4 layers
    python benchmarks/attention_probe.py --plan70 [--flash]
                                                         # tests/test_cuda.py's 70 GiB plan, with
                                                         # every candidate the budget tried

A Llama-3-8B shape (benchmarks/llama.py), sequence 2048, bf16 parameters, planned with
``explain(device="cuda")`` on fake tensors. On a machine without CUDA, explain traces CUDA's
fused (flash) attention on meta; torch 2.11 on an H200 traces cuDNN's. Where the math kernel is
traced instead, every layer keeps its 2048 x 2048 scores for backward, and a memory budget
searches far longer (it must recompute). benchmarks/results/gpu/plan70.md holds what this
printed on an H200 (docs/gpu.md, "The CUDA tests").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

GIB = 1 << 30


def _llama(layers: int) -> torch.nn.Module:
    from llama import LLAMA3_8B, Llama

    with torch.device("meta"):
        return Llama(dataclasses.replace(LLAMA3_8B, layers=layers))


def _explain(layers: int, backends: list[Any] | None = None, **options: Any) -> Any:
    import fxshard
    from fxshard.policies import by_class

    from llama import TransformerBlock

    forced: Any = contextlib.nullcontext()
    if backends is not None:
        from torch.nn.attention import sdpa_kernel

        forced = sdpa_kernel(backends)
    with forced:
        return fxshard.explain(_llama(layers), torch.zeros(1, 2048, dtype=torch.long), by_class(TransformerBlock),
                               device="cuda", mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16),
                               **options)


def _attention(e: Any) -> list[str]:
    """Each graph's first attention node, with its outputs' shapes and dtypes."""
    lines = []
    for name, gm in e.graphs.items():
        for node in gm.graph.nodes:
            if "attention" in str(node.target):
                value = node.meta.get("val")
                values = value if isinstance(value, (tuple, list)) else [value]
                shapes = [(tuple(t.shape), str(t.dtype).removeprefix("torch."))
                          for t in values if isinstance(t, torch.Tensor)]
                lines.append(f"    {name} {node.target} {shapes}")
                break
    return lines


def _largest(report: Any) -> str:
    forward, backward = (max(report.memory_curve.get(k, (0,))) / GIB for k in ("forward", "backward"))
    return f"max live forward {forward:.3f} GiB, backward {backward:.3f} GiB"


def kernels() -> None:
    """Each kernel forced, on 2 and 4 layers with AdamW: the peak and the largest live bytes."""
    from torch.nn.attention import SDPBackend

    forced: dict[str, list[Any] | None] = {
        "default": None, "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION]}
    for layers in (2, 4):
        for name, backends in forced.items():
            start = time.perf_counter()
            try:
                e = _explain(layers, backends, optimizer=torch.optim.AdamW)
            except Exception as exc:  # noqa: BLE001 - a kernel this machine lacks: say so, go on
                print(f"{layers} layers, {name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            r = e.report
            print(f"{layers} layers, {name}: peak {r.predicted_peak_bytes / GIB:.3f} GiB at {r.peak_phase}; "
                  f"temporaries at peak {r.activation_bytes_at_peak / GIB:.3f} GiB; "
                  f"{time.perf_counter() - start:.1f} s")
            print("\n".join(_attention(e)))
            print(f"    {_largest(r)}")


def plan70(flash: bool) -> None:
    """tests/test_cuda.py's plan: 32 layers, AdamW, memory_budget=70 GiB with offload."""
    from torch.nn.attention import SDPBackend

    import fxshard

    start = time.perf_counter()
    r = _explain(32, [SDPBackend.FLASH_ATTENTION] if flash else None, optimizer=torch.optim.AdamW,
                 memory_budget=70 * GIB, offload_policy=fxshard.CPUOffloadPolicy()).report
    print(f"{'flash forced' if flash else 'default kernel'}: {time.perf_counter() - start:.1f} s; "
          f"peak {r.predicted_peak_bytes / GIB:.3f} GiB at {r.peak_phase}")
    print(_largest(r))
    print(f"chosen: {r.budget.chosen.describe()} (ladder step: {r.budget.chosen.step})")
    print(f"{len(r.budget.tried)} candidates tried:")
    for label, peak in r.budget.tried:
        print(f"  {peak / GIB:8.3f} GiB  {label}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", action="store_true", help="each attention kernel forced, 2 and 4 layers")
    p.add_argument("--plan70", action="store_true", help="the 70 GiB plan, with what the budget tried")
    p.add_argument("--flash", action="store_true", help="with --plan70: flash attention forced")
    args = p.parse_args()
    if args.flash and not args.plan70:
        p.error("--flash forces the kernel of --plan70's plan: pass both")
    if args.kernels:
        kernels()
    if args.plan70:
        plan70(args.flash)
    if args.kernels or args.plan70:
        return
    start = time.perf_counter()
    e = _explain(2)
    ops = collections.Counter(f"{name}: {n.target}" for name, g in e.graphs.items() for n in g.graph.nodes
                              if any(k in str(n.target) for k in ("attention", "softmax", "bmm")))
    print(f"cuda available: {torch.cuda.is_available()}; torch {torch.__version__}; "
          f"explain of 2 layers: {time.perf_counter() - start:.1f} s")
    for op, count in sorted(ops.items()):
        print(f"  {count:3d}  {op}")


if __name__ == "__main__":
    main()
