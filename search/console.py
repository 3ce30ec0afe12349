"""The table a user watches while `raytrain tune` runs: Tune's classic CLIReporter (each trial's metric,
step and current hyperparameters), with its status lines made true for this package's trials.

Tune's own lines describe its trial actors, not the Train runs they host: "Logical resource usage" counts
what the trial actors reserve (nothing: the Train workers reserve their own), so it read 0/2 CPUs while
every worker trained; "Result logdir" names Tune's staging folder in the Ray session under /tmp. Here
the first becomes what the cluster's workers hold and the second the experiment folder, where the user
looks. (The best-trial line shows a trial's current hyperparameters because the trial reports its
config as it trains with it: `search.trial.TrialRun.step`.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import tune

from raytrain_ext import ray_compat
from raytrain_ext.worker_logs import quiet_logger
from search.trial import RUN_DIR
from trainers.metrics import MetricsTail
from trainers.run_dir import METRICS
from trainers.storage import list_names, location

__all__ = ["ExperimentReporter", "console", "quiet_warnings", "training_now"]


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """While Tune runs the population: warnings a user watching the console cannot act on, left out; and
    Tune's traceback for an upload of its experiment state that raced a save (`ray_compat.
    is_staging_temp_race`: the save's own upload follows and copies everything)."""
    experiment_state = logging.getLogger(ray_compat.EXPERIMENT_STATE_LOGGER)
    experiment_state.addFilter(_not_a_staging_race)
    try:
        with warnings.catch_warnings():
            # Ray's advice for PBT (reuse actors, reset_config) is for restarting trials; ours stay live.
            warnings.filterwarnings("ignore", message="Consider boosting PBT performance")
            # PB2's GP, fit on a few noisy points, hits a kernel bound at most decisions: scikit-learn's
            # ConvergenceWarning each time.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"sklearn\.gaussian_process")
            yield
    finally:
        experiment_state.removeFilter(_not_a_staging_race)


def _not_a_staging_race(record: logging.LogRecord) -> bool:
    return not ray_compat.is_staging_temp_race(record)


class ExperimentReporter(tune.CLIReporter):
    def __init__(
        self, *args: Any, exp_dir: str, slots: str | None = None, population: tuple[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.exp_dir, self.slots = exp_dir, slots  # slots: the time-sharing actor's name (search.slots)
        self.population = population  # (scheduler name, the population actor's name): search.population
        self.tails: dict[str, _Tail] = {}  # each trial's current run's metrics, read as they grow

    def report(self, trials: list[Any], done: bool, *sys_info: str) -> None:
        print(self.text(trials, done, *sys_info), flush=True)

    def text(self, trials: list[Any], done: bool, *sys_info: str) -> str:
        text = ray_compat.reporter_text(self, trials, done, *sys_info)
        lines = [self._line(line) for line in text.split("\n")]
        if not done:  # between reports (minutes, at first): where each Train run is now
            live = training_now(self.exp_dir, [t.trial_id for t in trials if t.status == "RUNNING"], self.tails)
            if live:
                lines.insert(1, live)
        return "\n".join(lines)

    def _line(self, line: str) -> str:
        if line.startswith("Logical resource usage:"):
            return held_by_workers() + self._turns()
        if line.startswith("Result logdir:"):
            return f"Experiment folder: {self.exp_dir}"
        if line.startswith("Using FIFO scheduling algorithm") and self.population is not None:
            return self._exploits()  # Tune's FIFO runs the trials; the population decides (search.population)
        return line

    def _exploits(self) -> str:
        name, actor = self.population
        try:
            summary = ray.get(ray.get_actor(actor).summary.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - a status line is never worth failing the experiment
            return f"{name.upper()}: population-based training"
        return f"{name.upper()}: {summary['exploits']} exploits decided"

    def _turns(self) -> str:
        if self.slots is None:
            return ""
        try:
            stats = ray.get(ray.get_actor(self.slots).stats.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - a status line is never worth failing the experiment
            return ""
        return f"; Train runs: {stats['running']} of {stats['capacity']} slots, {stats['waiting']} members waiting their turn"


@dataclass
class _Tail:
    """What was read of a trial's newest Train run: the run's folder name, its metrics, its last train row."""

    run: str
    metrics: MetricsTail
    last: dict[str, Any] | None = None


def training_now(exp_dir: Any, trials: list[str], tails: dict[str, _Tail]) -> str:
    """`Training now: 00000 step 37 loss 4.012 | 00001 starting`: the newest Train run of each running trial,
    from its own metrics.jsonl (the table's step and metric move at reports only: every `interval` steps)."""
    parts = []
    for trial in trials:
        runs = [n for n in list_names(location(exp_dir) / "runs" / trial) if RUN_DIR.match(n)]
        last = None
        if runs:
            run = max(runs)  # <kind>-<step:08d>-<id>: the newest starts at the latest step
            if trial not in tails or tails[trial].run != run:
                tails[trial] = _Tail(run, MetricsTail(location(exp_dir) / "runs" / trial / run / METRICS))
            tail = tails[trial]
            tail.last = next((r for r in reversed(tail.metrics.rows()) if r.get("kind") == "train"), tail.last)
            last = tail.last
        parts.append(f"{_short(trial)} step {last['step']} loss {last['loss']:.3f}" if last else f"{_short(trial)} starting")
    return "Training now: " + " | ".join(parts) if parts else ""


def _short(trial: str) -> str:
    return trial.rsplit("_", 1)[-1]  # Tune's `5ee36_00002` -> `00002`, as its table names trials


def held_by_workers() -> str:
    """What the cluster's tasks and actors hold now (the Train runs' workers, as Ray accounts them)."""
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception:  # noqa: BLE001 - a status line is never worth failing the experiment
        return "Cluster resources: ?"
    parts = [
        f"{total.get(kind, 0) - free.get(kind, 0):g}/{total.get(kind, 0):g} {kind}s"
        for kind in ("CPU", "GPU")
        if kind == "CPU" or total.get(kind)
    ]
    if total.get("CPU", 0) and free.get("CPU", 0) == total.get("CPU", 0):
        return "Held by Train workers: none yet (their runs are starting)"
    return "Held by Train workers: " + ", ".join(parts)


@contextlib.contextmanager
def console(quiet: bool) -> Iterator[None]:
    """What a user watching the experiment sees, for the command's duration: Tune's classic table (it
    takes our columns: the metric, the step, each trial's current values; the newer one shows sampled
    parameters only, not values an exploit changed), the scheduler's one line per exploit (recipient <-
    donor at step, old -> new values) and the driver's lines (how the population shares the cluster).
    Tune's loggers warn that a trial's progress file is missing in storage whenever its config changes (an
    exploit in place) before the file is written: silenced."""
    if quiet:
        yield
        return
    env = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    # Tune's loggers: a trial's missing progress file (see above), and "the `X` operation took 1.1 s,
    # which may be a performance bottleneck" whenever the machine is busy (its trials' Train runs are
    # what keeps it busy; nothing to act on)
    ours = [logging.getLogger(name) for name in ("search.population", "search.driver")]  # exploits, turns
    levels = [(log.level, log.propagate) for log in ours]
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for log in ours:
        log.setLevel(logging.INFO)
        log.addHandler(handler)
        log.propagate = False
    try:
        with quiet_logger("ray.tune.logger.logger"), quiet_logger("ray.tune.utils.util"):
            yield
    finally:
        for log, (level, propagate) in zip(ours, levels):
            log.removeHandler(handler)
            log.level, log.propagate = level, propagate
        if env is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = env
