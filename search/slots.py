"""Time-sharing: a population larger than the cluster takes turns at the cluster's Train-run slots.

Tune cannot see the placement groups that a trial's Train run asks for, so where the cluster holds fewer
Train runs than there are members (`search.driver.max_concurrent_trials`) every trial actor runs, but starts
its Train run only once it holds a slot of the experiment's `Slots` actor, and gives it back at a report when
another member waits (its run ends at its committed checkpoint, where it resumes; Ray's PBT pauses members
alike). The waiting member with the fewest steps goes first, so that every member reaches every interval and
PBT and PB2 decide as on a cluster that holds the whole population.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any

import ray
from ray import tune

from raytrain_ext.hosts import on_this_node
from search.population import experiment_actor_name

__all__ = ["SlotHold", "SlotRelease", "Slots", "slots_name"]


class Slots:
    """`capacity` slots; `acquire` waits for one (the member with the fewest steps first, then the
    earliest to ask), `release` gives it back. Plain class (unit-tested alone); `_SLOTS` is its actor."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.holders: set[str] = set()
        self.queue: dict[str, tuple[int, int, asyncio.Event]] = {}  # trial -> (steps, arrival, granted)
        self.arrivals = itertools.count()
        self.most = 0  # the most members that held a slot at once

    async def acquire(self, trial: str, steps: int) -> int:
        """Waits until `trial` holds a slot; returns how many members hold one then (itself included)."""
        if trial not in self.holders:
            granted = asyncio.Event()
            self.queue[trial] = (steps, next(self.arrivals), granted)
            self._grant()
            await granted.wait()
        return len(self.holders)

    async def release(self, trial: str) -> None:
        """Gives `trial`'s slot back (or its place in the queue); nothing if it holds neither."""
        self.holders.discard(trial)
        self.queue.pop(trial, None)
        self._grant()

    async def waiting(self) -> int:
        return len(self.queue)

    async def stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "running": len(self.holders), "waiting": len(self.queue),
                "most_at_once": self.most}

    def _grant(self) -> None:
        while self.queue and len(self.holders) < self.capacity:
            trial = min(self.queue, key=lambda t: self.queue[t][:2])
            _, _, granted = self.queue.pop(trial)
            self.holders.add(trial)
            self.most = max(self.most, len(self.holders))
            granted.set()


_SLOTS = ray.remote(num_cpus=0)(Slots)


def start_slots(name: str, capacity: int) -> Any:
    return _SLOTS.options(name=name, scheduling_strategy=on_this_node()).remote(capacity)


def slots_name(exp_dir: Any) -> str:
    return experiment_actor_name("slots", exp_dir)


class SlotHold:
    """A trial's side of the slots (None: the cluster holds the whole population, no member ever waits)."""

    def __init__(self, slots: Any, trial: str) -> None:
        self.slots, self.trial = slots, trial
        self.held = False
        self.running = 0  # members holding a slot when this one got its own

    def take(self, steps: int) -> float | None:
        """Before a Train run starts: waits for a slot (the members with fewer steps first); the seconds it
        waited, or None where it holds one already or there are no slots."""
        if self.slots is None or self.held:
            return None
        began = time.perf_counter()
        self.running = ray.get(self.slots.acquire.remote(self.trial, steps))
        self.held = True
        return time.perf_counter() - began

    def wanted(self, done: bool) -> bool:
        """At a report: whether to give the slot to a waiting member (Ray's PBT pauses a member when another
        is pending). A finished trial's slot goes back as Tune ends it."""
        return self.slots is not None and self.held and not done and ray.get(self.slots.waiting.remote()) > 0

    def give_back(self) -> None:
        if self.slots is not None and self.held:
            self.held = False
            with contextlib.suppress(ray.exceptions.RayActorError):  # the driver is gone
                ray.get(self.slots.release.remote(self.trial))


class SlotRelease(tune.Callback):
    """Gives a trial's slot back when the trial ends, fails or is stopped, whether or not its actor got to
    (a trial killed while it held one would otherwise keep it from the rest of the population)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        with contextlib.suppress(ValueError):  # the experiment's driver (and its actor) is gone
            ray.get_actor(self.name).release.remote(trial.trial_id)

    on_trial_error = on_trial_complete
