"""A run the cluster cannot place ends after `scaling.placement_timeout_s` with one line, its controller gone
and its CPUs free again. (A corrupt newest checkpoint passed over for the one before, with an uninterrupted
run's losses: tests/unit/test_crash_proof.py; a run dir run again after a killed worker, driver or host: the Ray
and cluster tiers' kill tests.)"""

from __future__ import annotations

import threading

import pytest
import yaml

from raytrain_ext.cleanup import placement_groups_of_this_job, train_controllers_of_this_job
from raytrain_ext.cli import main
from tests.conftest import tiny_raw

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
