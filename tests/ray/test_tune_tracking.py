"""A PBT experiment whose run config tracks with MLflow (a local store in the experiment folder): one parent
run for the experiment, each trial a child run holding every step once across the trial's Train runs, the
exploit as a tag of the exploited trial. The small synchronous-PBT experiment of test_pbt.py (2 trials of
1 worker; the weaker trial exploits the stronger one at the first interval)."""

from __future__ import annotations

import json

import pytest

from search.config import load_experiment, save
from search.driver import run_experiment
from search.lineage import read_events, read_reports
from tests.ray.test_pbt import STEPS, _experiment, _train_rows, ray_pbt  # noqa: F401  (ray_pbt: a fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # 83 s on a quiet 2-core machine: the slow tier


@pytest.fixture(scope="module")
def tracked(ray_pbt, corpus_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("tracked")
    path = _experiment(
        tmp,
        corpus_dir,
        "tracked",
        {"name": "adamw", "lr": 1e-3},
        {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        keep_checkpoints=1,
        overrides={"tracking": {"mlflow": {"experiment": "pbt-tracked"}, "flush_every_s": 0.5}},
    )
    exp = load_experiment(path)
    save(exp)
    return run_experiment(exp, verbose=0)


def test_trials_are_child_runs_of_the_experiments_run(tracked):
    from mlflow import MlflowClient

    exp_dir = tracked.exp_dir
    state = json.loads((exp_dir / "mlflow" / "parent.json").read_text())
    assert state["tracking_uri"] == f"sqlite:///{exp_dir.resolve() / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(state["tracking_uri"])
    parent = client.get_run(state["parent_run_id"])
    assert (parent.info.run_name, parent.info.status) == ("tracked", "FINISHED")
    assert client.get_experiment(parent.info.experiment_id).name == "pbt-tracked"
    assert parent.data.params["population"] == "2" and parent.data.params["scheduler.name"] == "pbt"
    assert parent.data.tags["best_trial"] == tracked.best_trial

    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    trials = sorted({r["trial"] for r in read_reports(exp_dir)})
    assert sorted(c.info.run_name for c in children) == trials, "one child per trial"
    for child in children:
        trial = child.info.run_name
        assert child.info.status == "FINISHED" and child.data.tags["raytrain.trial"] == trial
        history = client.get_metric_history(child.info.run_id, "loss")
        assert [m.step for m in history] == list(range(1, STEPS + 1)), "each step once, over its Train runs"
        rows = _train_rows(exp_dir, trial)
        assert [m.value for m in history] == pytest.approx([rows[s]["loss"] for s in range(1, STEPS + 1)])
        assert child.data.params["optimizer.name"] == "adamw"

    (exploit,) = read_events(exp_dir)
    weak = next(c for c in children if c.info.run_name == exploit["trial"])
    tag = weak.data.tags[f"exploit.{exploit['step']:08d}"]
    new_lr = exploit["new_hparams"]["optimizer.lr"]
    assert tag.startswith(f"from {exploit['donor']} (val_loss ") and f"-> {new_lr:.4g}" in tag
    assert weak.data.tags["changed.optimizer.lr"] == str(new_lr), "the explored value, next to the first"
    strong = next(c for c in children if c.info.run_name == exploit["donor"])
    assert not any(k.startswith("exploit.") for k in strong.data.tags)
