"""Train a small character-level GPT with fxshard on a text this repo ships.

    python examples/gpt.py                        # 2 CPU ranks, spawned here
    torchrun --nproc_per_node=2 examples/gpt.py   # one process per rank
    python examples/gpt.py --checkpoint ckpt      # save a sharded checkpoint every 50 steps
    python examples/gpt.py --checkpoint ckpt --resume --nproc 3   # go on, at any world size

Prints the first loss (near ln 89 = 4.49, a uniform guess over the text's 89
characters), a tqdm progress bar, the last loss, tokens per second, the plan
and fxshard's report (predicted peak memory and bytes communicated per step),
and a sample drawn with --temperature and --top-k.

``build()`` returns the model untrained, for ``fxshard explain``:

    fxshard explain examples/gpt.py:build --world-size 8 --policy "by_class(Block)" \\
        --input-shape 1,64 --input-dtype int64
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import fxshard
from fxshard.policies import by_class

TEXT = Path(__file__).resolve().parent / "data" / "fxshard_docs.txt"
DIM, HEADS, LAYERS, SEQ = 128, 4, 4, 64  # the defaults of build() and of the command line


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: fxshard keeps them in one unit
        # GPT-2's init. nn.Embedding's N(0, 1), read back through the tied head, gives
        # logits of std ~sqrt(dim) and a first loss of ~76 instead of ln(vocab) = 4.5.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():  # residual branches scaled: the stream keeps its size
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def vocabulary() -> list[str]:
    return sorted(set(TEXT.read_text()))


def build(dim: int = DIM, heads: int = HEADS, layers: int = LAYERS, seq: int = SEQ) -> GPT:
    """The example's model, untrained: one token id per character of the text."""
    return GPT(len(vocabulary()), dim, heads, layers, seq)


def generate(model: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, n: int, seq: int,
             temperature: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
             ) -> torch.Tensor:
    """``idx`` (1, t) followed by ``n`` sampled ids. The model always gets (1, seq), one input
    shape and so one trace: a shorter context is padded on the right, where causal attention
    cannot see it, and the next id is read at the context's last position."""
    for _ in range(n):
        context = idx[:, -seq:]
        last = context.shape[1] - 1
        window = F.pad(context, (0, seq - context.shape[1]))
        logits = model(window)[0, last]
        if temperature <= 0:
            choice = logits.argmax()
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -math.inf)
            choice = torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
        idx = torch.cat([idx, choice.view(1, 1)], dim=1)
    return idx


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    text = TEXT.read_text()
    chars = vocabulary()
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    torch.manual_seed(0)
    model = build(args.dim, args.heads, args.layers, args.seq)
    sharded = fxshard.compile(model, policy=by_class(Block))
    opt = torch.optim.AdamW(sharded.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank reads its own windows

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        windows = torch.stack([data[s:s + args.seq + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]

    first = 0
    if args.resume:
        extra = fxshard.checkpoint.load(args.checkpoint, sharded, opt)
        first = extra["step"] if extra else 0
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {first} on {world_size} ranks")
    steps = tqdm(range(first, args.steps), disable=rank != 0, desc="training")
    start, tokens = time.perf_counter(), 0
    for step in steps:
        x, y = batch()
        for group in opt.param_groups:  # linear warmup, from the step alone: a resumed run agrees
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        loss = F.cross_entropy(sharded(x).reshape(-1, len(chars)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        tokens += x.numel() * world_size
        if step == first:
            start, tokens = time.perf_counter(), 0  # the first step traces; time the rest
        steps.set_postfix(loss=f"{loss.item():.3f}")
        if step == first and rank == 0:
            v = len(chars)
            guess = f" (a uniform guess scores ln {v} = {math.log(v):.3f})" if step == 0 else ""
            tqdm.write(f"step {step + 1}: loss {loss.item():.3f}{guess}")
        if args.checkpoint and (step + 1 == args.steps or (step + 1) % args.save_every == 0):
            fxshard.checkpoint.save(args.checkpoint, sharded, opt, extra={"step": step + 1})
    elapsed = time.perf_counter() - start
    if rank == 0:
        if args.steps > first:
            print(f"step {args.steps}: loss {loss.item():.3f}")
        rate = tokens / elapsed if elapsed > 0 else math.nan
        print(f"\n{tokens} tokens in {elapsed:.1f}s: {rate:,.0f} tokens/s over {world_size} ranks")
        print(sharded.plan)
        print(sharded.report())
    sharded.eval()
    idx = torch.tensor([[stoi[c] for c in "fxshard "]], dtype=torch.long)
    # Every rank samples in lockstep (each call is collective), with the same seed.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        idx = generate(sharded, idx, args.sample, args.seq, args.temperature, args.top_k, gen)
    if rank == 0 and args.sample:
        print("sample:", "".join(chars[i] for i in idx[0].tolist()))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--dim", type=int, default=DIM)
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100, help="steps of linear learning-rate warmup")
    p.add_argument("--sample", type=int, default=200, help="characters to generate (0: none)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=10, help="sample among the k likeliest (0: all)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--checkpoint", default=None, help="directory of the sharded checkpoint to save")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="load --checkpoint first and go on from its step")
    args = p.parse_args()
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint DIR")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    mp.spawn(_spawned, args=(args.nproc, args), nprocs=args.nproc, join=True)


def _spawned(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """A rank started here: leave without interpreter teardown once done (see mnist.py's
    spawned: a native thread can abort the process at exit after all its work)."""
    run(rank, world_size, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
