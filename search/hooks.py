"""TrainerCallbacks that the search driver passes into Ray Train workers (as `module:Name(...)` specs).

Kept in a light module: every worker imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_ext.worker import LatestMetrics
from trainers.checkpoint_files import checkpoint_step
from trainers.trainer import Trainer, TrainerCallback

__all__ = ["ApplySchedule", "StopAtStep", "WaitAtGate"]


class StopAtStep(TrainerCallback):
    """Ends the run right after the checkpoint of `step` was committed and reported (a segment's end).
    The learning-rate schedule still spans the whole budget (`train.steps`)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_checkpoint(self, trainer: Trainer, path: Any) -> None:
        if checkpoint_step(path) >= self.step:
            trainer.request_stop(f"segment ends at step {checkpoint_step(path)}")


class WaitAtGate(LatestMetrics):
    """The live run's side of a Tune trial (see `search.trial`). After each checkpoint (reported to Ray
    just before): rank 0 posts the report to the trial's gate actor at once (not through Ray Train's
    controller, which polls its workers every 2 s); then every rank asks the gate for the trial's answer
    for this step: go on, stop here, or load a donor's checkpoint in place (a PBT exploit), with new
    hyperparameters. From step `wait_from` on (PBT decides there) the ranks wait for that answer; before
    it, or with `wait_from=None` (ASHA, random search: nothing to load), they only look whether the trial
    has said stop, and train on without waiting for Tune's round trip. A checkpoint written in the
    background commits a few steps after the step it holds: the report and the answer are that step's."""

    def __init__(self, gate: str, wait_from: int | None = 0) -> None:
        super().__init__()
        self.gate_name, self.wait_from = gate, wait_from
        self.gate = None
        self.branch = 0  # the gate's answers since the last exploit (search.trial.RunGate)

    def on_fit_start(self, trainer: Trainer) -> None:
        import ray

        if self.wait_from is not None:  # exploits may load in place: the steps after a commit may be abandoned
            trainer.log.hold_until_committed()
        try:  # a restarted group resumed the run's newest commit: it goes on on the gate's current branch
            self.gate = ray.get_actor(self.gate_name)
            self.branch = ray.get(self.gate.current_branch.remote())
        except (ValueError, ray.exceptions.RayActorError):  # the trial is gone: after_checkpoint stops
            pass

    def after_checkpoint(self, trainer: Trainer, path: Any) -> None:
        import ray

        step = checkpoint_step(path)
        try:
            self.gate = self.gate or ray.get_actor(self.gate_name)
            metrics = self.report(trainer, step)
            if trainer.engine.is_main:  # no wait: calls from one caller arrive in order
                self.gate.post.remote({"metrics": metrics, "path": str(path)})
            if step >= trainer.cfg.train.steps:  # the last one: the run ends by itself
                return
            waits = self.wait_from is not None and step >= self.wait_from
            answer = ray.get((self.gate.wait if waits else self.gate.peek).remote(step, self.branch))
        except (ValueError, ray.exceptions.RayActorError):  # the trial is gone
            answer = "stop"
        if isinstance(answer, dict):  # an exploit: the trial installed the donor's checkpoint as our newest
            extra = {"values": answer["values"], "tags": answer["tags"]} if answer.get("tags") else {}
            self.branch = answer["branch"]
            trainer.load_in_place(Path(answer["checkpoint"]), answer["values"], donor=answer["donor"], **extra)
        elif answer != "go":
            trainer.request_stop(f"the trial stopped the run at step {step}")


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

