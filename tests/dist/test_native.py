"""Native engines (DDP, FSDP2) on 2 gloo processes against one process (engine none), same global batch.

fp32 agrees within 1e-5 relative: only the order of the sums (gradient reduction, loss mean) differs. FSDP
bf16 is compared with single-process bf16 autocast under looser bounds (see RTOL). Checkpoints
saved at one world size resume at the other; a rank killed in the middle of a save leaves the previous
checkpoint in charge; `torchrun -m trainers` runs the FSDP example. The window ids every step really
trained on are recorded (all ranks', gathered) and compared step by step with the single-process run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.multiprocessing import ProcessExitedException

from bench.model_state import count, held_tensors
from tests.conftest import tiny_raw
from tests.dist.harness import run_ranks
from trainers.checkpoint import Checkpointer, is_complete
from trainers.checkpoint_files import checkpoint_step
from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
RTOL = {  # precision.dtype: (loss, grad norm) relative bounds, two processes vs one
    # Only the order of the sums (gradient reduction, loss mean) differs.
    "fp32": (1e-5, 1e-5),
    # bf16 keeps 8 significant bits (spacing 2**-8 = 3.9e-3). FSDP's bf16 runs the whole model in bf16,
    # where single-process autocast keeps the residual stream and norms in fp32. Measured over 10 steps:
    # loss 2.2e-4, grad norm 2.5e-3. Bounds: half a bf16 spacing for the loss (a mean over 256 tokens),
    # ~5 spacings for the grad norm (from gradients computed in bf16 throughout).
    "bf16": (2e-3, 2e-2),
    # fp16 is autocast on both sides; only the order of fp16 sums differs. Measured 1.1e-6 and 3.7e-5;
    # bounds a fifth and two of fp16's spacing (2**-11 = 4.9e-4).
    "fp16": (1e-4, 1e-3),
}
FSDP = {"engine": "fsdp", "zero_stage": 3}
TWO_PROCESS_RUNS = {  # name: config sections, each compared with one process of the same precision
    "ddp": {"parallel": {"engine": "ddp"}},
    "fsdp-zero2": {"parallel": {"engine": "fsdp", "zero_stage": 2}},
    "fsdp-zero3": {"parallel": FSDP},
    "fsdp-zero3-offload": {"parallel": {**FSDP, "offload": "all"}},
    # whole gradients kept between the 2 micro-batches, reduced once (the default reduces each one)
    "fsdp-zero3-unsharded-accumulation": {"parallel": {**FSDP, "grad_accumulation": "unsharded"}},
    "fsdp-zero3-ac": {"parallel": FSDP, "memory": {"activation_checkpointing": "every"}},
    "fsdp-zero3-bf16": {"parallel": FSDP, "precision": {"dtype": "bf16"}},
    # Overflows the first steps, to be skipped by all ranks together. Half one process's initial scale:
    # each micro-batch's loss is divided by the accumulation, halved at 2 ranks, so this scales each
    # micro-batch's fp16 gradients as one process does, and the same steps overflow.
    "fsdp-zero3-fp16": {"parallel": FSDP, "precision": {"dtype": "fp16", "init_scale": 2.0**19}},
}
PRECISIONS = {"fp32": {}, "bf16": {"dtype": "bf16"}, "fp16": {"dtype": "fp16", "init_scale": 2.0**20}}


def _dtype(name: str) -> str:
    return TWO_PROCESS_RUNS[name].get("precision", {}).get("dtype", "fp32")


def _raw(corpus: Path, run_dir: Path, world: int, **sections: dict) -> dict:
    """10 steps of global batch 8 in micro-batches of 2: 4 micro-batches per step on one process, 2 per
    rank on two, so gradient accumulation differs between the runs compared. eval_batches is a global
    count: both evaluate the same 4 validation windows."""
    train = {"steps": STEPS, "micro_batch_size": 2, "eval_every": 5, "eval_batches": 2}
    return tiny_raw(corpus, run_dir, train=train, checkpoint={"every": 5, "keep": 2}, **sections)


# ------------------------------------------------------------------------------- per-rank training


class _RecordSamples(TrainerCallback):
    """The window ids each step trained on, from every rank: wraps the train split's `get`."""

    def __init__(self, trainer: Trainer):
        self.per_step: dict[int, list[int]] = {}
        self._pending: list[int] = []
        get = trainer.train_data.get

        def recording_get(ids):
            self._pending.extend(int(i) for i in ids)
            return get(ids)

        trainer.train_data.get = recording_get
        trainer.callbacks.append(self)

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        ids, self._pending = self._pending, []
        if dist.is_initialized():
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, ids)
            ids = [i for part in parts for i in part]
        self.per_step[trainer.step] = sorted(ids)


class _Stopped(Exception):
    pass


class _StopAfterCheckpoint(TrainerCallback):
    """Interrupt the run once the checkpoint of `step` is committed: every rank gets here after the same
    collective save, so all ranks stop together."""

    def __init__(self, step: int):
        self.step = step

    def after_checkpoint(self, trainer: Trainer, path: Path) -> None:
        if checkpoint_step(path) == self.step:  # an async save commits a few steps after its step
            raise _Stopped


def _train(rank: int, world: int, raw: dict, stop_after: int | None = None) -> dict[int, list[int]]:
    """One rank's run (or the whole run on one process); returns the window ids per step."""
    trainer = Trainer(parse_config(raw), progress=False)
    samples = _RecordSamples(trainer)
    if stop_after is not None:
        trainer.callbacks.append(_StopAfterCheckpoint(stop_after))
    try:
        trainer.fit()
    except _Stopped:
        pass
    return samples.per_step


def _train_each(rank: int, world: int, raws: dict[str, dict]) -> dict[str, dict[int, list[int]]]:
    return {name: _train(rank, world, raw) for name, raw in raws.items()}


def _train_and_die_mid_save(rank: int, world: int, raw: dict, step: int) -> dict[int, list[int]]:
    """Rank 1 is SIGKILLed inside DCP's write of the checkpoint of `step`, its shard file just written."""
    if rank == 1:
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            future = write_data(self, plan, planner)
            if f"step_{step:08d}" in str(self.path):
                future.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return future

        FileSystemWriter.write_data = write_then_die
    return _train(rank, world, raw)


def _gradient_bytes(engine) -> tuple[int, int]:
    """(bytes of gradient this rank holds, bytes of parameters it holds: its shards, all resharded after
    backward): bench/model_state.py's census, which counts the sharded gradients and the whole ones FSDP2
    keeps pending a reduce-scatter, each storage once (with dim-0 padding)."""
    sizes = count(held_tensors(engine))[0]
    return sizes["grads"], sizes["params"]


def _gradients_between_micro_batches(rank: int, world: int, raws: dict[str, dict]) -> dict[str, tuple]:
    """Per run: the gradient bytes held right after the first micro-batch of step 1 (one more follows)."""
    out = {}
    for name, raw in raws.items():
        trainer = Trainer(parse_config(raw), progress=False)
        engine, backward = trainer.engine, trainer.engine.backward

        def recording_backward(loss, final_micro_batch, name=name, engine=engine, backward=backward):
            backward(loss, final_micro_batch)
            if not final_micro_batch and name not in out:
                out[name] = _gradient_bytes(engine)

        engine.backward = recording_backward
        trainer.fit()
    return out


def _run(world: int, raw: dict, stop_after: int | None = None) -> dict[int, list[int]]:
    if world == 1:
        return _train(0, 1, raw, stop_after)
    return run_ranks(_train, world, raw, stop_after)[0]


# ---------------------------------------------------------------------------------------- results


@dataclass
class _Result:
    run_dir: Path
    samples: dict[int, list[int]]

    def rows(self, kind: str = "train") -> list[dict[str, Any]]:
        return read_metrics(self.run_dir / "metrics.jsonl", kind)

    def values(self, key: str, kind: str = "train") -> list[float]:
        return [r[key] for r in self.rows(kind)]


@pytest.fixture(scope="module")
def one_process(corpus_dir, tmp_path_factory) -> dict[str, _Result]:
    """The references: engine none on one process, fp32 and bf16 autocast."""
    root = tmp_path_factory.mktemp("one_process")
    raws = {dtype: _raw(corpus_dir, root / dtype, 1, precision=p) for dtype, p in PRECISIONS.items()}
    return {dtype: _Result(root / dtype, _train(0, 1, raw)) for dtype, raw in raws.items()}


@pytest.fixture(scope="module")
def two_processes(corpus_dir, tmp_path_factory) -> dict[str, _Result]:
    """Every engine of TWO_PROCESS_RUNS, one after the other, in one spawn of 2 ranks."""
    root = tmp_path_factory.mktemp("two_processes")
    raws = {name: _raw(corpus_dir, root / name, 2, **sections) for name, sections in TWO_PROCESS_RUNS.items()}
    samples = run_ranks(_train_each, 2, raws)[0]
    return {name: _Result(root / name, samples[name]) for name in raws}


def _assert_close(got: _Result, ref: _Result, dtype: str = "fp32") -> None:
    loss_rtol, norm_rtol = RTOL[dtype]
    assert got.values("step") == list(range(1, STEPS + 1)), "each step once, written by rank 0 alone"
    assert got.values("loss") == pytest.approx(ref.values("loss"), rel=loss_rtol)
    assert got.values("grad_norm") == pytest.approx(ref.values("grad_norm"), rel=norm_rtol)


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", TWO_PROCESS_RUNS)
def test_two_processes_match_one(name, one_process, two_processes):
    dtype = _dtype(name)
    got, ref = two_processes[name], one_process[dtype]
    _assert_close(got, ref, dtype)
    assert got.samples == ref.samples, "the same windows each step"
    assert got.values("val_loss", "eval") == pytest.approx(ref.values("val_loss", "eval"), rel=RTOL[dtype][0])
    if dtype == "fp16":
        assert got.values("grad_norm")[0] == float("inf"), "the first step overflowed"
        assert got.values("loss_scale") == [scale / 2 for scale in ref.values("loss_scale")]


def test_ddp_checkpoint_writes_each_tensor_once(one_process, two_processes):
    def shards(result: _Result) -> list[Path]:
        return sorted((result.run_dir / "checkpoints" / f"step_{STEPS:08d}").glob("*.distcp"))

    ddp, single = shards(two_processes["ddp"]), shards(one_process["fp32"])
    assert {p.name.split("_")[2] for p in ddp} == {"0", "1"}, "each rank writes a part"
    # Replicated tensors: DCP's save planner gives each to one rank; written twice they would double.
    assert sum(p.stat().st_size for p in ddp) < 1.1 * sum(p.stat().st_size for p in single)


def test_fsdp_accumulates_gradients_in_the_shards(corpus_dir, tmp_path):
    """Between micro-batches a rank holds its gradient shards only (ZeRO's 4P/N), unless asked to keep
    whole gradients (4P: twice that at 2 ranks) and reduce once."""
    raws = {mode: _raw(corpus_dir, tmp_path / mode, 2, parallel={**FSDP, "grad_accumulation": mode})
            for mode in ("sharded", "unsharded")}
    for raw in raws.values():  # step 1 is recorded: 2 micro-batches per rank
        raw["train"].update(steps=2, eval_every=0)
        raw["schedule"].update(warmup_steps=1)
        raw["checkpoint"].update(every=0)
    for held_and_shard in run_ranks(_gradients_between_micro_batches, 2, raws):
        held, shard = held_and_shard["sharded"]
        assert held == shard > 0
        held, shard = held_and_shard["unsharded"]
        assert held >= 2 * shard * 0.99  # whole = both ranks' shards, less dim-0 padding


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)], ids=["fsdp2-to-1", "1-to-fsdp2"])
def test_resume_at_another_world_size(before, after, corpus_dir, tmp_path, one_process):
    run_dir = tmp_path / "run"

    def raw(world: int) -> dict:
        return _raw(corpus_dir, run_dir, world, parallel=FSDP if world > 1 else {})

    first = _run(before, raw(before), stop_after=5)
    second = _run(after, raw(after))
    # The first run stopped once step 5 committed: async, it may have trained a step or two past it.
    assert sorted(first)[:5] == list(range(1, 6)) and sorted(second) == list(range(6, STEPS + 1))
    ref = one_process["fp32"]
    _assert_close(_Result(run_dir, {}), ref)
    # Step by step, the windows of the uninterrupted run: none skipped, and steps trained again (past the
    # checkpoint) on the same windows.
    assert {**first, **second} == ref.samples and all(first[s] == ref.samples[s] for s in first)
    (resume,) = [r for r in _Result(run_dir, {}).rows("event") if r["event"] == "resume"]
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (5, before, after)


def test_rank_killed_mid_save_leaves_previous_checkpoint(corpus_dir, tmp_path, one_process):
    run_dir = tmp_path / "run"
    raw = _raw(corpus_dir, run_dir, 2, parallel=FSDP)
    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        run_ranks(_train_and_die_mid_save, 2, raw, STEPS)
    root = run_dir / "checkpoints"
    partial, final = root / f"step_{STEPS:08d}.partial", root / f"step_{STEPS:08d}"
    assert list(partial.glob("*.distcp")) and not final.exists()
    assert not (partial / ".metadata").exists(), "killed while shards were being written, before DCP's commit"
    assert Checkpointer(root, keep=2).latest() == root / "step_00000005"

    resumed = _run(2, raw)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    ref = one_process["fp32"]
    _assert_close(_Result(run_dir, {}), ref)
    assert resumed == {step: ref.samples[step] for step in range(6, STEPS + 1)}
    assert is_complete(final) and not partial.exists()


def test_torchrun_runs_the_fsdp_example(corpus_dir, tmp_path):
    """`torchrun -m trainers train` with the shipped FSDP example: 2 ranks, one metrics log."""
    overrides = {
        "data.path": corpus_dir,
        "run_dir": tmp_path,
        "train.steps": 4,
        "train.eval_batches": 1,
        "train.tensorboard": "false",
        "schedule.warmup_steps": 1,
        "checkpoint.every": 2,
    }
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "trainers", "train", str(ROOT / "examples" / "tiny-fsdp.yaml"), *sets]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = _Result(tmp_path, {})
    assert result.values("step") == [1, 2, 3, 4]
    assert set(result.values("world_size")) == {2}
    checkpoints = tmp_path / "checkpoints"
    assert Checkpointer(checkpoints, keep=2).latest() == checkpoints / "step_00000004"
