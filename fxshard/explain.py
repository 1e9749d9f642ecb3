"""``fxshard.explain``: the plan, graphs and report of any model at any world size, in one process.

No cluster and no real memory: the model is copied onto the meta device (a
model built on meta is used as it is), the process group is torch's ``fake``
backend with N ranks, and tracing runs under fake tensors. Nothing runs, so
nothing is communicated; the graphs are exactly those rank ``rank`` of a real
N-rank job would emit.
"""

from __future__ import annotations

import copy
import difflib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxshard.errors import FxShardError
from fxshard.plan import ShardPlan
from fxshard.policies import Policy
from fxshard.report import Report

log = logging.getLogger("fxshard")


@dataclass
class PassLog:
    """The code of each graph as traced and after each pass, in order."""

    steps: list[tuple[str, str, str]] = field(default_factory=list)  # (graph, pass, code)

    def __call__(self, graph: str, pass_name: str, gm: fx.GraphModule) -> None:
        gm.recompile()
        self.steps.append((graph, pass_name, gm.code))


@dataclass
class Explanation:
    plan: ShardPlan
    graphs: dict[str, fx.GraphModule]  # "forward" and, when training, "backward"
    report: Report
    passes: PassLog
    world_size: int
    rank: int

    def __str__(self) -> str:
        return f"{self.plan}\n\n{self.report}"

    def dump(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write everything to ``directory``; returns the files written."""
        from fxshard.dump import write_dump

        return write_dump(self, Path(directory))


def _to_meta(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def explain(
    model: nn.Module,
    example_inputs: Any,
    policy: Policy | None = None,
    world_size: int = 1,
    *,
    rank: int = 0,
    train: bool = True,
    dump_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Explanation:
    """Plan, emitted graphs and report of ``model`` sharded over ``world_size`` ranks.

    ``example_inputs`` is a tensor or a tuple of positional arguments (only
    shapes and dtypes matter; any device). ``model`` is left untouched.
    ``train=False`` explains an inference step. Options are those of
    ``fxshard.compile``. ``dump_dir`` (or the ``FXSHARD_DUMP`` environment
    variable) writes the graphs after each pass, a timeline picture and the
    unit graph there.
    """
    from fxshard.api import compile as fxshard_compile

    if world_size < 1 or not 0 <= rank < world_size:
        raise FxShardError(f"explain: need 0 <= rank < world_size, got rank {rank} of {world_size}")
    if dist.is_initialized():
        raise FxShardError(
            "fxshard.explain runs without a cluster, on a fake process group of its own; a "
            "process group is already initialised here. Call explain before "
            "init_process_group, or in a separate process."
        )
    meta_model = _to_meta(model)
    meta_model.train(train)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    meta_args = pytree.tree_map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, args
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    target = dump_dir if dump_dir is not None else os.environ.get("FXSHARD_DUMP")
    passes = PassLog()  # filled only when dumping: rendering code after every pass costs time
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with torch.set_grad_enabled(train):
            sharded = fxshard_compile(meta_model, policy=policy, example_inputs=meta_args,
                                      on_pass=passes if target else None, _allow_meta=True,
                                      **options)
        result = Explanation(sharded.plan, sharded.graphs, sharded.report(), passes, world_size, rank)
    finally:
        dist.destroy_process_group()
    if target:
        written = result.dump(target)
        log.info("fxshard: explain wrote %d files to %s", len(written), target)
    return result


def pass_diffs(passes: PassLog) -> list[tuple[str, str, str, str]]:
    """(graph, pass, code, unified diff against the previous step of the same graph)."""
    previous: dict[str, str] = {}
    out = []
    for graph, name, code in passes.steps:
        before = previous.get(graph, "")
        diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), code.splitlines(keepends=True),
                                            fromfile=f"{graph} before {name}", tofile=f"{graph} after {name}"))
        out.append((graph, name, code, diff))
        previous[graph] = code
    return out
