"""One Tune trial = a multi-worker Ray Train run of our Trainer, reporting every `scheduler.interval` steps.

Ray's `TuneReportCallback` hands Tune a checkpoint *path* inside the metrics, so PBT finds no checkpoint
and never exploits. Here the trial is a Tune `Trainable`: each `step()` returns the metrics of one
interval, and `save_checkpoint` gives Tune a real checkpoint (the Trainer's committed step folder, hard
linked, plus `meta.json`: which trial wrote it, at which step, with which hyperparameters and metric). A
trial restored from another trial's checkpoint (an exploit) records the event in the lineage and starts a
Train run from the donor's weights, optimizer state and data position, with its own new hyperparameters
(the Trainer re-applies them to the restored optimizer).

How a trial trains between reports (`trial_runs` in the experiment YAML):
- `live`: one Train run for the trial's life. After each checkpoint its workers wait at a gate (an actor)
  until Tune has taken the report and the trial says go; when Tune stops the trial (PBT exploits or
  pauses it), `cleanup` says stop and the run ends cleanly, releasing its workers' placement group.
- `segments`: a new bounded Train run per interval, restored from the previous one's checkpoint (a new
  Ray run name each time: a reused name makes Ray hand back the run's own old checkpoint).

A run that fails (NaN loss, a crash Ray could not recover) makes the trial report the worst metric at each
interval without training, so that PBT replaces it through exploit; under ASHA or random search it ends.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.train import UserCallback

from raytrain_ext.worker import RAY_LOG_LEVEL, set_ray_train_log_level
from search.config import ExperimentConfig
from search.lineage import LineageLog
from search.schedulers import EXPLOIT_ID, TIME_ATTR
from search.tracking import trial_tracking
from trainers.metrics import read_metrics

__all__ = ["META", "Gate", "TrialRun"]

META = "meta.json"


@dataclass
class _Interval:
    step: int
    metric: float
    step_dir: Path | None  # the committed checkpoint at `step` (None when the run failed)
    steps_s: float  # time in training steps since the previous report
    error: str | None = None


class TrialRun(tune.Trainable):
    """Runs in a Tune actor; its Train run's controller and workers are separate actors."""

    def setup(self, config: dict[str, Any], exp: ExperimentConfig) -> None:
        set_ray_train_log_level(RAY_LOG_LEVEL)  # not a line per checkpoint registered; Tune's table is the view
        self.exp = exp
        self.hparams = {k: config[k] for k in exp.search_space}
        self.log = LineageLog(exp.exp_dir, self.trial_id)
        self.dir = exp.exp_dir / "runs" / self.trial_id
        self.step_no, self.step_dir, self.error = 0, None, None
        self.runner: _LiveRun | None = None
        self.clock = time.perf_counter()

    # ---------------------------------------------------------------------------- Tune interface

    def step(self) -> dict[str, Any]:
        exp = self.exp
        if self.step_no >= exp.steps:  # restored at the end of the budget (a resumed, finished trial)
            last = self.log.last_report()
            return {
                exp.metric: last["metric"] if last else _worst(exp),
                TIME_ATTR: self.step_no,
                "done": True,
            }
        if self.error is not None:  # waiting to be replaced: no training, the worst metric
            out = _Interval(self._next_stop(), _worst(exp), None, 0.0, "waiting to be replaced")
        else:
            out = self._train_interval()
        self.error = self.error or out.error
        self.step_no, self.step_dir = out.step, out.step_dir or self.step_dir
        wall, self.clock = time.perf_counter() - self.clock, time.perf_counter()
        failed = self.error is not None
        self.log.report(
            out.step,
            out.metric,
            self.hparams,
            failed=failed,
            steps_s=out.steps_s,
            wall_s=wall,
            error=out.error,
        )
        done = out.step >= exp.steps or (failed and exp.scheduler.name not in ("pbt", "pb2"))
        return {
            exp.metric: out.metric,
            TIME_ATTR: out.step,
            "failed": failed,
            "steps_s": out.steps_s,
            "wall_s": wall,
            "done": done,
        }

    def save_checkpoint(self, checkpoint_dir: str) -> str:
        """The step folder of the last report (hard links: Tune copies it into the trial's storage)."""
        root = Path(checkpoint_dir)
        last = self.log.last_report()
        meta = {
            "trial": self.trial_id,
            "step": self.step_no,
            "time": time.time(),
            "hparams": self.hparams,
            "metric": last["metric"] if last else None,
            "step_dir": self.step_dir.name if self.step_dir else None,
        }
        if self.step_dir is not None:
            _link_tree(self.step_dir, root / self.step_dir.name)
        (root / META).write_text(json.dumps(meta))
        return checkpoint_dir

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        root = Path(checkpoint_dir)
        meta = json.loads((root / META).read_text())
        if meta["trial"] != self.trial_id:  # an exploit (logged once, however often Tune restores it)
            last = self.log.last_report()
            self.log.exploit(
                step=meta["step"],
                donor=meta["trial"],
                donor_time=meta["time"],
                old_hparams=last["hparams"] if last else None,
                new_hparams=self.hparams,
                donor_hparams=meta["hparams"],
                score=last["metric"] if last else None,
                donor_score=meta["metric"],
                exploit_id=self.config.get(EXPLOIT_ID),
            )
        self.step_no, self.step_dir, self.error = meta["step"], None, None
        if meta["step_dir"] is not None:  # keep a copy: Tune may clean `checkpoint_dir` up after this call
            self.step_dir = self.dir / f"restored-{uuid.uuid4().hex[:6]}" / meta["step_dir"]
            _link_tree(root / meta["step_dir"], self.step_dir)
        else:  # the saved trial had failed before its first checkpoint
            self.error = "restored a failed trial"

    def cleanup(self) -> None:
        if self.runner is not None:
            self.runner.stop()
            self.runner = None

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        return False  # a new actor per trial start: no Train run outlives its trial

    # ----------------------------------------------------------------------------------- training

    def _next_stop(self) -> int:
        interval = self.exp.scheduler.interval
        return min((self.step_no // interval + 1) * interval, self.exp.steps)

    def _run_dir(self, kind: str) -> Path:
        return self.dir / f"{kind}-{self.step_no:08d}-{uuid.uuid4().hex[:6]}"

    def _train_interval(self) -> _Interval:
        if self.exp.trial_runs == "segments":
            return self._segment()
        if self.runner is None:
            self.runner = _LiveRun(self.exp, self.hparams, self._run_dir("live"), self.step_dir)
        else:
            self.runner.go(self.step_no)
        out = self.runner.next(self.step_no, self._next_stop())
        if out.error is not None:
            self.runner.stop()
            self.runner = None
        return out

    def _segment(self) -> _Interval:
        from raytrain_ext.launcher import train

        stop, start = self._next_stop(), self.step_no
        run_dir = self._run_dir("seg")
        cfg = _run_config(self.exp, self.hparams, run_dir, self.step_dir, keep=1)
        try:
            result = train(cfg, progress=False, callbacks=[f"search.hooks:StopAtStep(step={stop})"])
        except Exception as e:  # NaN loss, a crash Ray could not recover: PBT replaces this member
            return _Interval(stop, _worst(self.exp), None, 0.0, f"{type(e).__name__}: {e}")
        rows = read_metrics(run_dir / "metrics.jsonl")
        last = {k: v for r in rows if r.get("step") == result.step for k, v in r.items()}
        if self.step_dir is not None and self.step_dir.is_relative_to(self.dir):  # restored from: done
            shutil.rmtree(self.step_dir, ignore_errors=True)
        return _Interval(
            result.step,
            _metric_of(self.exp, last),
            result.checkpoint,
            _steps_time(run_dir, start, result.step),
        )


# ------------------------------------------------------------------------------------ live runs


@ray.remote(num_cpus=0)
class Gate:
    """Between a live Train run and its trial: the controller posts reports, the trial takes them and
    answers go/stop for each step, every worker waits for that answer after its checkpoint."""

    def __init__(self) -> None:
        self.reports: asyncio.Queue = asyncio.Queue()
        self.answers: dict[int, str] = {}
        self.events: dict[int, asyncio.Event] = {}

    async def post(self, item: dict[str, Any]) -> None:
        await self.reports.put(item)

    async def take(self, timeout_s: float) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self.reports.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def answer(self, step: int, decision: str) -> None:
        self.answers[step] = decision
        self.events.setdefault(step, asyncio.Event()).set()

    async def stop_all(self) -> None:  # whatever step the workers are at
        self.answers = _StopAll()
        for event in self.events.values():
            event.set()

    async def wait(self, step: int) -> str:
        if step not in self.answers:
            await self.events.setdefault(step, asyncio.Event()).wait()
        return self.answers[step]


class _StopAll(dict):
    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: Any) -> str:
        return "stop"


class ForwardReports(UserCallback):
    """On the Train controller: posts each reported checkpoint (path + metrics) to the gate."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if checkpoint is not None:  # no wait: calls from one caller arrive in order
            self.gate.post.remote({"metrics": metrics[0], "path": checkpoint.path})


class _LiveRun:
    def __init__(self, exp: ExperimentConfig, hparams: dict[str, Any], run_dir: Path, resume: Path | None):
        from raytrain_ext.launcher import train

        self.exp, self.run_dir = exp, run_dir
        name = f"raytrain-gate-{uuid.uuid4().hex}"
        self.gate = Gate.options(name=name).remote()
        cfg = _run_config(exp, hparams, run_dir, resume, keep=2)
        self.error: BaseException | None = None

        def fit() -> None:
            try:
                train(
                    cfg,
                    progress=False,
                    callbacks=[f"search.hooks:WaitAtGate(gate={name!r})"],
                    ray_callbacks=[ForwardReports(self.gate)],
                )
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=fit, name="train-run", daemon=True)
        self.thread.start()

    def go(self, step: int) -> None:
        ray.get(self.gate.answer.remote(step, "go"))

    def next(self, start: int, stop: int) -> _Interval:
        while True:
            item = ray.get(self.gate.take.remote(1.0))
            if item is not None:
                step = int(item["metrics"]["step"])
                return _Interval(
                    step,
                    _metric_of(self.exp, item["metrics"]),
                    Path(item["path"]),
                    _steps_time(self.run_dir, start, step),
                )
            if not self.thread.is_alive():
                self.thread.join()
                error = self.error or RuntimeError("the Train run ended before its next report")
                return _Interval(stop, _worst(self.exp), None, 0.0, f"{type(error).__name__}: {error}")

    def stop(self) -> None:
        """End the run cleanly (its workers stop at the gate), so that its placement group is released."""
        try:
            ray.get(self.gate.stop_all.remote())
        except ray.exceptions.RayActorError:
            pass
        self.thread.join()
        ray.kill(self.gate)


# ----------------------------------------------------------------------------------------- helpers


def _run_config(
    exp: ExperimentConfig, hparams: dict[str, Any], run_dir: Path, resume: Path | None, keep: int
):
    return exp.run_config(
        hparams,
        name=run_dir.name,
        run_dir=str(run_dir),
        **{"checkpoint.resume": str(resume) if resume else "none", "checkpoint.keep": keep},
        **trial_tracking(exp, run_dir.parent.name),  # run_dir = EXP_DIR/runs/<trial>/<run>
    )


def _worst(exp: ExperimentConfig) -> float:
    return math.inf if exp.mode == "min" else -math.inf


def _metric_of(exp: ExperimentConfig, metrics: dict[str, Any]) -> float:
    value = metrics.get("val_loss" if exp.metric == "val_loss" else "loss")
    return float(value) if value is not None else math.nan


def _steps_time(run_dir: Path, after: int, upto: int) -> float:
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    return sum(r["step_time_s"] for r in rows if after < r["step"] <= upto)


def _link_tree(src: Path, dst: Path) -> None:
    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, copy_function=link)
