"""The experiment driver: a Tuner over `TrialRun` trials (see `search.trial`), sized to the cluster, with
the scheduler's state and the checkpoints an exploit needs kept across interruptions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune

from raytrain_ext.cleanup import placement_groups_of_this_job, release_stranded_placement_groups
from search.config import ExperimentConfig
from search.lineage import best_trial, collect
from search.retention import ProtectedRetention
from search.schedulers import TIME_ATTR, SchedulerState, build_scheduler, population_space
from search.trial import TrialRun
from trainers._base import ConfigError

__all__ = ["ExperimentResult", "max_concurrent_trials", "run_experiment"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ experiment


def max_concurrent_trials(exp: ExperimentConfig, cluster: dict[str, float]) -> int:
    """Trials whose Train runs fit side by side. Tune cannot see the placement groups that a trial's Train
    run asks for, so without this cap it would start trials whose workers then wait on each other forever."""
    per_cpu = exp.resources.workers * exp.resources.cpus_per_worker
    fits = [int(cluster.get("CPU", 0) // per_cpu)]
    if exp.resources.use_gpu:
        fits.append(int(cluster.get("GPU", 0) // exp.resources.workers))
    slots = min(fits)
    if slots < 1:
        need = f"{per_cpu:g} CPUs" + (f" and {exp.resources.workers} GPUs" if exp.resources.use_gpu else "")
        have = f"{cluster.get('CPU', 0):g} CPUs" + (
            f" and {cluster.get('GPU', 0):g} GPUs" if exp.resources.use_gpu else ""
        )
        raise ConfigError(
            f"resources: a trial needs {need} ({exp.resources.workers} workers) but the cluster has {have}; "
            f"fix: lower resources.workers or resources.cpus_per_worker, or add nodes"
        )
    if exp.max_concurrent_trials is not None:
        slots = min(slots, exp.max_concurrent_trials)
    return min(slots, exp.population)


@dataclass
class ExperimentResult:
    exp_dir: Path
    best_trial: str
    best_metric: float
    reports: list[dict[str, Any]]
    events: list[dict[str, Any]]


def _tuner_parts(exp: ExperimentConfig) -> tuple[Any, dict[str, Any]]:
    # The trial actor only waits on its Train run, whose workers reserve their own resources; Tune
    # refuses an empty request, and even 0.01 CPU per trial would take a worker's slot on a full node.
    trainable = tune.with_resources(tune.with_parameters(TrialRun, exp=exp), {"memory": 1})
    return trainable, population_space(exp.members())


def run_experiment(
    exp: ExperimentConfig, resume: bool = False, verbose: int = 1, callbacks: list[tune.Callback] = ()
) -> ExperimentResult:
    """Run (or with `resume`, continue) the experiment in `exp.exp_dir`; Ray must be initialised.
    `callbacks`: more Tune callbacks (a resumed experiment keeps those it started with)."""
    exp_dir = exp.exp_dir
    trainable, space = _tuner_parts(exp)
    if resume:
        if not tune.Tuner.can_restore(str(exp_dir)):
            raise ConfigError(
                f"--resume: no experiment to resume in {exp_dir}; fix: run without --resume first"
            )
        tuner = tune.Tuner.restore(str(exp_dir), trainable, resume_unfinished=True, resume_errored=True)
    else:
        if tune.Tuner.can_restore(str(exp_dir)):
            raise ConfigError(
                f"{exp_dir} already holds an experiment; fix: pass --resume to continue it, or change name/storage"
            )
        scheduler = build_scheduler(exp.scheduler, exp.search_space, exp.steps, seed=exp.seed)
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                scheduler=scheduler,
                metric=exp.metric,
                mode=exp.mode,
                max_concurrent_trials=max_concurrent_trials(exp, ray.cluster_resources()),
                reuse_actors=False,
                time_budget_s=exp.budget.time_s,
            ),
            run_config=tune.RunConfig(
                name=exp.name,
                storage_path=str(exp_dir.parent),
                stop={TIME_ATTR: exp.steps},
                verbose=verbose,
                # Every report holds a checkpoint; exploit needs the donor's (num_to_keep <= 2 breaks it,
                # ray #9036): ProtectedRetention deletes the rest once no pending exploit needs them.
                checkpoint_config=tune.CheckpointConfig(num_to_keep=None, checkpoint_frequency=1),
                failure_config=tune.FailureConfig(max_failures=0),
                callbacks=[
                    SchedulerState(scheduler, str(exp_dir / "scheduler_state.json")),
                    ProtectedRetention(exp.keep_checkpoints, scheduler),
                    *callbacks,
                ],
            ),
        )
    before = placement_groups_of_this_job()
    try:
        tuner.fit()
    finally:  # a trial stopped by force (Ctrl-C) may leave its Train run's workers' CPUs reserved
        released = release_stranded_placement_groups(before)
        if released:
            logger.warning("released %d placement group(s) of Train runs killed while starting", len(released))
    reports, events = collect(exp_dir)
    trial, row = best_trial(reports, exp.mode)
    return ExperimentResult(exp_dir, trial, row["metric"], reports, events)
