"""Tensor parallelism (with sequence parallelism and loss parallel) on 4 gloo processes against one process.

tp=2 x dp=2, tp=2 x pp=2 (dense) and tp=2 x dp=2 x ep=2 (MoE in every other block) train the same 8-block
model for 5 steps of global batch 8 in micro-batches of 2: losses, MoE aux/z-losses, grad norms and
validation losses agree with one process's run within 1e-5 relative, and every parameter's (clipped)
gradient of every step is as accurate as one process's fp32 gradient at the same parameters (a column/row
split sums a matmul in two halves, then adds them; `assert_as_accurate` in tests/dist/equivalence.py).

Checkpoints reshard across tp as across dp and pp: the tp=2 x dp=2 run's step-2 checkpoint resumes at
tp=1 x dp=2 and at tp=2 x dp=1 (2 processes) with the uninterrupted run's losses and the same samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_raw
from tests.dist.equivalence import (
    assert_as_accurate,
    assert_same_run,
    copy_at_step,
    merged,
    one_process_at,
    rows,
    trace_each,
    train,
    train_each,
)
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

STEPS = 5
DENSE = {"vocab_size": 257, "dim": 32, "n_layers": 8, "n_heads": 2, "max_seq_len": 32}
MOE = {**DENSE, "moe": {"num_experts": 4, "top_k": 2, "every": 2}}
FSDP = {"engine": "fsdp"}

# name: (model, parallel); every one on 4 processes
FOUR = {
    "tp2-dp2": (DENSE, {**FSDP, "tp": 2}),
    "tp2-pp2": (DENSE, {**FSDP, "tp": 2, "pp": 2}),
    "tp2-dp2-ep2": (MOE, {**FSDP, "tp": 2, "ep": 2}),
}
# resumed from tp2-dp2's step-2 checkpoint, on 2 processes
RESUMES = {"tp1-dp2": {**FSDP}, "tp2-dp1": {**FSDP, "tp": 2}}


def _raw(corpus: Path, run_dir: Path, model: dict, parallel: dict) -> dict:
    # eval_batches x micro_batch_size = 8 windows: whole micro-batches of 2 on every rank, as on one process
    train_ = {"steps": STEPS, "micro_batch_size": 2, "eval_every": 0, "eval_batches": 4}
    return tiny_raw(
        corpus,
        run_dir,
        model=model,
        parallel=parallel,
        train=train_,
        schedule={"warmup_steps": 1},
        checkpoint={"every": 2, "keep": 3},
    )


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ref")
    for name, model in (("dense", DENSE), ("moe", MOE)):
        train(_raw(corpus_dir, root / name, model, {}))
    return {"dense": root / "dense", "moe": root / "moe"}


@pytest.fixture(scope="module")
def four(corpus_dir, tmp_path_factory) -> dict[str, tuple[Path, dict, tuple[dict, dict]]]:
    """Each run's dir, its `trace`, and one process's fp32 and float64 gradients at its parameters."""
    root = tmp_path_factory.mktemp("four")
    raws = {name: _raw(corpus_dir, root / name, model, par) for name, (model, par) in FOUR.items()}
    traces = merged(run_ranks(trace_each, 4, raws))
    ones = {name: _raw(corpus_dir, root / f"one-{name}", model, {}) for name, (model, _) in FOUR.items()}
    return {name: (root / name, traces[name], one_process_at(traces[name], ones[name])) for name in FOUR}


@pytest.fixture(scope="module")
def resumed(corpus_dir, tmp_path_factory, four) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resumed")
    raws = {}
    for name, par in RESUMES.items():
        copy_at_step(four["tp2-dp2"][0], root / name, 2)
        raws[name] = _raw(corpus_dir, root / name, DENSE, par)
    run_ranks(train_each, 2, raws)
    return {name: root / name for name in RESUMES}


@pytest.mark.parametrize("name", FOUR)
def test_tensor_parallel_matches_one_process(name, four, refs):
    run_dir, got, (one, exact) = four[name]
    assert_same_run(run_dir, refs["moe" if "moe" in FOUR[name][0] else "dense"], STEPS)
    assert_as_accurate(got["grads"], one, exact)


@pytest.mark.parametrize("name", RESUMES)
def test_tp_checkpoint_resumes_at_another_tp(name, resumed, refs):
    run_dir = resumed[name]
    (resume,) = [r for r in rows(run_dir, "event") if r["event"] == "resume"]
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (2, 4, 2)
    assert_same_run(run_dir, refs["dense"], STEPS, steps=range(3, STEPS + 1))
