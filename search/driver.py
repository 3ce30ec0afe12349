"""The experiment driver: a Tuner over `TrialRun` trials (`search.trial`), sized to the cluster, and for
PBT/PB2 the `Population` actor that the trials ask (`search.population`). Tune holds no checkpoint of a
trial: each continues from its lineage log, from which a resumed population is rebuilt too."""

from __future__ import annotations

import contextlib
import logging
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
from search.population import Population, PopulationActor, population_name
from search.result import ExperimentResult, experiment_result
from search.schedulers import MEMBER, TIME_ATTR, build_scheduler, population_space
from search.slots import SlotRelease, slots_name, start_slots
from search.state import check_same_experiment, check_tune_state, has_tune_state, saved_trial_statuses
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
        gpus = exp.resources.use_gpu
        need = f"{per_cpu:g} CPUs" + (f" and {exp.resources.workers} GPUs" if gpus else "")
        have = f"{cluster.get('CPU', 0):g} CPUs" + (f" and {cluster.get('GPU', 0):g} GPUs" if gpus else "")
        raise ConfigError(
            f"resources: a trial needs {need} ({exp.resources.workers} workers) but the cluster has {have}; "
            f"fix: lower resources.workers or resources.cpus_per_worker, or add nodes"
        )
    if exp.max_concurrent_trials is not None:
        slots = min(slots, exp.max_concurrent_trials)
    return min(slots, exp.population)


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
        check_tune_state(exp_dir)


HEAD_SHARE = 0.001  # of it per trial: up to 1,000 trial actors on the head


def start_population(exp: ExperimentConfig, resume: bool) -> Any:
    """PBT/PB2's `Population` actor beside the driver (None for ASHA and random search); on `resume`,
    rebuilt from the trials' lineage logs."""
    if not exp.scheduler.exploits:
        return None
    population = Population(exp.scheduler, exp.search_space, exp.mode, exp.steps, exp.population, seed=exp.seed)
    if resume:
        reports, events = collect(exp.exp_dir)
        population.replay(reports, events, {r["trial"]: r.get(MEMBER) or 0 for r in reports})
    actor = ray.remote(num_cpus=0)(PopulationActor)
    return actor.options(name=population_name(exp.exp_dir), scheduling_strategy=on_this_node()).remote(population)


class PopulationEvents(tune.Callback):
    """One console line per exploit, as the trial that made it reports it (`exploit` in its result); a trial
    Tune ended in error leaves the population (a synchronous round does not wait for it)."""

    def __init__(self, population: str | None = None) -> None:
        self.population = population  # the actor's name

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        if self.population is not None:
            with contextlib.suppress(Exception):  # gone with the driver's shutdown: nothing waits on it then
                ray.get(ray.get_actor(self.population).leave.remote(trial.trial_id), timeout=10)

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any) -> None:
        e = result.get("exploit")
        if e:
            changes = ", ".join(f"{k} {_short(e['old'].get(k))} -> {_short(v)}" for k, v in e["new"].items() if e["old"].get(k) != v)
            donor = str(trial).removesuffix(trial.trial_id) + e["donor"]  # named as Tune names the trial
            logger.info("exploit: %s <- %s at step %d: %s", trial, donor, e["step"], changes or "same values")


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def run_experiment(
    exp: ExperimentConfig, resume: bool = False, verbose: int = 1, callbacks: list[tune.Callback] = (),
    driver_goes_on: bool = True, slots: int | None = None,
) -> ExperimentResult:
    """Run (or with `resume`, continue) the experiment in `exp.exp_dir`, which the caller checked
    (`check_target`); Ray must be initialised. `callbacks`: more Tune callbacks (a resumed experiment keeps
    those it started with). `driver_goes_on`: this process runs more on this Ray afterwards (a notebook,
    tests): release what interrupted trials left; a driver that exits next leaves that to Ray, which removes
    a job's placement groups when the job ends. `slots`: the Train runs that fit (`max_concurrent_trials`)."""
    exp_dir = exp.exp_dir
    start_experiment_run(exp)  # MLflow's parent run, when the trials' run config tracks (search/tracking.py)
    slots = max_concurrent_trials(exp, ray.cluster_resources()) if slots is None else slots
    population = start_population(exp, resume)
    pop_name = population_name(exp_dir) if population else None
    # PBT/PB2 on a cluster smaller than the population: members take turns at the slots (search.slots); ASHA
    # and random search need no turns, they run members one after another
    turns = slots_name(exp.name) if exp.scheduler.exploits and slots < exp.population else None
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
    # The trial actor only waits on its Train run, whose workers reserve their own resources; Tune
    # refuses an empty request, and even 0.01 CPU per trial would take a worker's slot on a full node. It
    # lives on the head node, beside the driver (Ray gives the head ray_compat.HEAD_NODE_RESOURCE = 1): a
    # worker host lost takes Train workers with it, which the trial's run restarts, never the trial itself.
    trainable = tune.with_resources(tune.with_parameters(TrialRun, exp=exp, population=pop_name, slots=turns),
                                    {"memory": 1, ray_compat.HEAD_NODE_RESOURCE: HEAD_SHARE})
    # A bucket: Tune gets the same fsspec file system the trials write with (credentials from the environment).
    fs, fs_path = ray_storage(exp_dir)
    if resume:
        tuner = tune.Tuner.restore(fs_path, trainable, resume_unfinished=True, resume_errored=True,
                                   storage_filesystem=fs)
    else:
        # The table a PBT user watches: each trial's metric, step and current hyperparameters (an exploit
        # changes them in place; the `member` column is the starting point's index).
        reporter = ExperimentReporter(
            metric_columns=[exp.metric, TIME_ATTR], parameter_columns=sorted(exp.search_space),
            max_report_frequency=30, exp_dir=str(exp_dir), slots=turns,
            population=(exp.scheduler.name, pop_name) if population else None,
        )
        tuner = tune.Tuner(
            trainable,
            param_space=population_space(exp.members()),
            tune_config=tune.TuneConfig(
                scheduler=build_scheduler(exp.scheduler, exp.steps), metric=exp.metric, mode=exp.mode,
                # time-sharing: every member's trial runs, its Train run waits for a slot (search.slots)
                max_concurrent_trials=exp.population if turns else slots,
                reuse_actors=False, time_budget_s=exp.budget.time_s,
            ),
            run_config=tune.RunConfig(
                name=exp.name, storage_path=fs_path.rsplit("/", 1)[0], storage_filesystem=fs,
                stop={TIME_ATTR: exp.steps}, verbose=verbose, progress_reporter=reporter,
                # No checkpoint of ours in Tune: the trials' pins and lineage logs are the record.
                checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=0, checkpoint_at_end=False),
                failure_config=tune.FailureConfig(max_failures=0),
                callbacks=[PopulationEvents(pop_name), *([SlotRelease(turns)] if turns else []), *callbacks],
            ),
        )
    before = placement_groups_of_this_job()
    try:
        # The trials' Train runs' tracebacks (a lost worker, a controller's shutdown) go to the experiment
        # folder's workers.log, with one line per lost worker, as `raytrain train` does for its run.
        with quiet_warnings(), WorkerLogs(exp_dir, experiment=True, replica_groups=exp.per_step):
            tuner.fit()
    finally:  # a trial stopped by force (Ctrl-C) may leave its Train run's workers' CPUs reserved
        for actor in (population, slots_actor):
            if actor is not None:
                ray.kill(actor)
        released = release_stranded_placement_groups(before) if driver_goes_on else []
        if released:
            logger.warning("released %d placement group(s) of Train runs killed while starting",
                           len(released))
    reports, events = collect(exp_dir)
    try:
        trial, _ = best_trial(reports, exp.mode)
    except ValueError:  # nothing finite reported (interrupted early, or every trial failed)
        trial = None
    statuses = saved_trial_statuses(exp_dir)
    # a trial whose run failed reports so and ends (PBT waits to replace it: failed still if it never was);
    # one whose trial actor failed (what Tune saw) ends in ERROR
    last_failed = {t for t, r in latest_reports(reports).items() if r.get("failed")}
    failed = sorted(last_failed | {t for t, status in statuses.items() if status == "ERROR"})
    result = experiment_result(exp, _finished(exp, statuses), reports, events, trial, failed)
    finish_experiment_run(exp, result)
    return result


def _finished(exp: ExperimentConfig, statuses: dict[str, str]) -> bool:
    """Tune catches the first Ctrl-C itself and returns as from a finished run (the trials it stopped read
    TERMINATED in the ResultGrid); its last save tells them apart: finished when every trial ended there."""
    return len(statuses) == exp.population and all(s in ("TERMINATED", "ERROR") for s in statuses.values())
