"""Any value a run logs can drive a search: `metric: KIND/KEY` with `mode`, checked before Ray starts, and
a report carries the callbacks' own eval values."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from raytrain_ext.worker import LatestMetrics
from search.config import load_experiment
from search.runs import metric_of, reported
from trainers._base import ConfigError
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _demo(tmp_path, corpus_dir, *overrides: str):
    return load_experiment(
        EXAMPLES / "pbt-demo.yaml", [f"overrides.data.path={corpus_dir}", f"storage={tmp_path}", *overrides]
    )


@pytest.mark.parametrize(
    ("metric", "key"),
    [("val_loss", "val_loss"), ("train_loss", "loss"), ("train/grad_norm", "grad_norm"), ("eval/val_loss", "val_loss")],
)
def test_a_metric_names_a_value_of_the_runs_reports(tmp_path, corpus_dir, metric, key):
    exp = _demo(tmp_path, corpus_dir, f"metric={metric}")
    assert exp.metric_key == key
    assert metric_of(exp, {"step": 40, "val_loss": 3.5, "loss": 3.25, "grad_norm": 0.5}) == {
        "val_loss": 3.5, "loss": 3.25, "grad_norm": 0.5}[key]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["metric=accuracy"], "metric='accuracy' is not a metric a run logs; fix: val_loss, train_loss, or KIND/KEY"),
        (["metric=eval/accuracy"], "no callback is given to add 'accuracy'; fix: callbacks:"),
    ],
)
def test_a_metric_no_run_could_report_is_refused_in_one_line(tmp_path, corpus_dir, overrides, says):
    with pytest.raises(ConfigError) as e:
        _demo(tmp_path, corpus_dir, *overrides)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_report_without_the_metric_fails_the_interval_with_the_reason(tmp_path, corpus_dir):
    exp = _demo(tmp_path, corpus_dir, "metric=eval/accuracy", "mode=max", "callbacks=[mypkg:Eval]")
    out = reported(exp, 40, {"step": 40, "val_loss": 3.5, "loss": 3.2}, tmp_path, 1.0, {})
    assert out.metric == -math.inf and out.step_dir is None
    assert out.error.startswith("ConfigError: metric eval/accuracy: the run's report at step 40 has no 'accuracy'")
    ok = reported(exp, 40, {"step": 40, "val_loss": 3.5, "accuracy": 0.25}, tmp_path, 1.0, {})
    assert ok.metric == 0.25 and ok.error is None and ok.step_dir == tmp_path


class _Accuracy(TrainerCallback):
    def after_eval(self, trainer, record):
        record["accuracy"] = math.exp(-record["val_loss"])


def test_a_callbacks_eval_value_is_logged_and_reported_whatever_the_order_of_callbacks(tiny_config):
    """The reporting callback comes first: it still reports the value a later callback adds to the record."""
    latest = LatestMetrics()
    cfg = tiny_config(train={"steps": 8, "eval_every": 4}, checkpoint={"every": 0})
    trainer = Trainer(cfg, callbacks=[latest, _Accuracy()], progress=False)
    trainer.fit()
    evals = read_metrics(cfg.out_dir / "metrics.jsonl", "eval")
    assert [e["step"] for e in evals] == [4, 8]
    assert all(e["accuracy"] == math.exp(-e["val_loss"]) for e in evals)
    report = latest.report(SimpleNamespace(step=8, engine=trainer.engine), 8)
    assert report["accuracy"] == evals[-1]["accuracy"] and report["val_loss"] == evals[-1]["val_loss"]
    assert report["loss"] == read_metrics(cfg.out_dir / "metrics.jsonl", "train")[-1]["loss"]
