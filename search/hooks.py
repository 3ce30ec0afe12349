"""TrainerCallbacks that the search driver passes into Ray Train workers (as `module:Name(...)` specs).

Kept in a light module: every worker imports it.
"""

from __future__ import annotations

from typing import Any

from raytrain_ext.worker import StopRun
from trainers.config import parse_config
from trainers.trainer import Trainer, TrainerCallback

__all__ = ["ApplySchedule", "StopAtStep", "WaitAtGate", "apply_live"]


class StopAtStep(TrainerCallback):
    """Ends the run right after the checkpoint of `step` was committed and reported (a segment's end).
    The learning-rate schedule still spans the whole budget (`train.steps`)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_checkpoint(self, trainer: Trainer, path: Any) -> None:
        if trainer.step >= self.step:
            raise StopRun(f"segment ends at step {trainer.step}")


class WaitAtGate(TrainerCallback):
    """After each checkpoint (reported to Ray just before), wait for the trial's answer at the named gate
    actor: go on, or end the run here. Every rank gets the same answer for the same step."""

    def __init__(self, gate: str) -> None:
        self.gate_name = gate
        self.gate = None

    def after_checkpoint(self, trainer: Trainer, path: Any) -> None:
        import ray

        if trainer.step >= trainer.cfg.train.steps:  # the last one: the run ends by itself
            return
        try:
            self.gate = self.gate or ray.get_actor(self.gate_name)
            answer = ray.get(self.gate.wait.remote(trainer.step))
        except (ValueError, ray.exceptions.RayActorError):  # the trial is gone
            answer = "stop"
        if answer != "go":
            raise StopRun(f"the trial stopped the run at step {trainer.step}")


class ApplySchedule(TrainerCallback):
    """Applies recorded hyperparameter changes during one run: `changes` = [[step, {dotted key: value}],
    ...]; after step s completes, the change recorded at s takes effect for step s + 1 - as when a PBT
    trial restored at step s with new hyperparameters."""

    def __init__(self, changes: list[list[Any]]) -> None:
        self.changes = {int(step): dict(values) for step, values in changes}

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.step in self.changes:  # restored exactly at a change
            apply_live(trainer, self.changes[trainer.step])

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.step in self.changes:
            apply_live(trainer, self.changes[trainer.step])


def apply_live(trainer: Trainer, values: dict[str, Any]) -> None:
    """Set optimizer.* and schedule.* keys on a running Trainer, as a restore with a new config would
    (`Engine.apply_hparams` writes them into the optimizer; the schedule is closed-form)."""
    raw = trainer.cfg.model_dump(mode="json")
    for key, value in values.items():
        section, name = key.split(".", 1)
        if section not in ("optimizer", "schedule"):
            raise ValueError(f"{key} cannot change during a run (only optimizer.* and schedule.*)")
        raw[section][name] = value
    cfg = parse_config(raw)
    trainer.cfg = cfg
    trainer.engine.apply_hparams(cfg.optimizer)
    trainer.schedule.cfg = cfg.schedule
