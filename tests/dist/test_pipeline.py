"""Pipeline parallelism (x FSDP2 x expert parallelism) on 4 gloo processes against one process.

Every layout trains the same 8-block model (dense, or MoE in every other block) for 4 steps of global
batch 8 in microbatches of 2, so the pipeline's microbatches are the single process's micro-batches:
losses, MoE aux/z-losses and validation losses agree with the single process's run within 1e-5 relative,
and every parameter's (clipped) gradient of every step is as accurate as one process's fp32 gradient at
the same parameters (`assert_as_accurate` in tests/dist/equivalence.py says why and how much). Resumes from
the runs' step-2 checkpoints at another dp or pp must continue with the uninterrupted run's losses.

Cost: the default tier is two spawns (4 then 2 processes, several runs each, one torch thread per
process) and, in the test's process, two single-process runs (fp32, float64) per layout at its parameters;
the rest of the schedule x layout matrix is marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_raw
from tests.dist.equivalence import (
    assert_as_accurate,
    assert_same_run,
    copy_at_step,
    merged,
    one_process_at,
    rows,
    trace,
    trace_each,
    train,
    train_each,
)
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

STEPS = 4
DENSE = {"vocab_size": 257, "dim": 32, "n_layers": 8, "n_heads": 2, "max_seq_len": 32}
MOE = {**DENSE, "moe": {"num_experts": 4, "top_k": 2, "every": 2}}
FSDP = {"engine": "fsdp"}
INTERLEAVED = {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}

# name: (model, parallel); every one runs on 4 processes
FOUR = {
    "pp2-dp2-1f1b": (DENSE, {**FSDP, "pp": 2}),
    "pp2-dp2-gpipe": (DENSE, {**FSDP, "pp": 2, "pipeline_schedule": "gpipe"}),
    "pp2-dp2-interleaved": (DENSE, {**FSDP, "pp": 2, **INTERLEAVED}),
    "pp4-1f1b": (DENSE, {**FSDP, "pp": 4}),
    "pp2-dp2-ep2-1f1b": (MOE, {**FSDP, "pp": 2, "ep": 2}),
    "pp2-dp2-ep2-interleaved": (MOE, {**FSDP, "pp": 2, "ep": 2, **INTERLEAVED}),
    "pp1-dp4-ep2": (MOE, {**FSDP, "ep": 2}),
}
FOUR_SLOW = {
    "pp4-gpipe": (DENSE, {**FSDP, "pp": 4, "pipeline_schedule": "gpipe"}),
    "pp4-interleaved": (DENSE, {**FSDP, "pp": 4, **INTERLEAVED}),
    "pp2-dp2-ep2-gpipe": (MOE, {**FSDP, "pp": 2, "ep": 2, "pipeline_schedule": "gpipe"}),
    "pp2-dp2-interleaved-zb": (
        DENSE,
        {**FSDP, "pp": 2, "pipeline_schedule": "interleaved_zb", "virtual_stages": 2},
    ),
    "pp2-dp2-zbv": (DENSE, {**FSDP, "pp": 2, "pipeline_schedule": "zbv", "virtual_stages": 2}),
    "pp2-dp2-ep2-zbv": (MOE, {**FSDP, "pp": 2, "ep": 2, "pipeline_schedule": "zbv", "virtual_stages": 2}),
    "pp2-dp2-ep2-zero2-ac": (MOE, {**FSDP, "pp": 2, "ep": 2, "zero_stage": 2}),
}
# resumed run: (the run whose step-2 checkpoint it starts from, model, parallel); on 2 processes
RESUMES = {
    "pp2-dp2->pp2-dp1": ("pp2-dp2-1f1b", DENSE, {**FSDP, "pp": 2}),  # dp changes
    "pp4->pp2-dp1": ("pp4-1f1b", DENSE, {**FSDP, "pp": 2, **INTERLEAVED}),  # pp (and schedule) change
    "pp2-dp2-ep2->pp1-dp2-ep2": ("pp2-dp2-ep2-1f1b", MOE, {**FSDP, "ep": 2}),  # pp changes, ep kept
    "pp1-dp4-ep2->pp1-dp2-ep2": ("pp1-dp4-ep2", MOE, {**FSDP, "ep": 2}),  # dp changes, pp and ep kept
    "one->pp2-dp1": ("ref-moe", MOE, {**FSDP, "pp": 2}),  # a single process's checkpoint into a pipeline
}


def _raw(corpus: Path, run_dir: Path, model: dict, parallel: dict) -> dict:
    # eval_batches x micro_batch_size = 8 windows: whole micro-batches of 2 on every rank at dp <= 4, as on one
    # process (capacity-dropping MoE routes a chunk of tokens together, so chunks must be the same)
    train = {"steps": STEPS, "micro_batch_size": 2, "eval_every": 0, "eval_batches": 4}
    memory = {"activation_checkpointing": "every"} if parallel.get("zero_stage") == 2 else {}
    return tiny_raw(
        corpus,
        run_dir,
        model=model,
        parallel=parallel,
        train=train,
        memory=memory,
        schedule={"warmup_steps": 1},
        checkpoint={"every": 2, "keep": 3},
    )


# ---------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    """One process, engine none: the dense and the MoE reference runs."""
    root = tmp_path_factory.mktemp("ref")
    for name, model in (("dense", DENSE), ("moe", MOE)):
        train(_raw(corpus_dir, root / name, model, {}))
    return {"dense": root / "dense", "moe": root / "moe"}


def _ref_of(model: dict) -> str:
    return "moe" if "moe" in model else "dense"


def _four(corpus_dir: Path, root: Path, runs: dict) -> dict[str, tuple[Path, dict, tuple[dict, dict]]]:
    """Each run on 4 processes: its run dir, its `trace`, and one process's fp32 and float64 gradients at its
    parameters (`one_process_at`)."""
    raws = {name: _raw(corpus_dir, root / name, model, par) for name, (model, par) in runs.items()}
    traces = merged(run_ranks(trace_each, 4, raws))
    ones = {name: _raw(corpus_dir, root / f"one-{name}", model, {}) for name, (model, _) in runs.items()}
    return {name: (root / name, traces[name], one_process_at(traces[name], ones[name])) for name in runs}


@pytest.fixture(scope="module")
def four(corpus_dir, tmp_path_factory) -> dict[str, tuple[Path, dict, tuple[dict, dict]]]:
    return _four(corpus_dir, tmp_path_factory.mktemp("four"), FOUR)


@pytest.fixture(scope="module")
def resumed(corpus_dir, tmp_path_factory, four, refs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resumed")
    runs = {**{name: run_dir for name, (run_dir, *_) in four.items()}, "ref-moe": refs["moe"]}
    raws = {}
    for name, (source, model, par) in RESUMES.items():
        copy_at_step(runs[source], root / name, 2)
        raws[name] = _raw(corpus_dir, root / name, model, par)
    run_ranks(train_each, 2, raws)
    return {name: root / name for name in RESUMES}


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", FOUR)
def test_pipeline_matches_one_process(name, four, refs):
    run_dir, got, (one, exact) = four[name]
    assert_same_run(run_dir, refs[_ref_of(FOUR[name][0])], STEPS)
    assert_as_accurate(got["grads"], one, exact)


@pytest.mark.slow
def test_pipeline_matrix_matches_one_process(corpus_dir, tmp_path, refs):
    runs = _four(corpus_dir, tmp_path, FOUR_SLOW)
    for name, (run_dir, got, (one, exact)) in runs.items():
        assert_same_run(run_dir, refs[_ref_of(FOUR_SLOW[name][0])], STEPS)
        assert_as_accurate(got["grads"], one, exact)


@pytest.mark.parametrize("name", RESUMES)
def test_resume_at_another_layout_continues_the_run(name, resumed, refs):
    source, model, _ = RESUMES[name]
    run_dir = resumed[name]
    (resume,) = [r for r in rows(run_dir, "event") if r["event"] == "resume"]
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (
        2,
        1 if source == "ref-moe" else 4,
        2,
    )
    assert_same_run(run_dir, refs[_ref_of(model)], STEPS, steps=range(3, STEPS + 1))


def test_pipeline_checkpoint_resumes_on_one_process(corpus_dir, tmp_path, four, refs):
    """pp=2 x dp=2 x ep=2 -> one process (engine none): the same checkpoint folder a single process writes.
    Step 3 starts from the pipeline's parameters, bit for bit, and computes one process's gradient there
    (bit for bit too: the same arithmetic from the same numbers); step 4 starts from this run's own AdamW
    step, which its losses check against the uninterrupted run."""
    run_dir = tmp_path / "run"
    source_dir, source, (one, _) = four["pp2-dp2-ep2-1f1b"]
    copy_at_step(source_dir, run_dir, 2)
    resumed = trace(_raw(corpus_dir, run_dir, MOE, {}))
    assert sorted(resumed["grads"]) == [3, 4]
    assert_same_run(run_dir, refs["moe"], STEPS, steps=range(3, STEPS + 1))
    for name, p in source["start"][3].items():
        assert torch.equal(resumed["start"][3][name], p), name
        assert torch.equal(resumed["grads"][3][name], one[3][name]), name
