"""A run dir can always be run again on Ray: after retention deleted checkpoints of an earlier invocation, and
with a corrupt newest checkpoint (it falls back to the one before, with an uninterrupted run's losses);
a run the cluster cannot place ends after `scaling.placement_timeout_s` with one line."""

from __future__ import annotations

import threading

import pytest
import ray.train
import yaml

from raytrain_ext.cleanup import placement_groups_of_this_job, train_controllers_of_this_job
from raytrain_ext.cli import main
from raytrain_ext.worker import pointed_to
from tests.conftest import tiny_raw
from trainers.metrics import read_metrics

pytestmark = pytest.mark.ray

STEPS, EVERY = 12, 2


def _run(corpus, run_dir, **extra):
    sections = dict(
        parallel={"engine": "ddp"},
        scaling={"num_workers": 2, "max_failures": 1},
        train={"steps": STEPS, "eval_every": 0},
        checkpoint={"every": EVERY, "keep": 2},
    )
    raw = tiny_raw(corpus, run_dir, **{**sections, **extra})
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _losses(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    return [r["step"] for r in rows], [r["loss"] for r in rows]


@pytest.mark.slow  # 76 s on 2 cores (three Ray runs)
def test_run_again_after_retention_and_past_a_corrupt_newest_checkpoint(ray_local, corpus_dir, tmp_path):
    ref_dir, run_dir = tmp_path / "straight", tmp_path / "again"
    assert main(["train", _run(corpus_dir, ref_dir), "--no-progress"]) == 0

    run = _run(corpus_dir, run_dir)
    assert main(["train", run, "--no-progress", "--callback", "search.hooks:StopAtStep(step=8)"]) == 0
    (ray_run,) = (run_dir / "ray").iterdir()  # this invocation's Ray run: Ray holds a pointer to our newest
    assert pointed_to(ray.train.Result.from_path(str(ray_run)).checkpoint) == run_dir / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    newest = run_dir / "checkpoints" / "step_00000008"
    victim = max(newest.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:100])

    assert main(["train", run, "--no-progress"]) == 0  # the same command again
    (again,) = (run_dir / "ray").iterdir()
    assert again != ray_run, "a new invocation is a new Ray run: Ray never reads the old one's record"
    steps, losses = _losses(run_dir)
    assert steps == list(range(1, STEPS + 1)), "each step exactly once"
    assert losses == _losses(ref_dir)[1], "bit for bit the losses of the uninterrupted run"
    (resume,) = [e for e in read_metrics(run_dir / "metrics.jsonl", "event") if e["event"] == "resume"]
    assert resume["step"] == 6 and resume["checkpoint"].endswith("step_00000006")
    assert resume["skipped"] == [
        {
            "checkpoint": str(newest),
            "reason": f"{victim.name} has 100 bytes, {resume['skipped'][0]['reason'].split(', ')[1]}",
        }
    ]
    assert "were written" in resume["skipped"][0]["reason"]


def test_a_run_the_cluster_cannot_place_ends_after_its_placement_timeout(
    ray_local, corpus_dir, tmp_path, capsys
):
    # This module's Ray has 2 CPUs and no autoscaler; 3 workers never fit.
    groups = placement_groups_of_this_job()
    run = _run(
        corpus_dir, tmp_path / "big", train={"steps": 6, "global_batch_size": 6, "micro_batch_size": 2}
    )
    code = main(
        [
            "train",
            run,
            "--no-progress",
            "--set",
            "scaling.num_workers=3",
            "--set",
            "scaling.placement_timeout_s=3",
        ]
    )
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "scaling.placement_timeout_s=3" in line and "3 workers x {CPU: 1}" in line
    assert "the cluster has CPU 2" in line and "fix:" in line
    # The run is over, not left asking for workers: its controller is gone and no thread of it waits inside
    # Ray's client (Ray shutting down under such a thread crashed the process with SIGSEGV).
    assert train_controllers_of_this_job() == set()
    assert not [t for t in threading.enumerate() if t.name == "raytrain-fit"]
    assert placement_groups_of_this_job() == groups, "the CPUs it reserved are free again"
