"""bench/model_state.py: the ZeRO formula against the paper's own example, and the storage census on one
process (no timing: the benchmark itself measures)."""

from __future__ import annotations

import pytest
import torch

from bench.model_state import count, held_tensors, zero_formula
from trainers.parallel import LocalEngine

GB = 1e9


def test_formula_reproduces_the_papers_example():
    # ZeRO (Rajbhandari et al. 2020), figure 1: 7.5B parameters, N = 64, mixed-precision Adam (K = 12).
    totals = [sum(zero_formula(7_500_000_000, 64, stage, mixed_precision=True).values()) for stage in range(4)]
    assert [round(t / GB, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_fp32_formula_shards_one_more_term_per_stage():
    p, n = 1000, 4
    assert zero_formula(p, n, 0, False) == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert zero_formula(p, n, 1, False) == {"params": 4000, "grads": 4000, "optimizer": 2000}
    assert zero_formula(p, n, 2, False) == {"params": 4000, "grads": 1000, "optimizer": 2000}
    assert zero_formula(p, n, 3, False) == {"params": 1000, "grads": 1000, "optimizer": 2000}


@pytest.mark.parametrize("stage, world", [(4, 2), (-1, 2), (3, 0)])
def test_formula_rejects_unknown_stage_or_world(stage, world):
    with pytest.raises(ValueError, match="stage"):
        zero_formula(10, world, stage, False)


def test_count_takes_a_shared_storage_once_in_its_first_category():
    flat = torch.zeros(100)
    held = {c: [] for c in ("params", "grads", "master", "optim_states", "comm_buffers")}
    held["params"] = [("a", flat[:60]), ("b", flat[60:])]  # views of one flat buffer
    held["master"] = [("same storage", flat), ("copy", flat.clone())]
    sizes, storages = count(held)
    assert sizes["params"] == 400 and sizes["master"] == 400 and sizes["grads"] == 0
    assert len(storages) == 2


def test_census_of_one_process_adam_is_16_bytes_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    engine = LocalEngine()
    engine.model = model
    engine.optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    engine.optimizer.step()
    sizes, _ = count(held_tensors(engine))
    n = sum(p.numel() for p in model.parameters())
    assert sizes["params"] == 4 * n and sizes["grads"] == 4 * n
    step_counters = 4 * len(list(model.parameters()))  # one fp32 `step` scalar per parameter tensor
    assert sizes["optim_states"] == 8 * n + step_counters
