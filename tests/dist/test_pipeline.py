"""Pipeline parallelism (x FSDP2 x expert parallelism) on 4 gloo processes against one process.

Every layout trains the same 8-block model (dense, or MoE in every other block) for 4 steps of global
batch 8 in microbatches of 2, so the pipeline's microbatches are the single process's micro-batches:
losses, MoE aux/z-losses, validation loss and every parameter's (clipped) gradient must agree within
1e-5 relative (fp32; only the order of sums differs). Resumes from the runs' step-2 checkpoints at
another dp or pp must continue with the uninterrupted run's losses.

Cost: the default tier is two spawns (4 then 2 processes, several runs each, one torch thread per
process); the rest of the schedule x layout matrix is marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_raw
from tests.dist.equivalence import (
    assert_same_grads,
    assert_same_run,
    copy_at_step,
    merged,
    rows,
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
def refs(corpus_dir, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One process, engine none: the dense and the MoE reference (run dir, gradients per step)."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, model in (("dense", DENSE), ("moe", MOE)):
        out[name] = (root / name, train(_raw(corpus_dir, root / name, model, {})))
    return out


def _ref_of(model: dict) -> str:
    return "moe" if "moe" in model else "dense"


def _four(corpus_dir: Path, root: Path, runs: dict) -> dict[str, tuple[Path, dict]]:
    raws = {name: _raw(corpus_dir, root / name, model, par) for name, (model, par) in runs.items()}
    grads = merged(run_ranks(train_each, 4, raws))
    return {name: (root / name, grads[name]) for name in runs}


@pytest.fixture(scope="module")
def four(corpus_dir, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    return _four(corpus_dir, tmp_path_factory.mktemp("four"), FOUR)


@pytest.fixture(scope="module")
def resumed(corpus_dir, tmp_path_factory, four, refs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resumed")
    runs = {**four, "ref-moe": refs["moe"]}
    raws = {}
    for name, (source, model, par) in RESUMES.items():
        copy_at_step(runs[source][0], root / name, 2)
        raws[name] = _raw(corpus_dir, root / name, model, par)
    run_ranks(train_each, 2, raws)
    return {name: root / name for name in RESUMES}


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", FOUR)
def test_pipeline_matches_one_process(name, four, refs):
    run_dir, grads = four[name]
    ref_dir, ref_grads = refs[_ref_of(FOUR[name][0])]
    assert_same_run(run_dir, ref_dir, STEPS)
    assert_same_grads(grads, ref_grads)


@pytest.mark.slow
def test_pipeline_matrix_matches_one_process(corpus_dir, tmp_path, refs):
    runs = _four(corpus_dir, tmp_path, FOUR_SLOW)
    for name, (run_dir, grads) in runs.items():
        ref_dir, ref_grads = refs[_ref_of(FOUR_SLOW[name][0])]
        assert_same_run(run_dir, ref_dir, STEPS)
        assert_same_grads(grads, ref_grads)


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
    assert_same_run(run_dir, refs[_ref_of(model)][0], STEPS, steps=range(3, STEPS + 1))


def test_pipeline_checkpoint_resumes_on_one_process(corpus_dir, tmp_path, four, refs):
    """pp=2 x dp=2 x ep=2 -> one process (engine none): the same checkpoint folder a single process writes."""
    run_dir = tmp_path / "run"
    copy_at_step(four["pp2-dp2-ep2-1f1b"][0], run_dir, 2)
    grads = train(_raw(corpus_dir, run_dir, MOE, {}))
    assert_same_run(run_dir, refs["moe"][0], STEPS, steps=range(3, STEPS + 1))
    assert_same_grads(grads, {step: refs["moe"][1][step] for step in grads})
