"""The PyTorch FSDP tutorial's MNIST example, trained with fxshard.

Two ways to launch it:

    python examples/mnist.py                         # spawns its own ranks (--nproc, default 2)
    torchrun --nproc_per_node=2 examples/mnist.py    # one process per rank

It trains the tutorial's Net with Adadelta (lr 1.0) and StepLR (gamma 0.7) over
a DistributedSampler, sharded by fxshard under a size policy. It prints the unit
plan, how many collectives the emitted graphs hold, and loss and accuracy per
epoch. There is no network here, so the default data is scikit-learn's bundled
handwritten digits (1797 real 8x8 scans, upsampled to 28x28 and normalised like
MNIST); ``--data-dir`` reads the real MNIST IDX files instead.

    --compare-policies   train with by_size(100) and by_size(20000), as the tutorial compares
    --compare-ddp        also train torch DDP on the same data; print time and memory side by side
    --print-graphs       print the code of the emitted forward and backward graphs
    --save-model         save full_state_dict() from rank 0 (--save-path)
    --max-steps N        at most N training steps per epoch (a short run, as the tests do)
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import socket
import struct
import sys
import time
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import fxshard
from fxshard.measure import peak_memory
from fxshard.policies import by_size

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
SPLIT_SEED = 0  # the digits' train/test split is the same whatever --seed says
MiB = 1 << 20


class Net(nn.Module):
    """The tutorial's model, unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


# -- data ---------------------------------------------------------------------------------------


def digits_datasets() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's handwritten digits as MNIST-like 28x28 images; a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # 0..16 -> 0..1
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = (images - MNIST_MEAN) / MNIST_STD
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, test = order[: int(0.8 * len(order))], order[int(0.8 * len(order)):]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def find_idx(path: Path) -> Path:
    """``path`` or ``path.gz``, whichever exists."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MNIST file not found: {path} (or {path}.gz)")


def read_idx(path: Path) -> torch.Tensor:
    """An unsigned-byte IDX file (the MNIST format): a big-endian header, then the bytes."""
    found = find_idx(path)
    with (gzip.open(found, "rb") if found.suffix == ".gz" else open(found, "rb")) as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{found} is not an unsigned-byte IDX file")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def mnist_datasets(data_dir: str) -> tuple[TensorDataset, TensorDataset]:
    """The real MNIST from its four IDX files, normalised as in the tutorial."""
    train_x, train_y, test_x, test_y = (read_idx(Path(data_dir) / name) for name in MNIST_FILES)

    def dataset(images: torch.Tensor, labels: torch.Tensor) -> TensorDataset:
        x = images.float().unsqueeze(1) / 255.0
        return TensorDataset((x - MNIST_MEAN) / MNIST_STD, labels.long())

    return dataset(train_x, train_y), dataset(test_x, test_y)


# -- what fxshard emitted, and what a rank holds ------------------------------------------------

# Node targets to count, and their column headers.
GRAPH_OPS = {"all_gather_into_tensor": "all_gather_into_tensor", "wait_tensor": "wait_tensor",
             "fxshard.free": "free", "reduce_scatter_tensor": "reduce_scatter_tensor"}


def graph_summary(sharded: fxshard.ShardedModule) -> str:
    """A table: per emitted graph, its ops and how many gather / wait / free / scatter nodes."""
    lines = [f"{'graph':<10}{'ops':>6}" + "".join(f"  {name}" for name in GRAPH_OPS.values())]
    for graph, gm in sharded.graphs.items():
        targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        line = f"{graph:<10}{len(targets):>6}"
        for op, name in GRAPH_OPS.items():
            line += f"{sum(op in target for target in targets):>{len(name) + 2}}"
        lines.append(line)
    return "\n".join(lines)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def max_rss_bytes() -> int:
    """The most resident memory this process has held so far (all of it: Python, torch, data)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


# -- training -----------------------------------------------------------------------------------


@dataclass
class Run:
    """One system to train: fxshard under ``by_size(min_params)``, or DDP when it is None."""

    min_params: int | None
    save: bool = False  # save fxshard's full state dict at the end (--save-model)

    @property
    def name(self) -> str:
        return "DDP" if self.min_params is None else f"fxshard {by_size(self.min_params)!r}"


@dataclass
class Result:
    name: str
    units: int | None
    epoch_time: float  # seconds of training per epoch, on average
    first_step_time: float  # fxshard traces and compiles the step here
    accuracy: float  # after the last epoch
    # Bytes, the largest over ranks:
    state_bytes: int  # parameters, gradients, optimizer state
    peak_step_bytes: int | None  # MemTracker's peak over one step; None if not measured
    max_rss: int  # the whole process


def train(run: Run, args: argparse.Namespace, rank: int, world_size: int, device: torch.device,
          data: tuple[TensorDataset, TensorDataset]) -> Result:
    train_set, test_set = data
    torch.manual_seed(args.seed)  # the same initial weights and dropout masks in every run
    net = Net().to(device)
    if run.min_params is None:
        model: nn.Module = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        model = fxshard.compile(net, policy=by_size(run.min_params))
    # The optimizer sees this rank's flat shards only, so its state is sharded too.
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    train_sampler: DistributedSampler[int] = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    test_sampler: DistributedSampler[int] = DistributedSampler(
        test_set, num_replicas=world_size, rank=rank)
    # fxshard traces the step once per input shape: drop the short last training batch
    # (evaluate() pads the short last test batch instead, so every test sample counts).
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    totals = torch.zeros(2, device=device)  # summed loss, samples: as the tutorial's ddp_loss

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y, reduction="sum")
        loss.backward()
        optimizer.step()
        totals[0] += loss.item()
        totals[1] += len(x)

    epoch_times: list[float] = []
    first_step_time = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        totals.zero_()
        start = time.perf_counter()
        for step, (x, y) in enumerate(islice(train_loader, args.max_steps or None)):
            train_step(x.to(device), y.to(device))
            if epoch == 1 and step == 0:
                first_step_time = time.perf_counter() - start
                if rank == 0 and isinstance(model, fxshard.ShardedModule):
                    show_plan_and_graphs(run, model, args.print_graphs)
        epoch_times.append(time.perf_counter() - start)
        dist.all_reduce(totals)
        test_loss, correct, count = evaluate(model, test_loader, args.test_batch_size, device)
        scheduler.step()
        if rank == 0:
            print(f"[{run.name}] epoch {epoch}: train loss {totals[0] / totals[1]:.4f}, "
                  f"test loss {test_loss / count:.4f}, accuracy {correct:.0f}/{count:.0f} "
                  f"({100 * correct / count:.2f}%), {epoch_times[-1]:.2f} s", flush=True)

    if run.save and isinstance(model, fxshard.ShardedModule):
        state = model.full_state_dict(rank0_only=True)  # a collective: every rank calls it
        if rank == 0:
            torch.save(state, args.save_path)
            print(f"[{run.name}] saved the full state dict to {args.save_path}", flush=True)

    peak_step_bytes = None
    if args.compare_ddp or args.compare_policies:
        # One more step, after saving and untimed, under torch's MemTracker: the peak bytes
        # of live tensors.
        model.train()
        x, y = (t.to(device) for t in next(iter(train_loader)))
        peak_step_bytes = peak_memory(partial(train_step, x, y), model, optimizer, x)

    memory = torch.tensor([state_bytes(model, optimizer), peak_step_bytes or 0, max_rss_bytes()],
                          dtype=torch.float64, device=device)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)  # the largest over ranks
    held, peak, rss = (int(m) for m in memory.tolist())
    units = len(model.plan.units) if isinstance(model, fxshard.ShardedModule) else None
    return Result(run.name, units, epoch_time=sum(epoch_times) / len(epoch_times),
                  first_step_time=first_step_time, accuracy=correct / count, state_bytes=held,
                  peak_step_bytes=None if peak_step_bytes is None else peak, max_rss=rss)


def evaluate(model: nn.Module, loader: DataLoader, batch_size: int,
             device: torch.device) -> tuple[float, float, float]:
    """Summed test loss, correct predictions and samples, over all ranks (as in the tutorial)."""
    model.eval()
    totals = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            n = len(y)
            if n < batch_size:  # pad the short last batch: a new shape would be a new trace
                x = torch.cat([x, x.new_zeros(batch_size - n, *x.shape[1:])])
            output = model(x.to(device))[:n]
            y = y.to(device)
            totals[0] += F.nll_loss(output, y, reduction="sum").item()
            totals[1] += (output.argmax(dim=1) == y).sum().item()
            totals[2] += n
    dist.all_reduce(totals)
    loss, correct, count = totals.tolist()
    return loss, correct, count


def show_plan_and_graphs(run: Run, sharded: fxshard.ShardedModule, print_code: bool) -> None:
    print(f"[{run.name}] plan:\n{sharded.plan}\n\n[{run.name}] emitted graphs on rank 0:\n"
          f"{graph_summary(sharded)}\n", flush=True)
    if print_code:
        for graph, gm in sharded.graphs.items():
            print(f"--- {graph} graph ---\n{gm.code}", flush=True)


def print_comparison(results: list[Result], fresh_processes: bool) -> None:
    def row(label: str, values: list[Any]) -> str:
        return f"{label:<42}" + "".join(f"{v:>26}" for v in values)

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / MiB:.2f}"

    print("\n" + row("", [r.name for r in results]))
    print(row("units", ["-" if r.units is None else r.units for r in results]))
    print(row("train time per epoch (s)", [f"{r.epoch_time:.2f}" for r in results]))
    print(row("  of which the first step (s)", [f"{r.first_step_time:.2f}" for r in results]))
    print(row("params + grads + optimizer state (MiB)", [mib(r.state_bytes) for r in results]))
    if any(r.peak_step_bytes is not None for r in results):
        print(row("peak live tensors in a step (MiB)", [mib(r.peak_step_bytes) for r in results]))
    print(row("max RSS of the process (MiB)", [mib(r.max_rss) for r in results]))
    print(row("test accuracy", [f"{100 * r.accuracy:.2f}%" for r in results]))
    print("\nMemory is the largest over ranks. The peak in a step is torch's MemTracker over one\n"
          "more step after training. max RSS counts the whole process: Python, torch, fxshard's\n"
          "tracer, the data; "
          + ("each system ran in fresh processes." if fresh_processes else
             "the systems ran one after another in the same processes,\nso each RSS includes "
             "the runs before it."), flush=True)


# -- launch -------------------------------------------------------------------------------------


def worker(rank: int, world_size: int, local_rank: int, args: argparse.Namespace, runs: list[Run],
           results: Any = None) -> list[Result]:
    """One rank: train every run in ``runs``; rank 0 puts the results on ``results``."""
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            rank=rank, world_size=world_size)
    try:
        data = mnist_datasets(args.data_dir) if args.data_dir else digits_datasets()
        out = [train(run, args, rank, world_size, device, data) for run in runs]
    finally:
        dist.destroy_process_group()
    if rank == 0 and results is not None:
        results.put(out)
    return out


def spawned(rank: int, world_size: int, args: argparse.Namespace, run: Run, queue: Any) -> None:
    """A rank started by torch.multiprocessing.spawn, which passes the rank first."""
    worker(rank, world_size, rank, args, [run], queue)
    # Its results are in the queue (a SimpleQueue writes them at once): leave without
    # interpreter teardown. About one run in six here, a rank died there after all its
    # work, with "terminate called without an active exception" (a native thread destroyed
    # while joinable), failing a finished run; tests/dist_utils.py does the same.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=64, help="training batch per rank")
    p.add_argument("--test-batch-size", type=int, default=100, help="test batch per rank")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="training steps per epoch (0: all)")
    p.add_argument("--lr", type=float, default=1.0, help="Adadelta's learning rate")
    p.add_argument("--gamma", type=float, default=0.7, help="StepLR's decay per epoch")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--min-params", type=int, default=20000,
                   help="fxshard.policies.by_size threshold (default 20000)")
    p.add_argument("--compare-policies", action="store_true",
                   help="train with by_size(100) and with by_size(20000)")
    p.add_argument("--compare-ddp", action="store_true", help="also train torch DDP")
    p.add_argument("--print-graphs", action="store_true", help="print the emitted graphs' code")
    p.add_argument("--save-model", action="store_true")
    p.add_argument("--save-path", default="mnist_fxshard.pt")
    p.add_argument("--data-dir", default=None,
                   help="directory with the MNIST IDX files (default: scikit-learn's digits)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.nproc < 1:
        p.error("--epochs and --nproc must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.data_dir is not None:
        try:  # fail now, with the path, rather than in every rank
            for name in MNIST_FILES:
                find_idx(Path(args.data_dir) / name)
        except FileNotFoundError as e:
            sys.exit(f"mnist.py: {e}")
    runs = [Run(100), Run(20000)] if args.compare_policies else [Run(args.min_params)]
    runs[0].save = args.save_model
    if args.compare_ddp:
        runs.append(Run(None))

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this is one rank
        rank = int(os.environ["RANK"])
        results = worker(rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
                         args, runs)
        if rank == 0 and len(results) > 1:
            print_comparison(results, fresh_processes=False)
        return

    # Spawn the ranks here, with a fresh set of processes per run so that each one's
    # max RSS is its own.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    queue = mp.get_context("spawn").SimpleQueue()
    results = []
    for run in runs:
        os.environ["MASTER_PORT"] = str(free_port())
        mp.spawn(spawned, args=(args.nproc, args, run, queue), nprocs=args.nproc, join=True)
        results += queue.get()
    if len(results) > 1:
        print_comparison(results, fresh_processes=True)


if __name__ == "__main__":
    main()
