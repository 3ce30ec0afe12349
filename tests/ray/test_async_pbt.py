"""PBT with asynchronous checkpoints and a slow disk (issue 24): reports (and so exploits) name committed
checkpoints only, made at their commit with the metrics of their own step. Where the scheduler does not
decide (burn-in) training does not wait for the writes; where it decides, the trial's loop trains to the
report (`Trainer.fit(until)`: the commit is waited for), so that no step an exploit would abandon is trained
(issue 42). tests/ray/hooks.py:SlowWrites holds the burn-in's writes until training has gone two steps
further."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.config import load_experiment, save
from search.driver import run_experiment
from search.lineage import read_reports
from tests.ray.test_pbt import INTERVAL, STEPS, _experiment, _train_rows, _trial_of, ray_pbt  # noqa: F401
from trainers.checkpoint_files import COMMITTED
from trainers.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~2 min on 2 cores: one PBT experiment


def test_pbt_reports_only_committed_checkpoints_and_only_a_decision_waits_for_their_writes(
    ray_pbt, corpus_dir, tmp_path  # noqa: F811
):
    burn_in, steps = 2 * INTERVAL, 3 * INTERVAL
    path = _experiment(
        tmp_path, corpus_dir, "slow-disk", {"name": "adamw", "lr": 1e-3},
        {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        keep_checkpoints=1,
        callbacks=[f"tests.ray.hooks:SlowWrites(steps=2, upto={INTERVAL})"],
        scheduler={"name": "pbt", "interval": INTERVAL, "burn_in": burn_in, "quantile_fraction": 0.5, "synch": True,
                   "resample_probability": 0.0},
        budget={"steps": steps},
    )
    exp = load_experiment(path)
    save(exp)
    result = run_experiment(exp, verbose=0)
    exp_dir = result.exp_dir
    strong, weak = _trial_of(exp_dir, 1e-2), _trial_of(exp_dir, 1e-4)

    # The exploit happened at the first decision, from a committed donor checkpoint, loaded in place.
    (event,) = [e for e in result.events if e["trial"] == weak]
    assert (event["donor"], event["step"]) == (strong, burn_in)
    (live,) = (exp_dir / "runs" / weak).glob("live-*")
    (loaded,) = [e for e in read_metrics(live / "metrics.jsonl", "event") if e["event"] == "exploit"]
    assert (Path(loaded["checkpoint"]) / COMMITTED).is_file()
    for row in [*read_reports(exp_dir), event]:  # each names a committed checkpoint (those pruned since aside)
        m = json.loads((Path(row["pin"]) / "meta.json").read_text()) if Path(row["pin"]).is_dir() else None
        assert m is None or (Path(row["pin"]) / m["step_dir"] / COMMITTED).is_file(), "a pin holds a committed checkpoint"

    # In burn-in the strong member trained steps 11 and 12 while step 10 was written; its report came at the
    # commit, with the metrics of step 10.
    (run,) = (exp_dir / "runs" / strong).glob("live-*")
    rows = read_metrics(run / "metrics.jsonl")
    (saved,) = [r for r in rows if r.get("event") == "checkpoint" and r["step"] == INTERVAL]
    assert {INTERVAL + 1, INTERVAL + 2} <= {r["step"] for r in rows[: rows.index(saved)] if r["kind"] == "train"}
    assert saved["mode"] == "async" and saved["blocking_s"] < saved["commit_s"]
    (report,) = [r for r in read_reports(exp_dir) if r["trial"] == strong and r["step"] == INTERVAL]
    (val,) = [r["val_loss"] for r in rows if r["kind"] == "eval" and r["step"] == INTERVAL]
    assert report["metric"] == val, "the report of step 10 carries step 10's val_loss"

    # At the decision (step 20) each member's run trained no further before the step's commit: nothing of a
    # branch an exploit abandons is trained or logged.
    for trial in (strong, weak):
        (run,) = (exp_dir / "runs" / trial).glob("live-*")
        rows = read_metrics(run / "metrics.jsonl")
        (decided,) = [r for r in rows if r.get("event") == "checkpoint" and r["step"] == burn_in]
        assert max(r["step"] for r in rows[: rows.index(decided)] if r["kind"] == "train") == burn_in, trial

    # Each member finished the budget, each step once; the recipient's steps after the exploit ran on the
    # donor's weights.
    weak_rows, strong_rows = _train_rows(exp_dir, weak), _train_rows(exp_dir, strong)
    assert sorted(weak_rows) == sorted(strong_rows) == list(range(1, steps + 1))
    assert weak_rows[burn_in + 1]["loss"] == pytest.approx(strong_rows[burn_in + 1]["loss"], rel=1e-6)
