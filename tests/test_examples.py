"""Every example runs in a short mode, so none rots. These are what a newcomer runs first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_mnist_demo_trains_prints_graphs_and_saves(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    out = run("examples/mnist.py", "--nproc", "2", "--epochs", "1", "--max-steps", "3",
              "--save-model", "--save-path", str(path))
    assert "ShardPlan(world_size=2, policy=by_size(20_000)" in out
    fw = re.search(r"forward +graph: .*all_gather_into_tensor x(\d+).*free x(\d+)", out)
    bw = re.search(r"backward graph: .*all_gather_into_tensor x(\d+).*reduce_scatter_tensor x(\d+)", out)
    assert fw and bw, out
    assert int(fw.group(1)) == 2 and int(fw.group(2)) >= 1
    assert int(bw.group(1)) >= 1 and int(bw.group(2)) == 2
    assert re.search(r"epoch 1: train loss [\d.]+ +test loss [\d.]+ +accuracy [\d.]+%", out), out
    sys.path.insert(0, str(ROOT / "examples"))
    from mnist import Net

    saved = torch.load(path)
    expected = Net().state_dict()
    assert saved.keys() == expected.keys()
    assert all(saved[k].shape == v.shape for k, v in expected.items())


def test_mnist_compare_ddp_prints_both_systems_with_equal_losses() -> None:
    out = run("examples/mnist.py", "--nproc", "2", "--epochs", "1", "--max-steps", "2", "--compare-ddp")
    ours = re.search(r"\[fxshard\] epoch 1: train loss ([\d.]+)", out)
    ddp = re.search(r"\[ddp\] epoch 1: train loss ([\d.]+)", out)
    assert ours and ddp, out
    assert abs(float(ours.group(1)) - float(ddp.group(1))) < 1e-4
    for row in ("time per epoch", "peak tensor MiB", "params+grads+optim MiB"):
        assert row in out


def test_mnist_missing_data_dir_fails_clearly(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "examples/mnist.py", "--data-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "MNIST file not found" in proc.stderr and "train-images-idx3-ubyte" in proc.stderr


def test_gpt_example_trains_and_reports() -> None:
    out = run("examples/gpt.py", "--nproc", "2", "--steps", "6", "--layers", "2", "--dim", "32",
              "--sample", "5")
    assert re.search(r"tokens in [\d.]+s: [\d,]+ tokens/s over 2 ranks", out), out
    assert "fxshard report: rank 0 of 2" in out and "predicted peak" in out
    assert "ShardPlan(world_size=2, policy=by_class(Block)" in out
    assert "sample: fxshard " in out
