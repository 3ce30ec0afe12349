"""The population's rule (PBT and PB2): ours, pure and seeded, over the members' reports.

Tune runs the trials (placement, time-sharing, `--resume`, its table) with its FIFO scheduler; the rule
lives here, beside Tune rather than inside it. Each trial, after it has logged a report (`search.lineage`),
hands it to the experiment's `Population` actor and follows the decision it answers: go on, or exploit
(load a donor's committed checkpoint with explored values). No private name of Ray or Tune is involved, and
the trials' lineage logs are the one record: a resumed experiment rebuilds the population from them
(`Population.replay`), so there is no scheduler state to save (docs/pbt.md: why, and the path of an exploit).

The rule, as Jaderberg et al. (2017) and Ray's `PopulationBasedTraining` define it:
- a member is decided on at a report once `burn_in` steps are trained and `interval` steps have passed
  since its last decision (its *perturbation*);
- rank: the members' latest scores (a failed member's is the worst); the bottom `quantile_fraction` (at
  most half) is *lower*, the top as many *upper*;
- a lower member exploits an upper one (chosen by the member's seeded stream), taking its latest reported
  checkpoint and its hyperparameters explored: PBT by `BoundedExplore` (by kind, inside the space, never a
  configuration another member holds); PB2 by a GP-UCB proposal on the space's search scale (Parker-Holder
  et al. 2020: a Gaussian process over (time, score, hyperparameters) -> score change per step, the upper
  confidence bound maximised at the donor's time and score);
- synchronous PBT decides a round at once: when every member still training has reported the round's step,
  or `sync_timeout_s` after the first arrived (without those not there; a late member is then decided
  alone when it reports).

PB2's GP is fit on the newest `PB2_WINDOW` points of the history (a fit is cubic in its points: 0.37 s
at 200, 8 s at 1,000, 100 s at 2,000 on 2 cores), newest by the step they end at (not by arrival: the
window a rebuilt population holds is the live one's, whatever order the reports reached the actor in). Each fit
starts from the kernel the one before found and stops after `GP_MAX_EVALS` evaluations of the likelihood, so
that its cost is bounded however the data moves. The actor fits in a process of its own, whenever
there are new points and no fit runs (for at most `FIT_SHARE` of the time); a decision takes the newest fit and
waits only when there is none yet.

Every random draw comes from a stream seeded by (experiment seed, member index, decision count), so a
rebuilt population decides as the original would have.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hashlib
import logging
import math
import multiprocessing
import os
import random
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from search.schedulers import SchedulerConfig
from search.space import SearchSpace

__all__ = ["BoundedExplore", "Decision", "Member", "Population", "PopulationActor", "population_name"]

logger = logging.getLogger(__name__)

GO = "go"
# PB2's GP fits the newest this many points (Ray's PB2 fits at least its newest 200, of at most 1,000, after a
# cross-validation of the length that costs more than the fit); the score change per step a member makes
# depends on where training is, so older points say least about a decision now
PB2_WINDOW = 200
# a fit evaluates the likelihood (a Cholesky of the window: ~6 ms at 200 points on one core) at most this often;
# started from the last fit's kernel it mostly converges in a few, and a cold start on noise is cut short
GP_MAX_EVALS = 50
# the actor's fits take at most this share of its time (a fit waits twice as long after the last as the last took):
# the fit's process and the actor share the cores of a small head node with the trials
FIT_SHARE = 1 / 3


class BoundedExplore:
    """PBT's explore step: the donor's values explored inside the space (`SearchSpace.explore`: by kind,
    reflected at the bounds, neighbours for lists). An explored configuration never equals one another
    member holds (`avoid`): it is drawn again, up to `REDRAWS` times. Without that a value at a bound stays
    there under every perturbation (weight decay 0 x 1.2 is 0), and two recipients of one donor would train the
    same configuration for the rest of the run. Where the space has no unused
    configuration left (a small categorical space), the last draw is kept."""

    REDRAWS = 32

    def __init__(self, space: SearchSpace, cfg: SchedulerConfig) -> None:
        self.space, self.cfg = space, cfg

    def __call__(
        self, config: dict[str, Any], rng: random.Random, avoid: list[dict[str, Any]] = ()
    ) -> dict[str, Any]:
        taken = {self._key(c) for c in avoid}
        new = config
        for attempt in range(self.REDRAWS):
            # after a few collisions perturbation alone is stuck (a value at a bound): resample more often
            p = self.cfg.resample_probability if attempt < 4 else max(self.cfg.resample_probability, 0.5)
            new, _ = self.space.explore(config, rng, p, self.cfg.perturbation_factors, self.cfg.linear_step)
            if self._key(new) not in taken:
                break
        return new

    def _key(self, config: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(repr(config.get(k)) for k in sorted(self.space.mutable))


@dataclass
class Member:
    """What the rule knows of one member: its latest report, and when it was last decided on."""

    trial: str
    index: int  # its place in the population (its starting point): seeds its draws
    step: int = 0
    score: float | None = None  # the metric, oriented so that larger is better
    base: float | None = None  # the score its current stretch started from (the donor's after an exploit)
    pin: str | None = None  # its latest report's committed checkpoint (what a recipient would load)
    hparams: dict[str, Any] = field(default_factory=dict)
    reported_at: float = 0.0  # the wall time of that report (a lineage row's `donor_time`)
    perturbed: int = 0  # the step of its last decision (`last_perturbation_time` in Ray's PBT)
    decisions: int = 0  # decisions made for it so far (its stream's position)
    done: bool = False


@dataclass(frozen=True)
class Decision:
    """An exploit: load `pin` (the donor's checkpoint at `step`) and train on with `values`."""

    donor: str
    pin: str
    step: int
    values: dict[str, Any]
    donor_hparams: dict[str, Any]
    donor_metric: float | None
    donor_time: float
    exploit_id: str
    perturbed: int = 0  # the recipient's perturbation step from now on (the donor's): replay reads it back

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Population:
    """The rule, with no Ray in it: `report` a member's report, get its decision (or None while a
    synchronous round waits), `round_due` and `decide_round` for synchronous rounds."""

    def __init__(
        self, cfg: SchedulerConfig, space: SearchSpace, mode: str, steps: int, size: int, seed: int = 0,
        window: int | None = PB2_WINDOW,
    ) -> None:
        self.cfg, self.space, self.mode, self.steps, self.size, self.seed = cfg, space, mode, steps, size, seed
        self.burn_in = cfg.burn_in_steps(steps)
        self.members: dict[str, Member] = {}
        self.explore = BoundedExplore(space, cfg)
        # PB2: (t, score, x, change/step), the newest `window` points by `_order`; `points` counts every one
        self.history: list[tuple[float, float, dict[str, float], float]] = []
        self._order: list[tuple[Any, ...]] = []  # each point's (end step, member, t, score, change), ascending
        self.window, self.points = window, 0
        self.gp: GPFit | None = None  # the newest fit (of `gp.points` points)
        self.fit_inline = True  # a decision refits a stale GP itself (the actor fits off its loop instead)
        self.next_round = max(self.burn_in, cfg.interval)  # synchronous PBT: the step of the next round
        self.waiting: dict[str, int] = {}  # synchronous PBT: members at the round, by the step they reported
        self.first_wait: float | None = None
        self.exploits = 0  # taken (a decision counts once its trial holds the donor's pin: `taken`)
        # decisions their trials have not taken or declined yet: (decision, the member's own pin and values)
        self.pending: dict[str, tuple[Decision, str | None, dict[str, Any]]] = {}

    # ----------------------------------------------------------------------------------- reports

    def score_of(self, metric: float | None, failed: bool = False) -> float:
        if failed or metric is None or math.isnan(metric):
            return -math.inf
        return metric if self.mode == "max" else -metric

    def record(
        self,
        trial: str,
        index: int,
        step: int,
        metric: float | None,
        hparams: dict[str, Any],
        pin: str | None,
        failed: bool = False,
        when: float | None = None,
    ) -> bool:
        """Take a report; returns whether the member is decided on at it (burn-in and interval passed)."""
        m = self.members.setdefault(trial, Member(trial, index))
        self._unsettle(trial)  # a decision its trial never took (it restarted from its log before the exploit's row)
        score = self.score_of(metric, failed)
        if self.cfg.name == "pb2" and m.base is not None and math.isfinite(score) and math.isfinite(m.base):
            if step > m.step:  # the change per step under the values it trained with
                x = self.space.to_search({k: m.hparams[k] for k in self.space.search_bounds() if k in m.hparams})
                self._add_point(step, m.index, (float(m.step), m.base, x, (score - m.base) / (step - m.step)))
        m.step, m.score, m.base, m.hparams = step, score, score, dict(hparams)
        m.pin = None if failed else pin
        m.reported_at = time.time() if when is None else when
        m.done = step >= self.steps
        return not m.done and step >= self.burn_in and step - m.perturbed >= self.cfg.interval

    def _add_point(self, step: int, index: int, point: tuple[float, float, dict[str, float], float]) -> None:
        key = (step, index, point[0], point[1], point[3])
        at = bisect.bisect(self._order, key)
        self._order.insert(at, key)
        self.history.insert(at, point)
        if self.window is not None and len(self.history) > self.window:  # the oldest goes
            del self._order[0], self.history[0]
        self.points += 1

    def decide(self, trial: str) -> Decision | None:
        """Asynchronous: the member's decision at its report, made now."""
        m = self.members[trial]
        m.perturbed = m.step
        lower, upper = self.quantiles()
        return self._decide(m, lower, upper)

    # -------------------------------------------------------------------------------- rounds

    def arrive(self, trial: str, now: float) -> bool:
        """Synchronous: the member is at its round (True), or late for a round decided without it (False:
        decide it alone, now)."""
        m = self.members[trial]
        if m.step < self.next_round:
            return False
        self.waiting[trial] = m.step
        self.first_wait = now if self.first_wait is None else self.first_wait
        return True

    def absent(self) -> int:
        """Members still training that have not reached the round (some may not have reported at all)."""
        there = sum(1 for m in self.members.values() if m.done or m.step >= self.next_round)
        return self.size - there

    def round_due(self, now: float) -> bool:
        if not self.waiting:
            return False
        return self.absent() == 0 or now - self.first_wait > self.cfg.sync_timeout_s

    def decide_round(self) -> dict[str, tuple[int, Decision | None]]:
        """Each waiting member's (report step, decision)."""
        if self.absent():
            logger.warning(
                "synchronous PBT: %d member(s) not at step %d after sync_timeout_s=%g; deciding without them",
                self.absent(), self.next_round, self.cfg.sync_timeout_s,
            )
        lower, upper = self.quantiles()
        out = {}
        for trial, step in self.waiting.items():
            m = self.members[trial]
            m.perturbed = step
            out[trial] = step, self._decide(m, lower, upper)
        steps = [m.step for m in self.members.values()]
        self.next_round = max(self.next_round + self.cfg.interval, max(steps))
        self.waiting, self.first_wait = {}, None
        return out

    # ---------------------------------------------------------------------------- the decision

    def quantiles(self) -> tuple[list[Member], list[Member]]:
        """(lower, upper): the bottom and top `quantile_fraction` of the members with a score, at most half."""
        ranked = sorted((m for m in self.members.values() if m.score is not None), key=lambda m: m.score)
        if len(ranked) <= 1:
            return [], []
        n = min(math.ceil(len(ranked) * self.cfg.quantile_fraction), len(ranked) // 2)
        return ranked[:n], ranked[-n:] if n else []

    def _decide(self, m: Member, lower: list[Member], upper: list[Member]) -> Decision | None:
        self._unsettle(m.trial)
        rng = random.Random(f"{self.seed}:{m.index}:{m.decisions}")
        m.decisions += 1
        # a member at the end of its budget gives nothing to train on: its recipient would skip its own rest
        donors = [d for d in upper if d.pin is not None and d is not m and not d.done]
        if m not in lower or not donors:
            return None
        donor = rng.choice(donors)
        base = {k: donor.hparams[k] for k in self.space if k in donor.hparams}
        if self.cfg.name == "pb2":
            values = self._pb2_values(donor, rng)
        else:  # never what another member holds now (what an earlier recipient of this round got, too)
            values = self.explore(base, rng, [o.hparams for o in self.members.values() if o is not m])
        decision = Decision(
            donor=donor.trial,
            pin=donor.pin,
            step=donor.step,
            values={**base, **values},
            donor_hparams=dict(donor.hparams),
            donor_metric=self._metric(donor.score),
            donor_time=donor.reported_at,
            exploit_id=uuid.UUID(int=rng.getrandbits(128)).hex,
            perturbed=donor.perturbed,
        )
        # until its trial takes it: no donor (it is about to leave its checkpoint), and holding the values it was
        # given (another recipient explores away from them)
        self.pending[m.trial] = decision, m.pin, m.hparams
        m.pin, m.hparams = None, dict(decision.values)
        return decision

    def taken(self, trial: str, exploit_id: str, took: bool) -> None:
        """The trial's word on its decision: it took it (the exploit's row is logged, the member is at the donor's
        checkpoint: what `replay` applies at that row), or found the donor's pin pruned and trained on as it was
        (no row: the member is as before the decision). Said once more by a trial restarted after the row: once."""
        pending = self.pending.get(trial)
        if pending is None or pending[0].exploit_id != exploit_id:
            return
        if took:
            del self.pending[trial]
            self.exploited(trial, pending[0])
        else:
            self._unsettle(trial)

    def _unsettle(self, trial: str) -> None:
        if trial in self.pending:
            _, pin, hparams = self.pending.pop(trial)
            self.members[trial].pin, self.members[trial].hparams = pin, hparams

    def exploited(self, trial: str, decision: Decision) -> None:
        """The member now holds the donor's checkpoint: it is at the donor's step, with no pin of its own
        until it reports (so that nobody exploits it meanwhile), perturbed when the donor last was."""
        m = self.members[trial]
        m.step, m.pin, m.hparams, m.perturbed = decision.step, None, dict(decision.values), decision.perturbed
        # its stretch starts from the donor's score at that checkpoint (not the donor's now: replay reads a row
        # written after the donor may have reported again)
        metric = decision.donor_metric
        m.base = None if metric is None else self.score_of(metric)
        self.exploits += 1

    def _metric(self, score: float | None) -> float | None:
        if score is None or not math.isfinite(score):
            return None
        return score if self.mode == "max" else -score

    def _pb2_values(self, donor: Member, rng: random.Random) -> dict[str, Any]:
        """PB2's proposal: GP-UCB on the search scale, at the donor's time and score."""
        keys, lo, width = self._scale()
        candidates = [[rng.random() for _ in keys] for _ in range(256)]
        pick = candidates[0]
        if len(self.history) >= 2:
            if self.gp is None or (self.fit_inline and self.fit_due()):
                self.gp = self.fit_job()()
            pick = self.gp.pick(donor.step, donor.score, candidates)
        proposal = {k: lo[i] + pick[i] * width[i] for i, k in enumerate(keys)}
        return self.space.coerce(self.space.from_search(proposal))

    def _scale(self) -> tuple[list[str], list[float], list[float]]:
        bounds = self.space.search_bounds()
        keys = sorted(bounds)
        return keys, [bounds[k][0] for k in keys], [max(bounds[k][1] - bounds[k][0], 1e-12) for k in keys]

    def fit_due(self) -> bool:
        """PB2: the history has points the newest fit has not seen."""
        return self.cfg.name == "pb2" and len(self.history) >= 2 and (self.gp is None or self.gp.points != self.points)

    def fit_job(self) -> Any:
        """The fit of the history as it is now, as a call that reads nothing of this population (for another process);
        it starts from the newest fit's kernel."""
        start = None if self.gp is None else self.gp.gp.kernel_
        return partial(GPFit.fit, list(self.history), *self._scale(), self.steps, self.seed, self.points, start=start)

    def take_fit(self, fit: GPFit) -> None:
        if self.gp is None or fit.points > self.gp.points:
            self.gp = fit

    def wants_values(self, trial: str) -> bool:
        """Whether the member's decision now would explore (it is in the lower quantile and has a donor)."""
        lower, upper = self.quantiles()
        m = self.members[trial]
        return m in lower and any(d.pin is not None and d is not m and not d.done for d in upper)

    # ------------------------------------------------------------------------------ rebuilding

    def replay(self, reports: list[dict[str, Any]], events: list[dict[str, Any]], index: dict[str, int]) -> None:
        """Rebuild from the lineage (a resumed experiment): every report and exploit in the order they
        happened, deciding nothing, so that scores, perturbation steps, the streams' positions and PB2's
        history are those the original had."""
        rows = [("report", r) for r in reports] + [("exploit", e) for e in events]
        for kind, row in sorted(rows, key=lambda kr: kr[1]["time"]):
            trial = row["trial"]
            if kind == "report":
                due = self.record(
                    trial, index.get(trial, 0), row["step"], row["metric"], row["hparams"] or {}, row.get("pin"),
                    failed=bool(row.get("failed")), when=row["time"],
                )
                if due:
                    self.members[trial].perturbed = row["step"]
                    self.members[trial].decisions += 1
            elif trial in self.members:
                donor = self.members.get(row["donor"])
                # the perturbation step the decision gave (the donor's then; by the row's time the donor may
                # have been decided again): logs written before rows carried it fall back to the donor's now
                perturbed = row.get("perturbed")
                if perturbed is None:
                    perturbed = donor.perturbed if donor else self.members[trial].perturbed
                decision = Decision(
                    row["donor"], row.get("pin") or "", row["step"], row["new_hparams"], row["donor_hparams"] or {},
                    row.get("donor_score"), row["donor_time"], row.get("exploit_id") or "", perturbed,
                )
                self.exploited(trial, decision)
        steps = [m.step for m in self.members.values()]
        if steps and self.cfg.synch:  # the next round after every report made: earlier ones are late
            self.next_round = max(self.next_round, (max(steps) // self.cfg.interval + 1) * self.cfg.interval)

    def summary(self) -> dict[str, Any]:
        return {"exploits": self.exploits, "members": {t: m.step for t, m in self.members.items()}}

    def state(self) -> dict[str, Any]:
        """The rule's state without wall times (a rebuilt population's equals the live one's)."""
        members = {t: {k: v for k, v in m.__dict__.items() if k != "reported_at"} for t, m in sorted(self.members.items())}
        # a finished population has no next round (replay sets it past the last report, the live rule leaves it)
        live = not all(m.done for m in self.members.values())
        return {"members": members, "exploits": self.exploits, "points": self.points,
                "history": [[t, s, x, c] for t, s, x, c in self.history],
                "next_round": self.next_round if live else None}


@dataclass(frozen=True)
class GPFit:
    """PB2's GP over (time, score, hyperparameters) -> score change per step, fit on `points` points."""

    gp: Any
    points: int
    size: int  # the points it was fit on (at most the window)
    s_lo: float
    s_w: float
    steps: int
    seconds: float = 0.0  # the fit's wall time

    @classmethod
    def fit(cls, history: list[tuple[float, float, dict[str, float], float]], keys: list[str], lo: list[float],
            width: list[float], steps: int, seed: int, points: int, start: Any = None) -> GPFit:
        """Fit on `history`; `start`: a kernel to start the likelihood's optimisation from (the last fit's)."""
        import warnings

        import numpy as np
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

        began = time.perf_counter()
        scores = np.array([s for _, s, _, _ in history])
        s_lo, s_w = float(scores.min()), float(max(np.ptp(scores), 1e-12))
        X = np.array([[t / max(steps, 1), (s - s_lo) / s_w, *((x.get(k, lo[i]) - lo[i]) / width[i] for i, k in enumerate(keys))]
                      for t, s, x, _ in history])
        y = np.array([c for *_, c in history])
        y = (y - y.mean()) / (y.std() or 1.0)
        kernel = start
        if kernel is None or kernel.n_dims != X.shape[1] + 2:  # (constant, a length scale per input, noise)
            kernel = ConstantKernel(1.0, (1e-3, 1e3)) * RBF(np.ones(X.shape[1]), (1e-2, 1e2)) + WhiteKernel(1e-2, (1e-6, 1e1))
        # one BLAS thread: the matrices are small, and on cores busy with training two threads spin on
        # each other (a fit of 200 points: 6.4 s with two, 0.3 s with one, beside a training run on 2 cores)
        with warnings.catch_warnings(), _one_blas_thread():
            warnings.simplefilter("ignore")  # a GP fit on a few noisy points hits a kernel bound: nothing to act on
            gp = GaussianProcessRegressor(kernel, optimizer=_bounded_lbfgs, normalize_y=False, random_state=seed).fit(X, y)
        return cls(gp, points, len(history), s_lo, s_w, steps, time.perf_counter() - began)

    def pick(self, step: int, score: float, candidates: list[list[float]]) -> list[float]:
        """The candidate (in [0, 1]^d) with the highest upper confidence bound of the score change per step
        the GP predicts at the donor's time and score."""
        import numpy as np

        t, s = step / max(self.steps, 1), (score - self.s_lo) / self.s_w
        with _one_blas_thread():
            mean, std = self.gp.predict(np.array([[t, s, *c] for c in candidates]), return_std=True)
        beta = 2.0 * math.log(self.size**2 * math.pi**2 / 0.6)  # GP-UCB's (Srinivas et al.), delta 0.1
        return candidates[int(np.argmax(mean + math.sqrt(beta) * std))]


def _one_blas_thread() -> Any:
    """BLAS on one thread while a fit or a pick runs (threadpoolctl's controller is made once: finding the
    libraries takes ~1 ms, as long as a pick)."""
    return _blas_controller().limit(limits=1, user_api="blas")


@functools.cache
def _blas_controller() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _bounded_lbfgs(objective: Any, theta: Any, bounds: Any) -> tuple[Any, float]:
    """scikit-learn's own optimiser (L-BFGS-B on the log marginal likelihood) with its evaluations bounded."""
    from scipy.optimize import minimize

    result = minimize(objective, theta, method="L-BFGS-B", jac=True, bounds=bounds, options={"maxfun": GP_MAX_EVALS})
    return result.x, float(result.fun)


# ------------------------------------------------------------------------------------ the actor


class PopulationActor:
    """The `Population` of one experiment, as an actor beside the driver: a trial `report`s and then waits
    for its `decision` (at once when asynchronous; when its round is decided when synchronous). A report is
    taken at once, and answered with its decision when that is made at once. PB2's GP is fit in a process of
    its own (`_fit_process`), so that the actor goes on answering meanwhile: one fit at a time, started when there are new points and
    the last fit ended long enough ago (fits take at most `FIT_SHARE` of the time); a decision takes the newest
    fit, and waits only for the first."""

    def __init__(self, population: Population) -> None:
        self.population = population
        population.fit_inline = False
        self.decisions: dict[tuple[str, int], Any] = {}
        self.events: dict[tuple[str, int], asyncio.Event] = {}
        self.fitting: asyncio.Future | None = None
        self.fit_after = 0.0  # (monotonic) no new fit before then
        self.fit_timer: asyncio.TimerHandle | None = None
        self.pool: ProcessPoolExecutor | None = None
        self.pending: set[asyncio.Task] = set()
        if population.cfg.name == "pb2":
            self.pool = _fit_process()
            # scikit-learn's import (1-4 s) before the first report, not when the first fit comes back to be read
            _import_gp()

    async def report(
        self, trial: str, index: int, step: int, metric: float | None, hparams: dict[str, Any],
        pin: str | None, failed: bool = False,
    ) -> Any:
        """Take a report; returns its decision when made at once (else None: ask `decision`)."""
        pop = self.population
        if not pop.record(trial, index, step, metric, hparams, pin, failed):
            self._post(trial, step, GO)
        elif pop.cfg.synch and pop.cfg.name == "pbt" and pop.arrive(trial, time.monotonic()):
            self._maybe_round()
        elif pop.gp is None and pop.fit_due() and pop.wants_values(trial):
            task = asyncio.ensure_future(self._decide_after_fit(trial, step))
            self.pending.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self.pending.discard)
        else:
            self._post(trial, step, _answer(pop.decide(trial)))
        self._fit(first=False)
        return self._take(trial, step)

    async def decision(self, trial: str, step: int, timeout_s: float) -> Any:
        """The decision on `trial`'s report of `step`: "go", an exploit (a dict), or None if not made yet."""
        key = (trial, step)
        if key not in self.decisions:
            self._maybe_round()
        if key not in self.decisions:
            try:
                await asyncio.wait_for(self.events.setdefault(key, asyncio.Event()).wait(), timeout_s)
            except asyncio.TimeoutError:
                self._maybe_round()  # a round past its timeout goes on
                if key not in self.decisions:
                    return None
        return self._take(trial, step)

    async def taken(self, trial: str, exploit_id: str, took: bool) -> None:
        self.population.taken(trial, exploit_id, took)

    async def summary(self) -> dict[str, Any]:
        return self.population.summary()

    async def state(self) -> dict[str, Any]:
        return self.population.state()

    async def leave(self, trial: str) -> None:
        """A member whose trial ended without finishing (Tune ended it in error): a synchronous round does
        not wait for it."""
        self.population.members.setdefault(trial, Member(trial, -1)).done = True
        self._maybe_round()

    async def _decide_after_fit(self, trial: str, step: int) -> None:
        """The first decision that needs the GP: it waits for the first fit (that of the fit running now, if any)."""
        fitting = self._fit(first=True)
        if fitting is not None:
            await asyncio.wait([fitting])  # a failed fit is logged by `_fitted`; the decision then fits inline
        self._post(trial, step, _answer(self.population.decide(trial)))

    def _fit(self, first: bool) -> asyncio.Future | None:
        """The fit running now, or one started now if the history has new points and the last fit ended long
        enough ago (`first`: at once); None when no fit is due."""
        pop, loop = self.population, asyncio.get_running_loop()
        if self.fitting is not None or not pop.fit_due():
            return self.fitting
        wait = self.fit_after - time.monotonic()
        if wait > 0 and not first:
            if self.fit_timer is None:
                self.fit_timer = loop.call_later(wait, self._fit_timer_fired)
            return None
        try:
            self.fitting = loop.run_in_executor(self.pool, pop.fit_job())
        except BrokenProcessPool:  # the fit's process died (killed, out of memory): a new one for the next fit
            logger.error("PB2's fit process ended; starting another (a decision meanwhile fits in the actor)")
            self.pool = _fit_process()
            return None
        self.fitting.add_done_callback(self._fitted)
        return self.fitting

    def _fit_timer_fired(self) -> None:
        self.fit_timer = None
        self._fit(first=False)

    def _fitted(self, fitting: asyncio.Future) -> None:
        self.fitting = None
        if fitting.exception() is not None:
            logger.error("PB2's GP fit failed", exc_info=fitting.exception())
            return
        fit = fitting.result()
        self.population.take_fit(fit)
        self.fit_after = time.monotonic() + fit.seconds * (1 / FIT_SHARE - 1)
        self._fit(first=False)

    def _maybe_round(self) -> None:
        if self.population.round_due(time.monotonic()):
            for trial, (step, decision) in self.population.decide_round().items():
                self._post(trial, step, _answer(decision))

    def _take(self, trial: str, step: int) -> Any:
        """The decision on that report, once (None if not made)."""
        self.events.pop((trial, step), None)
        return self.decisions.pop((trial, step), None)

    def _post(self, trial: str, step: int, answer: Any) -> None:
        for old in [k for k in self.decisions if k[0] == trial]:  # never taken: not awaited any more
            del self.decisions[old]
        self.decisions[(trial, step)] = answer
        self.events.setdefault((trial, step), asyncio.Event()).set()


def _import_gp() -> None:
    import sklearn.gaussian_process  # noqa: F401

    _blas_controller()


def _fit_process() -> ProcessPoolExecutor:
    """A process of its own for PB2's fits, started now (spawned: no copy of the actor's threads or Ray's
    sockets). A fit holds the interpreter it runs in for most of its ~0.3 s: in a thread of the actor, each
    report that came meanwhile waited for the interpreter's lock; here it waits only for a core, and the fit
    yields the cores first. (On the 2-core bench, where the cores are the limit, the report p99 at 256 members
    moved within its run-to-run noise: 33-53 ms over 12 runs, against 39 and 66 ms in a thread; on a head
    node with cores to spare a fit costs the reports nothing.)
    It ends with the actor."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_fitter,
                               initargs=(os.getpid(),))
    pool.submit(int)
    return pool


def _fitter(parent: int) -> None:
    """In the fit's process: a lower priority than the actor's (reports are answered first on busy cores; a
    fit is background work), scikit-learn imported before the first fit, and an end when the actor's process
    does (killed, it leaves this one to the init process)."""
    os.nice(10)
    _import_gp()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="pb2-fit-parent", daemon=True).start()


def _answer(decision: Decision | None) -> Any:
    return GO if decision is None else decision.as_dict()


def experiment_actor_name(kind: str, exp_dir: Any) -> str:
    """An experiment's actor of `kind`: one per experiment folder (the same after --resume); in the driver's
    job's namespace. (Here, not in `search.slots`: this module is what the population's actor process imports,
    and `search.slots` imports Tune.)"""
    return f"raytrain-{kind}-{hashlib.sha1(str(exp_dir).encode()).hexdigest()[:12]}"


def population_name(exp_dir: Any) -> str:
    return experiment_actor_name("population", exp_dir)
