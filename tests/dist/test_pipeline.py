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

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.conftest import tiny_raw
from tests.dist.harness import run_ranks
from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

pytestmark = pytest.mark.dist

STEPS, RTOL = 4, 1e-5
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


class _Grads(TrainerCallback):
    """Each step's gradients (after clipping, before the next step zeroes them), whole tensors by FQN."""

    def __init__(self):
        self.per_step: dict[int, dict[str, torch.Tensor]] = {}

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        grads = {}
        for name, p in trainer.model.named_parameters():  # the same order on ranks sharing a mesh
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name.replace("._checkpoint_wrapped_module", "")] = g.detach().clone()
        self.per_step[trainer.step] = grads


def _train(raw: dict) -> dict[int, dict[str, torch.Tensor]]:
    grads = _Grads()
    Trainer(parse_config(raw), callbacks=[grads], progress=False).fit()
    return grads.per_step


def _train_each(rank: int, world: int, raws: dict[str, dict]) -> dict[str, dict]:
    return {name: _train(raw) for name, raw in raws.items()}


def _merged(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Each run's gradients per step, the union over ranks (pipeline stages hold different names)."""
    out: dict[str, dict] = {}
    for result in per_rank:
        for name, steps in result.items():
            for step, grads in steps.items():
                out.setdefault(name, {}).setdefault(step, {}).update(grads)
    return out


def _rows(run_dir: Path, kind: str = "train") -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl", kind)


def _values(run_dir: Path, key: str, kind: str = "train") -> list[float]:
    return [r[key] for r in _rows(run_dir, kind)]


def _assert_same_run(run_dir: Path, ref_dir: Path, steps: range | None = None) -> None:
    got = {r["step"]: r for r in _rows(run_dir)}
    ref = {r["step"]: r for r in _rows(ref_dir)}
    steps = steps or range(1, STEPS + 1)
    assert sorted(got) == list(range(1, STEPS + 1)), "each step once, logged by rank 0 alone"
    keys = ["loss", "grad_norm"] + (["moe_aux_loss", "moe_z_loss"] if "moe_aux_loss" in ref[1] else [])
    for step in steps:
        for key in keys:
            assert got[step][key] == pytest.approx(ref[step][key], rel=RTOL), (step, key)
    assert _values(run_dir, "val_loss", "eval") == pytest.approx(
        _values(ref_dir, "val_loss", "eval"), rel=RTOL
    )


def _assert_same_grads(got: dict[int, dict], ref: dict[int, dict]) -> None:
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert sorted(got[step]) == sorted(ref[step]), "every parameter has a gradient, under its own name"
        for name, r in ref[step].items():
            error = float((got[step][name] - r).norm() / r.norm().clamp_min(1e-30))
            assert error <= RTOL, (step, name, error)


# ---------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One process, engine none: the dense and the MoE reference (run dir, gradients per step)."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for name, model in (("dense", DENSE), ("moe", MOE)):
        out[name] = (root / name, _train(_raw(corpus_dir, root / name, model, {})))
    return out


def _ref_of(model: dict) -> str:
    return "moe" if "moe" in model else "dense"


def _four(corpus_dir: Path, root: Path, runs: dict) -> dict[str, tuple[Path, dict]]:
    raws = {name: _raw(corpus_dir, root / name, model, par) for name, (model, par) in runs.items()}
    grads = _merged(run_ranks(_train_each, 4, raws))
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
        _copy_at_step_2(runs[source][0], root / name)
        raws[name] = _raw(corpus_dir, root / name, model, par)
    run_ranks(_train_each, 2, raws)
    return {name: root / name for name in RESUMES}


def _copy_at_step_2(src: Path, dst: Path) -> None:
    """A copy of run `src` holding only its step-2 checkpoint (the resume drops later metrics)."""
    shutil.copytree(src, dst)
    for later in (dst / "checkpoints").glob("step_*"):
        if later.name != "step_00000002":
            shutil.rmtree(later)


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", FOUR)
def test_pipeline_matches_one_process(name, four, refs):
    run_dir, grads = four[name]
    ref_dir, ref_grads = refs[_ref_of(FOUR[name][0])]
    _assert_same_run(run_dir, ref_dir)
    _assert_same_grads(grads, ref_grads)


@pytest.mark.slow
def test_pipeline_matrix_matches_one_process(corpus_dir, tmp_path, refs):
    runs = _four(corpus_dir, tmp_path, FOUR_SLOW)
    for name, (run_dir, grads) in runs.items():
        ref_dir, ref_grads = refs[_ref_of(FOUR_SLOW[name][0])]
        _assert_same_run(run_dir, ref_dir)
        _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("name", RESUMES)
def test_resume_at_another_layout_continues_the_run(name, resumed, refs):
    source, model, _ = RESUMES[name]
    run_dir = resumed[name]
    (resume,) = [r for r in _rows(run_dir, "event") if r["event"] == "resume"]
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (
        2,
        1 if source == "ref-moe" else 4,
        2,
    )
    _assert_same_run(run_dir, refs[_ref_of(model)][0], steps=range(3, STEPS + 1))


def test_pipeline_checkpoint_resumes_on_one_process(corpus_dir, tmp_path, four, refs):
    """pp=2 x dp=2 x ep=2 -> one process (engine none): the same checkpoint folder a single process writes."""
    run_dir = tmp_path / "run"
    _copy_at_step_2(four["pp2-dp2-ep2-1f1b"][0], run_dir)
    grads = _train(_raw(corpus_dir, run_dir, MOE, {}))
    _assert_same_run(run_dir, refs["moe"][0], steps=range(3, STEPS + 1))
    _assert_same_grads(grads, {step: refs["moe"][1][step] for step in grads})
