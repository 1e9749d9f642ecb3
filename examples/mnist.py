"""The PyTorch FSDP tutorial's MNIST example, trained with fxshard.

Two ways to launch it:

    python examples/mnist.py                                # spawns its own ranks (--nproc, default 2)
    torchrun --nproc_per_node=2 examples/mnist.py           # one process per rank

It trains the tutorial's Net with Adadelta (lr 1.0) and StepLR (gamma 0.7) on
a DistributedSampler, under fxshard's size policy, and prints the unit plan, a
summary of the collectives in the emitted graphs, and loss and accuracy per
epoch. There is no network here, so the default data is scikit-learn's bundled
handwritten digits (1797 real 8x8 scans, upsampled to 28x28); ``--data-dir``
reads the real MNIST IDX files instead.

    --compare-policies   train with by_size(100) and by_size(20000), as the tutorial compares
    --compare-ddp        train torch DDP on the same data and print both side by side
    --save-model         save full_state_dict() from rank 0
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


class Net(nn.Module):
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
        return F.log_softmax(self.fc2(x), dim=1)


# -- data ---------------------------------------------------------------------------------------


def digits_dataset(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's handwritten digits, upsampled to 28x28 and normalised like MNIST."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = (images - MNIST_MEAN) / MNIST_STD
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def _read_idx(path: Path) -> torch.Tensor:
    candidates = [path, path.with_name(path.name + ".gz")]
    found = next((p for p in candidates if p.exists()), None)
    if found is None:
        raise FileNotFoundError(f"MNIST file not found: {path} (or {path}.gz)")
    opener = gzip.open if found.suffix == ".gz" else open
    with opener(found, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{found} is not an unsigned-byte IDX file")
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def mnist_dataset(data_dir: str) -> tuple[TensorDataset, TensorDataset]:
    root = Path(data_dir)

    def load(images: str, labels: str) -> TensorDataset:
        x = _read_idx(root / images).float().unsqueeze(1) / 255.0
        return TensorDataset((x - MNIST_MEAN) / MNIST_STD, _read_idx(root / labels).long())

    return (load("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))


# -- one system ---------------------------------------------------------------------------------


def graph_summary(sharded: fxshard.ShardedModule) -> str:
    ops = ("all_gather_into_tensor", "wait_tensor", "fxshard.free", "reduce_scatter_tensor")
    lines = []
    for name, gm in sharded.graphs.items():
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        counts = ", ".join(f"{op.split('.')[-1]} x{sum(op in t for t in targets)}" for op in ops)
        lines.append(f"  {name:<8} graph: {len(targets)} ops; {counts}")
    return "\n".join(lines)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer state this rank holds."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def train_one(system: str, args: argparse.Namespace, rank: int, world_size: int,
              data: tuple[TensorDataset, TensorDataset], device: torch.device,
              min_params: int) -> dict[str, Any]:
    train_set, test_set = data
    torch.manual_seed(args.seed)
    model = Net().to(device)
    if system == "fxshard":
        model = fxshard.compile(model, policy=by_size(min_params))
    else:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank)
    # drop_last keeps one input shape: one trace for training.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    epoch_times, peak = [], 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        totals = torch.zeros(2, device=device)
        start = time.perf_counter()
        for step, (x, y) in enumerate(train_loader):
            if args.max_steps and step >= args.max_steps:
                break
            x, y = x.to(device), y.to(device)

            def train_step(x: torch.Tensor = x, y: torch.Tensor = y) -> float:
                optimizer.zero_grad()
                loss = F.nll_loss(model(x), y, reduction="sum")
                loss.backward()
                optimizer.step()
                return loss.item()

            if epoch == 1 and step == 1 and args.compare_ddp:  # warm: traced, optimizer state exists
                holder: list[float] = []
                peak = peak_memory(lambda h=holder, f=train_step: h.append(f()), model, optimizer, x)
                loss_value = holder[0]
            else:
                loss_value = train_step()
            totals += torch.tensor([loss_value, len(x)], device=device)
            if system == "fxshard" and epoch == 1 and step == 0 and rank == 0:
                print(f"[{system}] plan:\n{model.plan}\n[{system}] emitted graphs (rank 0):\n"
                      f"{graph_summary(model)}", flush=True)
                if args.print_graphs:
                    for name, gm in model.graphs.items():
                        print(f"--- {name} graph ---\n{gm.code}")
        dist.all_reduce(totals)
        epoch_times.append(time.perf_counter() - start)
        test_loss, accuracy = evaluate(model, test_loader, device)
        scheduler.step()
        if rank == 0:
            print(f"[{system}] epoch {epoch}: train loss {totals[0] / totals[1]:.4f}  "
                  f"test loss {test_loss:.4f}  accuracy {accuracy:.2%}  "
                  f"({epoch_times[-1]:.2f}s)", flush=True)

    result = {"time": sum(epoch_times) / len(epoch_times), "peak": peak,
              "state": state_bytes(model, optimizer), "accuracy": accuracy}
    if system == "fxshard":
        result["units"] = len(model.plan.units)
        if args.save_model:
            state = model.full_state_dict(rank0_only=True)
            if rank == 0:
                torch.save(state, args.save_path)
                print(f"[{system}] saved the full state dict to {args.save_path}")
    return result


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    model.eval()
    totals = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            totals += torch.tensor([F.nll_loss(out, y, reduction="sum").item(),
                                    (out.argmax(1) == y).sum().item(), len(y)], device=device)
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# -- launch -------------------------------------------------------------------------------------


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    use_cuda = args.device == "cuda"
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    data = mnist_dataset(args.data_dir) if args.data_dir else digits_dataset(args.seed)
    try:
        if args.compare_policies:
            results = {n: train_one("fxshard", args, rank, world_size, data, device, n) for n in (100, 20000)}
            if rank == 0:
                for n, r in results.items():
                    print(f"by_size({n}): {r['units']} units, {r['time']:.2f}s per epoch, "
                          f"accuracy {r['accuracy']:.2%}")
            return
        ours = train_one("fxshard", args, rank, world_size, data, device, args.min_params)
        if args.compare_ddp:
            ddp = train_one("ddp", args, rank, world_size, data, device, args.min_params)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if rank == 0:
                mib = 1 << 20
                print(f"\n{'':<26}{'fxshard':>12}{'DDP':>12}")
                print(f"{'time per epoch (s)':<26}{ours['time']:>12.2f}{ddp['time']:>12.2f}")
                print(f"{'peak tensor MiB (1 step)':<26}{ours['peak'] / mib:>12.2f}{ddp['peak'] / mib:>12.2f}")
                print(f"{'params+grads+optim MiB':<26}{ours['state'] / mib:>12.2f}{ddp['state'] / mib:>12.2f}")
                print(f"max RSS of rank 0, both systems in one process: {rss:.0f} MiB "
                      "(tensor bytes above are per system, from torch's MemTracker)")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--test-batch-size", type=int, default=100)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="steps per epoch (0: all)")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--min-params", type=int, default=20000, help="fxshard.policies.by_size threshold")
    p.add_argument("--compare-policies", action="store_true")
    p.add_argument("--compare-ddp", action="store_true")
    p.add_argument("--print-graphs", action="store_true")
    p.add_argument("--save-model", action="store_true")
    p.add_argument("--save-path", default="mnist_fxshard.pt")
    p.add_argument("--data-dir", default=None, help="directory with the MNIST IDX files")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.data_dir is not None:
        mnist_dataset(args.data_dir)  # fail here, before spawning, on a missing file
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(run, args=(args.nproc, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    sys.exit(main())
