"""A trial's Train runs (`TrialRuns`, which `search.trial.TrialRun` drives): a live run for the trial's life, its
workers waiting at a gate actor where the scheduler decides (`LiveRun`), or a bounded run per interval
(`run_segment`); each interval ends in an `Interval` read from the run's report and its metrics."""

from __future__ import annotations

import contextlib
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import ray

from raytrain_ext.hosts import on_this_node
from search.config import ExperimentConfig
from search.gate import RunGate, waits_at
from search.slots import SlotHold
from search.tracking import trial_tracking
from trainers._base import ConfigError
from trainers.checkpoint_files import checkpoint_step
from trainers.metrics import read_metrics
from trainers.run_dir import CHECKPOINTS, RunDir
from trainers.storage import location, remove_tree

__all__ = ["Interval", "LiveRun", "TrialRuns", "metric_of", "reported", "run_segment", "wait_from", "worst"]


def wait_from(exp: ExperimentConfig) -> int | None:
    """The first report at which a live run's workers wait for the trial's answer: PBT's first decision;
    None where no decision can change the run (ASHA, random search). Every report for replica groups
    (`per_step`): only the group that writes the checkpoints hears its commit, so all wait for the answer."""
    if exp.per_step:
        return 0
    return exp.scheduler.burn_in_steps(exp.steps) if exp.scheduler.exploits else None


@dataclass
class Interval:
    step: int
    metric: float
    step_dir: Path | None  # the committed checkpoint at `step` (None when the run failed)
    steps_s: float  # time in training steps since the previous report
    error: str | None = None
    parts: dict[str, float] = field(default_factory=dict)  # where the rest of the interval went (TIME_PARTS)
    events: list[str] = field(default_factory=list)  # replica groups lost and healed (`replica_events`)


# An actor per live run (RunGate stays a plain class: unit-tested alone), from a module that imports nothing
# heavy: this module's imports took ~6 CPU-s on the cores the run's controller and workers start on.
_GATE = ray.remote(num_cpus=0)(RunGate)


class LiveRun:
    def __init__(self, exp: ExperimentConfig, hparams: dict[str, Any], run_dir: Path, resume: Path | None):
        from raytrain_ext.launcher import train

        self.exp, self.run_dir = exp, run_dir
        name = f"raytrain-gate-{uuid.uuid4().hex}"
        self.gate = _GATE.options(name=name, scheduling_strategy=on_this_node()).remote()  # beside the trial
        cfg = run_config(exp, hparams, run_dir, resume, keep=2)
        self.wait_from = wait_from(exp)
        self.error: BaseException | None = None
        self.told: set[tuple[str, int, float]] = set()  # replica events in a report already

        def fit() -> None:
            try:  # label: the trial's id (run_dir = EXP_DIR/runs/<trial>/<run>)
                train(cfg, progress=False, callbacks=exp.callbacks, label=run_dir.parent.name,
                      loop=partial(gate_loop, gate=name, wait_from=self.wait_from))
            except BaseException as e:
                self.error = e

        self.launched: float | None = time.time()
        self.thread = threading.Thread(target=fit, name="train-run", daemon=True)
        self.thread.start()

    def go(self, step: int) -> None:
        ray.get(self.gate.answer.remote(step, "go"))

    def load(self, donor_dir: Path, values: dict[str, Any], donor: str, step: int,
             tags: dict[str, str] | None = None) -> None:
        """An exploit in place: the waiting workers load the donor's checkpoint (the trial's pin of it) with
        `values` (`tags`: for the run's trackers); a group Ray restarts before the branch commits gets it
        from the gate (`RunGate.current`)."""
        answer = {"checkpoint": str(donor_dir), "values": values, "donor": donor, "tags": tags or {}}
        ray.get(self.gate.answer.remote(step, answer))

    def next(self, start: int, stop: int) -> Interval:
        while True:
            item = ray.get(self.gate.take.remote(1.0))
            if item is not None:
                # the checkpoint's step, from its folder: a checkpoint written in the background commits
                # (and is reported) a few steps after the step it holds
                step = checkpoint_step(item["path"])
                steps_s, parts = run_times(self.run_dir, start, step, self.launched)
                self.launched = None  # start-up counts once, in the run's first interval
                out = reported(self.exp, step, item["metrics"], location(item["path"]), steps_s, parts)
                out.events = self._replica_events() if self.exp.per_step else []
                return out
            if not self.thread.is_alive():
                self.thread.join()
                error = self.error or RuntimeError("the Train run ended before its next report")
                return Interval(stop, worst(self.exp), None, 0.0, f"{type(error).__name__}: {error}")

    def _replica_events(self) -> list[str]:
        """The replica groups lost and back since the last report (an event is written when the next quorum
        forms, which may be after the report of its step: each is told once, whatever its step)."""
        from raytrain_ext.launcher import event_line

        rows = [r for r in read_metrics(RunDir(self.run_dir).metrics, "event") if r["event"] in ("replicas", "healed")]
        new = [r for r in rows if (r["event"], r["step"], r["time"]) not in self.told]
        self.told.update((r["event"], r["step"], r["time"]) for r in new)
        return [event_line(r) for r in new]

    def stop(self) -> None:
        """End the run cleanly (its workers stop at the gate), so that its placement group is released."""
        with contextlib.suppress(ray.exceptions.RayActorError):
            ray.get(self.gate.stop_all.remote())
        self.thread.join()
        ray.kill(self.gate)


def run_segment(exp: ExperimentConfig, hparams: dict[str, Any], run_dir: Path, step_dir: Path | None,
                start: int, stop: int, trial_dir: Path) -> Interval:
    """One bounded Train run from `step_dir` to the checkpoint of `stop` (`trial_runs: segments`); the
    previous segment's checkpoints go once this one has its own (the trial's pin holds what it reports)."""
    from raytrain_ext.launcher import train
    from search.hooks import StopAtStep

    cfg = run_config(exp, hparams, run_dir, step_dir, keep=1)
    launched = time.time()
    try:
        result = train(cfg, progress=False, callbacks=[StopAtStep(step=stop), *exp.callbacks], label=trial_dir.name)
    except Exception as e:  # NaN loss, a crash Ray could not recover: PBT replaces this member
        return Interval(stop, worst(exp), None, 0.0, f"{type(e).__name__}: {e}")
    rows = read_metrics(RunDir(run_dir).metrics)
    last = {k: v for r in rows if r.get("step") == result.step for k, v in r.items()}
    before = step_dir.parent if step_dir is not None else None
    if before is not None and before.name == CHECKPOINTS and str(before.parent.parent) == str(trial_dir):
        remove_tree(before)
    steps_s, parts = run_times(run_dir, start, result.step, launched)
    return reported(exp, result.step, last, result.checkpoint, steps_s, parts)


def gate_loop(gate: str, wait_from: int | None) -> Any:
    """The loop of a live run's workers (`search.hooks.GateLoop`), made in each worker: the trial passes
    this function, so that it never imports torch itself."""
    from search.hooks import GateLoop

    return GateLoop(gate=gate, wait_from=wait_from)


def run_config(exp: ExperimentConfig, hparams: dict[str, Any], run_dir: Path, resume: Path | None, keep: int):
    return exp.run_config(
        hparams, name=run_dir.name, run_dir=str(run_dir),
        # No donor: `auto` in a run dir made new for this run (its name is unique) finds nothing at the start,
        # and on a restart of the run's workers its own newest commit, one Ray's controller may not have
        # registered yet (`none` would start that restart from scratch); after an exploit the gate's
        # `current()` names the exploit's pin instead, until the branch commits.
        **{"checkpoint.resume": str(resume) if resume else "auto", "checkpoint.keep": keep},
        **trial_tracking(exp, run_dir.parent.name),  # run_dir = EXP_DIR/runs/<trial>/<run>
    )


def worst(exp: ExperimentConfig) -> float:
    return math.inf if exp.mode == "min" else -math.inf


def reported(
    exp: ExperimentConfig, step: int, metrics: dict[str, Any], step_dir: Any, steps_s: float, parts: dict[str, float]
) -> Interval:
    """The interval a run's report ends; without the experiment's metric, a failed one (its reason in the
    trial's log, for `tune report`)."""
    try:
        return Interval(step, metric_of(exp, metrics), step_dir, steps_s, parts=parts)
    except ConfigError as e:
        return Interval(step, worst(exp), None, steps_s, f"ConfigError: {e}", parts=parts)


def metric_of(exp: ExperimentConfig, metrics: dict[str, Any]) -> float:
    value = metrics.get(exp.metric_key)
    if value is None and exp.metric_key != "val_loss":  # val_loss: none yet when no eval came before it
        raise ConfigError(
            f"metric {exp.metric}: the run's report at step {metrics.get('step')} has no {exp.metric_key!r} "
            f"(it has {', '.join(sorted(k for k in metrics if k not in ('step', 'world_size')))}); fix: a "
            f"metric the run logs, or a callback that adds {exp.metric_key!r} to the eval record"
        )
    return float(value) if value is not None else math.nan


def run_times(run_dir: Path, after: int, upto: int, launched: float | None = None) -> tuple[float, dict[str, float]]:
    """From the run's metrics, for the steps in (after, upto]: the time in training steps, and the parts of
    the rest that the run itself logs (TIME_PARTS; start-up: from `launched` until its first step began)."""
    rows = read_metrics(RunDir(run_dir).metrics)
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    within = [r for r in rows if after < r["step"] <= upto]
    parts = {
        "eval_s": sum(r["time"] - train[r["step"]]["time"] for r in within if r["kind"] == "eval" and r["step"] in train),
        "checkpoint_s": sum(r.get("blocking_s", 0.0) for r in within if r.get("event") == "checkpoint"),
        "exploit_s": sum(r.get("restore_s", 0.0) for r in rows
                         if r.get("event") == "exploit" and after <= r["step"] < upto),
    }
    if launched is not None and train:
        first = train[min(train)]
        parts["start_s"] = max(0.0, first["time"] - first["step_time_s"] - launched)
    steps = sum(r["step_time_s"] for r in within if r["kind"] == "train")
    return steps, parts


class TrialRuns:
    """A trial's Train runs from report to report: its live run, kept from interval to interval, or a bounded
    run per interval (`trial_runs: segments`), each started once the trial holds a slot (`search.slots`)."""

    def __init__(self, exp: ExperimentConfig, trial_dir: Path, slot: SlotHold) -> None:
        self.exp, self.dir, self.slot = exp, trial_dir, slot
        self.live: LiveRun | None = None

    def next_stop(self, step: int) -> int:
        """The report after `step`."""
        interval = self.exp.scheduler.interval
        return min((step // interval + 1) * interval, self.exp.steps)

    def train(self, step: int, step_dir: Path | None, hparams: dict[str, Any]) -> Interval:
        """From `step` (its checkpoint `step_dir`) to the next report; a live run that failed is ended."""
        waited = self.slot.take(step)
        if self.exp.trial_runs == "segments":
            out = run_segment(self.exp, hparams, self._run_dir("seg", step), step_dir, step, self.next_stop(step),
                              self.dir)
        else:
            if self.live is None:
                self.live = LiveRun(self.exp, hparams, self._run_dir("live", step), step_dir)
            out = self.live.next(step, self.next_stop(step))
            if out.error is not None:
                self.stop()
        if waited is not None:
            out.parts["slot_s"] = out.parts.get("slot_s", 0.0) + waited
        return out

    def waits_at(self, step: int) -> bool:
        """Whether the live run's workers wait at the gate after the report of `step`."""
        return self.live is not None and waits_at(self.live.wait_from, step)

    def stop(self) -> None:
        """The live run ended (its workers stop at the gate, after the checkpoint the last report names)."""
        if self.live is not None:
            self.live.stop()
            self.live = None

    def give_way(self) -> None:
        """The slot given back (to a member waiting for one): the live run ends first."""
        self.stop()
        self.slot.give_back()

    def _run_dir(self, kind: str, step: int) -> Path:
        return self.dir / f"{kind}-{step:08d}-{uuid.uuid4().hex[:6]}"  # search.trial.RUN_DIR
