"""`raytrain train` on Ray Train V2 (CPU, gloo): the same losses as torchrun, a SIGKILLed worker resumed
from the last checkpoint, and errors a restart cannot fix ending the run at once with their cause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from raytrain_ext.cli import main
from raytrain_ext.launcher import wait_for
from tests.conftest import tiny_raw
from tests.dist.harness import free_port
from trainers.data.dataset import GlobalSampler, TokenWindows
from trainers.metrics import read_metrics

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def _write_run(corpus: Path, run_dir: Path, **sections) -> Path:
    raw = tiny_raw(corpus, run_dir, **sections)
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(raw))
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"each step exactly once, in order: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def _torchrun(run_yaml: Path, nproc: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "trainers", "train", str(run_yaml), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"engine": "fsdp", "zero_stage": 3}, id="fsdp"),
        # the slow tier: ~45 s more; Ray's part (workers, their process group, a run dir) is the engine's same
        # whatever it is (the default tier's fsdp case), and DeepSpeed's own losses match one process's on gloo
        # ranks (tests/dist/test_deepspeed.py)
        pytest.param({"engine": "deepspeed", "zero_stage": 2}, id="ds", marks=pytest.mark.slow),
    ],
)
def test_two_workers_match_torchrun(ray_local, corpus_dir, tmp_path, parallel):
    sections = dict(parallel=parallel, train={"steps": STEPS, "eval_every": 4}, checkpoint={"every": 4})
    on_ray = _write_run(corpus_dir, tmp_path / "ray", scaling={"num_workers": 2}, **sections)
    reference = _write_run(corpus_dir, tmp_path / "torchrun", **sections)

    assert main(["train", str(on_ray), "--no-progress"]) == 0
    _torchrun(reference, 2)

    got, want = _losses(tmp_path / "ray"), _losses(tmp_path / "torchrun")
    assert list(got) == list(range(1, STEPS + 1))
    assert got == pytest.approx(want, rel=1e-5)
    assert {r["world_size"] for r in read_metrics(tmp_path / "ray" / "metrics.jsonl", "train")} == {2}


def _sample_lines(run_dir: Path) -> list[dict]:
    lines = []
    for path in sorted((run_dir / "samples").glob("rank*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(lines, key=lambda r: r["time"])


def final_samples_per_step(run_dir: Path) -> dict[int, list[int]]:
    """The ids each step of the finished run trained on, from the last attempt that ran the step (an
    attempt killed after a step had run it once already): {step: sorted ids over that attempt's ranks}."""
    latest: dict[tuple[int, int], dict] = {}
    for r in _sample_lines(run_dir):
        latest[(r["step"], r["rank"])] = r
    out: dict[int, list[int]] = {}
    for step in sorted({s for s, _ in latest}):
        newest = max((r for (s, _), r in latest.items() if s == step), key=lambda r: r["time"])
        ranks = [latest.get((step, rank)) for rank in range(newest["world"])]
        assert all(r is not None and r["world"] == newest["world"] for r in ranks), f"step {step}: {ranks}"
        out[step] = sorted(i for r in ranks for i in r["ids"])
    return out


def assert_each_sample_once(run_dir: Path, corpus: Path, steps: int, batch: int, seed: int = 0) -> None:
    per_step = final_samples_per_step(run_dir)
    assert sorted(per_step) == list(range(1, steps + 1)), "every step trained exactly once in the end"
    seen = [i for ids in per_step.values() for i in ids]
    windows = TokenWindows(corpus, "train", 32).num_windows
    expected = GlobalSampler(windows, seed, True).window_ids(0, steps * batch)
    assert len(seen) == steps * batch
    assert sorted(seen) == sorted(int(i) for i in expected), "no sample repeated or skipped"


def test_sigkill_of_a_worker_resumes_from_last_checkpoint(ray_local, corpus_dir, tmp_path):
    steps, kill_at, every = 12, 7, 5
    run_dir = tmp_path / "killed"
    run = _write_run(
        corpus_dir, run_dir, parallel={"engine": "fsdp"}, scaling={"num_workers": 2, "max_failures": 2},
        train={"steps": steps, "eval_every": 0}, checkpoint={"every": every, "keep": 2},
    )
    argv = ["train", str(run), "--no-progress", "--callback", "tests.ray.hooks:RecordSamples",
            "--callback", f"tests.ray.hooks:KillMeAtStep(step={kill_at}, rank=1, after_commit={every})"]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(main, argv)
        pid_file = run_dir / "pids" / "rank1"
        wait_for(lambda: pid_file.exists() or future.done(), 180, "rank 1 to reach the kill step")
        assert not future.done(), future.result()
        killed_at = int((run_dir / "pids" / "rank1.step").read_text())
        assert killed_at == kill_at
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert future.result(timeout=300) == 0

    losses = _losses(run_dir)
    assert list(losses) == list(range(1, steps + 1)), "the metrics file has each step exactly once"
    (resume,) = [e for e in read_metrics(run_dir / "metrics.jsonl", "event") if e["event"] == "resume"]
    assert resume["step"] == every, "resumed from the last checkpoint before the kill"
    # Recomputed = steps run twice: only those after the checkpoint, up to the kill.
    rank0 = [r for r in _sample_lines(run_dir) if r["rank"] == 0]
    ran = [r["step"] for r in rank0]
    twice = sorted({s for s in ran if ran.count(s) > 1})
    assert twice and set(twice) <= set(range(every + 1, killed_at + 1)), twice
    # A resumed step repeats the killed attempt's step exactly.
    first: dict[int, float] = {}
    for r in rank0:
        first.setdefault(r["step"], r["loss"])
    assert all(first[s] == losses[s] for s in twice), "a recomputed step repeats the killed attempt's loss"
    assert_each_sample_once(run_dir, corpus_dir, steps, batch=8)


def test_failure_before_first_checkpoint_ends_run_with_its_cause(ray_local, corpus_dir, tmp_path, capsys):
    run_dir = tmp_path / "early"
    run = _write_run(
        corpus_dir, run_dir, parallel={"engine": "ddp"}, scaling={"num_workers": 2, "max_failures": 3},
        train={"steps": 10, "eval_every": 0}, checkpoint={"every": 5},
    )
    code = main(["train", str(run), "--no-progress", "--callback", "tests.ray.hooks:RaiseAtStep(step=2)"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "injected failure at step 2" in err and "before the first checkpoint" in err
    attempts = (run_dir / "attempts.log").read_text().split()
    assert len(attempts) == 2, "one attempt (2 workers) trained; no retries of the same doomed steps"
