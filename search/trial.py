"""One Tune trial = a multi-worker Ray Train run of our Trainer, reporting every `scheduler.interval` steps.

Ray's `TuneReportCallback` hands Tune a checkpoint *path* inside the metrics. Here the trial is a Tune
`Trainable`: each `step()` returns the metrics of one interval; Tune keeps no checkpoint of it. Each report
is a row of the trial's lineage log naming its *pin*: the Trainer's committed step folder hard-linked into
the trial's folder (`runs/<trial>/pins/`), so no tensor is copied and the Trainer's own retention cannot
delete what a report names (the trial keeps its newest `keep_checkpoints` pins). Under PBT/PB2 the trial
then hands the report to the experiment's `Population` (`search.population`) and follows its decision.

How a trial trains between reports (`trial_runs` in the experiment YAML):
- `live`: one Train run for the trial's life. Rank 0 posts each report to the trial's gate (an actor) as
  soon as its checkpoint is committed. Where the scheduler decides (PBT/PB2 past burn-in) the workers wait
  at the gate for the trial's answer: go on, or load a donor's checkpoint in place. An exploit never
  restarts the run: the trial makes the donor's pin its own, logs the exploit (the one record), and
  answers the gate with the pin and the values. Nothing of it is written into the run: a worker group Ray
  restarts before the branch has committed a checkpoint of its own starts from the gate's `current()`.
  The workers run a plain loop (`search.hooks.GateLoop`): train to the next report (`Trainer.fit(until)`),
  ask, then `Trainer.restore(donor, values)` or go on. Where the scheduler cannot act (ASHA, random search,
  burn-in) the workers only look whether the trial said stop and train on.
- `segments`: a new bounded Train run per interval, restored from the previous one's checkpoint (a new
  Ray run name each time: a reused name makes Ray hand back the run's own old checkpoint). The baseline
  that `bench/pbt_overhead.py` compares against.

A run that fails (NaN loss, a crash Ray could not recover) makes the trial report the worst metric at each
interval without training, so that PBT replaces it through exploit (a new run from the donor); under ASHA
or random search it ends.

An experiment in a bucket keeps the same layout there: the Train runs write to it (their `run_dir` is
under the experiment's), a pin is a copy made by the store (no hard links there), the lineage logs are
replaced whole at each append, and every path below is a location (`trainers.storage.location`).
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray import tune

from search.config import ExperimentConfig
from search.gate import waits_at
from search.lineage import LineageLog
from search.member import Member, log_exploit
from search.pins import Pins, read_meta
from search.runs import Interval, LiveRun, exploits, run_segment, wait_from, worst
from search.schedulers import MEMBER, TIME_ATTR
from search.slots import SlotHold
from search.tracking import in_place_tags
from trainers.config import HPARAM_PREFIXES
from trainers.storage import location

__all__ = ["RUN_DIR", "TrialRun"]

# A trial's Train run folders (`TrialRun._run_dir`): live-<step it starts at:08d>-<id>, or seg-... per segment
RUN_DIR = re.compile(r"^(live|seg)-\d{8}-[0-9a-f]+$")


class TrialRun(tune.Trainable):
    """Runs in a Tune actor; its Train run's controller and workers are separate actors. Imports no torch:
    the actor only waits on its run and moves files."""

    def setup(
        self, config: dict[str, Any], exp: ExperimentConfig, population: str | None = None, slots: str | None = None
    ) -> None:
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
        self.step_no, self.step_dir, self.pin, self.error = 0, None, None, None
        self.runner: LiveRun | None = None
        self.awaiting: int | None = None  # the report step whose decision the next interval follows
        self.continued = False  # whether step() has put this trial where its lineage log says it is
        self.exploited: dict[str, Any] | None = None  # the exploit the current interval began with
        self.clock = time.perf_counter()

    # ---------------------------------------------------------------------------- Tune interface

    def step(self) -> dict[str, Any]:
        exp = self.exp
        if not self.continued:
            self._continue_from_log()
        if self.step_no >= exp.steps:  # restored at the end of the budget (a resumed, finished trial)
            last = self.log.last_report()
            return {
                exp.metric: last["metric"] if last else worst(exp),
                TIME_ATTR: self.step_no,
                "done": True,
            }
        self.exploited = None
        if self.awaiting is not None:  # the population's decision on the last report
            began = time.perf_counter()
            self._follow_decision(self.awaiting)
            self.awaiting = None
            self._add_part("decision_s", time.perf_counter() - began)
        if self.error is not None:  # waiting to be replaced: no training, the worst metric
            out = Interval(self._next_stop(), worst(exp), None, 0.0, "waiting to be replaced")
        else:
            out = self._train_interval()
        self.error = self.error or out.error
        self.step_no = out.step
        if out.step_dir is not None:
            self.step_dir = out.step_dir
            self.pin = self.pins.make(out.step_dir, self._meta(out.metric), self._in_use())
        wall, self.clock = time.perf_counter() - self.clock, time.perf_counter()
        failed = self.error is not None
        done = out.step >= exp.steps or (failed and not exploits(exp))
        yields = self.slot.wanted(done)
        parts, self.parts = {**self.parts, **out.parts}, {}
        pin = str(self.pin) if self.pin is not None and not failed else None
        self.log.report(
            out.step,
            out.metric,
            self.hparams,
            failed=failed,
            steps_s=out.steps_s,
            wall_s=wall,
            error=out.error,
            pin=pin,
            yielded=yields,
            running=self.slot.running if self.slot.slots is not None else None,
            member=self.index,
            **{k: round(v, 4) for k, v in parts.items()},
        )
        self.member.report(out.step, out.metric, self.hparams, pin, failed)
        if yields:  # the report is committed: the run ends at its checkpoint, the slot goes on
            self._yield()
        if not done and self._decides_at(out.step):
            self.awaiting = out.step
        # Tune reports `config` with each result (its best-trial line shows it): the values trained with
        self.config = {**self.config, **self.hparams}
        return {
            exp.metric: out.metric,
            TIME_ATTR: out.step,
            "failed": failed,
            "steps_s": out.steps_s,
            "wall_s": wall,
            "pin": pin,
            "hparams": dict(self.hparams),
            "exploit": self.exploited,  # the exploit this interval began with (the console's line), if any
            "done": done,
        }

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Nothing: Tune keeps no checkpoint of a trial (`checkpoint_frequency=0`). The trial's lineage log
        is its record, and a restarted trial continues from it (`_continue_from_log`)."""

    def load_checkpoint(self, checkpoint: Any) -> None:
        """Never called (no checkpoint is saved): the lineage log, not Tune, says where a trial is."""

    def cleanup(self) -> None:
        if self.runner is not None:
            self.runner.stop()
            self.runner = None
        self.slot.give_back()

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        return False  # a new actor per trial start: no Train run outlives its trial

    def _continue_from_log(self) -> None:
        """Where a trial (re)starts: its lineage log's last row (see `search.lineage`), not the checkpoint Tune
        restored, which predates whatever the trial reported or exploited after Tune's last save (a killed
        driver). Nothing reported is trained again; a log with no such row keeps Tune's restore."""
        self.continued = True
        self.log.repair()
        point = self.log.resume_point()
        if point is None:
            return
        self.step_no, self.step_dir, self.pin, self.error = point["step"], None, None, point.get("error")
        if "pin" in point:
            self.pin = location(point["pin"])
            self.step_dir = self.pin / read_meta(self.pin)["step_dir"]
            self.hparams = {k: point["hparams"].get(k, v) for k, v in self.hparams.items()}

    # ------------------------------------------------------------------------------ exploit in place

    def _decides_at(self, step: int) -> bool:
        """Whether the scheduler may change this trial at its report of `step` (PBT/PB2 past burn-in), so
        that its next interval waits for the decision."""
        return self.exp.trial_runs == "live" and waits_at(wait_from(self.exp), step)

    def _follow_decision(self, step: int) -> None:
        """Before the next interval: the population's decision on the report of `step` ("go", or an
        exploit, which a live run loads in place)."""
        decision = self.member.decision(step, meanwhile=self._yield_if_wanted)
        try:  # the donor's pin, made this trial's own (hard links): the donor may prune its pins from now on
            pin, meta = self.pins.adopt(location(decision["pin"]), self._in_use()) if decision != "go" else (None, None)
        except FileNotFoundError:  # pruned already (it reported `keep` times since): no exploit after all
            pin = None
        if pin is None:
            if self.runner is not None and self.runner.waits_at(step):
                self.runner.go(step)
            return
        values = {k: decision["values"][k] for k in self.exp.search_space}
        changed = {k for k in values if values[k] != self.hparams.get(k)}
        log_exploit(self.log, decision, values, pin)  # the one record: a restart after it continues from `pin`
        self.exploited = {"donor": decision["donor"], "step": meta["step"], "old": dict(self.hparams), "new": values}
        self.hparams = values
        donor_dir = pin / meta["step_dir"]
        live = self.runner is not None and self.error is None
        if live and self.runner.waits_at(step) and all(k.startswith(HPARAM_PREFIXES) for k in changed):
            self.runner.load(donor_dir, values, decision["donor"], step, in_place_tags(self.exp, self.trial_id))
        elif self.runner is not None:  # a value a running Trainer cannot take on: a new run from the donor
            self.runner.stop()
            self.runner = None
        self.step_no, self.step_dir, self.pin, self.error = meta["step"], donor_dir, pin, None

    def _meta(self, metric: float | None) -> dict[str, Any]:
        return {
            "trial": self.trial_id,
            "step": self.step_no,
            "time": time.time(),
            "hparams": self.hparams,
            "metric": metric,
            "step_dir": self.step_dir.name if self.step_dir else None,
        }

    def _in_use(self) -> tuple[Path | None, ...]:
        """What the trial trains from: its pins keep these."""
        return self.pin, self.step_dir.parent if self.step_dir else None

    # ------------------------------------------------------------------------------- time-sharing

    def _yield(self) -> None:
        if self.runner is not None:
            self.runner.stop()  # the workers stop at the gate, after the checkpoint the report names
            self.runner = None
        self.slot.give_back()

    def _yield_if_wanted(self) -> None:
        if self.slot.wanted(done=False):  # a member queued for a slot after our report
            self._yield()

    def _add_part(self, key: str, seconds: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + seconds

    # ----------------------------------------------------------------------------------- training

    def _next_stop(self) -> int:
        interval = self.exp.scheduler.interval
        return min((self.step_no // interval + 1) * interval, self.exp.steps)

    def _run_dir(self, kind: str) -> Path:
        return self.dir / f"{kind}-{self.step_no:08d}-{uuid.uuid4().hex[:6]}"  # RUN_DIR

    def _train_interval(self) -> Interval:
        waited = self.slot.take(self.step_no)
        if waited is not None:
            self._add_part("slot_s", waited)
        if self.exp.trial_runs == "segments":
            return run_segment(self.exp, self.hparams, self._run_dir("seg"), self.step_dir, self.step_no,
                               self._next_stop(), self.dir)
        if self.runner is None:
            self.runner = LiveRun(self.exp, self.hparams, self._run_dir("live"), self.step_dir)
        out = self.runner.next(self.step_no, self._next_stop())
        if out.error is not None:
            self.runner.stop()
            self.runner = None
        return out
