"""The experiment's `scheduler:` section, Tune's scheduler for it, and the population's starting configs as a
Tune param space.

ASHA is Ray's own; random search and PBT/PB2 run under Tune's FIFO scheduler: the population's rule (PBT,
PB2) is ours (`search.population`), asked by the trials themselves, so that no Tune internals are involved.
"""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from search.space import FACTORS, LINEAR_STEP
from trainers._base import StrictModel

if TYPE_CHECKING:  # Ray loads when a scheduler is built: an experiment YAML is read and checked without it
    from ray.tune.schedulers import TrialScheduler

__all__ = ["MEMBER", "TIME_ATTR", "SchedulerConfig", "build_scheduler", "population_space"]

TIME_ATTR = "step"  # every trial reports its optimizer step; all scheduler intervals are in steps
MEMBER = "member"  # config key: the trial's index in the population (its starting point)
# PBT's default burn-in, a share of each trial's budget: no exploit before half of it is trained. Without
# one, PBT copies whoever did best over the last interval, where a smaller learning rate always wins, and
# anneals too early (chosen on seeds 0-9 by the previous round of bench/pbt_quality.py, population 8, its JSON
# as of 419ecf9: asynchronous 1.8845 +- 0.0138 with none, 1.8714 +- 0.0174 with half, 1.8773 with 75%; synchronous
# 1.9100 -> 1.8818; today's bench/results/pbt_quality.json judges this default on seeds that chose nothing)
BURN_IN = "50%"



def population_space(members: list[dict[str, Any]]) -> dict[str, Any]:
    """One trial per member, each starting from its own hyperparameters (flat dotted keys, so that
    PBT/PB2 mutate them where they are)."""
    from ray import tune

    keys = sorted({k for m in members for k in m})
    space: dict[str, Any] = {MEMBER: tune.grid_search(list(range(len(members))))}
    space.update({k: tune.sample_from(partial(_member_value, members, k)) for k in keys})
    return space


def _member_value(members: list[dict[str, Any]], key: str, config: dict[str, Any]) -> Any:
    return members[config[MEMBER]][key]


# the schedulers that change members at their reports (exploit and explore): `SchedulerConfig.exploits`
POPULATION_BASED = ("pbt", "pb2")

_ONLY_FOR = {  # settings that only one kind of scheduler reads: an error elsewhere, not ignored
    "burn_in": ("pbt",),
    "quantile_fraction": POPULATION_BASED,
    "resample_probability": ("pbt",),
    "perturbation_factors": ("pbt",),
    "linear_step": ("pbt",),
    "synch": ("pbt",),
    "sync_timeout_s": ("pbt",),
    "grace_period": ("asha",),
    "reduction_factor": ("asha",),
}


class SchedulerConfig(StrictModel):
    name: Literal["pbt", "pb2", "asha", "random"] = "pbt"  # random: independent samples, no early stop
    interval: PositiveInt = 50  # steps between reports; PBT/PB2 decide (exploit/explore) at each one
    burn_in: NonNegativeInt | str = Field(
        BURN_IN, description="pbt: steps before the first exploit, or a share of the budget ('50%': half of it)"
    )
    quantile_fraction: float = Field(0.25, gt=0, le=0.5)  # pbt, pb2: bottom fraction copies the top one
    resample_probability: float = Field(0.25, ge=0, le=1)  # pbt: chance a value is drawn afresh
    perturbation_factors: tuple[PositiveFloat, PositiveFloat] = FACTORS  # pbt: log ranges are multiplied by one
    linear_step: float = Field(LINEAR_STEP, gt=0, le=0.5)  # pbt: linear ranges move by this x their width
    synch: bool = False  # pbt: decide for the whole population at once (waits for the slowest)
    sync_timeout_s: PositiveFloat = 900.0  # pbt synch: decide without members not there this long after the first
    grace_period: PositiveInt | None = None  # asha: steps before the first stop (None = interval)
    reduction_factor: float = Field(3.0, gt=1)  # asha

    @property
    def exploits(self) -> bool:
        """Whether it changes members at their reports (PBT, PB2): a population's rule decides."""
        return self.name in POPULATION_BASED

    def burn_in_steps(self, steps: int) -> int:
        """Steps before PBT's first exploit, in a trial of `steps` (0 for the other schedulers)."""
        if self.name != "pbt":
            return 0
        if isinstance(self.burn_in, str):
            return round(float(self.burn_in[:-1]) / 100 * steps)
        return self.burn_in

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        share = self.burn_in if isinstance(self.burn_in, str) else None
        if share is not None and not (re.fullmatch(r"\d+(\.\d+)?%", share) and float(share[:-1]) < 100):
            raise ValueError(
                f"burn_in={share!r} is neither a step count nor a share of the budget; fix: steps (400) or a "
                f"percentage below 100 ('50%')"
            )
        for key in sorted(self.model_fields_set):
            allowed = _ONLY_FOR.get(key)
            if allowed and self.name not in allowed:
                raise ValueError(
                    f"{key} applies to {' and '.join(allowed)} only, not {self.name}; fix: remove "
                    f"scheduler.{key} or set scheduler.name to {allowed[0]}"
                )
        return self


def build_scheduler(cfg: SchedulerConfig, max_steps: int) -> TrialScheduler:
    """Tune's scheduler: ASHA's early stopping, else FIFO (random search; PBT and PB2 decide through
    `search.population`). Metric and mode are left to `TuneConfig` (Tune refuses them in both places)."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if cfg.name == "asha":
        return ASHAScheduler(
            time_attr=TIME_ATTR,
            max_t=max_steps,
            grace_period=cfg.grace_period or cfg.interval,
            reduction_factor=cfg.reduction_factor,
        )
    return FIFOScheduler()
