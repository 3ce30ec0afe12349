"""DeepSpeed engine on 1 and 2 gloo processes: ZeRO-3 and ZeRO-2 with CPU offload reproduce a single-process
run, checkpoints move between world sizes through DeepSpeed's universal format, and bad DeepSpeed input fails
before training with one line.

The multi-process runs are grouped into two spawns in the `runs` fixture (process start and the DeepSpeed
import cost more than 10 tiny steps); the tests read its results. The only JIT op build is DeepSpeed's
cpu_adam for the offload run (30-120 s measured on a fresh cache, then kept in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import yaml

from tests.conftest import tiny_raw
from tests.dist.harness import run_ranks
from trainers.checkpoint_files import checkpoint_step, is_complete
from trainers.config import ConfigError, ParallelConfig, parse_config
from trainers.launch import run_local
from trainers.metrics import read_metrics
from trainers.parallel import build_engine
from trainers.parallel.deepspeed_engine import TAG, UNIVERSAL_TAG, deepspeed_config
from trainers.trainer import Trainer, TrainerCallback

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]

FP32_RTOL = 1e-5
# DeepSpeed's bf16 keeps bf16 weights (fp32 masters in the optimizer); the reference keeps fp32 weights
# under autocast. Measured over these 10 steps: losses within 3.1e-4 relative, grad norms within 3e-3.
BF16_LOSS_RTOL, BF16_NORM_RTOL = 2e-3, 2e-2

# The stages at their extremes (CI's time: ZeRO-0, 1 and 2 without offload, bf16 at ZeRO-0 and a 2 -> 1 reshard at
# ZeRO-2 went; ZeRO-2 on two Ray workers against torchrun stays in the default tier)
PARITY = {  # 2 processes, fp32, against the single-process run "ref"
    "zero3": {"zero_stage": 3},
    "zero2-offload": {"zero_stage": 2, "offload": "optimizer"},
}
BF16 = {"zero3-bf16": 3}  # 2 processes, against "ref-bf16"
RESHARD = {"1to2": (1, 2, 3)}  # saved at, resumed at, ZeRO stage
STOP = 5  # the resharding runs stop after the checkpoint of this step and resume from it


@dataclass
class Job:
    name: str
    raw: dict[str, Any]
    stop_after: int | None = None


class _Stop(Exception):
    pass


class _StopAfterCheckpoint(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def after_checkpoint(self, trainer, path):
        if checkpoint_step(path) == self.step:
            raise _Stop


def _record_windows(trainer: Trainer) -> dict[int, list[int]]:
    """Window ids each step trains on, on this rank (step numbers 1-based, as in metrics.jsonl)."""
    seen: dict[int, list[int]] = {}
    get = trainer.train_data.get

    def recording(ids):
        seen.setdefault(trainer.step + 1, []).extend(int(i) for i in ids)
        return get(ids)

    trainer.train_data.get = recording
    return seen


def _train(rank: int, world: int, jobs: list[Job]) -> dict[str, dict[str, Any]]:
    out = {}
    for job in jobs:
        stop = [_StopAfterCheckpoint(job.stop_after)] if job.stop_after else []
        trainer = Trainer(parse_config(job.raw), callbacks=stop, progress=False)
        start, windows = trainer.step, _record_windows(trainer)
        try:
            trainer.fit()
        except _Stop:
            pass
        log = trainer.run_dir / "metrics.jsonl"
        rows = read_metrics(log, "train") if rank == 0 else []
        resumes = [e for e in read_metrics(log, "event") if e["event"] == "resume"] if rank == 0 else []
        out[job.name] = {
            "start": start,
            "rows": [(r["step"], r["loss"], r["grad_norm"]) for r in rows],
            "resume": resumes[-1] if resumes else None,
            "windows": windows,
        }
    return out


def _merge_ranks(results: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Rank 0's rows and events; every rank's windows."""
    merged = {}
    for name, first in results[0].items():
        windows: dict[int, list[int]] = {}
        for rank_result in results:
            for step, ids in rank_result[name]["windows"].items():
                windows.setdefault(step, []).extend(ids)
        merged[name] = {**first, "windows": windows}
    return merged


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("deepspeed")

    def job(name: str, run: str | None = None, stop_after: int | None = None, **sections) -> Job:
        base = {
            "train": {"steps": 10, "micro_batch_size": 2, "eval_every": 0},  # global batch 8
            "checkpoint": {"every": STOP},
        }
        for key, values in sections.items():
            base[key] = {**base.get(key, {}), **values}
        return Job(name, tiny_raw(corpus_dir, root / (run or name), **base), stop_after)

    def deepspeed(name: str, parallel: dict, dtype: str = "fp32", **kw) -> Job:
        return job(name, parallel={"engine": "deepspeed", **parallel}, precision={"dtype": dtype}, **kw)

    def reshard(name: str, half: str) -> Job:
        stage = RESHARD[name][2]
        stop = STOP if half == "first" else None
        return deepspeed(f"{name}-{half}", {"zero_stage": stage}, run=f"reshard-{name}", stop_after=stop)

    # Two spawns, in the order the resharding halves need: saved at 1 -> resumed at 2.
    spawns = [
        (1, [job("ref"), job("ref-bf16", precision={"dtype": "bf16"}), reshard("1to2", "first")]),
        (
            2,
            [
                *(deepspeed(name, parallel) for name, parallel in PARITY.items()),
                *(deepspeed(name, {"zero_stage": stage}, "bf16") for name, stage in BF16.items()),
                reshard("1to2", "second"),
            ],
        ),
    ]
    results: dict[str, Any] = {}
    for world, jobs in spawns:
        results |= _merge_ranks(run_ranks(_train, world, jobs))
    results["root"] = root
    return results


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def _same_windows(a: dict, b: dict) -> bool:
    """The same windows per step, whichever rank trained them."""

    def by_step(run: dict) -> dict[int, list[int]]:
        return {step: sorted(ids) for step, ids in run["windows"].items()}

    return by_step(a) == by_step(b)


def _compare(ref: dict, got: dict, loss_rtol: float, norm_rtol: float) -> None:
    assert [r[0] for r in got["rows"]] == [r[0] for r in ref["rows"]] == list(range(1, 11))
    assert all(math.isfinite(r[2]) for r in got["rows"]), "every step reports DeepSpeed's grad norm"
    loss = _max_rel([r[1] for r in ref["rows"]], [r[1] for r in got["rows"]])
    norm = _max_rel([r[2] for r in ref["rows"]], [r[2] for r in got["rows"]])
    assert loss <= loss_rtol and norm <= norm_rtol, (loss, norm)


# --------------------------------------------------------------------------------------------- parity


# The runs of these three are the slow tier's; the default tier keeps DeepSpeed on two Ray
# workers against torchrun (tests/ray/test_train_on_ray.py) and the one-process and refusal tests below.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_two_processes_match_one_in_fp32(runs, name):
    _compare(runs["ref"], runs[name], FP32_RTOL, FP32_RTOL)
    assert _same_windows(runs[name], runs["ref"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BF16))
def test_bf16_within_documented_bound(runs, name):
    _compare(runs["ref-bf16"], runs[name], BF16_LOSS_RTOL, BF16_NORM_RTOL)


# ------------------------------------------------------------------------------------------- resharding


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESHARD))
def test_checkpoint_resumes_at_another_world_size(runs, name):
    saved_at, resumed_at, _ = RESHARD[name]
    first, second = runs[f"{name}-first"], runs[f"{name}-second"]
    assert first["start"] == 0 and second["start"] == STOP
    assert second["resume"]["saved_world_size"] == saved_at and second["resume"]["world_size"] == resumed_at
    step_dir = runs["root"] / f"reshard-{name}" / "checkpoints" / f"step_{STOP:08d}"
    assert (step_dir / TAG).is_dir() and (step_dir / UNIVERSAL_TAG).is_dir(), "resumed via universal format"
    # metrics.jsonl holds steps 1-5 from the first run and 6-10 from the resumed one
    _compare(runs["ref"], second, FP32_RTOL, FP32_RTOL)
    # each global batch trained exactly once, on the same windows as without the interruption
    windows = {**first["windows"], **second["windows"]}
    assert sorted(first["windows"]) == list(range(1, STOP + 1))
    assert sorted(second["windows"]) == list(range(STOP + 1, 11))
    assert _same_windows({"windows": windows}, runs["ref"])
    everything = [i for ids in windows.values() for i in ids]
    assert len(everything) == len(set(everything)) == 10 * 8


# ------------------------------------------------------------------------------------- one process, inline


@pytest.fixture
def inline_deepspeed(monkeypatch):
    """DeepSpeed in the test process: `import deepspeed` sets PYTORCH_NVML_BASED_CUDA_CHECK=1
    (deepspeed/__init__.py); monkeypatch undoes it for the leak guard."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def test_one_process_without_a_group_and_new_hparams_on_resume(tiny_config, inline_deepspeed):
    cfg = tiny_config(
        parallel={"engine": "deepspeed", "zero_stage": 2},
        train={"steps": 6, "micro_batch_size": 2, "eval_every": 0},
        checkpoint={"every": 3},
    )
    assert not dist.is_initialized()
    result = run_local(cfg, progress=False)  # the engine starts its own 1-process group and ends it
    assert result.step == 6 and not dist.is_initialized()
    assert (result.checkpoint / TAG / "mp_rank_00_model_states.pt").is_file()

    pbt = cfg.model_copy(deep=True)  # what an exploit does: same checkpoint, new hyperparameters
    pbt.train.steps = 7
    pbt.optimizer.lr, pbt.optimizer.betas, pbt.optimizer.weight_decay = 1e-4, (0.8, 0.9), 0.05
    trainer = Trainer(pbt, progress=False)
    try:
        assert trainer.step == 6
        groups = trainer.engine.param_groups
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
        assert all(g["initial_lr"] == 1e-4 and g["betas"] == (0.8, 0.9) for g in groups)
        record = trainer.train_step()
        assert record["lr"] < 1e-4 and all(g["lr"] == record["lr"] for g in groups)
    finally:
        trainer.engine.close()
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------- bad input


def _extra(**extra) -> dict:
    return {"parallel": {"deepspeed_extra": extra}}


CONFLICTS = {  # sections over tiny_config (zero_stage 2 unless set) -> the error
    "stage": (
        _extra(zero_optimization={"stage": 3}),
        r"deepspeed_extra.zero_optimization.stage=3 conflicts with 2 from parallel.zero_stage",
    ),
    "micro-batch": (
        _extra(train_micro_batch_size_per_gpu=8),
        r"train_micro_batch_size_per_gpu=8 conflicts with 4 from train.micro_batch_size",
    ),
    "dtype": (_extra(bf16={"enabled": True}), r"bf16.enabled=True conflicts with False from precision.dtype"),
    "optimizer": (_extra(optimizer={"type": "Adam"}), r"deepspeed_extra.optimizer is set by the trainer"),
    "scheduler": (_extra(scheduler={"type": "WarmupLR"}), r"use the run's schedule section"),
    "universal": (
        _extra(checkpoint={"load_universal": True}),
        r"deepspeed_extra.checkpoint.load_universal is set by the trainer",
    ),
    "offload-stage0": (
        {"parallel": {"zero_stage": 0, "offload": "optimizer"}},
        r"parallel.offload=optimizer needs a ZeRO stage",
    ),
    "fp16-scale": (
        {"precision": {"dtype": "fp16", "init_scale": 1000.0}},
        r"precision.init_scale=1000.0 is not a power of 2",
    ),
    "fp16-zero0": (
        {"parallel": {"zero_stage": 0}, "precision": {"dtype": "fp16"}},
        r"precision.dtype=fp16 with deepspeed zero_stage=0: DeepSpeed 0.19 divides the gradients",
    ),
    "adagrad": (
        {"optimizer": {"name": "adagrad", "weight_decay": 0.1}},
        r"optimizer.name=adagrad with weight_decay>0 and deepspeed zero_stage=2",
    ),
}
REJECTED_BY_DEEPSPEED = {  # found when the engine sets up, before any step
    "nested-typo": (
        _extra(zero_optimization={"stag": 1}),
        r"DeepSpeed rejects the config \(DeepSpeedZeroConfig.stag: Extra inputs are not permitted\)",
    ),
    "top-level-typo": (
        _extra(zero_optimisation={"stage": 1}),
        r"zero_optimisation is not a DeepSpeed config key; fix: did you mean 'zero_optimization'",
    ),
    "fp16-on-cpu": (
        {"precision": {"dtype": "fp16"}},
        r"precision.dtype=fp16: DeepSpeed does not support fp16",
    ),
}


def _deepspeed_cfg(tiny_config, sections: dict):
    sections = {key: dict(value) for key, value in sections.items()}
    sections["parallel"] = {"engine": "deepspeed", **sections.get("parallel", {})}
    return tiny_config(**sections)


@pytest.mark.parametrize(("sections", "match"), CONFLICTS.values(), ids=CONFLICTS)
def test_conflicting_config_is_one_line(tiny_config, sections, match):
    with pytest.raises(ConfigError, match=match) as err:
        deepspeed_config(_deepspeed_cfg(tiny_config, sections), dp=2)
    assert "\n" not in str(err.value) and "fix:" in str(err.value)


def test_extra_keys_merge_deeply_and_agreeing_values_pass(tiny_config):
    sections = _extra(zero_optimization={"overlap_comm": False, "stage": 2}, wall_clock_breakdown=False)
    ds = deepspeed_config(_deepspeed_cfg(tiny_config, sections), dp=2)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["overlap_comm"] is False
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    batch = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
    assert batch == (8, 4, 1)


@pytest.mark.parametrize(("sections", "match"), REJECTED_BY_DEEPSPEED.values(), ids=REJECTED_BY_DEEPSPEED)
def test_deepspeed_rejections_are_one_line_before_training(tiny_config, inline_deepspeed, sections, match):
    from deepspeed.accelerator import get_accelerator

    if "precision" in sections and get_accelerator().is_fp16_supported():
        pytest.skip("this device runs DeepSpeed fp16")
    with pytest.raises(ConfigError, match=match) as err:
        Trainer(_deepspeed_cfg(tiny_config, sections), progress=False)
    assert "\n" not in str(err.value)
    assert not dist.is_initialized(), "the engine ends the group it started when setup fails"


@pytest.mark.parametrize(
    ("saved_with", "match"),
    [
        ({"engine": "none"}, r"was not written by the deepspeed engine; fix: resume it with"),
        (
            {"engine": "deepspeed", "zero_stage": 2},
            r"saved with ZeRO stage 1-2 and cannot resume at zero_stage=3",
        ),
    ],
    ids=["dcp-checkpoint", "zero2-to-zero3"],
)
def test_checkpoint_it_cannot_load_is_refused(tiny_config, inline_deepspeed, saved_with, match):
    cfg = tiny_config(parallel=saved_with, train={"steps": 6, "eval_every": 0}, checkpoint={"every": 6})
    run_local(cfg, progress=False)
    resumed = cfg.model_copy(update={"parallel": ParallelConfig(engine="deepspeed", zero_stage=3)})
    engine = build_engine(resumed)
    try:
        with pytest.raises(ConfigError, match=match):
            Trainer(resumed, engine=engine, progress=False)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------- the console


def test_a_zero3_run_prints_no_warning_a_user_cannot_act_on(corpus_dir, tmp_path):
    """A fresh process, as a worker is: DeepSpeed's accelerator guess ("unable to detect" a GPU on a CPU
    machine) and torch's deprecation of the collectives DeepSpeed calls (FutureWarnings, again at each step)
    stay off stderr; a warning of ours or any other would still show."""
    raw = tiny_raw(
        corpus_dir,
        tmp_path / "run",
        parallel={"engine": "deepspeed", "zero_stage": 3},
        train={"steps": 4, "micro_batch_size": 2, "eval_every": 0},
        schedule={"warmup_steps": 1},
        checkpoint={"every": 2},
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run(
        [sys.executable, "-m", "trainers", "train", str(tmp_path / "run.yaml"), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert is_complete(tmp_path / "run" / "checkpoints" / "step_00000004")  # the run did its work
    noise = [line for line in done.stderr.splitlines() if "Warning" in line or "[WARNING]" in line]
    assert noise == [], done.stderr
