"""The population's rule (search.population): PBT's and PB2's decisions over reports, with no Ray."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import sklearn.gaussian_process  # noqa: F401  (scikit-learn sets KMP_* variables on import: at collection)

from raytrain_ext import ray_compat
from search.console import quiet_warnings
from search.population import Population
from search.schedulers import SchedulerConfig
from search.space import parse_space

SPACE = parse_space({"optimizer.lr": {"loguniform": [1e-4, 1e-2]}})


def _population(size=3, space=SPACE, seed=0, **cfg):
    cfg = {"name": "pbt", "interval": 10, "burn_in": 0, "quantile_fraction": 0.34, **cfg}
    return Population(SchedulerConfig(**cfg), space, "min", 40, size, seed=seed)


def _decide(pop, trial):
    """The member's decision, taken by its trial (as a trial that holds the donor's pin says)."""
    d = pop.decide(trial)
    if d is not None:
        pop.taken(trial, d.exploit_id, True)
    return d


def _report(pop, trial, step, loss, lr, index=None):
    """A member's report; returns whether it is decided on at it."""
    index = int(trial[1:]) if index is None else index
    return pop.record(trial, index, step, loss, {"optimizer.lr": lr}, f"/pins/{trial}/{step}")


def test_asynchronous_pbt_decides_each_report_against_those_reported_so_far():
    pop = _population()
    decided = []
    for trial, loss, lr in (("t0", 3.0, 1e-2), ("t1", 4.0, 1e-3), ("t2", 5.0, 1e-4)):
        assert _report(pop, trial, 10, loss, lr)
        decided.append(_decide(pop, trial))
    # the first alone (go), the second the worse of two, the third the worst of three: both exploit t0's report
    assert decided[0] is None
    assert decided[1].donor == decided[2].donor == "t0" and decided[1].pin == "/pins/t0/10" == decided[2].pin
    assert decided[1].step == 10 and decided[1].donor_metric == 3.0
    # explored from the donor's value: x 0.5, or x 2 reflected at the top bound; never what another member holds
    assert decided[1].values["optimizer.lr"] == pytest.approx(5e-3)
    assert decided[1].exploit_id != decided[2].exploit_id and len(decided[1].exploit_id) == 32
    assert pop.exploits == 2


def test_no_decision_before_burn_in_or_within_an_interval_of_the_last():
    pop = _population(burn_in=20)
    assert not _report(pop, "t0", 10, 3.0, 1e-2)  # burn-in
    assert _report(pop, "t0", 20, 3.0, 1e-2)
    _decide(pop, "t0")
    assert not _report(pop, "t0", 25, 3.0, 1e-2)  # 5 steps since its last decision
    assert _report(pop, "t0", 30, 3.0, 1e-2)
    assert not _report(pop, "t0", 40, 3.0, 1e-2)  # the end of the budget: nothing to decide


def test_quantiles_are_at_most_half_and_a_failed_member_ranks_last():
    pop = _population(size=4, quantile_fraction=0.5)
    for trial, loss in (("t0", 1.0), ("t1", 2.0), ("t2", 3.0)):
        _report(pop, trial, 10, loss, 1e-3)
    pop.record("t3", 3, 10, None, {"optimizer.lr": 1e-3}, None, failed=True)
    lower, upper = pop.quantiles()
    assert [m.trial for m in lower] == ["t3", "t2"] and [m.trial for m in upper] == ["t1", "t0"]
    decision = _decide(pop, "t3")
    assert decision is not None and decision.donor in ("t0", "t1"), "a failed member is replaced by exploit"


def test_a_synchronous_round_waits_for_every_member_then_decides_them_together():
    pop = _population(synch=True)
    for trial, loss, lr in (("t2", 5.0, 1e-4), ("t0", 3.0, 1e-2)):
        assert _report(pop, trial, 10, loss, lr) and pop.arrive(trial, now=0.0)
    assert not pop.round_due(now=1.0), "a member is missing: the others wait, their runs live"
    assert _report(pop, "t1", 10, 4.0, 1e-3) and pop.arrive("t1", now=2.0)
    assert pop.round_due(now=2.0)
    decided = pop.decide_round()
    assert decided["t0"] == (10, None) and decided["t1"] == (10, None)
    step, order = decided["t2"]
    assert step == 10 and order.donor == "t0" and order.pin == "/pins/t0/10"
    assert pop.next_round == 20


def test_a_synchronous_round_goes_on_without_a_member_past_its_timeout_and_decides_it_alone_later():
    pop = _population(synch=True, sync_timeout_s=60.0)
    for trial, loss, lr in (("t2", 5.0, 1e-4), ("t0", 3.0, 1e-2)):
        _report(pop, trial, 10, loss, lr)
        pop.arrive(trial, now=0.0)
    assert not pop.round_due(now=59.0)
    assert pop.round_due(now=61.0)
    assert set(pop.decide_round()) == {"t0", "t2"}
    # the member that hung reports late: not held for a round that has passed, decided alone
    assert _report(pop, "t1", 10, 4.0, 1e-3)
    assert not pop.arrive("t1", now=62.0)
    assert _decide(pop, "t1") is None  # ranked with all three: the middle one (t2 still ranks by its 5.0)
    assert pop.members["t1"].perturbed == 10 and pop.next_round == 20


def test_recipients_of_one_donor_never_share_a_configuration():
    """The donor sits at a bound of both keys (lr at its top, weight decay at 0): every perturbation of it
    clips to few values, and without a re-draw two recipients of one round trained the same configuration
    for the rest of the run (`make demo` before issue 25)."""
    space = parse_space({"optimizer.lr": {"loguniform": [1e-4, 1e-2]}, "optimizer.weight_decay": {"uniform": [0.0, 0.2]}})
    for seed in range(20):
        pop = _population(size=4, space=space, seed=seed, quantile_fraction=0.5, resample_probability=0.1, synch=True)
        pop.record("t0", 0, 10, 1.0, {"optimizer.lr": 1e-2, "optimizer.weight_decay": 0.0}, "/pins/t0")
        pop.record("t1", 1, 10, 1.5, {"optimizer.lr": 1e-2, "optimizer.weight_decay": 0.0}, None)  # no pin: no donor
        for i in (2, 3):
            pop.record(f"t{i}", i, 10, 5.0, {"optimizer.lr": 1e-4, "optimizer.weight_decay": 0.1}, f"/pins/t{i}")
        for t in ("t0", "t1", "t2", "t3"):
            pop.arrive(t, now=0.0)
        decided = [d for _, d in pop.decide_round().values() if d is not None]
        held = [(d.values["optimizer.lr"], d.values["optimizer.weight_decay"]) for d in decided] + [(1e-2, 0.0)]
        assert len(decided) == 2 and len(set(held)) == len(held), f"seed {seed}: {held}"


def test_a_space_with_no_unused_configuration_left_still_explores():
    space = parse_space({"model.kind": {"choice": ["a", "b"]}})
    pop = _population(size=4, space=space, quantile_fraction=0.5)
    for i, kind in enumerate("abab"):
        pop.record(f"t{i}", i, 10, float(i), {"model.kind": kind}, f"/pins/t{i}")
    decision = _decide(pop, "t3")  # every value is held: the last draw is kept
    assert decision is not None and decision.values["model.kind"] in ("a", "b")


def test_a_population_rebuilt_from_the_lineage_decides_as_the_original():
    """A resumed experiment's population is its lineage replayed: scores, perturbation steps and each
    member's stream position, so that its next decisions are those an uninterrupted one makes."""
    import random

    def run(pop, reports, events, start, stop):
        rng = random.Random(7)
        out = []
        for step in range(start, stop, 10):
            for trial in ("t0", "t1", "t2", "t3"):
                loss = rng.random() + (3.0 if pop.members.get(trial) and pop.members[trial].hparams.get("optimizer.lr", 0) < 1e-3 else 0.0)
                lr = pop.members[trial].hparams["optimizer.lr"] if trial in pop.members else 10 ** (-2 - int(trial[1]) / 2)
                row = {"time": len(reports) + len(events) + 1.0, "trial": trial, "step": step, "metric": loss,
                       "hparams": {"optimizer.lr": lr}, "pin": f"/pins/{trial}/{step}", "failed": False}
                reports.append(row)
                if pop.record(trial, int(trial[1]), step, loss, row["hparams"], row["pin"], when=row["time"]):
                    d = _decide(pop, trial)
                    if d is not None:
                        events.append({"time": row["time"] + 0.5, "trial": trial, "donor": d.donor, "step": d.step,
                                       "new_hparams": d.values, "donor_hparams": d.donor_hparams, "pin": d.pin,
                                       "donor_score": d.donor_metric, "donor_time": d.donor_time, "exploit_id": d.exploit_id})
                    out.append((trial, step, d and (d.donor, d.exploit_id, d.values["optimizer.lr"])))
        return out

    whole = _population(size=4, seed=3, quantile_fraction=0.25)
    decisions = run(whole, [], [], 10, 110)
    first = _population(size=4, seed=3, quantile_fraction=0.25)
    reports, events = [], []
    before = run(first, reports, events, 10, 60)
    rebuilt = _population(size=4, seed=3, quantile_fraction=0.25)
    rebuilt.replay(reports, events, {t: int(t[1]) for t in ("t0", "t1", "t2", "t3")})
    after = run(rebuilt, reports, events, 60, 110)
    assert any(d for _, _, d in decisions), "the run exploits at all"
    assert before + after == decisions


# ---------------------------------------------------------------------------------------- PB2


def _pb2_proposals(space_raw: dict, best_log10_lr: float, proposals: int = 4) -> list[dict]:
    """PB2 fed five reports of six members whose loss falls fastest at lr = 10**best_log10_lr; then the
    two bottom members explore, `proposals` times."""
    pop = Population(SchedulerConfig(name="pb2", interval=10), parse_space(space_raw), "min", 100, 6, seed=0)
    lrs = (3e-4, 6e-4, 1.5e-3, 4e-3, 1e-2, 2.5e-2)
    loss = [3.0] * 6
    for step in range(10, 60, 10):
        for i, lr in enumerate(lrs):
            loss[i] -= 0.1 * math.exp(-((math.log10(lr) - best_log10_lr) ** 2))
            pop.record(f"t{i}", i, step, loss[i], {"optimizer.lr": lr, "train.accum": 4}, f"/pins/t{i}/{step}")
    out = []
    for _ in range(proposals):
        worst = min(pop.members.values(), key=lambda m: m.score if m.pin else math.inf)
        trial = f"t{[i for i in range(6) if f't{i}' == worst.trial][0]}"
        decision = _decide(pop, trial)
        assert decision is not None
        out.append(decision.values)
        pop.record(trial, int(trial[1]), 50, loss[int(trial[1])], {"optimizer.lr": lrs[int(trial[1])], "train.accum": 4}, f"/pins/{trial}/50b")
    return out


@pytest.mark.parametrize(("best", "decade"), [(-3.2, (3e-4, 1e-3)), (-2.5, (1e-3, 1e-2)), (-1.8, (1e-2, 3e-2))])
def test_pb2_searches_a_log_uniform_range_in_log_space(best, decade):
    """Ray's PB2 normalised its bounds linearly: over [3e-4, 3e-2] the lowest decade was 0.7% of the box
    (it proposed 3e-3..3e-2 where the data pointed to 6e-4). On the log scale the proposals go to the decade
    the data favour, whichever it is, and come back as the space's own values (a logint as an int)."""
    space = {"optimizer.lr": {"loguniform": [3e-4, 3e-2]}, "train.accum": {"logint": [1, 64]}}
    for new in _pb2_proposals(space, best):
        assert decade[0] <= new["optimizer.lr"] < decade[1], (best, new)
        assert isinstance(new["train.accum"], int) and 1 <= new["train.accum"] <= 64


def test_pb2_decides_without_scikit_learns_convergence_warnings():
    """Its GP, fit on a few noisy points, hits a kernel bound at most decisions: a ConvergenceWarning each
    time on the console would be noise a user cannot act on."""
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ConvergenceWarning)
        proposals = _pb2_proposals({"optimizer.lr": {"loguniform": [3e-4, 3e-2]}}, -2.5)
    assert len(proposals) == 4
    assert not [w for w in seen if issubclass(w.category, ConvergenceWarning)], [str(w.message) for w in seen]


def test_tunes_upload_that_raced_a_save_of_its_state_prints_no_traceback(tmp_path, caplog):
    """Stop 49's CI: on a Ctrl-C, Tune's final save of its experiment state logged, with a traceback, the
    failure of the previous upload of its staging folder, which had listed the searcher's temp file before
    the save renamed it (the save's own upload follows). Left out under `quiet_warnings`, and only that
    error: another failure of the upload (a file of the state itself missing) is still shown."""
    import pyarrow.fs

    log = logging.getLogger(ray_compat.EXPERIMENT_STATE_LOGGER)
    local = pyarrow.fs.LocalFileSystem()

    def upload_fails_on(name: str) -> None:
        try:  # the copy Ray's syncer makes (ray/train/_internal/storage.py), of a file gone since listed
            pyarrow.fs.copy_files(str(tmp_path / name), str(tmp_path / "storage" / name), local, local)
        except FileNotFoundError:
            log.error("Saving experiment state to storage at '%s' failed with exception: ", tmp_path, exc_info=True)

    rays = ".d7514445-tmp-basic-variant-state-2026-11-27_23-00-34.json"  # ray/tune/utils/util.py _atomic_save
    ours = ".experiment.json.15524.a1b2c3"  # a file of ours, trainers.storage.write_bytes_atomic
    state = "experiment_state-2026-11-27_23-00-34.json"
    with caplog.at_level(logging.ERROR, logger=ray_compat.EXPERIMENT_STATE_LOGGER):
        with quiet_warnings():
            upload_fails_on(rays)
            upload_fails_on(ours)
            upload_fails_on(state)
        upload_fails_on(rays)  # outside it, Ray's logging as it was
    shown = [str(r.exc_info[1]) for r in caplog.records]
    assert len(shown) == 2 and state in shown[0] and rays in shown[1], shown
    assert not log.filters


def test_pbt_burn_in_is_half_the_budget_by_default_or_steps_or_a_share():
    """The default (chosen by bench/pbt_quality.py's previous round, search/schedulers.py's BURN_IN): no exploit
    before half of each trial's steps."""
    cfg = SchedulerConfig(name="pbt", interval=10)
    assert cfg.burn_in_steps(1600) == 800
    assert Population(cfg, SPACE, "min", 40, 2).burn_in == 20
    assert SchedulerConfig(name="pbt", burn_in="25%").burn_in_steps(1600) == 400
    assert SchedulerConfig(name="pbt", burn_in=30).burn_in_steps(1600) == 30
    assert SchedulerConfig(name="pb2", interval=10).burn_in_steps(1600) == 0  # pb2 decides from its first report
    for bad in ("half", "100%", "-5%"):
        with pytest.raises(ValueError, match="neither a step count nor a share"):
            SchedulerConfig(name="pbt", burn_in=bad)


def test_the_actor_answers_at_once_when_asynchronous_and_a_member_that_left_is_not_waited_for():
    """`PopulationActor` (a plain class here, an actor beside the driver in an experiment), as trials call it."""
    import asyncio

    from search.population import PopulationActor

    async def scenario():
        actor = PopulationActor(_population())
        assert await actor.report("t0", 0, 10, 3.0, {"optimizer.lr": 1e-2}, "/pins/t0/10") == "go"
        order = await actor.report("t1", 1, 10, 5.0, {"optimizer.lr": 1e-4}, "/pins/t1/10")
        assert order["donor"] == "t0" and order["pin"] == "/pins/t0/10"
        assert await actor.decision("t1", 10, 0.01) is None, "answered at the report, once"

        sync = PopulationActor(_population(synch=True))
        assert await sync.report("t0", 0, 10, 3.0, {"optimizer.lr": 1e-2}, "/pins/t0/10") is None
        assert await sync.report("t2", 2, 10, 5.0, {"optimizer.lr": 1e-4}, "/pins/t2/10") is None
        assert await sync.decision("t0", 10, 0.01) is None, "the round waits for t1"
        await sync.leave("t1")  # Tune ended its trial in error
        assert await sync.decision("t0", 10, 0.01) == "go"
        assert (await sync.decision("t2", 10, 0.01))["donor"] == "t0"

    asyncio.run(scenario())


def test_a_member_that_finished_its_budget_is_no_donor():
    """Asynchronous PBT, a member ahead at the end of the budget (step 40 of 40): a recipient copying it
    would jump to the end with nothing left to train (`make demo` ended such a trial failed)."""
    pop = _population(size=3, quantile_fraction=0.5)
    _report(pop, "t0", 40, 1.0, 1e-2)  # done
    _report(pop, "t1", 30, 2.0, 1e-3)
    assert _report(pop, "t2", 30, 5.0, 1e-4)
    decision = _decide(pop, "t2")
    assert decision is None or decision.donor == "t1"
    pop2 = _population(size=2, quantile_fraction=0.5)
    _report(pop2, "t0", 40, 1.0, 1e-2)
    assert _report(pop2, "t1", 30, 5.0, 1e-4)
    assert _decide(pop2, "t1") is None, "the only better member has finished: no exploit"


# ------------------------------------------------------------------------- PB2 at any history length


def _pb2_history(pop, reports, members=6, start_step=10):
    """`reports` rounds of reports of `members` members (PB2 records a point per member per round after the
    first): losses falling fastest near lr 1e-3, seeded."""
    import random

    rng = random.Random(5)
    lrs = [10 ** (-4 + 2 * i / (members - 1)) for i in range(members)]
    loss = [3.0] * members
    for r in range(reports):
        for i, lr in enumerate(lrs):
            loss[i] -= 0.01 * math.exp(-((math.log10(lr) + 3) ** 2)) + 0.002 * rng.random()
            pop.record(f"t{i}", i, start_step + 10 * r, loss[i], {"optimizer.lr": lr}, f"/pins/t{i}/{r}")
    return lrs


def test_pb2_fits_the_newest_window_of_its_history_and_decides_as_before_within_it():
    """The GP fits at most `PB2_WINDOW` points (the newest); a history no longer than the window gives the
    decision the unbounded rule gives, and each fit serves every decision until a new point arrives."""
    from search.population import PB2_WINDOW

    def decide(window, reports):
        pop = _pop_with_gp(window, reports)
        worst = min(pop.members.values(), key=lambda m: m.score).trial
        return pop, _decide(pop, worst)

    short = 1 + PB2_WINDOW // 6 - 1  # (reports - 1) x 6 points, within the window
    bounded, d1 = decide(PB2_WINDOW, short)
    unbounded, d2 = decide(None, short)
    assert bounded.points == unbounded.points <= PB2_WINDOW and d1.values == d2.values
    long, _ = decide(PB2_WINDOW, 3 * short)
    assert long.points > 2 * PB2_WINDOW and len(long.history) == long.gp.size == PB2_WINDOW
    fit = long.gp
    second = [m for m in long.members.values() if m.pin is not None][0].trial
    _decide(long, second)
    assert long.gp is fit, "no new point since the last fit: not fit again"


def _pop_with_gp(window=None, reports=6):
    """A PB2 population of 6 members with `reports` rounds of history."""
    cfg = SchedulerConfig(name="pb2", interval=10, quantile_fraction=0.34)
    pop = Population(cfg, SPACE, "min", 10_000, 6, seed=0, window=window)
    _pb2_history(pop, reports)
    return pop


def _fit_when_released(started, release, job):
    """In the actor's fit process: a fit that starts when the test says so (events of a manager)."""
    import dataclasses

    started.set()
    assert release.wait(30)
    return dataclasses.replace(job(), seconds=3600.0)


def test_a_report_is_answered_while_a_pb2_fit_runs_and_the_decision_follows_the_fit(monkeypatch):
    """The actor fits PB2's GP in a process of its own: while a fit blocks there (until the test releases it),
    another member's report and its decision are answered; the waiting member's decision comes once the fit
    ends, and a second recipient deciding meanwhile shares that one fit. With a fit in hand a recipient is
    answered at once, and the next fit waits as long as the last took (here an hour)."""
    import asyncio
    import multiprocessing
    from functools import partial

    from search.population import Population, PopulationActor

    manager = multiprocessing.get_context("spawn").Manager()
    started, release, fits = manager.Event(), manager.Event(), []
    real_job = Population.fit_job

    def blocking_job(self):
        fits.append(self.points)
        return partial(_fit_when_released, started, release, real_job(self))

    monkeypatch.setattr(Population, "fit_job", blocking_job)

    async def scenario():
        actor = PopulationActor(_pop_with_gp())
        pop = actor.population
        ranked = sorted(pop.members.values(), key=lambda m: m.score)
        (worst, ws), (second, ss), (best, bs) = ((m, m.step + 10) for m in (ranked[0], ranked[1], ranked[-1]))
        assert await actor.report(worst.trial, worst.index, ws, -worst.score + 0.5, dict(worst.hparams), "/p/w") is None
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)  # the fit runs, blocked
        # the best member reports and is answered (go) while the fit is blocked
        assert await actor.report(best.trial, best.index, bs, -best.score - 0.01, dict(best.hparams), "/p/b") == "go"
        assert await actor.decision(worst.trial, ws, 0.01) is None, "its decision waits for the fit"
        assert await actor.report(second.trial, second.index, ss, -second.score + 0.5, dict(second.hparams), "/p/s") is None
        release.set()
        first, then = await actor.decision(worst.trial, ws, 30.0), await actor.decision(second.trial, ss, 30.0)
        assert first["donor"] and then["donor"] and first["values"] != then["values"]
        assert len(fits) == 1, "the two recipients shared the fit that was running"
        assert actor.fitting is None and actor.fit_timer is not None, "new points: the next fit is timed, not run"
        w = pop.members[worst.trial]
        ws2 = w.step + 10
        answer = await actor.report(worst.trial, worst.index, ws2, -best.score + 9.0, dict(w.hparams), "/p/w2")
        assert answer["donor"], "answered at the report, on the fit it has"
        assert await actor.decision(worst.trial, ws2, 0.01) is None, "answered once"
        assert len(fits) == 1 and actor.fitting is None
        actor.fit_timer.cancel()
        actor.pool.shutdown()

    with manager:
        asyncio.run(scenario())


def test_a_synchronous_round_decides_each_member_once():
    import asyncio

    from search.population import PopulationActor

    async def scenario():
        actor = PopulationActor(_population(size=4, synch=True, quantile_fraction=0.25))
        reported = [
            await actor.report(f"t{i}", i, 10, loss, {"optimizer.lr": 10 ** (-2 - i / 2)}, f"/pins/t{i}/10")
            for i, loss in enumerate((1.0, 2.0, 3.0, 4.0))
        ]
        assert reported[:3] == [None] * 3, "the round waits for all four; the last report is answered with it"
        answers = [await actor.decision(f"t{i}", 10, 0.01) for i in range(3)] + reported[3:]
        assert answers[:3] == ["go"] * 3 and answers[3]["donor"] == "t0"
        assert [m.decisions for m in actor.population.members.values()] == [1, 1, 1, 1]
        assert await actor.decision("t3", 10, 0.01) is None, "answered once, never decided again"
        assert actor.population.exploits == 0, "an exploit counts once its trial took it"
        await actor.taken("t3", answers[3]["exploit_id"], True)
        assert actor.population.exploits == 1 and [m.decisions for m in actor.population.members.values()] == [1] * 4

    asyncio.run(scenario())


def test_replay_gives_a_recipient_the_perturbation_step_its_decision_gave_though_the_donor_moved_on():
    """The trial writes its exploit row after its donor may have reported and been decided again: the row
    carries the recipient's perturbation step as decided, so the rebuilt population equals the live one."""
    live = _population(size=3, quantile_fraction=0.34)
    rows, events = [], []

    def report(trial, step, loss, lr, t, row_at=None):
        rows.append({"time": t, "trial": trial, "step": step, "metric": loss, "hparams": {"optimizer.lr": lr},
                     "pin": f"/pins/{trial}/{step}"})
        d = _decide(live, trial) if _report(live, trial, step, loss, lr) else None
        if d is not None:  # the exploit's row, written by the trial once it holds the pin
            events.append({"time": row_at or t + 0.5, "trial": trial, "donor": d.donor, "step": d.step,
                           "new_hparams": d.values, "donor_hparams": d.donor_hparams, "pin": d.pin,
                           "donor_score": d.donor_metric, "donor_time": d.donor_time, "exploit_id": d.exploit_id,
                           "perturbed": d.perturbed})
        return d

    report("t0", 10, 1.0, 1e-2, 1.0)
    report("t1", 10, 2.0, 1e-3, 2.0)
    d = report("t2", 10, 5.0, 1e-4, 3.0, row_at=5.0)  # its row after the donor's next report (4.0)
    assert d is not None and d.donor == "t0" and d.perturbed == 10
    report("t0", 20, 0.9, 1e-2, 4.0)  # the donor decided again, at 20
    rebuilt = _population(size=3, quantile_fraction=0.34)
    rebuilt.replay(rows, events, {"t0": 0, "t1": 1, "t2": 2})
    assert rebuilt.state() == live.state() and rebuilt.members["t2"].perturbed == 10
    older = _population(size=3, quantile_fraction=0.34)  # rows written before they carried it: the donor's now
    older.replay(rows, [{k: v for k, v in e.items() if k != "perturbed"} for e in events], {"t0": 0, "t1": 1, "t2": 2})
    assert older.members["t2"].perturbed == 20


@pytest.mark.parametrize("pruned", [True, False])
def test_a_donor_pin_pruned_between_decision_and_adoption_leaves_population_lineage_and_replay_agreeing(
    tmp_path, pruned
):
    """As trials run it (search/trial.py): each report pinned and logged, then handed to the rule; the
    recipient adopts the donor's pin (`take_exploit`) and says whether it took it. The donor prunes that pin
    between the decision and the adoption: no exploit row, the member as before the decision, and the
    population rebuilt from the lineage equals the live one; the member then reports on and is decided again."""
    from search.lineage import LineageLog, collect
    from search.member import take_exploit
    from search.pins import Pins

    live = _population(size=3, quantile_fraction=0.34)
    logs = {t: LineageLog(tmp_path, t) for t in ("t0", "t1", "t2")}
    pins = {t: Pins(tmp_path / "runs" / t, keep=1) for t in logs}

    def report(trial, step, loss, lr):
        step_dir = tmp_path / "train" / trial / f"step_{step:08d}"
        step_dir.mkdir(parents=True)
        (step_dir / "model.pt").write_bytes(b"w")
        hparams = {"optimizer.lr": lr}
        pin = pins[trial].make(step_dir, {"trial": trial, "step": step, "hparams": hparams, "step_dir": step_dir.name})
        logs[trial].report(step, loss, hparams, failed=False, pin=str(pin), member=int(trial[1]))
        return live.record(trial, int(trial[1]), step, loss, hparams, str(pin)) and live.decide(trial)

    def rebuilt():
        reports, events = collect(tmp_path)
        pop = _population(size=3, quantile_fraction=0.34)
        pop.replay(reports, events, {t: int(t[1]) for t in logs})
        return pop.state()

    assert not report("t1", 10, 2.0, 1e-3) and not report("t0", 10, 1.0, 1e-2)  # the better: no exploit
    decision = report("t2", 10, 5.0, 1e-4)
    assert decision and decision.donor == "t0"
    if pruned:
        report("t0", 20, 0.9, 1e-2)  # keep=1: the donor's pin at 10 goes
    taken = take_exploit(decision.as_dict(), pins["t2"], logs["t2"], SPACE, ())
    live.taken("t2", decision.exploit_id, taken is not None)
    assert (taken is None) == pruned and logs["t2"].exploits() == (0 if pruned else 1)
    assert live.exploits == (0 if pruned else 1) and not live.pending
    assert rebuilt() == live.state()
    live.taken("t2", decision.exploit_id, True)  # said again (a trial restarted after its row): once
    assert rebuilt() == live.state() and live.exploits == (0 if pruned else 1)
    t2 = live.members["t2"]
    assert (t2.step, t2.hparams["optimizer.lr"]) == ((10, 1e-4) if pruned else (10, decision.values["optimizer.lr"]))
    assert (t2.pin is None) != pruned, "its own pin back, or none until it reports from the donor's"
    lr = t2.hparams["optimizer.lr"]
    again = report("t2", 20, 4.0, lr)
    assert again and again.donor == "t0" and live.members["t2"].decisions == 2, "decided again at its next report"
    live.taken("t2", again.exploit_id, take_exploit(again.as_dict(), pins["t2"], logs["t2"], SPACE, ()) is not None)
    assert rebuilt() == live.state() and live.exploits == logs["t2"].exploits() == (1 if pruned else 2)
