"""GPU benchmark: fxshard against FSDP2 on a Llama-3-8B shape, one process per system.

    python benchmarks/gpu.py                      # speed, then offload (needs a CUDA GPU)
    python benchmarks/gpu.py --parts speed        # only the four systems at world size 8 and 1
    python benchmarks/gpu.py --parts offload      # only offload at world size 1
    python benchmarks/gpu.py --device cpu --quick # a tiny shape on the CPU: checks the script

**speed.** A Llama-3-8B shape (``--layers`` blocks at full width, the
published vocabulary), bf16 compute with fp32 shards, optimizer state and
gradient reduction (``fxshard.MixedPrecision(param_dtype=bf16,
reduce_dtype=fp32)``; FSDP2's ``MixedPrecisionPolicy`` with the same fields),
fused AdamW, sequence ``--seq``, the loss (fp32 cross-entropy) inside the
model. Units: one per ``TransformerBlock``, and the root. Systems:

- ``fxshard``: fxshard with eager compute;
- ``fxshard_inductor``: fxshard with ``compute="inductor"``;
- ``fsdp2``: ``fully_shard`` per block, then the root;
- ``fsdp2_compile``: the same, each block ``torch.compile``d first (torchtitan's order).

Each runs at world size 8 on torch's fake process group (one GPU computes
rank 0's step: compute, scheduling and memory per rank; the collectives
communicate nothing and cost nothing) and at world size 1 on nccl (one GPU,
everything real). Every model is built whole on the device from the same seed,
then sharded, so the world-size-1 runs start from equal weights and see equal
batches: their losses are compared (numerics).

**offload.** The same shape with ``--offload-layers`` blocks at world size 1 on
nccl, too large for the GPU unless its shards, gradients and optimizer state
live on the host: ``fxshard`` without offload (expected: out of memory),
``fxshard_offload`` (``offload_policy=fxshard.CPUOffloadPolicy()``) and
``fsdp2_offload`` (FSDP2's ``CPUOffloadPolicy``); both step AdamW on the host.

Measured per system, rank 0: step time (CUDA events around forward, backward
and optimizer step; the median of the measured steps after the warm-up),
``torch.cuda.max_memory_allocated`` over the measured steps, MFU (model FLOPs,
torchtitan's count: 6 per parameter outside the embedding and 12·layers·dim·seq
for attention, per token, against the bf16 matrix-product rate measured at the
start of the same run), and for fxshard the peak its report predicted.

Results: ``--out`` (default benchmarks/results/gpu): ``latest.json`` and
``latest.md``. Ratios are against FSDP2 measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import LLAMA3_8B, Llama, LlamaConfig, TransformerBlock  # noqa: E402

SPEED_SYSTEMS = ("fxshard", "fxshard_inductor", "fsdp2", "fsdp2_compile")
OFFLOAD_SYSTEMS = ("fxshard", "fxshard_offload", "fsdp2_offload")
# fxshard_host_agreement: fxshard with the ranks' agreement read on the host before every
# phase, as a gloo job reads it (a device's backend checks steady-state phases on the device).
TIME_SYSTEMS = ("fxshard", "fxshard_host_agreement", "fsdp2", "fxshard_auto")
GIB = 1 << 30


class LlamaLM(nn.Module):
    """The Llama with its loss inside: the step the memory model sees is the whole step."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.model = Llama(config)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def flops_per_token(config: LlamaConfig, seq: int) -> float:
    """torchtitan's count: 6 FLOPs per parameter outside the embedding, and attention's
    12 * layers * dim * seq (the whole score matrix)."""
    per_layer = (2 * config.dim * config.dim + 2 * config.dim * (config.dim // config.heads * config.kv_heads)
                 + 3 * config.dim * config.ffn + 2 * config.dim)
    params = config.layers * per_layer + config.dim + config.vocab * config.dim  # output layer, final norm
    return 6 * params + 12 * config.layers * config.dim * seq


def matmul_rate(device: torch.device) -> float:
    """bf16 matrix-product FLOP/s on random data, measured here (the MFU's denominator)."""
    if device.type != "cuda":
        return float("nan")
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


# -- one system, in its own process -----------------------------------------------------------


def _init_group(world: str, device: torch.device) -> int:
    if world.startswith("rehearse"):  # "rehearse8:h100-nvlink": fxshard.rehearse's process group
        import fxshard

        size, hardware = world[len("rehearse"):].split(":")
        fxshard.rehearse(int(size), hardware, device=device)
        return int(size)
    if world.startswith("fake"):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        size = int(world[len("fake"):])
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
        return size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    return 1


def _world_size(world: str) -> int:
    """fake8, rehearse8:h100-nvlink, nccl1: the ranks the world stands for."""
    return int("".join(c for c in world.split(":")[0] if c.isdigit()))


def _build(config: LlamaConfig, device: torch.device) -> LlamaLM:
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaLM(config)


def _batches(config: LlamaConfig, batch: int, seq: int, steps: int, device: torch.device) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # Fused AdamW: one kernel on the GPU, and torch's fused CPU kernel on the host.
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def _fxshard(model: nn.Module, system: str, device: torch.device, example: Any = None,
             budget_gib: float | None = None) -> tuple[nn.Module, Any]:
    import fxshard
    from fxshard.policies import auto, by_class

    options: dict[str, Any] = {
        "mixed_precision": fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "optimizer": functools.partial(torch.optim.AdamW, fused=True),  # what _optimizer builds
    }
    if system == "fxshard_inductor":
        options["compute"] = "inductor"
    if system == "fxshard_offload":
        options["offload_policy"] = fxshard.CPUOffloadPolicy(pin_memory=True)
    if system == "fxshard_host_agreement":
        from fxshard.driver.run import consistency

        consistency.checks_on_device = lambda device: False  # type: ignore[assignment]
    policy: Any = by_class(TransformerBlock)
    if system == "fxshard_auto":  # the plan fxshard predicts fastest within the budget (FSDP2's peak)
        policy, options["example_inputs"] = auto(), example
        if budget_gib is not None:
            options["memory_budget"] = int(budget_gib * GIB)
    sharded = fxshard.compile(model, policy, **options)
    return sharded, sharded


def _fsdp2(model: nn.Module, system: str, device: torch.device, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if system == "fsdp2_offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in model.model.layers:
        if system == "fsdp2_compile":
            block.compile()
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    system, world = spec["system"], spec["world"]
    config = LlamaConfig(**spec["config"])
    result: dict[str, Any] = {"system": system, "world": world, "layers": config.layers}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world_size = _init_group(world, device)
    try:
        t0 = time.perf_counter()
        model = _build(config, device)
        result["params"] = sum(p.numel() for p in model.parameters())
        report = None
        if system.startswith("fxshard"):
            first = _batches(config, spec["batch"], spec["seq"], 1, device)[0]
            model, sharded = _fxshard(model, system, device, first, spec.get("budget_gib"))
        else:
            model = _fsdp2(model, system, device, world_size)
        optimizer = _optimizer(model.parameters())
        result["setup_s"] = time.perf_counter() - t0
        batches = _batches(config, spec["batch"], spec["seq"], spec["warmup"] + spec["steps"], device)
        times, losses = [], []
        for i, (tokens, targets) in enumerate(batches):
            if i == spec["warmup"] and device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                result["allocated_before_measured_gib"] = torch.cuda.memory_allocated() / GIB
            t = time.perf_counter()
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                elapsed = time.perf_counter() - t
            if i == 0:
                result["first_step_s"] = elapsed
                if system.startswith("fxshard"):
                    report = sharded.report()
            if i >= spec["warmup"]:
                times.append(elapsed)
            losses.append(float(loss.detach()))
        result["step_s"] = statistics.median(times)
        result["losses"] = losses
        if device.type == "cuda":
            # The measured steps again, back to back with no synchronize between them, as a
            # training loop runs: the host may run ahead of the GPU across steps.
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for tokens, targets in batches[spec["warmup"]:]:
                model(tokens, targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            end.record()
            torch.cuda.synchronize()
            result["back_to_back_step_s"] = start.elapsed_time(end) / 1e3 / spec["steps"]
        if device.type == "cuda":
            result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            result["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        if report is not None:
            if report.auto is not None:
                result["auto"] = report.auto.table()
            result["predicted_step_s"] = report.predicted_step_seconds
            result["predicted_exposed_s"] = report.exposed_comm_seconds
            result["rates"] = report.time.rates if report.time is not None else None
            result["predicted_peak_gib"] = report.predicted_peak_bytes / GIB
            result["predicted_phase"] = report.peak_phase
            result["host_gib"] = report.host_bytes / GIB
            result["report"] = str(report)
        tokens_per_step = spec["batch"] * spec["seq"]
        result["model_tflop"] = flops_per_token(config, spec["seq"]) * tokens_per_step / 1e12
        result["ok"] = True
    except torch.OutOfMemoryError as e:
        result.update(ok=False, oom=True, error=str(e).splitlines()[0])
    except Exception as e:  # recorded in the table: a system that fails says how
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    finally:
        dist.destroy_process_group()
    return result


def _in_process(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", json.dumps(spec)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"system": spec["system"], "world": spec["world"], "ok": False, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"system": spec["system"], "world": spec["world"], "ok": False,
                "error": f"exit {done.returncode}: {done.stderr[-3000:]}"}
    return json.loads(lines[-1][len("RESULT "):])


# -- the run ----------------------------------------------------------------------------------


def _row(r: dict[str, Any], base: dict[str, Any] | None, rate: float) -> str:
    if not r.get("ok"):
        why = "out of memory" if r.get("oom") else r.get("error", "?").splitlines()[0][:120]
        return f"| {r['system']} | {r['world']} | {r.get('layers', '')} | failed: {why} | | | | | |"
    step, peak = r["step_s"], r.get("peak_gib")
    mfu = r["model_tflop"] * 1e12 / step / rate if rate == rate else float("nan")
    ratio = f"{step / base['step_s']:.2f}" if base and base.get("ok") else ""
    pratio = f"{peak / base['peak_gib']:.2f}" if base and base.get("ok") and peak else ""
    predicted = r.get("predicted_peak_gib")
    pred = f"{predicted:.2f} ({predicted / peak - 1:+.1%})" if predicted and peak else ""
    peak_s = f"{peak:.2f}" if peak is not None else ""
    return (f"| {r['system']} | {r['world']} | {r['layers']} | {step * 1e3:.1f} | {ratio} | {peak_s} | {pratio} "
            f"| {pred} | {mfu:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="speed,offload")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a tiny shape: checks the script, measures nothing")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--offload-layers", type=int, default=20)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-worlds", default="fake8,rehearse8:h100-nvlink,fake16,rehearse16:h100-ib,nccl1",
                    help="the time part's worlds: fakeN (torch's fake group), rehearseN:PROFILE "
                         "(fxshard.rehearse), nccl1")
    ap.add_argument("--budgets", default="", help="fxshard_auto's memory_budget in GiB per world, "
                    "e.g. rehearse8:h100-nvlink=9.60 (FSDP2's measured peak there)")
    ap.add_argument("--systems", default=None, help="comma-separated subset of the part's systems")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per system")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu"))
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    config = LLAMA3_8B
    seq = args.seq
    if args.quick:
        config, seq = LlamaConfig(dim=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=512), 64
    device = torch.device(args.device)
    rate = matmul_rate(device)
    chosen = None if args.systems is None else set(args.systems.split(","))
    results: list[dict[str, Any]] = []
    lines = [f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor() or 'cpu'}; "
             f"torch {torch.__version__}; bf16 matmul {rate / 1e12:.0f} TFLOP/s measured",
             ""]
    header = ("| system | world | layers | step ms | × FSDP2 | peak GiB | × FSDP2 | predicted GiB | MFU |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    parts = args.parts.split(",")
    budgets = {w: float(g) for w, g in (item.split("=") for item in args.budgets.split(",") if item)}

    def run_systems(systems: tuple[str, ...], world: str, layers: int, warmup: int,
                    steps: int) -> list[dict[str, Any]]:
        """Each of ``systems`` (those chosen) in a process of its own; prints each result."""
        rows = []
        for system in systems:
            if chosen and system not in chosen:
                continue
            spec = {"system": system, "world": world, "device": args.device, "seq": seq, "batch": args.batch,
                    "warmup": warmup, "steps": steps, "budget_gib": budgets.get(world),
                    "config": dataclasses.asdict(dataclasses.replace(config, layers=layers))}
            r = _in_process(spec, args.timeout)
            print(json.dumps({k: v for k, v in r.items() if k not in ("report", "traceback")}), flush=True)
            rows.append(r)
        return rows

    if "speed" in parts:
        lines += [f"speed: Llama-3-8B shape, {args.layers if not args.quick else config.layers} layers, "
                  f"seq {seq}, batch {args.batch} per rank", header]
        for world in ("fake8", "nccl1"):
            rows = run_systems(SPEED_SYSTEMS, world, config.layers if args.quick else args.layers,
                               args.warmup, args.steps)
            by = {r["system"]: r for r in rows}
            for r in rows:
                lines.append(_row(r, by.get("fsdp2"), rate))
            results += rows
            if world == "nccl1" and by.get("fxshard", {}).get("ok") and by.get("fsdp2", {}).get("ok"):
                a, b = by["fxshard"]["losses"], by["fsdp2"]["losses"]
                lines.append(f"numerics, world size 1: fxshard vs FSDP2 losses, max |diff| "
                             f"{max(abs(x - y) for x, y in zip(a, b)):.3g} over {len(a)} steps "
                             f"(fxshard {a[-1]:.6f}, FSDP2 {b[-1]:.6f} at the last)")
        lines.append("")
    if "time" in parts:
        # Time: each system on torch's fake process group (collectives free), under a rehearsal
        # of the named networks (collectives as long as the profile predicts, on the GPU's
        # streams), and on one real nccl rank; fxshard's predicted step beside each.
        layers = config.layers if args.quick else args.layers
        lines += [f"time: Llama-3-8B shape, {layers} layers, seq {seq}, batch {args.batch} per rank; "
                  "exposed = the step under the rehearsal - the step on the fake group of the same size",
                  "back to back: the mean step of the measured steps run again with no synchronize between "
                  "them (the host may run ahead)",
                  "| system | world | step ms | × FSDP2 | back to back ms | × FSDP2 | predicted ms | error "
                  "| exposed ms | predicted exposed ms | peak GiB | × FSDP2 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        free: dict[tuple[str, int], float] = {}
        for world in args.time_worlds.split(","):
            rows = run_systems(TIME_SYSTEMS, world, layers, args.warmup, args.steps)
            by = {r["system"]: r for r in rows}
            size = _world_size(world)
            for r in rows:
                base = by.get("fsdp2")
                if not r.get("ok"):
                    lines.append(f"| {r['system']} | {world} | failed: {r.get('error', '?').splitlines()[0][:120]} "
                                 "| | | | | | | | | |")
                    continue
                step = r["step_s"]
                # fxshard_host_agreement runs as fxshard does on the fake group (nobody to agree with)
                same = "fxshard" if r["system"] == "fxshard_host_agreement" else r["system"]
                if world.startswith("fake"):
                    free[(same, size)] = step
                exposed = step - free[(same, size)] if world.startswith("rehearse") and \
                    (same, size) in free else None
                pred, pexp = r.get("predicted_step_s"), r.get("predicted_exposed_s")
                ratio = f"{step / base['step_s']:.2f}" if base and base.get("ok") else ""
                b2b = r.get("back_to_back_step_s")
                b2b_cells = (f"{b2b * 1e3:.1f} | " + (f"{b2b / base['back_to_back_step_s']:.2f}"
                             if base and base.get("back_to_back_step_s") else "")) if b2b else " | "
                peak = r.get("peak_gib")
                pratio = f"{peak / base['peak_gib']:.2f}" if peak and base and base.get("ok") else ""
                lines.append(
                    f"| {r['system']} | {world} | {step * 1e3:.1f} | {ratio} | {b2b_cells} | "
                    f"{pred * 1e3:.1f} | {pred / step - 1:+.1%} | " if pred else
                    f"| {r['system']} | {world} | {step * 1e3:.1f} | {ratio} | {b2b_cells} | | | ")
                lines[-1] += (f"{exposed * 1e3:.1f} | " if exposed is not None else "| ") + \
                    (f"{pexp * 1e3:.1f} | " if pexp is not None else "| ") + \
                    (f"{peak:.2f} | {pratio} |" if peak else "| |")
            results += rows
            lines += [f"auto() at {world}:\n```\n{r['auto']}\n```" for r in rows if r.get("auto")]
        lines.append("")
    if "offload" in parts:
        layers = config.layers if args.quick else args.offload_layers
        lines += [f"offload: Llama-3-8B shape, {layers} layers, world size 1, seq {seq}", header]
        rows = run_systems(OFFLOAD_SYSTEMS, "nccl1", layers, 2, 3)
        by = {r["system"]: r for r in rows}
        for r in rows:
            lines.append(_row(r, by.get("fsdp2_offload"), rate))
        if by.get("fxshard_offload", {}).get("ok") and by.get("fsdp2_offload", {}).get("ok"):
            a, b = by["fxshard_offload"]["losses"], by["fsdp2_offload"]["losses"]
            lines.append(f"numerics: fxshard offload vs FSDP2 offload losses, max |diff| "
                         f"{max(abs(x - y) for x, y in zip(a, b)):.3g}")
        results += rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": lines[0], "torch": torch.__version__, "matmul_tflops": rate / 1e12, "args": vars(args)}
    (out / "latest.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "latest.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
