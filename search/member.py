"""A trial's side of the population's actor (`search.population.PopulationActor`; PBT and PB2, none for the
other schedulers): its report, answered with the decision when the rule makes it at once, the wait for the
decision otherwise, and an exploit taken: the donor's pin adopted and the lineage row written."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from search.lineage import LineageLog
from search.pins import Pins
from trainers.storage import location

__all__ = ["Member", "take_exploit"]


class Member:
    def __init__(self, population: Any, trial: str, index: int, sync_timeout_s: float) -> None:
        self.population, self.trial, self.index = population, trial, index
        self.sync_timeout_s = sync_timeout_s
        self.answered: tuple[int, Any] | None = None  # (step, decision) when the report was answered with it

    def report(self, step: int, metric: float, hparams: dict[str, Any], pin: str | None, failed: bool) -> None:
        """After the trial's lineage row (a restarted population replays the logs)."""
        if self.population is None:
            return
        answer = ray.get(self.population.report.remote(self.trial, self.index, step, metric, hparams, pin, failed))
        self.answered = None if answer is None else (step, answer)

    def decision(self, step: int, meanwhile: Callable[[], None]) -> Any:
        """The population's decision on this trial's report of `step` ("go" or an exploit). A synchronous PBT
        decides once the population is there (or after `sync_timeout_s`); `meanwhile` runs at each wait (the
        trial gives its slot to a member queued for one: that member may be the one the round waits for)."""
        if self.population is None:
            return "go"
        if self.answered is not None and self.answered[0] == step:  # the report's own answer
            return self.answered[1]
        limit = time.monotonic() + self.sync_timeout_s + 60.0
        while time.monotonic() < limit:
            decision = ray.get(self.population.decision.remote(self.trial, step, 5.0))
            if decision is not None:
                return decision
            meanwhile()
        return "go"  # never decided (the population is gone): train on

    def taken(self, exploit_id: str, took: bool) -> None:
        """Tell the population whether the trial took its exploit (after the row: `replay` applies it there)."""
        if self.population is not None:
            ray.get(self.population.taken.remote(self.trial, exploit_id, took))


def take_exploit(decision: Any, pins: Pins, log: LineageLog, space: dict[str, Any], in_use: tuple[Path | None, ...]
                 ) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
    """A decision taken: the donor's pin made the trial's own (the donor may prune its pins from now on) and
    the exploit's row logged (the one record: a restart after it continues from that pin); the pin, its
    metadata (the donor's step) and the values to train with. None for "go", or when the donor pruned it."""
    if decision == "go":
        return None
    try:
        pin, meta = pins.adopt(location(decision["pin"]), in_use)
    except FileNotFoundError:
        return None
    values = {k: decision["values"][k] for k in space}
    last = log.last_report() or {}
    log.exploit(step=decision["step"], donor=decision["donor"], donor_time=decision["donor_time"],
                old_hparams=last.get("hparams"), new_hparams=values, donor_hparams=decision["donor_hparams"],
                score=last.get("metric"), donor_score=decision["donor_metric"],
                exploit_id=decision["exploit_id"], pin=str(pin), from_step=last.get("step"),
                perturbed=decision.get("perturbed"))
    return pin, meta, values
