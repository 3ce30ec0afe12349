"""Tune schedulers from the experiment's `scheduler:` section (thin adapters over Ray's own), and the
population's starting configs as a Tune param space.

PBT keeps Ray's exploit but explores with `SearchSpace.explore` (bounded, neighbours for lists, seeded);
PB2 gets the space's bounds; ASHA stops on the same report steps; `random` is Tune's FIFO.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from functools import partial
from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining, TrialScheduler

from search.space import SearchSpace
from trainers._base import StrictModel

__all__ = [
    "EXPLOIT_ID",
    "MEMBER",
    "SCHEDULER_FILE",
    "TIME_ATTR",
    "SchedulerConfig",
    "BoundedExplore",
    "build_scheduler",
    "population_space",
]

TIME_ATTR = "step"  # every trial reports its optimizer step; all scheduler intervals are in steps
MEMBER = "member"  # config key: the trial's index in the population (its starting point)
EXPLOIT_ID = "exploit_id"  # config key: set at each exploit (see _Resumable._get_new_config)
SCHEDULER_FILE = "scheduler_state.json"  # in the experiment folder: a summary of the scheduler's state


def population_space(members: list[dict[str, Any]]) -> dict[str, Any]:
    """One trial per member, each starting from its own hyperparameters (flat dotted keys, so that
    PBT/PB2 mutate them where they are)."""
    keys = sorted({k for m in members for k in m})
    space: dict[str, Any] = {MEMBER: tune.grid_search(list(range(len(members))))}
    space.update({k: tune.sample_from(partial(_member_value, members, k)) for k in keys})
    return space


def _member_value(members: list[dict[str, Any]], key: str, config: dict[str, Any]) -> Any:
    return members[config[MEMBER]][key]


_ONLY_FOR = {  # settings that only one kind of scheduler reads: an error elsewhere, not ignored
    "burn_in": ("pbt",),
    "quantile_fraction": ("pbt", "pb2"),
    "resample_probability": ("pbt",),
    "perturbation_factors": ("pbt",),
    "synch": ("pbt",),
    "grace_period": ("asha",),
    "reduction_factor": ("asha",),
}


class SchedulerConfig(StrictModel):
    name: Literal["pbt", "pb2", "asha", "random"] = "pbt"  # random: independent samples, no early stop
    interval: PositiveInt = 50  # steps between reports; PBT/PB2 decide (exploit/explore) at each one
    burn_in: NonNegativeInt = 0  # pbt: steps before the first decision
    quantile_fraction: float = Field(0.25, gt=0, le=0.5)  # pbt, pb2: bottom fraction copies the top one
    resample_probability: float = Field(0.25, ge=0, le=1)  # pbt: chance a value is drawn afresh
    perturbation_factors: tuple[PositiveFloat, PositiveFloat] = (1.2, 0.8)  # pbt
    synch: bool = False  # pbt: decide for the whole population at once (waits for the slowest)
    grace_period: PositiveInt | None = None  # asha: steps before the first stop (None = interval)
    reduction_factor: float = Field(3.0, gt=1)  # asha

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        for key in sorted(self.model_fields_set):
            allowed = _ONLY_FOR.get(key)
            if allowed and self.name not in allowed:
                raise ValueError(
                    f"{key} applies to {' and '.join(allowed)} only, not {self.name}; fix: remove "
                    f"scheduler.{key} or set scheduler.name to {allowed[0]}"
                )
        return self


class BoundedExplore:
    """PBT's `custom_explore_fn`: receives the donor's config (Ray's own mutations are left empty) and
    returns it explored inside the space. Holds its RNG so that an experiment is repeatable and a
    restored scheduler continues the same stream."""

    def __init__(
        self, space: SearchSpace, seed: int, resample_probability: float, factors: tuple[float, ...]
    ):
        self.space, self.rng = space, random.Random(seed)
        self.resample_probability, self.factors = resample_probability, tuple(factors)

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        new, _ = self.space.explore(config, self.rng, self.resample_probability, self.factors)
        return new


def build_scheduler(
    cfg: SchedulerConfig, space: SearchSpace, max_steps: int, seed: int = 0
) -> TrialScheduler:
    """Metric and mode are left to `TuneConfig` (Tune refuses them in both places)."""
    if cfg.name == "pbt":
        return ResumablePBT(
            time_attr=TIME_ATTR,
            perturbation_interval=cfg.interval,
            burn_in_period=cfg.burn_in,
            hyperparam_mutations={},
            quantile_fraction=cfg.quantile_fraction,
            custom_explore_fn=BoundedExplore(space, seed, cfg.resample_probability, cfg.perturbation_factors),
            synch=cfg.synch,
        )
    if cfg.name == "pb2":
        return _resumable_pb2()(
            time_attr=TIME_ATTR,
            perturbation_interval=cfg.interval,
            hyperparam_bounds={k: list(b) for k, b in space.bounds().items()},
            quantile_fraction=cfg.quantile_fraction,
        )
    if cfg.name == "asha":
        return ASHAScheduler(
            time_attr=TIME_ATTR,
            max_t=max_steps,
            grace_period=cfg.grace_period or cfg.interval,
            reduction_factor=cfg.reduction_factor,
        )
    return FIFOScheduler()


# ------------------------------------------------------------------------------ resumable state
# Tune checkpoints its search algorithm and callbacks, not its scheduler: after `Tuner.restore` a PBT
# would start over (no scores, perturbation times or explore RNG, PB2 without its history). The state is
# carried through Tune's callback checkpoints instead (`SchedulerState`), keyed by trial id, and put back
# as each restored trial is added.

_TRIAL_FIELDS = ("last_score", "last_perturbation_time", "last_train_time", "last_result", "last_checkpoint")
_SCHEDULER_FIELDS = ("_next_perturbation_sync", "_num_checkpoints", "_num_perturbations")
_PB2_FIELDS = ("data", "last_exploration_time", "current")


class _Resumable:
    _restored: dict[str, Any] | None = None

    def export_state(self) -> dict[str, Any]:
        trials = {}
        for trial, state in self._trial_state.items():
            _settle_donor_checkpoint(state)
            fields = {f: getattr(state, f) for f in _TRIAL_FIELDS}
            if not isinstance(fields["last_checkpoint"], tune.Checkpoint):  # a save still running
                fields["last_checkpoint"] = None
            trials[trial.trial_id] = fields
        own = {f: getattr(self, f) for f in (*_SCHEDULER_FIELDS, *_PB2_FIELDS) if hasattr(self, f)}
        explore = self._custom_explore_fn
        rng = explore.rng.getstate() if isinstance(explore, BoundedExplore) else None
        return {"trials": trials, "scheduler": own, "explore_rng": rng}

    def import_state(self, state: dict[str, Any]) -> None:
        for name, value in state["scheduler"].items():
            setattr(self, name, value)
        if state["explore_rng"] is not None and isinstance(self._custom_explore_fn, BoundedExplore):
            self._custom_explore_fn.rng.setstate(state["explore_rng"])
        self._restored = dict(state["trials"])

    def _get_new_config(self, trial: Any, trial_to_clone: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """An id per exploit decision, in the exploited trial's new config (which Tune saves with its
        experiment state): the trial records the exploit once, however often Tune restores it from the
        donor's checkpoint (again after each `--resume` until it saved one of its own)."""
        config, operations = super()._get_new_config(trial, trial_to_clone)
        return {**config, EXPLOIT_ID: uuid.uuid4().hex}, operations

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        super().on_trial_add(tune_controller, trial)
        saved = (self._restored or {}).pop(trial.trial_id, None)
        if saved is not None:
            for name, value in saved.items():
                setattr(self._trial_state[trial], name, value)

    def summary(self) -> dict[str, Any]:
        return {
            "perturbations": self._num_perturbations,
            "checkpoints": self._num_checkpoints,
            "trials": {
                t.trial_id: {"last_score": s.last_score, "last_perturbation_time": s.last_perturbation_time}
                for t, s in self._trial_state.items()
            },
        }


def _settle_donor_checkpoint(state: Any) -> None:
    """The checkpoint PBT asks a top trial to save stays a future until an exploit needs it (PBT resolves
    it then). Take the saved checkpoint as that resolve would, once the save is done: exported as a
    future, it was lost, and a resumed scheduler skipped every exploit of that donor until its next
    perturbation. A save still running at Tune's save is lost still (the trial donates its next one)."""
    pending = state.last_checkpoint
    if pending is None or isinstance(pending, tune.Checkpoint) or not hasattr(pending, "resolve"):
        return
    result = pending.resolve(block=False)
    if result is not None and result.checkpoint is not None:
        state.last_checkpoint, state.last_result = result.checkpoint, result.metrics


class ResumablePBT(_Resumable, PopulationBasedTraining):
    """Ray's PBT whose state survives `Tuner.restore` (with `SchedulerState` among the callbacks)."""


def _resumable_pb2() -> type:
    """Built on first use: importing PB2 imports scikit-learn, which trials should not pay for."""
    if "ResumablePB2" not in globals():
        from ray.tune.schedulers.pb2 import PB2

        globals()["ResumablePB2"] = type("ResumablePB2", (_Resumable, PB2), {"__module__": __name__})
    return globals()["ResumablePB2"]


def __getattr__(name: str) -> Any:  # unpickling a ResumablePB2 finds it by name
    if name == "ResumablePB2":
        return _resumable_pb2()
    raise AttributeError(name)


class SchedulerState(tune.Callback):
    """Checkpoints the scheduler's state with Tune's callback state, so that `--resume` continues the same
    population, and writes a readable summary of it (`scheduler_state.json`) with each of Tune's saves.

    The summary goes to Tune's driver staging folder, which Tune copies over the experiment folder after
    each save: a resumed Tune first copies the folder's JSON files there, so a summary written straight
    to the experiment folder was overwritten with the one of the interruption at every later save."""

    staging: str | None = None  # Tune's driver staging folder (a class default: older pickles lack it)

    def __init__(self, scheduler: TrialScheduler):
        self.scheduler = scheduler

    def on_step_begin(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if trials and self.staging is None:
            self.staging = trials[0].storage.experiment_driver_staging_path

    def get_state(self) -> dict[str, Any] | None:
        if not isinstance(self.scheduler, _Resumable):
            return None
        if self.staging is not None:  # None before Tune made the trials: nothing to summarise yet
            _write_json(os.path.join(self.staging, SCHEDULER_FILE), self.scheduler.summary())
        return self.scheduler.export_state()

    def set_state(self, state: dict[str, Any]) -> None:
        if isinstance(self.scheduler, _Resumable):
            self.scheduler.import_state(state)


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)
