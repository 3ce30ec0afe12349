"""`tune()`: `raytrain tune EXP.yaml` from Python (a notebook, a script), returning the population's results.

    from search import tune

    result = tune("examples/pbt-demo.yaml", overrides={"population": 2})
    result.best            # trial, step, metric, hparams, checkpoint, path
    result.to_dataframe()  # one row per report (reports.parquet); hyperparameters a column each
    result.lineage         # one row per exploit (lineage.parquet)

Ray as for `raytrain_ext.train`: a Ray this process already joined is used and left running; else the
cluster `address` (else RAY_ADDRESS) names is joined for the call; else a local Ray is started for it and
shut down at its end, on an error too.
The steps are the command's (`search.cli.run_tune`): the same checks before anything is written, the same
one-line ConfigError (a ValueError) for bad input.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_ext.api import as_set_items

if TYPE_CHECKING:
    from search.config import ExperimentConfig

__all__ = ["ExperimentResult", "TrialResult", "experiment_config", "tune"]


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


def tune(
    experiment: ExperimentConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    overrides: Mapping[str, Any] | None = None,
    resume: bool = False,
    address: str | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Run (with `resume`: continue) an experiment and wait for it.

    `experiment`: an experiment YAML's path, its mapping (a relative `base` is then relative to the working
    directory), or an ExperimentConfig. `overrides`: dotted keys to Python values, applied as the command's
    `--set` ({"population": 2, "space.optimizer.lr": {"loguniform": [1e-4, 1e-2]}}). `address`: a Ray
    cluster to join. `progress`: Tune's table and a line per exploit on stdout, as the command prints them.
    Raises ConfigError (a ValueError) with one line naming the field and the fix, before anything starts."""
    from search.cli import run_tune

    exp = experiment_config(experiment, overrides)
    return _result(exp, run_tune(exp, address=address, resume=resume, quiet=not progress, driver_goes_on=True))


def experiment_config(
    experiment: ExperimentConfig | Mapping[str, Any] | str | os.PathLike[str],
    overrides: Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    """The validated experiment of `tune`'s `experiment` with `overrides` applied."""
    from search.config import ExperimentConfig, load_experiment, parse_experiment
    from trainers.config import apply_overrides

    items = as_set_items(overrides or {})
    if isinstance(experiment, (str, os.PathLike)):
        return load_experiment(experiment, items)
    if isinstance(experiment, ExperimentConfig):
        if not items:
            return experiment
        experiment = experiment.model_dump(mode="json")
    if isinstance(experiment, Mapping):
        return parse_experiment(apply_overrides(dict(experiment), items, flat=("space",)))
    raise TypeError(f"experiment: a YAML's path, a mapping or an ExperimentConfig, not {type(experiment).__name__}")


def _result(exp: ExperimentConfig, ran: Any) -> ExperimentResult:
    """From the driver's result (search.driver.ExperimentResult): each trial's end with its checkpoint."""
    from search.lineage import latest_reports

    trials = [_trial(ran.exp_dir, row) for _, row in sorted(latest_reports(ran.reports).items())]
    best = next((t for t in trials if t.trial == ran.best_trial), None)
    return ExperimentResult(ran.exp_dir, exp.metric, exp.mode, ran.finished, best, trials, ran.failed, ran.reports,
                            ran.events)


def _trial(exp_dir: Path, row: dict[str, Any]) -> TrialResult:
    from search.lineage import LineageLog
    from trainers.checkpoint_files import STEP_DIR
    from trainers.storage import list_names, location

    last = LineageLog(exp_dir, row["trial"]).last_report() or {}
    pin = location(last["pin"]) if last.get("pin") and last.get("step") == row["step"] else None
    steps = [n for n in list_names(pin, "step_*") if STEP_DIR.match(n)] if pin is not None else []
    return TrialResult(
        trial=row["trial"],
        step=row["step"],
        metric=row["metric"],
        hparams=row["hparams"],
        checkpoint=pin / steps[-1] if steps else None,
        path=location(exp_dir) / "runs" / row["trial"],
        failed=bool(row.get("failed")),
    )


def _frame(reports: list[dict[str, Any]]) -> Any:
    """Report rows as a DataFrame, the `hparams` mapping spread into a column per key."""
    import pandas as pd

    rows = [{**{k: v for k, v in r.items() if k != "hparams"}, **(r.get("hparams") or {})} for r in reports]
    return pd.DataFrame(rows)
