"""Experiment sizing and the `raytrain tune` command line, without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raytrain_ext.cli import main
from search.config import load_experiment, load_saved, save
from search.driver import max_concurrent_trials
from trainers._base import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def demo(tmp_path, corpus_dir):
    def make(*overrides: str):
        return load_experiment(
            EXAMPLES / "pbt-demo.yaml",
            [f"overrides.data.path={corpus_dir}", f"storage={tmp_path}", *overrides],
        )

    return make


@pytest.mark.parametrize(
    ("cluster", "changes", "expected"),
    [
        ({"CPU": 2.0}, [], 4),  # the demo: 4 trials x 2 workers x 0.25 CPU
        ({"CPU": 2.0}, ["resources.cpus_per_worker=1"], 1),
        ({"CPU": 16.0}, ["resources.cpus_per_worker=1"], 4),  # never more than the population
        ({"CPU": 16.0}, ["resources.cpus_per_worker=1", "max_concurrent_trials=2"], 2),
        ({"CPU": 64.0, "GPU": 4.0}, ["resources.use_gpu=true", "resources.cpus_per_worker=1"], 2),
    ],
)
def test_concurrency_follows_what_the_train_runs_need(demo, cluster, changes, expected):
    assert max_concurrent_trials(demo(*changes), cluster) == expected


def test_a_trial_larger_than_the_cluster_is_an_error(demo):
    with pytest.raises(ConfigError, match=r"a trial needs 4 CPUs \(2 workers\) but the cluster has 2 CPUs"):
        max_concurrent_trials(demo("resources.cpus_per_worker=2"), {"CPU": 2.0})


def test_saved_experiment_reloads_from_its_folder(demo, tmp_path):
    exp = demo()
    save(exp)
    again = load_saved(exp.exp_dir)
    assert again.model_dump() == exp.model_dump() and again.base_raw == exp.base_raw


def test_tune_command_rejects_bad_input_before_ray(tmp_path, capsys):
    bad = tmp_path / "exp.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"base": str(EXAMPLES / "tiny-dense.yaml"), "space": {"optimizer.lr": [1]}, "populaton": 2}
        )
    )
    assert main(["tune", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "raytrain: error: unknown key 'populaton'; fix: did you mean 'population'?"
    assert main(["tune", "report", str(tmp_path)]) == 2
    assert "holds no experiment.json" in capsys.readouterr().err
