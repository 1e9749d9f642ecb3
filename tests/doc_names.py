"""What the docs' examples leave to the reader, bound to small stand-ins, so that
tests/test_doc_examples.py runs every example as written (tests/doc_examples.py says how).

Each block of a page runs after ``from doc_names import *``: the imports the docs take as
given, the reader's model classes, data and loss, and a new ``model`` each time. Paths the
examples read (a pretrained checkpoint, a Hugging Face model) are made by the test, in the
folder the page runs in.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard.policies import by_class, by_size

from models import Block, TinyGPT


@dataclass
class Config:
    vocab: int = 61
    dim: int = 32
    heads: int = 4
    layers: int = 2
    seq: int = 16


config = Config()


def GPT(config: Config = config) -> TinyGPT:  # the docs' class name
    return TinyGPT(**asdict(config))


# The reader's model, under each name the docs give it; its blocks are Block.
MyTransformer = MyModel = Build = TinyGPT
Transformer = GPT
MyBlock = Block


def build() -> nn.Module:
    return TinyGPT()


def build_llama() -> nn.Module:
    """A model that reads 8192 tokens (inspecting.md's explain at 1024 ranks)."""
    return TinyGPT(seq=8192)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab, (2, config.seq), generator=g)
    return x, torch.roll(x, -1, dims=1)


loader = [_batch(0), _batch(1)]
micro_batches = loader
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*map(torch.cat, zip(*loader))),
                                   batch_size=2)
x, y = loader[0]
device = torch.device("cpu")


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


# launching.md's mesh: this job's ranks, and the policy to shard by.
world = int(os.environ.get("WORLD_SIZE", "1"))
policy = by_class(Block)

# checkpoints.md's DCP path; integrations.md's Hugging Face model (a folder the test writes) and data.
path = "ckpt/dcp"
name = "tiny-llama"
PRETRAINED = ("hf-ckpt/", "path/to/hf-checkpoint/")
train = val = [{"input_ids": list(range(i, i + 8)), "labels": list(range(i, i + 8))} for i in range(4)]

model: nn.Module = TinyGPT()  # the script makes a new one before every block

__all__ = [
    "Block", "Build", "GPT", "MyBlock", "MyModel", "MyTransformer", "Transformer", "build",
    "build_llama", "by_class", "by_size", "config", "data", "device", "dist", "fxshard", "loader",
    "loss_fn", "micro_batches", "model", "name", "path", "policy", "torch", "train", "val",
    "world", "x", "y",
]
