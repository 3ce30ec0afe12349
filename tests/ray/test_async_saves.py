"""Asynchronous checkpoints on Ray (issue 24): a worker killed while a checkpoint is being written in the
background resumes from the commit before it with the losses of an uninterrupted run, each step once. (The
driver killed in a background write: tests/ray/test_driver_kill.py; PBT with a slow disk:
tests/ray/test_async_pbt.py.)"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from raytrain_ext.cli import main
from raytrain_ext.launcher import wait_for
from tests.conftest import tiny_raw
from tests.ray.test_train_on_ray import _sample_lines
from trainers.checkpoint_files import COMMITTED
from trainers.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~75 s on 2 cores: two Train runs, one with a kill

EVERY, LAST = 2, 8


def _yaml(corpus_dir: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    run_dir, path = tmp_path / name, tmp_path / f"{name}.yaml"
    raw = tiny_raw(
        corpus_dir, run_dir,
        parallel={"engine": "ddp"},
        scaling={"num_workers": 2, "max_failures": 1},
        train={"steps": LAST, "eval_every": 0},
        checkpoint={"every": EVERY, "keep": 2},
    )
    path.write_text(yaml.safe_dump(raw))
    return run_dir, path


def _losses(run_dir: Path) -> tuple[list[int], list[float]]:
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def _kill_in_write(step: int, marks: Path) -> list[str]:
    return ["--callback", f"tests.ray.hooks:KillMeMidSave(step={step}, rank=1, marker_dir={str(marks)!r})"]


def test_a_worker_killed_during_a_background_write_resumes_from_the_commit_before(ray_local, corpus_dir, tmp_path):
    ref_dir, ref = _yaml(corpus_dir, tmp_path, "reference")
    assert main(["train", str(ref), "--no-progress"]) == 0

    run_dir, run = _yaml(corpus_dir, tmp_path, "killed")
    marks = tmp_path / "marks"
    with ThreadPoolExecutor(1) as pool:
        argv = ["train", str(run), "--no-progress", "--callback", "tests.ray.hooks:RecordSamples"]
        future = pool.submit(main, [*argv, *_kill_in_write(6, marks)])
        wait_for(lambda: (marks / "pid").exists() or future.done(), 240, "rank 1's writer inside the save of 6")
        assert not future.done(), future.result()
        os.kill(int((marks / "pid").read_text()), signal.SIGKILL)
        assert future.result(timeout=300) == 0

    cut = json.loads((marks / "listing.json").read_text())
    assert [n for n in cut if n.endswith(".distcp")] and COMMITTED not in cut, "killed mid-write, uncommitted"
    first_attempt = [r["step"] for r in _sample_lines(run_dir) if r["world"] == 2 and r["rank"] == 0]
    assert max(first_attempt) > 6, "training went on while step 6 was written (it waits only at the next save)"
    resumes = [(e["step"], e["checkpoint"]) for e in read_metrics(run_dir / "metrics.jsonl", "event")
               if e["event"] == "resume"]
    assert resumes == [(4, str(run_dir / "checkpoints" / "step_00000004"))], "the half-written 6 was never loaded"
    assert _losses(run_dir) == _losses(ref_dir), "each step once, bit for bit the uninterrupted run's losses"
