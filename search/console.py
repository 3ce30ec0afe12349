"""The table a user watches while `raytrain tune` runs: Tune's classic CLIReporter (each trial's metric,
step and current hyperparameters), with its status lines made true for this package's trials: Tune's
"Logical resource usage" counts what its trial actors reserve (nothing: the Train workers reserve their own)
and "Result logdir" names its staging folder under /tmp; here they read what the cluster's workers hold and
the experiment folder.
"""

from __future__ import annotations

import contextlib
import logging
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
from trainers._base import scoped_environ
from trainers.metrics import MetricsTail
from trainers.run_dir import METRICS
from trainers.storage import list_names, location

__all__ = ["ExperimentReporter", "console", "quiet_warnings", "training_now"]


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Warnings a user cannot act on, left out while Tune runs; and Tune's traceback for an upload of its
    state that raced a save (`ray_compat.is_staging_temp_race`: the save's own upload copies everything)."""
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
    def __init__(self, *args: Any, exp_dir: str, slots: str | None = None,
                 population: tuple[str, str] | None = None, **kwargs: Any) -> None:
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
        summary = _ask(actor, "summary")
        if summary is None:
            return f"{name.upper()}: population-based training"
        return f"{name.upper()}: {summary['exploits']} exploits decided"

    def _turns(self) -> str:
        stats = _ask(self.slots, "stats") if self.slots is not None else None
        if stats is None:
            return ""
        return (f"; Train runs: {stats['running']} of {stats['capacity']} slots, {stats['waiting']} members "
                "waiting their turn")


def _ask(actor: str, method: str) -> dict[str, Any] | None:
    """A status from the experiment's actor by that name; None when it does not answer."""
    try:
        return ray.get(getattr(ray.get_actor(actor), method).remote(), timeout=5)
    except Exception:  # noqa: BLE001 - a status line is never worth failing the experiment
        return None


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
    if total.get("CPU", 0) and free.get("CPU", 0) == total.get("CPU", 0):
        return "Held by Train workers: none yet (their runs are starting)"
    kinds = [kind for kind in ("CPU", "GPU") if kind == "CPU" or total.get(kind)]
    return "Held by Train workers: " + ", ".join(
        f"{total.get(kind, 0) - free.get(kind, 0):g}/{total.get(kind, 0):g} {kind}s" for kind in kinds)


@contextlib.contextmanager
def console(quiet: bool) -> Iterator[None]:
    """What a user watching the experiment sees, for the command's duration: Tune's classic table (the newer
    one shows sampled parameters only, not values an exploit changed), a line per exploit and the driver's
    lines (how the population shares the cluster)."""
    if quiet:
        yield
        return
    ours = [logging.getLogger(name) for name in ("search.population", "search.driver")]  # exploits, turns
    levels = [(log.level, log.propagate) for log in ours]
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for log in ours:
        log.setLevel(logging.INFO)
        log.addHandler(handler)
        log.propagate = False
    try:
        with scoped_environ(RAY_AIR_NEW_OUTPUT="0"):  # the classic table
            # Tune's loggers: a trial's progress file missing whenever an exploit changes its config before
            # the file is written, and "the `X` operation took 1.1 s" whenever the Train runs keep it busy
            with quiet_logger("ray.tune.logger.logger"), quiet_logger("ray.tune.utils.util"):
                yield
    finally:
        for log, (level, propagate) in zip(ours, levels):
            log.removeHandler(handler)
            log.level, log.propagate = level, propagate
