"""Side-by-side benchmark: fxshard against FSDP2, FSDP1, DDP and a single process.

    python benchmarks/run.py                 # full run: MNIST Net and a 12-layer GPT, 2 gloo ranks
    python benchmarks/run.py --quick         # small models, few steps (what CI runs)
    python benchmarks/run.py --scaling       # also: compile time vs depth, explain at scale
    python benchmarks/run.py --scaling --models ""   # only those (results/scaling.{json,md})
    python benchmarks/run.py --models large  # the model near the memory limit alone
    python benchmarks/run.py --models net,gpt --append  # keep the other models' rows, marked † (earlier run)

Every system trains the same model from the same initial weights (the large
model: see below) on the same per-rank data, in its own spawned process group (gloo, one intra-op thread
per rank), and is measured with the same tools:

- step time: median over the measured steps (forward, backward, optimizer step), rank 0;
- peak live tensor bytes of one step: torch's MemTracker (fxshard.measure.peak_memory);
- max RSS: the largest of the ranks' peak resident set sizes;
- bytes communicated per step per rank: fxshard.measure.CommCounter (bus bytes);
- fxshard's safety costs, as ratios within the run: the wall time its ranks'
  agreement (``fxshard.driver.run.consistency.Agreement.agree``, two 8-byte all_gathers per
  step) takes within the measured steps, wrapped in a timer in the fxshard
  ranks' processes; and ``fxshard_onegroup``, every collective on one gloo
  group (``inflight_groups=False``) instead of one group per in-flight slot.

``fxshard_onegroup`` exists only to measure what the per-slot groups cost: on
gloo it is unsafe (torch 2.13 frees a heap string twice when two collectives
on one group complete together; docs/devices.md) and may crash a run.

Measured on this 2-core CPU machine, gloo, 2 ranks, in one run of net and gpt
with nothing else running (benchmarks/results/latest.md): the agreement took
1.9% of fxshard's step on Net (2.2 ms of 120) and 0.6% on the GPT (5.2 ms of
848), 1.3-4.1% and 0.3-0.6% across the six fxshard systems; one gloo group
instead of per-slot groups ran at 0.95x fxshard's step time on Net and 1.00x
on the GPT: the per-slot groups cost no step time measurable here.

Mixed precision: ``fsdp2_bf16`` and ``fxshard_bf16`` train the same units
with bf16 parameters for compute and fp32 shards, optimizer state and gradient
reduction (FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``; ``fxshard.MixedPrecision`` with the same
fields); the loss is taken on the logits cast to fp32. Their ×FSDP2 ratios are
against ``fsdp2_bf16``, the same precision (``step_s_vs_fsdp2_bf16`` in the
JSON; ``step_s_vs_fsdp2`` stays against fp32 FSDP2 for every row).

The "large" model (a 0.7B-parameter GPT) runs with each rank's data memory
capped (RLIMIT_DATA) at its share of 80% of this machine's RAM: DDP needs
16 bytes per parameter per rank (weights, gradients, two Adam states) and does
not fit; the sharded systems need half that. Every sharded system builds it on
the meta device, so no rank ever holds all of it: fxshard materialises its
shards module by module (the same weights as a model built normally); FSDP1
materialises one wrapped unit at a time (``device_id``, then each module's
``reset_parameters()``); FSDP2 allocates its shards (``to_empty``) and runs
``reset_parameters()`` on them (see ``init_fsdp2_on_meta``: other initial
values than the rest, which time, memory and bytes do not depend on). Only
``single`` and ``ddp`` build it whole; every system builds the smaller models
whole. Allocations of 1 MiB and more go straight to the OS (glibc's
MALLOC_MMAP_THRESHOLD_) for every system, so the cap counts live memory rather
than the allocator's leftovers.

Results go to benchmarks/results/latest.{json,md,png}; ratios are against
FSDP2 (the bf16 rows: FSDP2-bf16) and DDP (fxshard's scheduling variants also
against fxshard) measured in the same run. Absolute times on a shared machine
are noise; the ratios are the claim.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))

SYSTEMS = ("single", "ddp", "fsdp1", "fsdp2", "fxshard", "fxshard_onegroup", "fxshard_noprefetch",
           "fxshard_inductor", "fsdp2_bf16", "fxshard_bf16",
           "fsdp2_ac", "fxshard_ac", "fxshard_sac", "fsdp2_reshard_root", "fxshard_reshard_root")
# The root resharded after forward too: FSDP2 as torchtitan configures it
# (fully_shard(model, reshard_after_forward=True)) against fxshard's reshard_root=True.
# Their ×FSDP2 ratios are against fsdp2_reshard_root. Both free the root's gathered
# parameters (a tied embedding and output head) across the user's loss, which runs
# between the forward and backward graphs and holds the step's peak when the
# vocabulary is large; both gather the root once more in backward.
# Activation checkpointing per unit (issue 13): FSDP2 with torch's checkpoint around
# each block (apply_activation_checkpointing, non-reentrant, as torchtitan), fxshard's
# pass with the same regions (fxshard_ac) and selective (fxshard_sac: matmul and
# attention outputs saved). Their ×FSDP2 ratios are against fsdp2_ac.
# A sweep of GPT shapes (width, layers, vocabulary, batch; sequence 64), run with
# --models sweep1,...,sweep6 --systems fsdp2,fxshard,fxshard_noprefetch.
SWEEP = {"sweep1": (128, 6, 512, 4), "sweep2": (256, 6, 512, 4), "sweep3": (512, 6, 512, 4),
         "sweep4": (128, 6, 512, 16), "sweep5": (256, 12, 1024, 8), "sweep6": (64, 4, 4096, 4)}
# Mixed precision: bf16 parameters for compute, fp32 shards, optimizer state and
# gradient reduction (FSDP2's MixedPrecisionPolicy; fxshard.MixedPrecision, the same semantics).
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
# Built whole on every rank: the unsharded systems. The sharded ones build the
# model on the meta device and materialise only their shards (see build()).
BUILT_WHOLE = ("single", "ddp")
# The large model runs where it shows something: which systems fit at all.
LARGE_SYSTEMS = ("ddp", "fsdp1", "fsdp2", "fxshard")
# MemTracker and CommCounter are dispatch modes, and torch.compile runs a frame
# eagerly under one (the backend refuses that run: its stand-ins are not the
# model), so neither can watch the backend's compiled steps.
NOT_VISIBLE = {"fxshard_inductor": ("peak_bytes", "comm_bytes", "comm_by_kind")}


def model_spec(name: str, quick: bool) -> dict[str, Any]:
    """How to build a model, its inputs, its loss and its units, per benchmark model."""
    from mnist import Net
    from models import Block, TinyGPT

    if name == "net":
        batch = 16 if quick else 64
        return dict(make=Net, block=None, min_params=20000, loss=lambda o, y: F.nll_loss(o.float(), y),
                    inputs=lambda g: (torch.randn(batch, 1, 28, 28, generator=g),
                                      torch.randint(0, 10, (batch,), generator=g)))
    if name == "large":
        layers, dim, seq, vocab, batch, heads = (2, 256, 32, 512, 1, 8) if quick else (14, 2048, 64, 8192, 1, 16)
    elif name == "gpt":
        layers, dim, seq, vocab, batch, heads = (2, 128, 32, 512, 2, 8) if quick else (12, 512, 64, 8192, 2, 8)
    elif name in SWEEP:
        (dim, layers, vocab, batch), seq, heads = SWEEP[name], 64, 4
    else:
        raise SystemExit(f"unknown model {name!r}: choose from net, gpt, large, {', '.join(SWEEP)}")

    def make() -> nn.Module:
        return TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq)

    def inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]

    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.reshape(-1, o.shape[-1]).float(), y.reshape(-1))

    return dict(make=make, block=Block, min_params=dim * dim * 4, loss=loss, inputs=inputs,
                label=f"GPT {layers}x{dim}")


def baseline(system: str) -> str:
    """The FSDP2 row a system's ×FSDP2 ratios are against: the one at the same precision,
    and with activation checkpointing for the checkpointing rows."""
    if system.endswith("_bf16"):
        return "fsdp2_bf16"
    if system.endswith("_reshard_root"):
        return "fsdp2_reshard_root"
    return "fsdp2_ac" if system.endswith("_ac") or system.endswith("_sac") else "fsdp2"


def build(system: str, model_name: str, spec: dict[str, Any]) -> nn.Module:
    """The model, under the seed set by the caller: whole for the unsharded systems; for the
    sharded ones, the large model on the meta device (no rank ever holds all of it)."""
    if system in BUILT_WHOLE or model_name != "large":
        return spec["make"]()
    with torch.device("meta"):
        return spec["make"]()


def init_fsdp2_on_meta(model: nn.Module) -> None:
    """FSDP2's meta-device init, as torchtitan does it: allocate this rank's shards, then each
    module's ``reset_parameters()`` on its DTensor parameters, in construction order, skipping
    a module whose parameters an earlier one initialised (a tied output embedding: built
    normally, the tie comes after its init). On CPU, DTensor draws each rank's local shard
    from that rank's generator (its random ops are for CUDA-like devices), so these initial
    weights are not the other systems'; step time, memory and bytes do not depend on them."""
    model.to_empty(device="cpu")
    done: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            own = [id(p) for p in m.parameters(recurse=False)]
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and not (own and done.issuperset(own)):
                reset()
            done.update(own)


def wrap(system: str, model: nn.Module, spec: dict[str, Any], world_size: int) -> nn.Module:
    import fxshard
    from fxshard.policies import by_class, by_size

    block = spec["block"]
    on_meta = any(p.is_meta for p in model.parameters())
    if system == "single":
        return model
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    if system == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=spec["min_params"])
        # On meta, FSDP1 materialises one wrapped unit at a time (to_empty, then each
        # module's reset_parameters()) before flattening and sharding it.
        return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    def is_unit(m: nn.Module) -> bool:
        if block is not None:
            return isinstance(m, block)
        return m is not model and sum(p.numel() for p in m.parameters(recurse=False)) >= spec["min_params"]

    if system in ("fsdp2", "fsdp2_bf16", "fsdp2_ac", "fsdp2_reshard_root"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        mp_policy = MixedPrecisionPolicy(**BF16) if system == "fsdp2_bf16" else MixedPrecisionPolicy()
        if system == "fsdp2_ac":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )

            apply_activation_checkpointing(model, check_fn=is_unit)
        # With checkpointing, each unit is inside its CheckpointWrapper: shard the wrapper
        # (as torchtitan does), so the recompute runs FSDP2's hooks around the block.
        units = [m for m in model.modules() if is_unit(m)]
        if system == "fsdp2_ac":
            units = [m for m in model.modules() if is_unit(getattr(m, "_checkpoint_wrapped_module", model))]
        for m in units:
            fully_shard(m, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=True if system == "fsdp2_reshard_root" else None)
        if on_meta:
            init_fsdp2_on_meta(model)
        return model
    policy = by_class(block) if block is not None else by_size(spec["min_params"])
    if system == "fxshard_inductor":  # the torch.compile backend, Inductor compiling the graphs
        compiled = torch.compile(model, backend=fxshard.backend(policy=policy, compute="inductor"),
                                 dynamic=False)
        compiled.shards = fxshard.parameters(compiled)  # type: ignore[attr-defined]
        return compiled
    options: dict[str, Any] = {}
    if system == "fxshard_noprefetch":
        options = dict(forward_prefetch=False, backward_prefetch=None)
    if system == "fxshard_reshard_root":
        options = dict(reshard_root=True)
    if system == "fxshard_onegroup":  # unsafe on gloo (docs/devices.md): here only to measure the cost
        options = dict(inflight_groups=False)
    if system == "fxshard_bf16":
        options = dict(mixed_precision=fxshard.MixedPrecision(**BF16))
    if system == "fxshard_ac":
        options = dict(activation_checkpointing=policy)
    if system == "fxshard_sac":
        options = dict(activation_checkpointing=fxshard.policies.selective(policy))
    return fxshard.compile(model, policy=policy, **options)


class AgreementTimer:
    """Wall time spent in the ranks' agreement, while ``on``.

    Wraps ``fxshard.driver.run.consistency.Agreement.agree``, the method the driver calls,
    in this rank's process only. A missing name raises: the measurement must not go
    silently to zero when the driver changes.
    """

    def __init__(self) -> None:
        from fxshard.driver.run.consistency import Agreement

        self.seconds, self.calls, self.on = 0.0, 0, False
        inner = Agreement.agree

        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                inner(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1

        Agreement.agree = timed  # type: ignore[method-assign]


def run_system(rank: int, world_size: int, port: int, system: str, model_name: str, args: Any,
               out_dir: str, memory_limit: int | None) -> None:
    import fxshard
    from fxshard.measure import CommCounter, peak_memory

    if memory_limit is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_limit, memory_limit))
    torch.set_num_threads(1)
    distributed = system != "single"
    if distributed:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    spec = model_spec(model_name, args.quick)
    timer = AgreementTimer() if system.startswith("fxshard") else None
    torch.manual_seed(0)
    model = wrap(system, build(system, model_name, spec), spec, world_size)
    params = getattr(model, "shards", None) or model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(100 + rank)
    # The large model's steps take seconds each: fewer of them.
    warmup, steps = (min(args.warmup, 1), min(args.steps, 3)) if model_name == "large" else (args.warmup, args.steps)
    batches = [spec["inputs"](gen) for _ in range(warmup + steps + 2)]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = spec["loss"](model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    t0 = time.perf_counter()
    for x, y in batches[:warmup]:
        step(x, y)
    warmup_s = time.perf_counter() - t0
    times, losses = [], []
    if timer is not None:
        timer.on = True
    for x, y in batches[warmup:warmup + steps]:
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - start)
    if timer is not None:
        timer.on = False
    x, y = batches[-2]
    watched = system not in NOT_VISIBLE
    peak = peak_memory(lambda: step(x, y), model, opt, x, y) if watched else None

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> None:
        spec["loss"](model(x), y).backward()

    # Issue 13's harness: forward + backward alone, the optimizer state not counted.
    fb_peak = peak_memory(lambda: forward_backward(x, y), model, x, y) if watched else None
    opt.zero_grad(set_to_none=True)
    x, y = batches[-1]
    with CommCounter() if watched else contextlib.nullcontext() as counter:
        step(x, y)
    result = {
        "system": system, "model": model_name, "rank": rank,
        "step_s": statistics.median(times), "warmup_s": warmup_s, "peak_bytes": peak,
        "fb_peak_bytes": fb_peak,
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "comm_bytes": counter.total if watched else None,
        "comm_by_kind": dict(counter.bytes) if watched else None,
        "comm_uncounted": dict(counter.uncounted) if watched else None, "losses": losses,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "built_on_meta": system not in BUILT_WHOLE and model_name == "large",
        "memory_limit_bytes": memory_limit,
    }
    if isinstance(model, fxshard.ShardedModule):  # what inflight_groups chose, from the emitted graphs
        from fxshard.ir.analysis import gathers_without_overlap
        from fxshard.ir.predicates import group_name, is_all_gather, is_collective

        result["comm_groups"] = len({group_name(n) for gm in model.graphs.values()
                                     for n in gm.graph.nodes if is_collective(n)})
        # Gathers with no compute between issue and wait, per emitted graph (the first of each
        # graph has nothing before it to hide behind).
        result["gathers"] = {g: sum(1 for n in model.graphs[g].graph.nodes if is_all_gather(n))
                             for g in ("forward", "backward")}
        result["gathers_exposed"] = {g: len(gathers_without_overlap(model.graphs[g].graph))
                                     for g in ("forward", "backward")}
    if timer is not None:
        # Per step, and as a share of the same steps' time. It includes waiting
        # for the slower rank, which the step's first collective would otherwise wait.
        result["agreement_s"] = timer.seconds / len(times)
        result["agreement_share"] = timer.seconds / sum(times)
        result["agreement_calls"] = timer.calls
    for key in NOT_VISIBLE.get(system, ()):
        result[key] = None
    torch.save(result, os.path.join(out_dir, f"{system}-{model_name}-{rank}.pt"))
    if distributed:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memory_limit(args: Any, model_name: str) -> int | None:
    """Each rank's data-memory cap in bytes: its share of 80% of RAM for the large model."""
    if args.memory_limit_gib is not None:
        return int(args.memory_limit_gib * (1 << 30))
    if model_name != "large" or args.quick:
        return None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(0.8 * ram / args.world_size)


def _failure(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    reason = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
    if "can't allocate memory" in reason:  # keep the size, drop the C++ location
        reason = "out of memory: " + reason[reason.index("you tried"):].split(". Error code")[0]
    return reason[:200]


def measure(system: str, model_name: str, args: Any, out_dir: str) -> dict[str, Any]:
    n = 1 if system == "single" else args.world_size
    limit = memory_limit(args, model_name)
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if limit is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # read by each rank's libc at start
    try:
        mp.spawn(run_system, args=(n, free_port(), system, model_name, args, out_dir, limit), nprocs=n)
    except Exception as e:  # one system failing must not lose the others' numbers
        reason = _failure(e)
        print(f"  {system} on {model_name} failed: {reason}", flush=True)
        return {"system": system, "model": model_name, "failed": reason, "memory_limit_bytes": limit}
    finally:
        if previous is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous
    ranks = [torch.load(os.path.join(out_dir, f"{system}-{model_name}-{r}.pt")) for r in range(n)]
    first = ranks[0]
    peaks = [r["peak_bytes"] for r in ranks]
    fb_peaks = [r.get("fb_peak_bytes") for r in ranks]
    merged = {**first, "rss_bytes": max(r["rss_bytes"] for r in ranks),
              "peak_bytes": None if None in peaks else max(peaks),
              "fb_peak_bytes": None if None in fb_peaks else max(fb_peaks),
              "load_1min": os.getloadavg()[0]}  # above world size + 1, others took CPU time
    if "agreement_share" in first:  # rank 0's, like the step time; each rank's too
        merged["agreement_share_ranks"] = [r["agreement_share"] for r in ranks]
    return merged


def compile_scaling(depths: list[int]) -> list[dict[str, Any]]:
    """Trace + plan + passes + recompile time of a GPT (width 512) by depth, via explain (world size 8)."""
    import fxshard

    from models import Block, TinyGPT

    rows = []
    for layers in depths:
        with torch.device("meta"):
            model = TinyGPT(vocab=8192, dim=512, heads=8, layers=layers, seq=64)
        start = time.perf_counter()
        fxshard.explain(model, torch.zeros(2, 64, dtype=torch.long), policy=fxshard.policies.by_class(Block),
                        world_size=8)
        rows.append({"layers": layers, "seconds": time.perf_counter() - start})
        print(f"  compile, {layers} layers: {rows[-1]['seconds']:.1f}s", flush=True)
    return rows


def planning_at_scale(world_sizes: list[int], models: list[str],
                      meshes: tuple[tuple[str, tuple[int, int]], ...] = ()) -> list[dict[str, Any]]:
    """explain's wall time and predictions for each model at each world size (one flat
    group), then for each (model, mesh shape) in ``meshes`` (HSDP: rank 1 of the last row)."""
    import fxshard

    from llama import LLAMA3_8B, LLAMA3_70B, Llama, TransformerBlock

    configs = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
    cases: list[tuple[str, int, tuple[int, int] | None]] = [(m, n, None) for m in models for n in world_sizes]
    cases += [(m, shape[0] * shape[1], shape) for m, shape in meshes]
    rows = []
    for name, n, mesh in cases:
        with torch.device("meta"):
            model = Llama(configs[name])
        where: dict[str, Any] = ({"world_size": n} if mesh is None else
                                 {"mesh_shape": mesh, "rank": n - mesh[1] + 1})
        start = time.perf_counter()
        e = fxshard.explain(model, torch.zeros(1, 2048, dtype=torch.long),
                            policy=fxshard.policies.by_class(TransformerBlock), **where)
        seconds = time.perf_counter() - start
        psi = sum(g.padded_numel * g.dtype.itemsize for g in e.plan.groups)
        shard = e.report.world_size  # the shard group's size: n, or the mesh's S
        largest = max(u.padded_bytes for u in e.report.units)
        # shards + gradients + two Adam states, over the shard group; plus the largest unit
        # gathered (times the prefetch depth, 2).
        formula = 4 * psi // shard + 2 * largest
        rows.append({"model": name, "world_size": n, "seconds": seconds,
                     "mesh": "x".join(map(str, mesh)) if mesh else None,
                     "shard_bytes": e.report.shard_bytes, "psi_bytes": psi,
                     "predicted_peak_bytes": e.report.predicted_peak_bytes,
                     "shards_grads_adam_over_n_plus_2_units": formula,
                     "comm_bytes_per_dimension": e.report.comm_bytes_per_dimension})
        print(f"  explain {name} at {rows[-1]['mesh'] or n}: {seconds:.1f}s, predicted peak "
              f"{e.report.predicted_peak_bytes / 2**30:.1f} GiB", flush=True)
    return rows


def ratios(results: list[dict[str, Any]]) -> None:
    """``{key}_vs_{base}``: against fp32 FSDP2 and DDP for every row, and against FSDP2-bf16
    for the bf16 rows (the same precision: what the table's ×FSDP2 columns show for them)."""
    by = {(r["model"], r["system"]): r for r in results if "failed" not in r}
    for r in results:
        if "failed" in r:
            continue
        for base in dict.fromkeys(("fsdp2", "ddp", baseline(r["system"]))):
            ref = by.get((r["model"], base))
            for key in ("step_s", "peak_bytes", "rss_bytes", "fb_peak_bytes"):
                ok = ref and ref.get(key) and r.get(key) is not None
                r[f"{key}_vs_{base}"] = r[key] / ref[key] if ok else None
        # A variant of fxshard's scheduling against its defaults (bf16 computes otherwise:
        # it is against FSDP2-bf16 instead).
        if r["system"].startswith("fxshard_") and baseline(r["system"]) == "fsdp2":
            ref = by.get((r["model"], "fxshard"))
            r["step_s_vs_fxshard"] = r["step_s"] / ref["step_s"] if ref else None


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [f"Machine: {meta['machine']}; torch {meta['torch']}; gloo, world size {meta['world_size']}, "
             "one thread per rank; medians of the measured steps.", "",
             *([meta["note"], ""] if meta.get("note") else []),
             "| model | system | step ms | ×FSDP2 | ×DDP | peak MiB | ×FSDP2 | ×DDP | max RSS MiB | comm MiB/step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    def m(v: int | None, digits: int) -> str:
        return "n/v" if v is None else f"{v / mib:.{digits}f}"

    for r in results:
        model = r["model"] + ("†" if "earlier_run" in r else "")
        if "failed" in r:
            lines.append(f"| {model} | {r['system']} | failed: {r['failed']} |" + " |" * 7)
            continue
        base = baseline(r["system"])
        lines.append(f"| {model} | {r['system']} | {r['step_s'] * 1000:.0f} | {f(r.get(f'step_s_vs_{base}'))} | "
                     f"{f(r['step_s_vs_ddp'])} | {m(r['peak_bytes'], 1)} | {f(r.get(f'peak_bytes_vs_{base}'))} | "
                     f"{f(r['peak_bytes_vs_ddp'])} | {r['rss_bytes'] / mib:.0f} | {m(r['comm_bytes'], 2)} |")
    notes = []
    if any(baseline(r["system"]) != "fsdp2" for r in results):
        notes.append("_bf16 rows: bf16 parameters for compute, fp32 shards, optimizer state and gradient "
                     "reduction (FSDP2's `MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                     "reduce_dtype=torch.float32)`, `fxshard.MixedPrecision` with the same fields). Their "
                     "×FSDP2 columns are against fsdp2_bf16, the same precision; ×DDP is against fp32 DDP.")
    meta_built = list(dict.fromkeys(r["model"] for r in results if r.get("built_on_meta")))
    if meta_built:
        notes.append(f"{', '.join(meta_built)}: built on the meta device by every sharded system "
                     "(each rank materialises only its shards); single and DDP build it whole.")
    loads = [r["load_1min"] for r in results if r.get("load_1min") is not None and "earlier_run" not in r]
    if loads:
        ws = meta["world_size"]
        own = ws + 1  # the ranks' compute threads, and their communication threads at times
        notes.append(f"1-minute load average after each system: {min(loads):.1f} to {max(loads):.1f} "
                     f"({meta['machine']}); a system's own {ws} ranks, with their communication threads, "
                     f"account for about {ws} to {own}" + (
                         ": above that, other processes took CPU time from the ranks." if max(loads) > own
                         else ", so nothing else took CPU time to speak of."))
    earlier = list(dict.fromkeys(r["model"] for r in results if "earlier_run" in r))
    if earlier:
        releases = sorted({r["torch"] for r in results if "earlier_run" in r and "torch" in r})
        other = [t for t in releases if t != meta["torch"]]
        notes.append(f"†: {', '.join(earlier)} measured in a separate run of this benchmark, kept by "
                     "--append; their ratios are within that run"
                     + (f" (torch {', '.join(other)})." if other else "."))
        before_meta = [m for m in earlier if m == "large" and not any(
            "built_on_meta" in r for r in results if r["model"] == m)]
        if before_meta:
            notes.append(f"{', '.join(before_meta)}†: measured before the benchmark built it on the meta "
                         "device: every system built it whole, then sharded it.")
    if any(r["system"] in NOT_VISIBLE for r in results):
        notes.append("n/v: not measured. MemTracker and CommCounter are dispatch modes, and "
                     "torch.compile runs a frame eagerly under one (fxshard's backend refuses that "
                     "run), so they cannot watch the torch.compile backend's compiled steps.")
    limits = {r["model"]: r.get("memory_limit_bytes") for r in results if r.get("memory_limit_bytes")}
    for model, limit in limits.items():
        params = meta.get("params", {}).get(model)
        notes.append(f"{model}: {params / 1e9:.2f}B parameters; each rank's data memory capped at "
                     f"{limit / (1 << 30):.1f} GiB (RLIMIT_DATA), 80% of RAM shared by {meta['world_size']} ranks."
                     if params else f"{model}: each rank capped at {limit / (1 << 30):.1f} GiB.")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes) + forward_backward(results) + overheads(results)


def forward_backward(results: list[dict[str, Any]]) -> str:
    """Issue 13's harness: the peak of forward + backward alone (no optimizer state counted),
    against FSDP2 at the same precision and checkpointing."""
    rows = [r for r in results if r.get("fb_peak_bytes") and "earlier_run" not in r]
    if not rows:
        return ""
    lines = ["", "Peak of forward + backward alone (optimizer state not counted), step time, and "
             "all_gathers with no compute between issue and wait (forward, backward; of all):", "",
             "| model | system | peak MiB | ×FSDP2 | step ×FSDP2 | gathers exposed |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        vs = r.get(f"fb_peak_bytes_vs_{baseline(r['system'])}")
        step = r.get(f"step_s_vs_{baseline(r['system'])}")
        exposed = r.get("gathers_exposed")
        gathers = r.get("gathers") or {}
        shown = ("–" if not exposed else ", ".join(f"{exposed[g]}/{gathers.get(g, '?')}"
                                                  for g in ("forward", "backward")))
        lines.append(f"| {r['model']} | {r['system']} | {r['fb_peak_bytes'] / (1 << 20):.1f} | "
                     f"{'–' if vs is None else f'{vs:.2f}'} | {'–' if step is None else f'{step:.2f}'} | "
                     f"{shown} |")
    return "\n".join(lines) + "\n"


def overheads(results: list[dict[str, Any]]) -> str:
    """fxshard's safety features as ratios within the run: the agreement, and per-slot gloo groups."""
    rows = [r for r in results if r["system"].startswith("fxshard") and "failed" not in r
            and ("agreement_share" in r or "step_s_vs_fxshard" in r)]
    if not rows:
        return ""
    lines = ["", "Overheads of fxshard's safety features (†: rows measured in a separate run):", "",
             "| model | system | agreement ms/step | agreement ÷ step, rank 0 (each rank) | step ÷ fxshard |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        each = ", ".join(f"{x:.1%}" for x in r.get("agreement_share_ranks", []))
        ms, share = "–", "–"
        if "agreement_share" in r:
            ms = f"{r['agreement_s'] * 1000:.1f}"
            share = f"{r['agreement_share']:.1%}" + (f" ({each})" if each else "")
        vs = r.get("step_s_vs_fxshard")
        model = r["model"] + ("†" if "earlier_run" in r else "")
        lines.append(f"| {model} | {r['system']} | {ms} | {share} | {'–' if vs is None else f'{vs:.2f}'} |")
    lines += ["", "Agreement: wall time inside `fxshard.driver.run.consistency.Agreement.agree` (two 8-byte all_gathers per "
              "step) over the measured steps, as a share of those steps' time; it includes any wait for "
              "the slower rank, which the step's first collective would wait otherwise. "
              "`fxshard_onegroup` (`inflight_groups=False`) puts every collective on one gloo group "
              "instead of one per in-flight slot: unsafe on gloo (torch 2.13 heap corruption, "
              "docs/devices.md), run only to measure what the per-slot groups cost."]
    return "\n".join(lines) + "\n"


def scaling_markdown(scaling: dict[str, Any]) -> str:
    gib = 1 << 30
    lines = ["| layers (GPT, width 512) | trace + plan + passes + recompile |", "|---:|---:|"]
    lines += [f"| {r['layers']} | {r['seconds']:.1f} s |" for r in scaling["compile_scaling"]]
    lines += ["", "| model | ranks | explain wall time | shard / rank | predicted peak / rank | "
              "shards+grads+Adam/S + 2 largest units |", "|---|---:|---:|---:|---:|---:|"]
    for r in scaling["planning"]:
        ranks = f"{r['world_size']}" + (f" (mesh {r['mesh']})" if r.get("mesh") else "")
        shard = f"{r['shard_bytes'] / gib:.2f} GiB" if "shard_bytes" in r else "–"
        lines.append(f"| {r['model']} | {ranks} | {r['seconds']:.1f} s | {shard} | "
                     f"{r['predicted_peak_bytes'] / gib:.1f} GiB | "
                     f"{r['shards_grads_adam_over_n_plus_2_units'] / gib:.1f} GiB |")
    return "\n".join(lines) + "\n"


def chart(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "step_s", "step time ÷ FSDP2 (bf16: ÷ FSDP2-bf16)"),
                           (axes[1], "peak_bytes", "peak tensor memory ÷ FSDP2 (bf16: ÷ FSDP2-bf16)")):
        width = 0.8 / len(SYSTEMS)
        for i, system in enumerate(SYSTEMS):
            ratio = f"{key}_vs_{baseline(system)}"
            values = [next((r.get(ratio) or 0 for r in results if r["model"] == m and r["system"] == system), 0)
                      for m in models]
            xs = [j + i * width for j in range(len(models))]
            ax.bar(xs, values, width, label=system)
            for x, m in zip(xs, models):
                failed = next((r["failed"] for r in results
                               if r["model"] == m and r["system"] == system and "failed" in r), None)
                if failed:
                    ax.text(x, 0.05, "out of memory" if "memory" in failed else "failed",
                            rotation=90, ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        earlier = {r["model"] for r in results if "earlier_run" in r}
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))],
                      [m + " (separate run)" if m in earlier else m for m in models])
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=(len(SYSTEMS) + 1) // 2, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def keep_earlier(results: list[dict[str, Any]], params: dict[str, int], meta: dict[str, Any],
                 earlier: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``--append``: after this run's rows, the earlier report's rows of the models not run
    now, marked ``earlier_run``; ``meta["earlier_run"]`` records what they were measured with."""
    ran = {r["model"] for r in results}
    kept = [{**r, "earlier_run": r.get("earlier_run", True)} for r in earlier["results"]
            if r["model"] not in ran]
    if kept:
        meta["earlier_run"] = earlier["meta"].get("earlier_run") or {
            k: v for k, v in earlier["meta"].items() if k not in ("params", "earlier_run")}
    return results + kept, {**earlier["meta"].get("params", {}), **params}


def flush_subnormals() -> bool:
    """Flush subnormal floats to zero in this process, in a benchmark that compares a step's
    measured time with the time model. The GPT's gradients turn subnormal from its third AdamW
    step on (about a million of its 42M, the optimizer's state after them), and on an x86 CPU
    without flushing, a matmul over subnormal operands takes about four times as long: its
    steps then slow down 2.5 times and the time model (rates measured on normal numbers)
    cannot know it (docs/time.md, "Where the model is known to err"). Flushing changes the
    numbers a step computes; the correctness tests never flush. False where this CPU cannot
    flush them (torch's ``set_flush_denormal``): the benchmark's first line then says so."""
    return bool(torch.set_flush_denormal(True))


def subnormals(flushed: bool) -> str:
    """What a benchmark's first line says of subnormal floats."""
    return "subnormal floats flushed to zero" if flushed else "subnormal floats not flushed (this CPU cannot)"


def machine() -> str:
    """This machine in a benchmark's first line: its architecture, CPU model and cores."""
    from fxshard.driver.report.calibrate import device_name

    return f"{platform.machine()}, {device_name(torch.device('cpu')).split(',')[0]}, {os.cpu_count()} cores"


def fxshard_version() -> str | None:
    """The commit measured, and whether the library had local changes."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "fxshard")
        return git("rev-parse", "--short", "HEAD") + (" with local changes to the library" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default="net,gpt,large")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--append", action="store_true",
                   help="keep the rows of models not run now from the existing latest.json")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="cap each rank's data memory (default: only for the large model)")
    p.add_argument("--scaling", action="store_true", help="compile-time scaling and planning at scale")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--note", default=None, help="a sentence printed under the table's first line "
                   "(e.g. what else ran on the machine)")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "ranks"
    scratch.mkdir(exist_ok=True)
    results = []
    params = {}
    for model_name in filter(None, args.models.split(",")):
        with torch.device("meta"):
            params[model_name] = sum(p.numel() for p in model_spec(model_name, args.quick)["make"]().parameters())
        systems = args.systems.split(",")
        if model_name == "large" and args.systems == ",".join(SYSTEMS):
            systems = list(LARGE_SYSTEMS)
        for system in systems:
            print(f"{model_name} / {system} ...", flush=True)
            # Each row names its torch release: --append keeps rows of earlier runs, maybe on another.
            results.append({**measure(system, model_name, args, str(scratch)), "torch": torch.__version__})
    meta: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                            "torch": torch.__version__, "world_size": args.world_size,
                            "quick": args.quick, "steps": args.steps, "fxshard": fxshard_version()}
    if args.note:
        meta["note"] = args.note
    if args.append and results and (out / "latest.json").exists():
        results, params = keep_earlier(results, params, meta, json.loads((out / "latest.json").read_text()))
    ratios(results)
    meta["params"] = params
    report: dict[str, Any] = {"meta": meta, "results": results}
    if args.scaling:
        scaling = {"torch": torch.__version__, "compile_scaling": compile_scaling([12, 24, 48]),
                   "planning": planning_at_scale([8, 64, 256, 1024], ["llama3-8b", "llama3-70b"],
                                                 meshes=(("llama3-70b", (128, 8)),))}
        (out / "scaling.json").write_text(json.dumps(scaling, indent=1))
        (out / "scaling.md").write_text(scaling_markdown(scaling))
        print(scaling_markdown(scaling))
    if not results:
        return
    (out / "latest.json").write_text(json.dumps(report, indent=1, default=str))
    table = markdown(results, meta)
    (out / "latest.md").write_text(table)
    chart(results, out / "latest.png")
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()
    print(table)


if __name__ == "__main__":
    main()
