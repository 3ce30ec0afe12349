"""`raytrain tune replay EXP_DIR [--trial best]`: re-train a trial's hyperparameter schedule from scratch
as one run. The schedule is its lineage's (see `lineage.schedule_of`): the donors' hyperparameters up to
each exploit, then its own; `hooks.ApplySchedule` changes them at the recorded steps during the run."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from search.lineage import Schedule, best_trial, collect, schedule_of
from search.report import format_hparams
from search.state import load_experiment_dir
from trainers.metrics import read_metrics
from trainers.run_dir import RunDir

__all__ = ["ReplayResult", "replay"]


@dataclass
class ReplayResult:
    trial: str
    schedule: Schedule
    run_dir: Path
    metric: str
    replayed: float | None
    reported: float  # what the trial reported at the same step during the experiment

    def describe(self) -> str:
        got = f"{self.replayed:.4f}" if self.replayed is not None else "n/a"
        changes = "; ".join(f"step {s}: {format_hparams(h)}" for s, h in self.schedule.changes)
        return (
            f"replayed {self.trial}'s schedule ({changes}) in {self.run_dir}:\n"
            f"{self.metric} {got} at step {self.schedule.final_step} (the experiment reported {self.reported:.4f})"
        )


def replay(exp_dir: Path, trial: str = "best") -> ReplayResult:
    """Ray must be initialised (the run is a Ray Train run like the trials', same workers)."""
    from raytrain_ext.launcher import train
    from search.hooks import ApplySchedule

    exp = load_experiment_dir(exp_dir)
    reports, events = collect(exp.exp_dir)
    if trial == "best":
        trial, _ = best_trial(reports, exp.mode)
    schedule = schedule_of(trial, reports, events)
    reported = [r for r in reports if r["trial"] == trial and r["step"] == schedule.final_step][-1]["metric"]
    run_dir = exp.exp_dir / "replay" / f"{trial}-{uuid.uuid4().hex[:6]}"
    first, later = schedule.changes[0][1], [[s, h] for s, h in schedule.changes[1:]]
    steps = {"train.steps": schedule.final_step}
    cfg = exp.run_config(first, name=run_dir.name, run_dir=str(run_dir), **steps)
    # the experiment's own callbacks too: one may add the metric (`metric: eval/accuracy`)
    callbacks = [*([ApplySchedule(changes=later)] if later else []), *exp.callbacks]
    result = train(cfg, progress=False, callbacks=callbacks)
    final = {k: v for r in read_metrics(RunDir(run_dir).metrics) if r.get("step") == result.step for k, v in r.items()}
    replayed = final.get(exp.metric_key)
    return ReplayResult(trial, schedule, run_dir, exp.metric, replayed, reported)
