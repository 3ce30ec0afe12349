"""The PBT paper's toy problem through the search layer (Tune trials, no Train workers): starting from
t = (0.9, 0.9) with h = (1, 0) and (0, 1), PBT reaches Q >= 1.19 within 40 steps, while the same two
workers without exploit and explore (the grid) stay at Q = 0.39 < 1.0.

One seed here (a full Tune experiment, ~10-20 s); `bench/pbt_toy.py` runs 20 seeds and records how
many reach the target (bench/results/pbt_toy.json)."""

from __future__ import annotations

import pytest

from bench.toy import run_toy
from tests.ray.test_pbt import ray_pbt  # noqa: F401  (the module-scoped local Ray)

pytestmark = pytest.mark.ray

BUDGET = 40  # steps: 10 rounds of 4 steps (0.3% of seeds miss the target in a NumPy replica of the loop)


def test_pbt_reaches_the_optimum(ray_pbt, tmp_path):  # noqa: F811
    result = run_toy(0, BUDGET, tmp_path)
    assert result["best_q"] >= 1.19, result["curves"]


def test_grid_without_exploit_stays_below_one(ray_pbt, tmp_path):  # noqa: F811
    result = run_toy(0, BUDGET, tmp_path, pbt=False)
    # each worker can only shrink one coordinate: Q -> 1.2 - 0.81
    assert result["best_q"] < 1.0
    assert result["best_q"] == pytest.approx(0.39, abs=1e-3)
