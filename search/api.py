"""`tune()`: `raytrain tune EXP.yaml` from Python (a notebook, a script), returning the population's results.

    from search import tune

    result = tune("examples/pbt-demo.yaml", overrides={"population": 2})
    result.best            # trial, step, metric, hparams, checkpoint, path
    result.to_dataframe()  # one row per report (reports.parquet); hyperparameters a column each
    result.lineage         # one row per exploit (lineage.parquet)

Ray as for `raytrain_ext.train`: a Ray this process already joined is used and left running; else the
cluster `address` (else RAY_ADDRESS) names is joined for the call; else a local Ray is started for it and
shut down at its end, on an error too. `raytrain tune` calls this function.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from raytrain_ext.api import as_set_items
from search.result import ExperimentResult, TrialResult

if TYPE_CHECKING:
    from search.config import ExperimentConfig

__all__ = ["ExperimentResult", "TrialResult", "experiment_config", "tune"]


def tune(
    experiment: ExperimentConfig | Mapping[str, Any] | str | os.PathLike[str],
    *, overrides: Mapping[str, Any] | None = None, resume: bool = False, address: str | None = None,
    progress: bool = True, release_stranded: bool = True,
) -> ExperimentResult:
    """Run (with `resume`: continue) an experiment and wait for it.

    `experiment`: an experiment YAML's path, its mapping (a relative `base` is then relative to the working
    directory), or an ExperimentConfig. `overrides`: dotted keys to Python values, applied as the command's
    `--set` ({"population": 2, "space.optimizer.lr": {"loguniform": [1e-4, 1e-2]}}). `address`: a Ray
    cluster to join. `progress`: Tune's table and a line per exploit on stdout, as the command prints them.
    `release_stranded`: after the experiment, release what interrupted trials left on a Ray this process
    goes on using (`raytrain tune` exits next: Ray releases its job's placement groups itself).
    Raises ConfigError (a ValueError), one line naming the field and the fix, before anything is written."""
    from raytrain_ext.launcher import ensure_ray, stop_ray
    from search.config import EXPERIMENT_FILE, save
    from search.console import console
    from search.driver import check_target, max_concurrent_trials, run_experiment

    exp = experiment_config(experiment, overrides)
    check_target(exp, resume)
    started = ensure_ray(address)
    try:
        import ray

        slots = max_concurrent_trials(exp, ray.cluster_resources())  # a trial larger than the cluster: refused
        if not resume or not (exp.exp_dir / EXPERIMENT_FILE).exists():  # resume: the same (checked)
            save(exp)
        with console(quiet=not progress):
            return run_experiment(
                exp, resume=resume, verbose=1 if progress else 0, slots=slots,
                # a Ray stopped next frees what Ctrl-C'd trials hold with the job, no sweep to wait for
                driver_goes_on=release_stranded and not started,
            )
    finally:
        if started:
            stop_ray()


def experiment_config(experiment: ExperimentConfig | Mapping[str, Any] | str | os.PathLike[str],
                      overrides: Mapping[str, Any] | None = None) -> ExperimentConfig:
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
