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

import json
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import ray
from ray import tune

from raytrain_ext.hosts import on_this_node
from search.config import ExperimentConfig
from search.gate import RunGate
from search.lineage import LineageLog
from search.schedulers import MEMBER, TIME_ATTR
from search.tracking import in_place_tags, trial_tracking
from trainers._base import ConfigError
from trainers.checkpoint_files import STEP_DIR, link_tree
from trainers.config import HPARAM_PREFIXES
from trainers.metrics import read_metrics
from trainers.run_dir import CHECKPOINTS, RunDir
from trainers.storage import list_names, location, remove_tree, write_json_atomic

__all__ = ["META", "PINS", "RUN_DIR", "RunGate", "TrialRun"]

# A trial's Train run folders (`TrialRun._run_dir`): live-<step it starts at:08d>-<id>, or seg-... per segment
RUN_DIR = re.compile(r"^(live|seg)-\d{8}-[0-9a-f]+$")

META = "meta.json"
PINS = "pins"  # in the trial's folder: the step folders its Tune checkpoints point at (hard links)


@dataclass
class _Interval:
    step: int
    metric: float
    step_dir: Path | None  # the committed checkpoint at `step` (None when the run failed)
    steps_s: float  # time in training steps since the previous report
    error: str | None = None
    parts: dict[str, float] = field(default_factory=dict)  # where the rest of the interval went (TIME_PARTS)


class TrialRun(tune.Trainable):
    """Runs in a Tune actor; its Train run's controller and workers are separate actors. Imports no torch:
    the actor only waits on its run and moves files."""

    def setup(
        self, config: dict[str, Any], exp: ExperimentConfig, population: str | None = None, slots: str | None = None
    ) -> None:
        from raytrain_ext.worker import RAY_LOG_LEVEL, set_ray_train_log_level

        set_ray_train_log_level(RAY_LOG_LEVEL)  # not a line per checkpoint registered; Tune's table is the view
        self.exp = exp
        self.population = ray.get_actor(population) if population else None  # PBT/PB2's rule (search.population)
        self.index = int(config.get(MEMBER, 0))  # its place in the population
        self.slots = ray.get_actor(slots) if slots else None  # time-sharing the cluster (search.slots)
        self.holds_slot = False
        self.running = 0  # members holding a slot when this one got its own
        self.parts: dict[str, float] = {}  # this interval's time outside the Train run (TIME_PARTS)
        self.hparams = {k: config[k] for k in exp.search_space}
        self.log = LineageLog(exp.exp_dir, self.trial_id)
        self.dir = exp.exp_dir / "runs" / self.trial_id
        self.step_no, self.step_dir, self.pin, self.error = 0, None, None, None
        self.runner: _LiveRun | None = None
        self.awaiting: int | None = None  # the report step whose decision the next interval follows
        self.answered: tuple[int, Any] | None = None  # (step, decision) when the report was answered with it
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
                exp.metric: last["metric"] if last else _worst(exp),
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
            out = _Interval(self._next_stop(), _worst(exp), None, 0.0, "waiting to be replaced")
        else:
            out = self._train_interval()
        self.error = self.error or out.error
        self.step_no = out.step
        if out.step_dir is not None:
            self.step_dir = out.step_dir
            self.pin = self._pin(out)
        wall, self.clock = time.perf_counter() - self.clock, time.perf_counter()
        failed = self.error is not None
        done = out.step >= exp.steps or (failed and exp.scheduler.name not in ("pbt", "pb2"))
        yields = self._should_yield(done)
        parts, self.parts = {**self.parts, **out.parts}, {}
        self.log.report(
            out.step,
            out.metric,
            self.hparams,
            failed=failed,
            steps_s=out.steps_s,
            wall_s=wall,
            error=out.error,
            pin=str(self.pin) if self.pin is not None and not failed else None,
            yielded=yields,
            running=self.running if self.slots is not None else None,
            member=self.index,
            **{k: round(v, 4) for k, v in parts.items()},
        )
        if self.population is not None:  # after the row: a restarted population replays the logs
            pin = str(self.pin) if self.pin is not None and not failed else None
            answer = ray.get(self.population.report.remote(
                self.trial_id, self.index, out.step, out.metric, self.hparams, pin, failed
            ))
            self.answered = None if answer is None else (out.step, answer)
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
            "pin": str(self.pin) if self.pin is not None and not failed else None,
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
        self._give_slot_back()

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
            self.step_dir = self.pin / _read_meta(self.pin)["step_dir"]
            self.hparams = {k: point["hparams"].get(k, v) for k, v in self.hparams.items()}

    # ------------------------------------------------------------------------------ exploit in place

    def _decides_at(self, step: int) -> bool:
        """Whether the scheduler may change this trial at its report of `step` (PBT/PB2 past burn-in), so
        that its next interval waits for the decision."""
        sched, live = self.exp.scheduler, self.exp.trial_runs == "live"
        return sched.name in ("pbt", "pb2") and step >= sched.burn_in_steps(self.exp.steps) and live

    def _follow_decision(self, step: int) -> None:
        """Before the next interval: the population's decision on the report of `step` ("go", or an
        exploit, which a live run loads in place)."""
        decision = self._decision(step)
        try:  # the donor's pin, made this trial's own (hard links): the donor may prune its pins from now on
            pin, meta = self._adopt_pin(location(decision["pin"])) if decision != "go" else (None, None)
        except FileNotFoundError:  # pruned already (it reported `keep` times since): no exploit after all
            pin = None
        if pin is None:
            if self.runner is not None and self.runner.waits_at(step):
                self.runner.go(step)
            return
        values = {k: decision["values"][k] for k in self.exp.search_space}
        changed = {k for k in values if values[k] != self.hparams.get(k)}
        self._log_exploit(decision, values, pin)  # the one record: a restart after it continues from `pin`
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

    def _decision(self, step: int) -> Any:
        """Waits for the population's decision on this trial's report of `step` ("go" or an exploit). A
        synchronous PBT decides once the population is there (or its `sync_timeout_s` has passed)."""
        if self.population is None:
            return "go"
        if self.answered is not None and self.answered[0] == step:  # the report's own answer
            return self.answered[1]
        limit = time.monotonic() + self.exp.scheduler.sync_timeout_s + 60.0
        while time.monotonic() < limit:
            decision = ray.get(self.population.decision.remote(self.trial_id, step, 5.0))
            if decision is not None:
                return decision
            if self._should_yield(done=False):  # a member queued for a slot after our report: it may be
                self._yield()  # the one synchronous PBT waits for, so this run gives its slot up meanwhile
        return "go"  # never decided (the population is gone): train on

    def _log_exploit(self, decision: dict[str, Any], values: dict[str, Any], pin: Path) -> None:
        """Before the exploit is loaded: a restart after this row continues from its pin."""
        last = self.log.last_report()
        self.log.exploit(
            step=decision["step"],
            donor=decision["donor"],
            donor_time=decision["donor_time"],
            old_hparams=last["hparams"] if last else None,
            new_hparams=values,
            donor_hparams=decision["donor_hparams"],
            score=last["metric"] if last else None,
            donor_score=decision["donor_metric"],
            exploit_id=decision["exploit_id"],
            pin=str(pin),
            from_step=last["step"] if last else None,
            perturbed=decision.get("perturbed"),
        )

    def _meta(self, metric: float | None) -> dict[str, Any]:
        return {
            "trial": self.trial_id,
            "step": self.step_no,
            "time": time.time(),
            "hparams": self.hparams,
            "metric": metric,
            "step_dir": self.step_dir.name if self.step_dir else None,
        }

    def _pin(self, out: _Interval) -> Path:
        """Hard-link the report's step folder into the trial's pins (a copy by the store, in a bucket), with
        its metadata beside it. Pins are named in the order they are made (the time first: a trial's steps go
        back when it exploits a donor behind it); the trial keeps its newest `keep_checkpoints`."""
        pin = self._new_pin(out.step_dir.name)
        link_tree(out.step_dir, pin / out.step_dir.name)
        write_json_atomic(pin / META, self._meta(out.metric), indent=None)  # last: a pin with its metadata is whole
        self._prune_pins(keep=pin)
        return pin

    def _adopt_pin(self, donor_pin: Path) -> tuple[Path, dict[str, Any]]:
        """A donor's pin made one of this trial's, and its metadata (which still names the donor's trial and
        step)."""
        meta = _read_meta(donor_pin)
        pin = self._new_pin(meta["step_dir"])
        link_tree(donor_pin / meta["step_dir"], pin / meta["step_dir"])
        write_json_atomic(pin / META, meta, indent=None)
        self._prune_pins(keep=pin)
        return pin, meta

    def _new_pin(self, step_dir: str) -> Path:
        return self.dir / PINS / f"{time.time_ns():020d}-{step_dir}-{uuid.uuid4().hex[:6]}"

    def _prune_pins(self, keep: Path) -> None:
        """Beyond the newest `keep_checkpoints` pins, the older go (whole ones: a pin without its metadata
        is one a crash cut short, never named by a log row). The one the current run came from stays."""
        names = sorted(n for n in list_names(self.dir / PINS) if n[:1].isdigit())
        stay = {keep.name, *(p.name for p in (self.pin, self.step_dir.parent if self.step_dir else None) if p)}
        for name in names[: max(len(names) - self.exp.keep_checkpoints, 0)]:
            if name not in stay:
                remove_tree(self.dir / PINS / name, first=META)

    # ------------------------------------------------------------------------------- time-sharing

    def _take_slot(self) -> None:
        """Before a Train run starts: wait for a slot (the members with fewer steps go first)."""
        if self.slots is None or self.holds_slot:
            return
        began = time.perf_counter()
        self.running = ray.get(self.slots.acquire.remote(self.trial_id, self.step_no))
        self.holds_slot = True
        self._add_part("slot_s", time.perf_counter() - began)

    def _should_yield(self, done: bool) -> bool:
        """At a report: give the slot to a waiting member (Ray's PBT pauses a member when another is
        pending). A finished trial's slot goes back as Tune ends it."""
        return self.slots is not None and self.holds_slot and not done and ray.get(self.slots.waiting.remote()) > 0

    def _yield(self) -> None:
        if self.runner is not None:
            self.runner.stop()  # the workers stop at the gate, after the checkpoint the report names
            self.runner = None
        self._give_slot_back()

    def _give_slot_back(self) -> None:
        if self.slots is not None and self.holds_slot:
            self.holds_slot = False
            try:
                ray.get(self.slots.release.remote(self.trial_id))
            except ray.exceptions.RayActorError:  # the driver is gone
                pass

    def _add_part(self, key: str, seconds: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + seconds

    # ----------------------------------------------------------------------------------- training

    def _next_stop(self) -> int:
        interval = self.exp.scheduler.interval
        return min((self.step_no // interval + 1) * interval, self.exp.steps)

    def _run_dir(self, kind: str) -> Path:
        return self.dir / f"{kind}-{self.step_no:08d}-{uuid.uuid4().hex[:6]}"  # RUN_DIR

    def _train_interval(self) -> _Interval:
        self._take_slot()
        if self.exp.trial_runs == "segments":
            return self._segment()
        if self.runner is None:
            self.runner = _LiveRun(self.exp, self.hparams, self._run_dir("live"), self.step_dir)
        out = self.runner.next(self.step_no, self._next_stop())
        if out.error is not None:
            self.runner.stop()
            self.runner = None
        return out

    def _segment(self) -> _Interval:
        from raytrain_ext.launcher import train
        from search.hooks import StopAtStep

        stop, start = self._next_stop(), self.step_no
        run_dir = self._run_dir("seg")
        cfg = _run_config(self.exp, self.hparams, run_dir, self.step_dir, keep=1)
        launched = time.time()
        try:
            result = train(cfg, progress=False, callbacks=[StopAtStep(step=stop), *self.exp.callbacks])
        except Exception as e:  # NaN loss, a crash Ray could not recover: PBT replaces this member
            return _Interval(stop, _worst(self.exp), None, 0.0, f"{type(e).__name__}: {e}")
        rows = read_metrics(RunDir(run_dir).metrics)
        last = {k: v for r in rows if r.get("step") == result.step for k, v in r.items()}
        before = self.step_dir.parent if self.step_dir is not None else None
        if before is not None and before.name == CHECKPOINTS and str(before.parent.parent) == str(self.dir):
            remove_tree(before)  # the previous segment's: its pin holds what Tune needs
        steps_s, parts = _run_times(run_dir, start, result.step, launched)
        return _reported(self.exp, result.step, last, result.checkpoint, steps_s, parts)


# ------------------------------------------------------------------------------------ live runs


# An actor per live run (RunGate stays a plain class: unit-tested alone). Its module imports nothing heavy: the
# gate's process starts beside each Train run's controller, and this module's imports (Tune, torch through
# trainers) took ~6 CPU-s there, on the cores that controller and its workers start on.
_GATE = ray.remote(num_cpus=0)(RunGate)


class _LiveRun:
    def __init__(
        self, exp: ExperimentConfig, hparams: dict[str, Any], run_dir: Path, resume: Path | None
    ):
        from raytrain_ext.launcher import train

        self.exp, self.run_dir = exp, run_dir
        name = f"raytrain-gate-{uuid.uuid4().hex}"
        self.gate = _GATE.options(name=name, scheduling_strategy=on_this_node()).remote()  # beside the trial
        cfg = _run_config(exp, hparams, run_dir, resume, keep=2)
        # Where the workers wait for the trial's answer: from PBT's first decision on; never where no
        # scheduler decision can change the run (ASHA, random search: a stop is looked up without waiting).
        self.wait_from = exp.scheduler.burn_in_steps(exp.steps) if exp.scheduler.name in ("pbt", "pb2") else None
        self.error: BaseException | None = None

        def fit() -> None:
            try:
                train(
                    cfg,
                    progress=False,
                    callbacks=exp.callbacks,
                    loop=partial(gate_loop, gate=name, wait_from=self.wait_from),
                )
            except BaseException as e:
                self.error = e

        self.launched: float | None = time.time()
        self.thread = threading.Thread(target=fit, name="train-run", daemon=True)
        self.thread.start()

    def waits_at(self, step: int) -> bool:
        return self.wait_from is not None and step >= self.wait_from

    def go(self, step: int) -> None:
        ray.get(self.gate.answer.remote(step, "go"))

    def load(
        self, donor_dir: Path, values: dict[str, Any], donor: str, step: int, tags: dict[str, str] | None = None
    ) -> None:
        """An exploit in place: the waiting workers load the donor's checkpoint (the trial's pin of it) with
        `values` (`tags`: for the run's trackers); a group Ray restarts before the branch commits gets it
        from the gate (`RunGate.current`)."""
        answer = {"checkpoint": str(donor_dir), "values": values, "donor": donor, "tags": tags or {}}
        ray.get(self.gate.answer.remote(step, answer))

    def next(self, start: int, stop: int) -> _Interval:
        while True:
            item = ray.get(self.gate.take.remote(1.0))
            if item is not None:
                # the checkpoint's step, from its folder: a checkpoint written in the background commits
                # (and is reported) a few steps after the step it holds
                match = STEP_DIR.match(location(item["path"]).name)
                step = int(match.group(1)) if match else int(item["metrics"]["step"])
                steps_s, parts = _run_times(self.run_dir, start, step, self.launched)
                self.launched = None  # start-up counts once, in the run's first interval
                return _reported(self.exp, step, item["metrics"], location(item["path"]), steps_s, parts)
            if not self.thread.is_alive():
                self.thread.join()
                error = self.error or RuntimeError("the Train run ended before its next report")
                return _Interval(stop, _worst(self.exp), None, 0.0, f"{type(error).__name__}: {error}")

    def stop(self) -> None:
        """End the run cleanly (its workers stop at the gate), so that its placement group is released."""
        try:
            ray.get(self.gate.stop_all.remote())
        except ray.exceptions.RayActorError:
            pass
        self.thread.join()
        ray.kill(self.gate)


# ----------------------------------------------------------------------------------------- helpers


def gate_loop(gate: str, wait_from: int | None) -> Any:
    """The loop of a live run's workers (`search.hooks.GateLoop`), made in each worker: the trial passes
    this function, so that it never imports torch itself."""
    from search.hooks import GateLoop

    return GateLoop(gate=gate, wait_from=wait_from)


def _run_config(
    exp: ExperimentConfig, hparams: dict[str, Any], run_dir: Path, resume: Path | None, keep: int
):
    return exp.run_config(
        hparams,
        name=run_dir.name,
        run_dir=str(run_dir),
        # No donor: `auto` in a run dir made new for this run (its name is unique) finds nothing at the start,
        # and on a restart of the run's workers its own newest commit, one Ray's controller may not have
        # registered yet (`none` would start that restart from scratch); after an exploit the gate's
        # `current()` names the exploit's pin instead, until the branch commits.
        **{"checkpoint.resume": str(resume) if resume else "auto", "checkpoint.keep": keep},
        **trial_tracking(exp, run_dir.parent.name),  # run_dir = EXP_DIR/runs/<trial>/<run>
    )


def _read_meta(root: Path) -> dict[str, Any]:
    return json.loads((location(root) / META).read_text())


def _worst(exp: ExperimentConfig) -> float:
    return math.inf if exp.mode == "min" else -math.inf


def _reported(
    exp: ExperimentConfig, step: int, metrics: dict[str, Any], step_dir: Any, steps_s: float, parts: dict[str, float]
) -> _Interval:
    """The interval a run's report ends; without the experiment's metric, a failed one (its reason in the
    trial's log, for `tune report`)."""
    try:
        return _Interval(step, _metric_of(exp, metrics), step_dir, steps_s, parts=parts)
    except ConfigError as e:
        return _Interval(step, _worst(exp), None, steps_s, f"ConfigError: {e}", parts=parts)


def _metric_of(exp: ExperimentConfig, metrics: dict[str, Any]) -> float:
    value = metrics.get(exp.metric_key)
    if value is None and exp.metric_key != "val_loss":  # val_loss: none yet when no eval came before it
        raise ConfigError(
            f"metric {exp.metric}: the run's report at step {metrics.get('step')} has no {exp.metric_key!r} "
            f"(it has {', '.join(sorted(k for k in metrics if k not in ('step', 'world_size')))}); fix: a "
            f"metric the run logs, or a callback that adds {exp.metric_key!r} to the eval record"
        )
    return float(value) if value is not None else math.nan


def _run_times(run_dir: Path, after: int, upto: int, launched: float | None = None) -> tuple[float, dict[str, float]]:
    """From the run's metrics, for the steps in (after, upto]: the time in training steps, and the parts of
    the rest that the run itself logs (TIME_PARTS): evaluation (an eval row after its step's train row),
    the time a checkpoint held training, loading an exploit's checkpoint; with `launched` (when the run
    was started), its start-up: until its first step began."""
    rows = read_metrics(RunDir(run_dir).metrics)
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    within = [r for r in rows if after < r["step"] <= upto]
    parts = {
        "eval_s": sum(r["time"] - train[r["step"]]["time"] for r in within if r["kind"] == "eval" and r["step"] in train),
        "checkpoint_s": sum(r.get("blocking_s", 0.0) for r in within if r.get("event") == "checkpoint"),
        "exploit_s": sum(
            r.get("restore_s", 0.0) for r in rows if r.get("event") == "exploit" and after <= r["step"] < upto
        ),
    }
    if launched is not None and train:
        first = train[min(train)]
        parts["start_s"] = max(0.0, first["time"] - first["step_time_s"] - launched)
    steps = sum(r["step_time_s"] for r in within if r["kind"] == "train")
    return steps, parts
