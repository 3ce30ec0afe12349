"""What an experiment left, as `search.tune()`, `raytrain tune` and the driver return it: the best trial,
each trial's end (with its committed checkpoint), every report and every exploit, read from the lineage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ExperimentResult", "TrialResult", "experiment_result"]


@dataclass(frozen=True)
class TrialResult:
    """A trial as its latest report left it."""

    trial: str
    step: int
    metric: float
    hparams: dict[str, Any]  # the values it trained with last (an exploit changes them)
    checkpoint: Path | None  # the committed step folder of that report (`raytrain export`, checkpoint.resume)
    path: Path  # the trial's folder, EXP_DIR/runs/<trial>: its Train runs and pinned checkpoints
    failed: bool = False

    @property
    def config(self) -> dict[str, Any]:
        """`hparams`, under the name of Ray's `Result.config`."""
        return self.hparams


@dataclass
class ExperimentResult:
    """What `tune` ran: the best trial, each trial's end, every report and every exploit."""

    exp_dir: Path
    metric: str  # its name: val_loss or train_loss
    mode: str  # min or max
    finished: bool  # False: interrupted (Ctrl-C); `tune(..., resume=True)` continues it
    best: TrialResult | None  # None when no trial reported a finite metric
    trials: list[TrialResult]
    failed: list[str] = field(default_factory=list)  # trial ids that ended failed, short of the budget
    reports: list[dict[str, Any]] = field(default_factory=list, repr=False)  # reports.parquet's rows
    lineage: list[dict[str, Any]] = field(default_factory=list, repr=False)  # lineage.parquet's: the exploits

    def to_dataframe(self) -> Any:
        """One row per report (trial, step, metric, failed, abandoned, times...), each hyperparameter a
        column. A rolled-back trial's reports on the branch it left are there, `abandoned`."""
        return _frame(self.reports)

    def lineage_dataframe(self) -> Any:
        """One row per exploit: trial, step, donor, old/new/donor hyperparameters, scores."""
        import pandas as pd

        return pd.DataFrame(self.lineage)

    def get_dataframe(self) -> Any:
        """One row per trial, its latest report: what Ray's `ResultGrid.get_dataframe()` gives."""
        from search.lineage import latest_reports

        return _frame(sorted(latest_reports(self.reports).values(), key=lambda r: r["trial"]))

    def get_best_result(self) -> TrialResult:
        """`best`, under the name of Ray's `ResultGrid.get_best_result()`; ValueError when there is none."""
        if self.best is None:
            raise ValueError(f"no trial reported a finite {self.metric} in {self.exp_dir}")
        return self.best

    @property
    def best_trial(self) -> str | None:
        return self.best.trial if self.best is not None else None

    @property
    def best_metric(self) -> float:
        """The best trial's best report's metric (its latest may be worse)."""
        from search.lineage import best_trial

        try:
            return best_trial(self.reports, self.mode)[1]["metric"]
        except ValueError:  # nothing finite reported
            return math.nan

    @property
    def events(self) -> list[dict[str, Any]]:
        """`lineage`: the exploits."""
        return self.lineage


def experiment_result(exp: Any, finished: bool, reports: list[dict[str, Any]], events: list[dict[str, Any]],
                      best: str | None, failed: list[str]) -> ExperimentResult:
    """Each trial's end (its latest report) with its checkpoint, the best one `best`."""
    from search.lineage import latest_reports

    trials = [_trial(exp.exp_dir, row) for _, row in sorted(latest_reports(reports).items())]
    best_trial = next((t for t in trials if t.trial == best), None)
    return ExperimentResult(exp.exp_dir, exp.metric, exp.mode, finished, best_trial, trials, failed, reports, events)


def _trial(exp_dir: Path, row: dict[str, Any]) -> TrialResult:
    from search.lineage import LineageLog
    from trainers.checkpoint_files import STEP_DIR
    from trainers.storage import list_names, location

    last = LineageLog(exp_dir, row["trial"]).last_report() or {}
    pin = location(last["pin"]) if last.get("pin") and last.get("step") == row["step"] else None
    steps = [n for n in list_names(pin, "step_*") if STEP_DIR.match(n)] if pin is not None else []
    return TrialResult(row["trial"], row["step"], row["metric"], row["hparams"],
                       checkpoint=pin / steps[-1] if steps else None,
                       path=location(exp_dir) / "runs" / row["trial"], failed=bool(row.get("failed")))


def _frame(reports: list[dict[str, Any]]) -> Any:
    """Report rows as a DataFrame, the `hparams` mapping spread into a column per key."""
    import pandas as pd

    rows = [{**{k: v for k, v in r.items() if k != "hparams"}, **(r.get("hparams") or {})} for r in reports]
    return pd.DataFrame(rows)
