"""The memory budget's search on a full-size plan: Llama-3-8B (32 layers) at sequence 2048 within
70 GiB, planned on meta. A file of its own, slow tier: over a minute on one core, which
pytest-xdist (one worker per file) then runs beside the rest of the tier."""

from __future__ import annotations

import pytest
import torch

import fxshard
from fxshard.policies import by_class
from tests.test_explain import _llama3_8b


@pytest.mark.slow
def test_llama3_8b_planned_on_meta_at_world_size_1_offloads_and_recomputes_within_70_gib() -> None:
    """The same budget planned on meta: the math kernel keeps every layer's (2048 x 2048)
    scores for backward, so once offload fits the optimizer step the planner also recomputes
    blocks, and where recomputing them all does not fit either, offloads more. Of the 32 alike
    blocks only the first and the last are measured alone per recompute step before its 33
    prefixes are scanned, and the reshard step, which misses, scans only the ends of their
    runs: 83 candidates."""
    model = _llama3_8b(32)
    from llama import TransformerBlock

    report = fxshard.explain(model, torch.zeros(1, 2048, dtype=torch.long), by_class(TransformerBlock),
                             mixed_precision=fxshard.MixedPrecision(param_dtype=torch.bfloat16),
                             optimizer=torch.optim.AdamW, memory_budget=70 << 30,
                             offload_policy=fxshard.CPUOffloadPolicy()).report
    assert report.budget is not None and report.predicted_peak_bytes <= 70 << 30
    chosen = report.budget.chosen
    assert chosen.offloaded and chosen.full and not chosen.selective
    assert chosen.step == "offload more units"
    # Measuring all 32 blocks alone in each recompute step would take 60 more, every reshard
    # prefix about 28 more.
    assert len(report.budget.tried) < 90
