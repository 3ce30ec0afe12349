"""One Tune trial = a multi-worker Ray Train run of our Trainer, reporting every `scheduler.interval` steps.

Tune keeps no checkpoint of a trial: each report is a row of its lineage log naming a *pin*, the committed
step folder hard-linked into the trial's folder (`search.pins`; a copy by the store in a bucket), so no
tensor is copied and the Trainer's retention cannot delete it. Under PBT/PB2 the trial hands the report to
the `Population` (`search.population`) and follows its decision. Between reports (`trial_runs`,
`search.runs`) it runs one `live` Train run for its life, whose workers wait at the trial's gate where the
scheduler decides and load an exploit in place (`search.hooks.GateLoop`), or a bounded run per interval
(`segments`, `bench/pbt_overhead.py`'s baseline; a new Ray run name each time: a reused one makes Ray hand
back its old checkpoint). The trial makes an exploit's donor pin its own and logs it (the one record; nothing
of it is written into the run) before the run loads it. A run that fails makes the trial report the worst
metric each interval without training, so that PBT replaces it through an exploit; under ASHA or random
search it ends.
"""

from __future__ import annotations

import re
import time
from typing import Any

import ray
from ray import tune

from search.config import ExperimentConfig
from search.gate import waits_at
from search.lineage import LineageLog
from search.member import Member, take_exploit
from search.pins import Pins, Place
from search.runs import Interval, TrialRuns, wait_from, worst
from search.schedulers import MEMBER, TIME_ATTR
from search.slots import SlotHold
from search.tracking import in_place_tags
from trainers.config import HPARAM_PREFIXES

__all__ = ["RUN_DIR", "TrialRun"]

# A trial's Train run folders (`TrialRuns._run_dir`): live-<step it starts at:08d>-<id>, or seg-... per segment
RUN_DIR = re.compile(r"^(live|seg)-\d{8}-[0-9a-f]+$")


class TrialRun(tune.Trainable):
    """Runs in a Tune actor; its Train run's controller and workers are separate actors. Imports no torch:
    the actor only waits on its run and moves files."""

    def setup(self, config: dict[str, Any], exp: ExperimentConfig, population: str | None = None,
              slots: str | None = None) -> None:
        from raytrain_ext.worker import RAY_LOG_LEVEL, set_ray_train_log_level

        set_ray_train_log_level(RAY_LOG_LEVEL)  # not a line per checkpoint registered; Tune's table is the view
        self.exp = exp
        self.index = int(config.get(MEMBER, 0))  # its place in the population
        self.member = Member(ray.get_actor(population) if population else None, self.trial_id, self.index,
                             exp.scheduler.sync_timeout_s)  # PBT/PB2's rule (search.population)
        self.slot = SlotHold(ray.get_actor(slots) if slots else None, self.trial_id)  # time-sharing (search.slots)
        self.parts: dict[str, float] = {}  # this interval's time outside the Train run (TIME_PARTS)
        self.hparams = {k: config[k] for k in exp.search_space}
        self.log = LineageLog(exp.exp_dir, self.trial_id)
        self.dir = exp.exp_dir / "runs" / self.trial_id
        self.pins = Pins(self.dir, exp.keep_checkpoints)
        self.place = Place()
        self.runs = TrialRuns(exp, self.dir, self.slot)
        self.awaiting: int | None = None  # the report step whose decision the next interval follows
        self.continued = False  # whether step() has put this trial where its lineage log says it is
        self.exploited: dict[str, Any] | None = None  # the exploit the current interval began with
        self.clock = time.perf_counter()

    # ---------------------------------------------------------------------------- Tune interface

    def step(self) -> dict[str, Any]:
        exp = self.exp
        if not self.continued:
            self._continue_from_log()
        place = self.place
        if place.step >= exp.steps:  # restored at the end of the budget (a resumed, finished trial)
            last = self.log.last_report()
            return {exp.metric: last["metric"] if last else worst(exp), TIME_ATTR: place.step, "done": True}
        self.exploited = None
        if self.awaiting is not None:  # the population's decision on the last report
            began = time.perf_counter()
            self._follow_decision(self.awaiting)
            self.awaiting = None
            self.parts["decision_s"] = time.perf_counter() - began
        place = self.place  # (an exploit moved it)
        if place.error is not None:  # waiting to be replaced: no training, the worst metric
            out = Interval(self.runs.next_stop(place.step), worst(exp), None, 0.0, "waiting to be replaced")
        else:
            out = self.runs.train(place.step, place.step_dir, self.hparams)
        place.error, place.step = place.error or out.error, out.step
        if out.step_dir is not None:
            place.step_dir = out.step_dir
            place.pin = self.pins.make(out.step_dir, place.meta(self.trial_id, self.hparams, out.metric), place.in_use())
        wall, self.clock = time.perf_counter() - self.clock, time.perf_counter()
        failed = place.error is not None
        done = out.step >= exp.steps or (failed and not exp.scheduler.exploits)
        yields = self.slot.wanted(done)
        parts, self.parts = {**self.parts, **out.parts}, {}
        pin = str(place.pin) if place.pin is not None and not failed else None
        running = self.slot.running if self.slot.slots is not None else None
        events = {"replica_events": out.events} if out.events else {}
        self.log.report(out.step, out.metric, self.hparams, failed=failed, steps_s=out.steps_s, wall_s=wall,
                        error=out.error, pin=pin, yielded=yields, running=running, member=self.index,
                        **events, **{k: round(v, 4) for k, v in parts.items()})
        self.member.report(out.step, out.metric, self.hparams, pin, failed)
        if yields:  # the report is committed: the run ends at its checkpoint, the slot goes on
            self.runs.give_way()
        if not done and self._decides_at(out.step):
            self.awaiting = out.step
        # Tune reports `config` with each result (its best-trial line shows it): the values trained with
        self.config = {**self.config, **self.hparams}
        # `exploit`: the exploit this interval began with (the console's line), if any
        return {exp.metric: out.metric, TIME_ATTR: out.step, "failed": failed, "steps_s": out.steps_s,
                "wall_s": wall, "pin": pin, "hparams": dict(self.hparams), "exploit": self.exploited,
                "done": done}

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Nothing: the lineage log is the trial's record (`_continue_from_log`)."""

    def load_checkpoint(self, checkpoint: Any) -> None:
        """Never called: no checkpoint is saved."""

    def cleanup(self) -> None:
        self.runs.give_way()

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        return False  # a new actor per trial start: no Train run outlives its trial

    def _continue_from_log(self) -> None:
        """Where a trial (re)starts: its lineage log's last row (see `search.lineage`), not the checkpoint Tune
        restored, which predates whatever the trial reported or exploited after Tune's last save (a killed
        driver). Nothing reported is trained again; a log with no such row keeps Tune's restore."""
        self.continued = True
        self.log.repair()
        point = self.log.resume_point()
        if point is not None:
            self.place = Place.at(point)
        if point is not None and "pin" in point:
            self.hparams = {k: point["hparams"].get(k, v) for k, v in self.hparams.items()}
        if point is not None and point.get("exploit_id"):  # killed between the exploit's row and its word to the rule
            self.member.taken(point["exploit_id"], True)

    # ------------------------------------------------------------------------------ exploit in place

    def _decides_at(self, step: int) -> bool:
        """Whether the scheduler may change this trial at its report of `step`: its next interval waits."""
        return self.exp.trial_runs == "live" and waits_at(wait_from(self.exp), step)

    def _follow_decision(self, step: int) -> None:
        """Before the next interval: the population's decision on the report of `step` ("go", or an
        exploit, which a live run loads in place)."""
        runs = self.runs
        # (at each wait: a member queued for a slot after our report may be the one a synchronous round waits for)
        decision = self.member.decision(step, meanwhile=lambda: self.slot.wanted(done=False) and runs.give_way())
        taken = take_exploit(decision, self.pins, self.log, self.exp.search_space, self.place.in_use())
        if decision != "go":
            self.member.taken(decision["exploit_id"], taken is not None)
        if taken is None:
            if runs.waits_at(step):
                runs.live.go(step)
            return
        pin, meta, values = taken
        changed = {k for k in values if values[k] != self.hparams.get(k)}
        self.exploited = {"donor": decision["donor"], "step": meta["step"], "old": dict(self.hparams), "new": values}
        self.hparams = values
        donor_dir = pin / meta["step_dir"]
        if self.place.error is None and runs.waits_at(step) and all(k.startswith(HPARAM_PREFIXES) for k in changed):
            runs.live.load(donor_dir, values, decision["donor"], step, in_place_tags(self.exp, self.trial_id))
        else:  # a value a running Trainer cannot take on: a new run from the donor
            runs.stop()
        self.place = Place(meta["step"], donor_dir, pin)
