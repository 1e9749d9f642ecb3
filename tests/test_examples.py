"""Every example runs in a short mode, so none rots. These are what a newcomer runs first."""

from __future__ import annotations

import gzip
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def mnist_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One short run of the demo with every flag the tests look at: train, compare with DDP, save."""
    path = tmp_path_factory.mktemp("mnist") / "m.pt"
    out = run("examples/mnist.py", "--nproc", "2", "--epochs", "1", "--max-steps", "3",
              "--compare-ddp", "--save-model", "--save-path", str(path))
    return out, path


def test_mnist_demo_trains_prints_graphs_and_saves(mnist_run: tuple[str, Path]) -> None:
    out, path = mnist_run
    assert "ShardPlan(world_size=2, policy=by_size(20_000)" in out
    # The graph summary: ops, all_gather_into_tensor, wait_tensor, free, reduce_scatter_tensor.
    counts = {graph: [int(n) for n in numbers.split()] for graph, numbers in
              re.findall(r"^(forward|backward) +((?:\d+ +){4}\d+)$", out, re.MULTILINE)}
    assert counts.keys() == {"forward", "backward"}, out
    _, fw_gather, fw_wait, fw_free, fw_scatter = counts["forward"]
    _, bw_gather, bw_wait, bw_free, bw_scatter = counts["backward"]
    assert fw_gather == 2 and fw_wait >= 2 and fw_free >= 1 and fw_scatter == 0  # one per unit
    assert bw_gather >= 1 and bw_free >= 1 and bw_scatter == 2 and bw_wait >= bw_gather + 2
    assert re.search(r"epoch 1: train loss [\d.]+, test loss [\d.]+, "
                     r"accuracy \d+/360 \([\d.]+%\)", out), out

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist import Net

    saved = torch.load(path)
    expected = Net().state_dict()
    assert saved.keys() == expected.keys()
    assert all(saved[k].shape == v.shape for k, v in expected.items())


def test_mnist_compare_ddp_prints_both_systems_with_equal_losses(mnist_run: tuple[str, Path]) -> None:
    out, _ = mnist_run
    ours = re.search(r"\[fxshard by_size\(20_000\)\] epoch 1: train loss ([\d.]+)", out)
    ddp = re.search(r"\[DDP\] epoch 1: train loss ([\d.]+)", out)
    assert ours and ddp, out
    # Same seed, same data, same dropout masks: the same training, sharded or replicated.
    assert abs(float(ours.group(1)) - float(ddp.group(1))) < 1e-4
    assert re.search(r"^ +fxshard by_size\(20_000\) +DDP$", out, re.MULTILINE), out
    for label in ("train time per epoch (s)", "params + grads + optimizer state (MiB)",
                  "peak live tensors in a step (MiB)", "max RSS of the process (MiB)"):
        assert re.search(rf"^{re.escape(label)} +[\d.]+ +[\d.]+$", out, re.MULTILINE), label
    state = re.search(r"^params \+ grads \+ optimizer state \(MiB\) +([\d.]+) +([\d.]+)$", out,
                      re.MULTILINE)
    assert state and float(state.group(1)) < 0.6 * float(state.group(2))  # sharded over 2 ranks


def test_mnist_missing_data_dir_fails_clearly(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "examples/mnist.py", "--data-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "MNIST file not found" in proc.stderr
    assert str(tmp_path / "train-images-idx3-ubyte") in proc.stderr


def _write_idx(path: Path, array: torch.Tensor, compress: bool) -> None:
    header = struct.pack(f">HBB{array.dim()}I", 0, 0x08, array.dim(), *array.shape)
    data = header + array.to(torch.uint8).numpy().tobytes()
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def test_mnist_reads_idx_files_plain_and_gzipped(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from mnist import MNIST_MEAN, MNIST_STD, mnist_datasets

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (5, 28, 28), generator=g)
    labels = torch.randint(0, 10, (5,), generator=g)
    _write_idx(tmp_path / "train-images-idx3-ubyte", images, compress=True)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", labels, compress=False)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", images[:3], compress=False)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:3], compress=True)
    train, test = mnist_datasets(str(tmp_path))
    x, y = train.tensors
    assert x.shape == (5, 1, 28, 28) and torch.equal(y, labels)
    torch.testing.assert_close(x[:, 0], (images / 255.0 - MNIST_MEAN) / MNIST_STD)
    assert test.tensors[0].shape == (3, 1, 28, 28) and torch.equal(test.tensors[1], labels[:3])


@pytest.mark.slow  # resuming at another world size is in the fast tier through test_checkpoint
def test_gpt_example_trains_reports_saves_and_resumes_at_another_world_size(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    common = ["--layers", "2", "--dim", "32", "--checkpoint", ckpt]
    out = run("examples/gpt.py", "--nproc", "2", "--steps", "6", "--sample", "5", *common)
    # A fresh model guesses about uniformly over the text's characters: its loss is near ln(vocab).
    first = re.search(r"^step 1: loss ([\d.]+) \(a uniform guess scores ln (\d+) = ([\d.]+)\)$", out,
                      re.MULTILINE)
    assert first, out
    assert float(first.group(3)) == pytest.approx(math.log(int(first.group(2))), abs=1e-3)
    assert float(first.group(1)) == pytest.approx(float(first.group(3)), rel=0.3)
    assert re.search(r"^step 6: loss [\d.]+$", out, re.MULTILINE), out
    assert re.search(r"tokens in [\d.]+s: [\d,]+ tokens/s over 2 ranks", out), out
    assert "fxshard report: rank 0 of 2" in out and "predicted peak" in out
    assert "ShardPlan(world_size=2, policy=by_class(Block)" in out
    assert "sample: fxshard " in out
    assert (tmp_path / "ckpt" / ".metadata").exists()
    out = run("examples/gpt.py", "--nproc", "3", "--steps", "8", "--sample", "0", "--resume", *common)
    assert "resumed from" in out and "at step 6 on 3 ranks" in out


def test_gpt_sample_reads_each_context_as_it_is() -> None:
    # One input shape for every step: a short context is padded on the right, where causal
    # attention cannot see it, so each id follows from the unpadded context alone.
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, generate

    torch.manual_seed(0)
    model = GPT(vocab=11, dim=16, heads=2, layers=2, seq=8).double()
    for p in model.parameters():
        torch.nn.init.normal_(p)  # logits far apart: greedy choices cannot tie
    seen = []

    def recording(window: torch.Tensor) -> torch.Tensor:
        seen.append(window.shape)
        return model(window)

    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = generate(recording, prompt, 12, seq=8, temperature=0)
        expected = prompt
        for _ in range(12):
            choice = model(expected[:, -8:])[0, -1].argmax()
            expected = torch.cat([expected, choice.view(1, 1)], dim=1)
    assert torch.equal(out, expected)
    assert set(seen) == {torch.Size([1, 8])}
