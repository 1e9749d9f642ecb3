"""Models the test suite trains, each with the policies it is tested under."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxshard.policies import Policy, by_class, by_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mnist import Net as TutorialNet  # noqa: E402


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, hidden: int = 24, d_out: int = 5, depth: int = 3):
        super().__init__()
        dims = [d_in] + [hidden] * (depth - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class Net(TutorialNet):
    """The Net of the PyTorch FSDP MNIST tutorial (examples/mnist.py); dropout can be switched off."""

    def __init__(self, dropout: bool = True):
        super().__init__()
        if not dropout:
            self.dropout1.p = self.dropout2.p = 0.0


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        # No qkv bias: the key bias has an exactly-zero gradient (softmax ignores a
        # per-query constant), so Adam would turn rounding noise into updates and
        # no two implementations could agree on it.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        if dropout:  # only then: the other tests' graphs stay as they were
            self.attn.proj = nn.Sequential(self.attn.proj, nn.Dropout(dropout))
            self.mlp.append(nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-style LM: token + position embeddings, pre-LN blocks, tied output embedding."""

    def __init__(self, vocab: int = 61, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalises in fp32 and returns the input's dtype, which it reads."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RotaryBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in self.qkv(self.norm1(x)).split(d, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class RotaryGPT(nn.Module):
    """A Llama-style LM whose root computes the rotary table in fp32 and passes it to every block."""

    def __init__(self, vocab: int = 61, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.head_dim = dim // heads
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(RotaryBlock(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        inv_freq = 1.0 / 10000 ** (torch.arange(half, device=idx.device, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()  # fp32, whatever the blocks compute in
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 6 * 6, 4, bias=False)
        self.bn_out = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.bn_out(self.fc(x.flatten(1)))


class FrozenNet(nn.Module):
    """A frozen feature extractor (no gradient, no gradient memory) under a trained head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        for p in self.features.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.features(x)))


class SharedUse(nn.Module):
    """One Linear applied twice, and one weight shared by two sibling modules."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.twice = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight  # used by two units
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        x = torch.tanh(self.a(x)) + torch.sigmoid(self.b(x))
        return self.out(x)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    policies: tuple[Policy, ...]


def _regression(shape: tuple[int, ...], d_out: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(*shape, generator=g), torch.randn(shape[0], d_out, generator=g)

    return make


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _digits(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 61, (3, 17), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


CASES = {
    c.name: c
    for c in [
        Case("mlp", MLP, _regression((6, 12), 5), _mse, (by_size(300), by_class(nn.Linear))),
        Case("mnist_net", lambda: Net(dropout=False), _digits, lambda o, y: F.nll_loss(o, y),
             (by_size(20000), by_class(nn.Conv2d, nn.Linear))),
        Case("gpt", TinyGPT, _tokens, _lm_loss, (by_class(Block), by_size(2000))),
        Case("batchnorm", BNNet, _regression((5, 3, 6, 6), 4), _mse,
             (by_class(nn.Conv2d, nn.Linear), by_size(100))),
        Case("frozen", FrozenNet, _regression((6, 10), 3), _mse,
             (by_class(nn.Sequential), by_size(100))),
        Case("shared_use", SharedUse, _regression((6, 8), 2), _mse,
             (by_class(nn.Linear), by_size(50))),
    ]
}
