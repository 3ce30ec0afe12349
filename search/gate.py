"""The mailbox between a PBT trial and its live Train run (`search.trial`): a Ray actor per run, on the trial's node.

Kept apart from `search.trial` so that the actor's process imports only this (asyncio): the gate starts beside
each Train run's controller and workers, which wait on the same cores for their own imports."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["RunGate", "waits_at"]


def waits_at(wait_from: int | None, step: int) -> bool:
    """Whether a live run's workers wait at the gate after the checkpoint of `step` for the trial's answer:
    from `wait_from` on (PBT's first decision, `search.runs.wait_from`); never with None."""
    return wait_from is not None and step >= wait_from


class RunGate:
    """Between a trial and its live Train run (one per run): rank 0 posts reports, the trial takes them and
    answers each step ("go", "stop" or an exploit to load), every worker asks for that answer after its
    checkpoint. Answers are kept per branch: an exploit starts a new one (the run goes on from the donor's
    step, maybe behind its own), so that a rolled-back run reaching a step again waits for the trial's new
    answer instead of loading the same exploit a second time. A worker group that Ray restarts asks
    `current()`; one that starts at a report the others wait at (`was_posted`) waits with them."""

    def __init__(self) -> None:
        self.reports: asyncio.Queue = asyncio.Queue()
        self.answers: dict[tuple[int, int], Any] = {}  # by (branch, step)
        self.events: dict[tuple[int, int], asyncio.Event] = {}
        self.branch = 0  # exploits answered so far
        self.exploit: dict[str, Any] | None = None  # the latest one answered
        self.committed = False  # whether the branch has committed (and posted) a checkpoint of its own
        self.stopped = False
        self.posted: set[tuple[int, int]] = set()  # (branch, step) of each report posted

    async def post(self, item: dict[str, Any]) -> None:
        """A committed report: {"metrics", "path", "branch", "step"}; once per branch and step."""
        key = (item["branch"], item["step"])
        if key in self.posted:
            return
        self.posted.add(key)
        self.committed = True  # posts after an exploit's answer come from its branch (the workers waited)
        await self.reports.put(item)

    async def was_posted(self, step: int, branch: int) -> bool:
        """Whether the report of `step` on `branch` was posted: its answer is (or will be) given."""
        return (branch, step) in self.posted

    async def take(self, timeout_s: float) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self.reports.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def answer(self, step: int, decision: Any) -> None:
        key = (self.branch, step)
        if isinstance(decision, dict):  # an exploit: the workers go on on the next branch
            self.branch += 1
            decision = {**decision, "branch": self.branch}
            self.exploit, self.committed = decision, False
        self.answers[key] = decision
        self.events.setdefault(key, asyncio.Event()).set()

    async def stop_all(self) -> None:  # whatever step the workers are at
        self.stopped = True
        for event in self.events.values():
            event.set()

    async def current(self) -> dict[str, Any]:
        """For workers that (re)start: the branch, the exploit's values (None before any), and the exploit to
        restore when the branch has no commit of its own yet."""
        values = self.exploit["values"] if self.exploit else None
        restore = self.exploit if self.exploit is not None and not self.committed else None
        return {"branch": self.branch, "values": values, "restore": restore}

    async def wait(self, step: int, branch: int = 0, timeout_s: float | None = None) -> Any:
        """The answer for the report of `step` on `branch` once given (None: not within `timeout_s`)."""
        key = (branch, step)
        if key not in self.answers and not self.stopped:
            try:
                await asyncio.wait_for(self.events.setdefault(key, asyncio.Event()).wait(), timeout_s)
            except asyncio.TimeoutError:
                return None
        return "stop" if self.stopped else self.answers[key]

    async def abandon(self, step: int, branch: int) -> None:
        """A report that will not come (replica groups: its writer was lost before the commit): the workers
        waiting for its answer train on ("skip"), a late post of it is dropped; nothing when it was posted."""
        key = (branch, step)
        if key in self.posted:
            return
        self.posted.add(key)
        self.answers[key] = "skip"
        self.events.setdefault(key, asyncio.Event()).set()

    async def peek(self, step: int, branch: int = 0) -> str:
        """For a step the workers do not wait at: stop, or go on."""
        return "stop" if self.stopped or self.answers.get((branch, step)) == "stop" else "go"
