"""Tune schedulers from the experiment's `scheduler:` section (thin adapters over Ray's own), and the
population's starting configs as a Tune param space.

PBT keeps Ray's exploit but explores with `SearchSpace.explore` (by kind of parameter, reflected at the bounds,
neighbours for lists, seeded: `search.space.EXPLORE_RULES`); PB2 searches the space on its search scale (the
log of a log range); ASHA stops on the same report steps; `random` is Tune's FIFO.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any, Literal

import ray
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining, TrialScheduler

from raytrain_ext import ray_compat
from search.space import FACTORS, LINEAR_STEP, SearchSpace
from trainers._base import StrictModel
from trainers.storage import location, location_on, pyarrow_fs, write_json_atomic

__all__ = [
    "DecisionBoard",
    "EXPLOIT_ID",
    "InPlace",
    "board_name",
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
# PBT's default burn-in, a share of each trial's budget: no exploit before half of it is trained. Without
# one, PBT copies whoever did best over the last interval, where a smaller learning rate always wins, and
# anneals too early (bench/results/pbt_quality.json, population 8, 5 seeds, best val_loss: asynchronous
# 1.8845 +- 0.0138 with none, 1.8714 +- 0.0174 with half (1.8773 re-run), 1.8773 with 75%; synchronous 1.9100 ->
# 1.8818; bench/README.md)
BURN_IN = "50%"

logger = logging.getLogger(__name__)


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


class BoundedExplore:
    """PBT's `custom_explore_fn`: receives the donor's config (Ray's own mutations are left empty) and
    returns it explored inside the space. Holds its RNG so that an experiment is repeatable and a
    restored scheduler continues the same stream.

    An explored config never equals one that another member holds (`avoid`, set by the scheduler before
    each exploit: the donor's and every other member's current values, so also what an earlier recipient
    of the same donor got in this round): it is drawn again, up to `REDRAWS` times. Without it a value at a
    bound stays there under every perturbation (weight decay 0 x 1.2 is 0), and two recipients of one donor
    trained the same configuration for the rest of the run (`make demo`, issue 25). Where the space has no
    unused configuration left (a small categorical space), the last draw is kept."""

    REDRAWS = 32
    avoid: list[dict[str, Any]] = []  # a class default: schedulers pickled before it existed

    step = LINEAR_STEP  # a class default: schedulers pickled before linear steps existed

    def __init__(
        self,
        space: SearchSpace,
        seed: int,
        resample_probability: float,
        factors: tuple[float, ...],
        step: float = LINEAR_STEP,
    ):
        self.space, self.rng = space, random.Random(seed)
        self.resample_probability, self.factors, self.step = resample_probability, tuple(factors), step

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        taken = [self._key(c) for c in self.avoid]
        new = config
        for attempt in range(self.REDRAWS):
            # after a few collisions perturbation alone is stuck (a value at a bound): resample more often
            p = self.resample_probability if attempt < 4 else max(self.resample_probability, 0.5)
            new, _ = self.space.explore(config, self.rng, p, self.factors, self.step)
            if self._key(new) not in taken:
                break
        self.avoid = []  # one exploit's context
        return new

    def _key(self, config: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(repr(config.get(k)) for k in sorted(self.space.mutable))


def build_scheduler(
    cfg: SchedulerConfig, space: SearchSpace, max_steps: int, seed: int = 0
) -> TrialScheduler:
    """Metric and mode are left to `TuneConfig` (Tune refuses them in both places)."""
    if cfg.name == "pbt":
        return ResumablePBT(
            time_attr=TIME_ATTR,
            perturbation_interval=cfg.interval,
            burn_in_period=cfg.burn_in_steps(max_steps),
            hyperparam_mutations={},
            quantile_fraction=cfg.quantile_fraction,
            custom_explore_fn=BoundedExplore(
                space, seed, cfg.resample_probability, cfg.perturbation_factors, cfg.linear_step
            ),
            synch=cfg.synch,
            sync_timeout_s=cfg.sync_timeout_s,
        )
    if cfg.name == "pb2":
        return _resumable_pb2()(
            time_attr=TIME_ATTR,
            perturbation_interval=cfg.interval,
            hyperparam_bounds={k: list(b) for k, b in space.search_bounds().items()},
            quantile_fraction=cfg.quantile_fraction,
            space=space,
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
_SCHEDULER_FIELDS = ("_next_perturbation_sync", "_num_checkpoints", "_num_perturbations", "_applied", "_decided")
_PB2_FIELDS = ("data", "last_exploration_time", "current")


class _Resumable:
    _restored: dict[str, Any] | None = None
    _decided = 0  # exploits decided (each logged on the console as it is): a class default for older states

    def debug_string(self) -> str:
        """Tune's status line for the scheduler. Ray's counts the exploits the trials have applied (a
        decision reaches the trial at its next interval) next to "checkpoints" (donor candidates): it read
        "1 perturbs" under two printed exploit lines. Here: the exploits decided, as the console lists them."""
        applied = self._num_perturbations
        decided = max(self._decided, applied)  # a state saved before decisions were counted
        pending = f" ({decided - applied} not yet loaded)" if decided > applied else ""
        return f"{type(self).__name__.removeprefix('Resumable')}: {decided} exploits{pending}"

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
        explore = self._custom_explore_fn
        if isinstance(explore, BoundedExplore):  # what the other members hold: not to be given again
            explore.avoid = [t.config for t in self._trial_state if t is not trial]
        config, operations = super()._get_new_config(trial, trial_to_clone)
        self._decided += 1  # one call per exploit decision (in place, or Ray's pause and restore)
        return {**config, EXPLOIT_ID: uuid.uuid4().hex}, operations

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        super().on_trial_add(tune_controller, trial)
        saved = (self._restored or {}).pop(trial.trial_id, None)
        if saved is not None:
            for name, value in saved.items():
                setattr(self._trial_state[trial], name, value)

    def donor_candidates(self) -> list[Any]:
        """Each trial's donor checkpoint, if it has one (a Checkpoint, or the future of a save): what an
        exploit may still clone (search.retention keeps them)."""
        return [state.last_checkpoint for state in self._trial_state.values()]

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


# ----------------------------------------------------------------------------------- in place
# Why a scheduler subclass (and not an actor that hosts each trial's Train run beyond Tune's trial actor):
# Ray's PBT turns an exploit into pause + restore, and synchronous PBT pauses every member at every
# interval; a pause stops the trial's actor, and with it any run it hosts. Deciding the same way but
# returning CONTINUE keeps Tune's trial actors (and their runs) alive without a second lifecycle to keep
# in step with Tune's; the trial actor still owns its run, so Ctrl-C, --resume and failures work as
# before. The decision reaches the trial through a `DecisionBoard` actor; the trial loads the donor's checkpoint
# into its live run (search/trial.py). What this relies on in Ray 2.60's PBT (its fields and helpers
# named below) is pinned by tests/unit/test_search_schedulers.py.


@ray.remote(num_cpus=0)
class DecisionBoard:
    """Between the scheduler and the trials (one per experiment): the scheduler's decisions, per trial and
    report step, "go" or an exploit order. The scheduler posts (no wait), the trial takes (waits). A trial
    passes them on to its live run through the run's `search.trial.RunGate`."""

    def __init__(self) -> None:
        self.decisions: dict[tuple[str, int], Any] = {}
        self.events: dict[tuple[str, int], asyncio.Event] = {}

    async def post(self, trial: str, step: int, decision: Any) -> None:
        self.decisions[(trial, step)] = decision
        self.events.setdefault((trial, step), asyncio.Event()).set()

    async def peek(self, trial: str, step: int) -> Any:
        """The decision if it is made, without taking it (None if not yet)."""
        return self.decisions.get((trial, step))

    async def take(self, trial: str, step: int, timeout_s: float) -> Any:
        key = (trial, step)
        if key not in self.decisions:
            try:
                await asyncio.wait_for(self.events.setdefault(key, asyncio.Event()).wait(), timeout_s)
            except asyncio.TimeoutError:
                return None
        for old in [k for k in self.decisions if k[0] == trial and k[1] < step]:  # never taken: not awaited
            del self.decisions[old]
        self.events.pop(key, None)
        return self.decisions.pop(key)


def board_name(exp_dir: Any) -> str:
    """The board's actor name: one per experiment folder (the same after --resume; the namespace is the
    driver's job's)."""
    return f"raytrain-board-{hashlib.sha1(str(exp_dir).encode()).hexdigest()[:12]}"


class InPlace:
    """PBT/PB2 deciding as Ray's, but never pausing a trial whose run can stay live: an exploit is posted
    to the trial (which loads the donor's checkpoint into its running Train run) instead of a pause and a
    restore; synchronous PBT holds members at the gate (their runs live) instead of pausing them, until the
    population is there or `sync_timeout_s` has passed (a member that hung is left out of that round and
    decided on alone when it reports). Active once `attach`ed to a board (`trial_runs: live`, every member
    running at once); otherwise Ray's own behaviour. The upper quantile's donor checkpoint is the pin its
    report names: no extra save per report."""

    board: str | None = None
    _sync_timeout_s = 900.0

    def attach(self, board: str) -> None:
        self.board = board

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for runtime in ("_board", "_controller", "_waiting", "_first_wait"):
            state.pop(runtime, None)
        return state

    # --------------------------------------------------------------------------------- decisions

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        self._adopt_trial_log(trial, result)
        if self.board is None or TIME_ATTR not in result or self._metric not in result:
            return super().on_trial_result(tune_controller, trial, result)
        self._controller = tune_controller
        time_ = result[TIME_ATTR]
        state = self._trial_state[trial]
        if time_ < self._burn_in_period or time_ - state.last_perturbation_time < self._perturbation_interval:
            self._post(trial, time_, "go")
            return TrialScheduler.CONTINUE
        self._save_trial_state(state, time_, result, trial)
        if not self._synch or time_ < self._next_perturbation_sync:
            # async, or a synchronous member late for a round decided without it: on its own, now
            state.last_perturbation_time = time_
            lower, upper = self._quantiles()
            self._decide(trial, upper, lower)
            return TrialScheduler.CONTINUE
        waiting = self.__dict__.setdefault("_waiting", {})
        waiting[trial] = time_
        self.__dict__.setdefault("_first_wait", time.monotonic())
        self._maybe_sync()
        return TrialScheduler.CONTINUE

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> None:
        self._adopt_trial_log(trial, result or {})
        super().on_trial_complete(tune_controller, trial, result)

    def _adopt_trial_log(self, trial: Any, result: dict[str, Any]) -> None:
        """A trial's lineage log is the truth over Tune's saved state (search.trial): after a killed driver
        the trial goes on with what it logged since Tune's last save (an exploit's hyperparameters, which a
        later explore of it as a donor starts from), and the count of exploits is what the trials applied
        (`exploits` in each result: an exploit decided and lost with the driver never happened)."""
        hparams = {k.removeprefix("hparams/"): v for k, v in result.items() if k.startswith("hparams/")}
        if any(trial.config.get(k) != v for k, v in hparams.items()):
            trial.set_config({**trial.config, **hparams})
        if "exploits" in result:
            applied = self.__dict__.setdefault("_applied", {})
            applied[trial.trial_id] = int(result["exploits"])
            self._num_perturbations = sum(applied.values())

    def tick(self) -> None:
        """From Tune's loop (SchedulerState.on_step_end): a synchronous round past its timeout goes on."""
        if self.__dict__.get("_waiting"):
            self._maybe_sync()

    def _maybe_sync(self) -> None:
        waiting = self._waiting
        absent = [
            t
            for t in self._controller.get_live_trials()
            if t not in waiting and self._trial_state[t].last_train_time < self._next_perturbation_sync
        ]
        late = time.monotonic() - self._first_wait > self._sync_timeout_s
        if absent and not late:
            return
        if absent:
            logger.warning(
                "synchronous PBT: %s not at step %d after sync_timeout_s=%g; deciding without %s",
                ", ".join(str(t) for t in absent),
                self._next_perturbation_sync,
                self._sync_timeout_s,
                "it" if len(absent) == 1 else "them",
            )
        lower, upper = self._quantiles()
        middle = [t for t in waiting if t not in upper and t not in lower]
        for trial in [t for t in upper if t in waiting] + middle + [t for t in lower if t in waiting]:
            self._trial_state[trial].last_perturbation_time = waiting[trial]
            self._decide(trial, upper, lower)
        times = [self._trial_state[t].last_train_time for t in self._controller.get_trials()]
        self._next_perturbation_sync = max(self._next_perturbation_sync + self._perturbation_interval, max(times))
        self._waiting = {}
        self.__dict__.pop("_first_wait", None)

    def _decide(self, trial: Any, upper: list[Any], lower: list[Any]) -> None:
        """Ray's `_checkpoint_or_exploit`, in place: a top trial's donor checkpoint is its report's pin."""
        state = self._trial_state[trial]
        pin = (state.last_result or {}).get("pin")
        if trial in upper and pin:
            state.last_checkpoint = pin_checkpoint(pin)
            self._num_checkpoints += 1
        else:
            state.last_checkpoint = None
        for top in upper:  # a top member decided before it was top donates the report it was scored on
            top_state = self._trial_state[top]
            top_pin = (top_state.last_result or {}).get("pin")
            if top_state.last_checkpoint is None and top_pin:
                top_state.last_checkpoint = pin_checkpoint(top_pin)
        donors = [t for t in upper if self._trial_state[t].last_checkpoint is not None and t is not trial]
        if trial in lower and donors:
            self._post(trial, state.last_train_time, self._exploit_in_place(trial, random.choice(donors)))
        else:
            self._post(trial, state.last_train_time, "go")

    def _exploit_in_place(self, trial: Any, donor: Any) -> dict[str, Any]:
        """Ray's `_exploit` without the pause: the trial's config and tag change now (Tune's table shows
        them), and the order goes to the trial. Tune's save of this report, which follows this decision
        (`checkpoint_frequency=1`), is the donor's (`TrialRun.save_checkpoint` finds the order on the board):
        a restart or --resume before the trial's next save restores the exploit."""
        state, donor_state = self._trial_state[trial], self._trial_state[donor]
        step = donor_state.last_train_time
        old = {k: trial.config.get(k) for k in self._explored_keys(trial.config)}
        new_config, _ = self._get_new_config(trial, donor)
        trial.set_experiment_tag(ray_compat.experiment_tag(state.orig_tag, new_config, self._hyperparam_mutations))
        trial.set_config(new_config)
        checkpoint = donor_state.last_checkpoint
        self._num_perturbations += 1
        state.last_perturbation_time = donor_state.last_perturbation_time
        state.last_train_time = donor_state.last_train_time
        changes = ", ".join(
            f"{k} {_short(old[k])} -> {_short(new_config.get(k))}" for k in old if old[k] != new_config.get(k)
        )
        logger.info("exploit: %s <- %s at step %d: %s", trial, donor, step, changes or "same values")
        return {"pin": pin_of_checkpoint(checkpoint), "config": new_config, "exploit_id": new_config.get(EXPLOIT_ID)}

    def _explored_keys(self, config: dict[str, Any]) -> list[str]:
        return [k for k in config if k not in (MEMBER, EXPLOIT_ID)]

    def _post(self, trial: Any, step: int, decision: Any) -> None:
        """On the board before Tune goes on: the save of this report that Tune asks of the trial next looks
        the decision up there."""
        if self.__dict__.get("_board") is None:
            self._board = ray.get_actor(self.board)
        ray.get(self._board.post.remote(trial.trial_id, int(step), decision))


REF = "ref"  # in a pin (search.trial): its metadata alone, what the Tune checkpoint of a donor points at


def pin_checkpoint(pin: str) -> tune.Checkpoint:
    """The Tune checkpoint of a pin (a local folder or a bucket URI): its `ref/` (metadata only, so that a
    restore by Tune downloads nothing more), on the pin's own file system (a bucket's: the trials' fsspec one)."""
    where = location(pin)
    ref = where / REF
    fs, path = pyarrow_fs(ref if ref.exists() else where)  # a pin made before refs existed: the pin itself
    return tune.Checkpoint(path, filesystem=fs)


def pin_of_checkpoint(checkpoint: tune.Checkpoint) -> str:
    """The pin (as a location string) that `pin_checkpoint` made `checkpoint` for."""
    where = location_on(checkpoint.filesystem, checkpoint.path)
    return str(where.parent if where.name == REF else where)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


class ResumablePBT(InPlace, _Resumable, PopulationBasedTraining):
    """Ray's PBT whose state survives `Tuner.restore` (with `SchedulerState` among the callbacks), exploiting
    in place once attached to a board."""

    def __init__(self, *args: Any, sync_timeout_s: float = 900.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync_timeout_s = sync_timeout_s


class _SearchScale:
    """PB2 on the space's search scale (`SearchSpace.to_search`): Ray's PB2 normalises each bound linearly,
    so over a log-uniform learning rate in [3e-4, 3e-2] its GP proposed half its values in the top decade
    (bench/results/pbt_quality.json before this). Its bounds are the search scale's (`build_scheduler`), the
    values it records of a trial are mapped to it, the donor it explores from is shown on it, and its
    proposal comes back to the space's own values (ints rounded, clipped)."""

    def __init__(self, *args: Any, space: SearchSpace, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._space = space

    def _save_trial_state(self, state: Any, time: int, result: dict[str, Any], trial: Any) -> Any:
        first = len(self.data)
        score = super()._save_trial_state(state, time, result, trial)
        new = self.data.index >= first  # the row just recorded holds the trial's own values
        for key in self._hyperparam_bounds_flat:
            column = self.data[key].astype(float)
            column[new] = [self._space[key].to_search(v) for v in self.data.loc[new, key]]
            self.data[key] = column
        return score

    def _get_new_config(self, trial: Any, trial_to_clone: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        donor = _OnSearchScale(trial_to_clone, self._space.to_search(trial_to_clone.config))
        config, operations = super()._get_new_config(trial, donor)
        return self._space.from_search(config), operations


class _OnSearchScale:
    """A trial as PB2's explore reads it: its name, and its config on the search scale."""

    def __init__(self, trial: Any, config: dict[str, Any]) -> None:
        self.trial, self.config = trial, config

    def __str__(self) -> str:
        return str(self.trial)


def _resumable_pb2() -> type:
    """Built on first use: importing PB2 imports scikit-learn, which trials should not pay for."""
    if "ResumablePB2" not in globals():
        from ray.tune.schedulers.pb2 import PB2

        bases = (InPlace, _Resumable, _SearchScale, PB2)
        globals()["ResumablePB2"] = type("ResumablePB2", bases, {"__module__": __name__})
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

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if isinstance(self.scheduler, InPlace):
            self.scheduler.tick()

    def get_state(self) -> dict[str, Any] | None:
        if not isinstance(self.scheduler, _Resumable):
            return None
        if self.staging is not None:  # None before Tune made the trials: nothing to summarise yet
            write_json_atomic(Path(self.staging) / SCHEDULER_FILE, self.scheduler.summary(), default=str)
        return self.scheduler.export_state()

    def set_state(self, state: dict[str, Any]) -> None:
        if isinstance(self.scheduler, _Resumable):
            self.scheduler.import_state(state)
