"""The TrainerCallbacks and the trial loop that a Tune trial passes into its Ray Train workers.

Kept in a light module: every worker imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from raytrain_ext.worker import LatestMetrics
from search.gate import waits_at
from trainers.checkpoint_files import checkpoint_step
from trainers.trainer import FitResult, Trainer, TrainerCallback

__all__ = ["ApplySchedule", "GateLoop", "StopAtStep"]


# Replica groups waiting for the trial's answer look this often whether a group of theirs fell silent.
SILENCE_WAIT_S = 1.0
# The trial's gate is gone (no actor by that name, or it died): the run stops.
_GONE = (ValueError, ray.exceptions.RayActorError)


class StopAtStep(TrainerCallback):
    """Ends the run right after the checkpoint of `step` was committed and reported (a segment's end).
    The learning-rate schedule still spans the whole budget (`train.steps`)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_checkpoint(self, trainer: Trainer, path: Any) -> None:
        if checkpoint_step(path) >= self.step:
            trainer.request_stop(f"segment ends at step {checkpoint_step(path)}")


class GateLoop(LatestMetrics):
    """The live run's side of a Tune trial (`search.trial`): the loop that drives each worker's Trainer, and
    as a callback it hears each commit, which rank 0 posts to the trial's gate at once (not through Ray
    Train's controller, which polls its workers every 2 s). From `wait_from` on (PBT decides there) the loop
    trains to the next report (`fit(until=...)`) and every rank asks the gate for the answer: go on, stop, or
    restore a donor's checkpoint with new values, so a branch an exploit abandons is never trained. Before
    `wait_from`, or with None (ASHA, random search), a commit only looks whether the trial said stop."""

    def __init__(self, gate: str, wait_from: int | None = 0) -> None:
        super().__init__()
        self.gate_name, self.wait_from = gate, wait_from
        self.gate = None
        self.branch = 0  # the gate's answers since the last exploit (search.gate.RunGate)
        self.start: dict[str, Any] | None = None
        self._healed: Any = None  # the engine's last heal seen (replica groups: `_follow_heal`)

    def start_point(self) -> dict[str, Any]:
        """Before the worker builds its Trainer: where a (re)started group starts. After an exploit, its
        values over the run config and, until the branch has committed a checkpoint of its own, its
        checkpoint to resume from: {"values": {...} or None, "checkpoint": path or None}."""
        self.gate = None  # a (re)started group looks the gate up again
        # the trial gone: the first commit stops the run
        current = self._call("current", gone={"branch": 0, "values": None, "restore": None})
        self.branch, restore = current["branch"], current["restore"]
        self.start = {"values": current["values"], "checkpoint": restore["checkpoint"] if restore else None}
        return self.start

    def _next_decision(self, trainer: Trainer) -> int | None:
        """The next report step the trial decides at, before the end; None: none is left."""
        if self.wait_from is None:
            return None
        every = trainer.cfg.checkpoint.every or trainer.cfg.train.steps
        first = max(trainer.step + 1, self.wait_from)
        until = -(-first // every) * every  # the report steps are the checkpoint's
        return until if until < trainer.cfg.train.steps else None

    def run(self, trainer: Trainer) -> FitResult:
        if self.start is None:
            self.start_point()
        self._follow_heal(trainer)
        # (Re)started at a report the others wait at (a replica group Ray starts while the run waits for the
        # trial, a worker group restarted before the answer): it takes the answer with them.
        step = trainer.step
        at_report = (step < trainer.cfg.train.steps and waits_at(self.wait_from, step)
                     and self._call("was_posted", step, self.branch, gone=False))
        while True:
            stopped = self._follow(trainer, step) if at_report else None
            if stopped is not None:
                return stopped
            result = trainer.fit(until=self._next_decision(trainer))
            if result.stopped is not None or result.step >= trainer.cfg.train.steps:
                return result
            step, at_report = result.step, True

    def _follow(self, trainer: Trainer, step: int) -> FitResult | None:
        """The trial's answer for the report of `step`, followed: an exploit loaded (None), go on (None: "go",
        or "skip" for a report that will not come), or the run stopped (its result)."""
        answer = self._wait(trainer, step)
        if isinstance(answer, dict):  # an exploit: the trial's pin of the donor's checkpoint, and the values
            self.branch = answer["branch"]
            extra = {"values": answer["values"], "tags": answer["tags"]} if answer.get("tags") else {}
            trainer.restore(Path(answer["checkpoint"]), answer["values"], event="exploit", donor=answer["donor"],
                            **extra)
        elif answer not in ("go", "skip"):
            trainer.request_stop(f"the trial stopped the run at step {step}")
            return trainer.fit()  # returns at once: the run ends stopped
        return None

    def _wait(self, trainer: Trainer, step: int) -> Any:
        """The trial's answer for `step`, waited for. Replica groups: while it does not come and a group of
        the last quorum fell silent (maybe the one writing the report's checkpoint), the report is posted from
        its commit, else abandoned: a lost host costs the member that report, never a wait for Ray to place
        it again."""
        silent = getattr(trainer.engine, "peers_silent", None)
        if silent is None:
            return self._call("wait", step, self.branch)
        try:
            gate = self._gate()
            while (answer := ray.get(gate.wait.remote(step, self.branch, SILENCE_WAIT_S))) is None:
                if not silent():
                    continue
                newest = trainer.checkpointer.latest()
                if newest is not None and checkpoint_step(newest) == step:
                    self._post(step, newest, self.report(trainer, step))
                else:
                    gate.abandon.remote(step, self.branch)
            return answer
        except _GONE:
            return "stop"

    def _follow_heal(self, trainer: Trainer) -> None:
        """A replica group that healed took a live group's state, whose branch is the gate's now (a heal
        happens in a step the live groups train: they took the trial's newest answer)."""
        healed = getattr(trainer.engine, "healed_from", None)
        if healed is not self._healed:
            self._healed = healed
            self.branch = self._call("current", gone={"branch": self.branch})["branch"]

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        super().after_step(trainer, record)
        self._follow_heal(trainer)

    def after_checkpoint(self, trainer: Trainer, path: Any) -> None:
        step = checkpoint_step(path)
        metrics = self.report(trainer, step)
        try:
            if trainer.engine.is_main:
                self._post(step, path, metrics)
        except _GONE:
            trainer.request_stop("the trial is gone")
            return
        if (step < trainer.cfg.train.steps and not waits_at(self.wait_from, step)
                and self._call("peek", step, self.branch) != "go"):
            trainer.request_stop(f"the trial stopped the run at step {step}")

    def _gate(self) -> Any:
        self.gate = self.gate or ray.get_actor(self.gate_name)
        return self.gate

    def _post(self, step: int, path: Any, metrics: dict[str, Any]) -> None:
        """The report of `step` to the gate, not waited for: calls from one caller arrive in order."""
        self._gate().post.remote({"metrics": metrics, "path": str(path), "branch": self.branch, "step": step})

    def _call(self, method: str, *args: Any, gone: Any = "stop") -> Any:
        """The gate's `method` called and waited for; `gone` when the trial is gone."""
        try:
            return ray.get(getattr(self._gate(), method).remote(*args))
        except _GONE:
            return gone


class ApplySchedule(TrainerCallback):
    """Applies recorded hyperparameter changes during one run: `changes` = [[step, {dotted key: value}],
    ...]; after step s completes, the change recorded at s takes effect for step s + 1 - as when a PBT
    trial restored at step s with new hyperparameters."""

    def __init__(self, changes: list[list[Any]]) -> None:
        self.changes = {int(step): dict(values) for step, values in changes}

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.step in self.changes:  # restored exactly at a change
            trainer.set_hparams(self.changes[trainer.step])

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.step in self.changes:
            trainer.set_hparams(self.changes[trainer.step])
