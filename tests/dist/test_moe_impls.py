"""The grouped expert path against the per-expert loop on 2 gloo processes: expert parallelism (ep=2, the
all-to-all path), pipeline parallelism (pp=2) and tensor parallelism (tp=2, experts split by hidden unit).

Each layout trains the same capacity-dropping top-2 MoE model with `model.moe.impl: loop` and `grouped`:
losses, aux and z-losses, grad norms, validation loss and every parameter's gradient agree within 1e-5
relative (fp32), and the MoE loads and dropped fraction are the same numbers (the same tokens kept).
"""

from __future__ import annotations

import pytest

from tests.conftest import tiny_raw
from tests.dist.equivalence import assert_same_grads, assert_same_run, merged, rows, train_each
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

STEPS = 3
MODEL = {"vocab_size": 257, "dim": 32, "n_layers": 4, "n_heads": 2, "max_seq_len": 32,
         "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0}}
LAYOUTS = {  # on 2 processes
    "ep2": {"engine": "fsdp", "ep": 2},
    "pp2": {"engine": "fsdp", "pp": 2},
    "tp2": {"engine": "fsdp", "tp": 2},
}
IMPLS = ("loop", "grouped")


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict:
    """One spawn of 2 processes: every layout with each impl; run dirs and gradients per step."""
    root = tmp_path_factory.mktemp("moe-impls")
    raws = {}
    for layout, parallel in LAYOUTS.items():
        for impl in IMPLS:
            name = f"{layout}-{impl}"
            raws[name] = tiny_raw(
                corpus_dir, root / name, model={**MODEL, "moe": {**MODEL["moe"], "impl": impl}},
                parallel=parallel, schedule={"warmup_steps": 1}, checkpoint={"every": 0},
                train={"steps": STEPS, "micro_batch_size": 2, "eval_every": 0, "eval_batches": 4},
            )
    grads = merged(run_ranks(train_each, 2, raws))
    return {name: (root / name, grads[name]) for name in raws}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_trains_like_the_loop(layout, runs):
    grouped_dir, grouped_grads = runs[f"{layout}-grouped"]
    loop_dir, loop_grads = runs[f"{layout}-loop"]
    assert_same_run(grouped_dir, loop_dir, STEPS)
    assert_same_grads(grouped_grads, loop_grads)
    for got, ref in zip(rows(grouped_dir), rows(loop_dir), strict=True):
        assert got["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"]
        assert got["moe_dropped_fraction"] == pytest.approx(ref["moe_dropped_fraction"], abs=1e-7)
        assert got["moe_load_imbalance"] == pytest.approx(ref["moe_load_imbalance"], rel=1e-6)
        assert got["moe_dropped_fraction"] > 0  # capacity 1.0 drops: the dropping path is exercised
