"""The experiment driver: a Tuner over `TrialRun` trials (see `search.trial`), sized to the cluster, with
the scheduler's state and the checkpoints an exploit needs kept across interruptions. Where Tune's saved
state and the trials' lineage logs differ (a driver killed between Tune's saves), the logs win: each trial
continues from its own, and the scheduler takes the trials' hyperparameters and exploit counts from their
results.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune

from raytrain_ext import ray_compat
from raytrain_ext.cleanup import placement_groups_of_this_job, release_stranded_placement_groups
from raytrain_ext.hosts import on_this_node
from raytrain_ext.worker_logs import WorkerLogs
from search.config import ExperimentConfig
from search.console import ExperimentReporter, quiet_warnings
from search.lineage import best_trial, collect, latest_reports
from search.retention import ProtectedRetention
from search.schedulers import (
    TIME_ATTR,
    DecisionBoard,
    InPlace,
    SchedulerState,
    board_name,
    build_scheduler,
    population_space,
)
from search.slots import SlotRelease, slots_name, start_slots
from search.state import (
    check_same_experiment,
    check_tune_state,
    has_tune_state,
    read_scheduler_summary,
    saved_trial_statuses,
)
from search.tracking import finish_experiment_run, start_experiment_run
from search.trial import TrialRun
from trainers._base import ConfigError
from trainers.storage import ray_storage

__all__ = ["ExperimentResult", "check_target", "max_concurrent_trials", "run_experiment"]

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
    exp_dir: Path | Any  # a local folder or a bucket location
    finished: bool  # False: interrupted (Ctrl-C: Tune stops the trials and returns); `--resume` continues
    best_trial: str | None  # None when no trial reported a finite metric (yet)
    best_metric: float
    reports: list[dict[str, Any]]
    events: list[dict[str, Any]]
    failed: list[str] = field(default_factory=list)  # trials that ended failed, not at the budget


def check_target(exp: ExperimentConfig, resume: bool) -> None:
    """Whether `exp` may run (or with `resume`, continue) in its folder: ConfigError if not. Reads only,
    so that a refused command has written nothing (the CLI calls it before it saves anything)."""
    exp_dir = exp.exp_dir
    exists = has_tune_state(exp_dir)
    if resume and not exists:
        raise ConfigError(f"--resume: no experiment to resume in {exp_dir}; fix: run without --resume first")
    if not resume and exists:
        raise ConfigError(
            f"{exp_dir} already holds an experiment; fix: pass --resume to continue it, or change name/storage"
        )
    if resume:
        check_same_experiment(exp, exp_dir)
        read_scheduler_summary(exp_dir)
        check_tune_state(exp_dir)


class LineageState(tune.Callback):
    """Kept so that experiments started before issue 29 resume (Tune unpickles the callbacks an experiment
    started with). It cut the lineage logs back to Tune's last save on a resume; the logs are the truth now
    and each trial continues from its own (`search.trial.TrialRun._continue_from_log`)."""

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        pass


HEAD_SHARE = 0.001  # of it per trial: up to 1,000 trial actors on the head


def _tuner_parts(exp: ExperimentConfig, board: str | None, slots: str | None) -> tuple[Any, dict[str, Any]]:
    # The trial actor only waits on its Train run, whose workers reserve their own resources; Tune
    # refuses an empty request, and even 0.01 CPU per trial would take a worker's slot on a full node. It
    # lives on the head node, beside the driver (Ray gives the head ray_compat.HEAD_NODE_RESOURCE = 1): a
    # worker host lost takes Train workers with it, which the trial's run restarts, never the trial itself.
    trainable = tune.with_resources(tune.with_parameters(TrialRun, exp=exp, board=board, slots=slots),
                                    {"memory": 1, ray_compat.HEAD_NODE_RESOURCE: HEAD_SHARE})
    return trainable, population_space(exp.members())


def in_place(exp: ExperimentConfig) -> bool:
    """PBT/PB2 exploit in the trials' live runs (search.schedulers.InPlace); with `trial_runs: segments`
    Tune pauses and restores a trial to exploit."""
    return exp.scheduler.name in ("pbt", "pb2") and exp.trial_runs == "live"


def time_shared(exp: ExperimentConfig, slots: int) -> bool:
    """PBT/PB2 with a population larger than the cluster holds: members take turns at the `slots` Train
    runs that fit (search.slots), yielding at report boundaries, so that every member reaches every
    interval. Other schedulers run members one after another (ASHA and random search need no turns)."""
    return exp.scheduler.name in ("pbt", "pb2") and slots < exp.population


def run_experiment(
    exp: ExperimentConfig,
    resume: bool = False,
    verbose: int = 1,
    callbacks: list[tune.Callback] = (),
    driver_goes_on: bool = True,
) -> ExperimentResult:
    """Run (or with `resume`, continue) the experiment in `exp.exp_dir`; Ray must be initialised.
    `callbacks`: more Tune callbacks (a resumed experiment keeps those it started with).
    `driver_goes_on`: this Python process runs more on this Ray afterwards (a notebook, tests): release
    what interrupted trials left (see below). A driver that exits next leaves that to Ray, which removes
    a job's placement groups when the job ends; the sweep waits up to 30 s for Train controllers."""
    exp_dir = exp.exp_dir
    check_target(exp, resume)
    start_experiment_run(exp)  # MLflow's parent run, when the trials' run config tracks (search/tracking.py)
    slots = max_concurrent_trials(exp, ray.cluster_resources())
    board = board_name(exp.name) if in_place(exp) else None
    board_actor = DecisionBoard.options(name=board, scheduling_strategy=on_this_node()).remote() if board else None
    turns = slots_name(exp.name) if time_shared(exp, slots) else None
    slots_actor = start_slots(turns, slots) if turns else None
    r = exp.resources
    logger.info(
        "%s %d trial%s (%s), each a Train run of %d worker%s x %g CPU%s: reports every %d steps to %d; "
        "the table below every 30 s, with each trial's step and loss as it trains",
        "continuing" if resume else "starting", exp.population, "s" if exp.population > 1 else "",
        exp.scheduler.name, r.workers, "s" if r.workers > 1 else "", r.cpus_per_worker,
        " + 1 GPU" if r.use_gpu else "", exp.scheduler.interval, exp.steps,
    )
    if turns:
        logger.info(
            "population %d, %d Train run%s fit%s at once: members take turns, yielding at each report",
            exp.population, slots, "s" if slots > 1 else "", "" if slots > 1 else "s",
        )
    trainable, space = _tuner_parts(exp, board, turns)
    # A bucket: Tune gets the same fsspec file system the trials write with (credentials from the environment).
    fs, fs_path = ray_storage(exp_dir)
    if resume:
        tuner = tune.Tuner.restore(
            fs_path, trainable, resume_unfinished=True, resume_errored=True, storage_filesystem=fs
        )
    else:
        scheduler = build_scheduler(exp.scheduler, exp.search_space, exp.steps, seed=exp.seed)
        if board and isinstance(scheduler, InPlace):
            scheduler.attach(board)
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                scheduler=scheduler,
                metric=exp.metric,
                mode=exp.mode,
                # time-sharing: every member's trial runs, its Train run waits for a slot (search.slots)
                max_concurrent_trials=exp.population if turns else slots,
                reuse_actors=False,
                time_budget_s=exp.budget.time_s,
            ),
            run_config=tune.RunConfig(
                name=exp.name,
                storage_path=fs_path.rsplit("/", 1)[0],
                storage_filesystem=fs,
                stop={TIME_ATTR: exp.steps},
                verbose=verbose,
                # The table a PBT user watches: each trial's metric, step and current hyperparameters (an
                # exploit changes them in place; the `member` column is the starting point's index).
                progress_reporter=ExperimentReporter(
                    metric_columns=[exp.metric, TIME_ATTR],
                    parameter_columns=sorted(exp.search_space),
                    max_report_frequency=30,
                    exp_dir=str(exp_dir),
                    slots=turns,
                ),
                # Every report holds a checkpoint; exploit needs the donor's (num_to_keep <= 2 breaks it,
                # ray #9036): ProtectedRetention deletes the rest once no pending exploit needs them.
                checkpoint_config=tune.CheckpointConfig(num_to_keep=None, checkpoint_frequency=1),
                failure_config=tune.FailureConfig(max_failures=0),
                callbacks=[
                    SchedulerState(scheduler),
                    ProtectedRetention(exp.keep_checkpoints, scheduler),
                    *([SlotRelease(turns)] if turns else []),
                    *callbacks,
                ],
            ),
        )
    before = placement_groups_of_this_job()
    try:
        # The trials' Train runs' tracebacks (a lost worker, a controller's shutdown) go to the experiment
        # folder's workers.log, with one line per lost worker, as `raytrain train` does for its run.
        with quiet_warnings(), WorkerLogs(exp_dir, experiment=True):
            tuner.fit()
    finally:  # a trial stopped by force (Ctrl-C) may leave its Train run's workers' CPUs reserved
        for actor in (board_actor, slots_actor):
            if actor is not None:
                ray.kill(actor)
        released = release_stranded_placement_groups(before) if driver_goes_on else []
        if released:
            logger.warning(
                "released %d placement group(s) of Train runs killed while starting", len(released)
            )
    reports, events = collect(exp_dir)
    try:
        trial, row = best_trial(reports, exp.mode)
    except ValueError:  # nothing finite reported (interrupted early, or every trial failed)
        trial, row = None, {"metric": math.nan}
    statuses = saved_trial_statuses(exp_dir)
    # a trial whose run failed reports so and ends (PBT waits to replace it: failed still if it never was);
    # one whose trial actor failed (what Tune saw) ends in ERROR
    last_failed = {t for t, r in latest_reports(reports).items() if r.get("failed")}
    failed = sorted(last_failed | {t for t, status in statuses.items() if status == "ERROR"})
    result = ExperimentResult(exp_dir, _finished(exp, statuses), trial, row["metric"], reports, events, failed)
    finish_experiment_run(exp, result)
    return result


def _finished(exp: ExperimentConfig, statuses: dict[str, str]) -> bool:
    """Tune catches the first Ctrl-C itself: it saves its state, stops the trials and returns as from a
    finished run (the trials it stopped even read TERMINATED in the ResultGrid). Its last save tells
    them apart, as `--resume` will read it: finished when every member's trial had ended there."""
    return len(statuses) == exp.population and all(s in ("TERMINATED", "ERROR") for s in statuses.values())
