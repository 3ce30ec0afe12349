"""Lineage tables, the schedule a trial descends from, and the live run's gate."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest

from search import lineage
from search.lineage import LineageLog, best_trial, collect, read_events, schedule_of


def _report(trial, step, metric, lr, t):
    return {"time": t, "trial": trial, "step": step, "metric": metric, "hparams": {"lr": lr}, "failed": False}


def _exploit(trial, donor, step, t, donor_time, new_lr, donor_lr):
    return {
        "time": t,
        "trial": trial,
        "donor": donor,
        "step": step,
        "donor_time": donor_time,
        "new_hparams": {"lr": new_lr},
        "donor_hparams": {"lr": donor_lr},
    }


def test_schedule_follows_exploits_back_through_donors():
    # a: lr 1 all along. b copies a at step 10 (lr 2), c copies b at step 20 (lr 3).
    reports = [
        _report("a", 10, 5.0, 1, 1),
        _report("b", 10, 6.0, 9, 1),
        _report("c", 10, 7.0, 8, 1),
        _report("a", 20, 4.0, 1, 3),
        _report("b", 20, 3.5, 2, 3),
        _report("c", 20, 6.0, 8, 3),
        _report("c", 30, 3.0, 3, 5),
    ]
    events = [_exploit("b", "a", 10, 2, 1, 2, 1), _exploit("c", "b", 20, 4, 3, 3, 2)]
    s = schedule_of("c", reports, events)
    assert s.changes == [(0, {"lr": 1}), (10, {"lr": 2}), (20, {"lr": 3})]
    assert s.path == [("a", 0, 10), ("b", 10, 20), ("c", 20, 30)]
    assert s.final_step == 30
    # a trial that was never exploited keeps its own hyperparameters
    assert schedule_of("a", reports, events).changes == [(0, {"lr": 1})]


def test_a_donors_later_exploit_does_not_rewrite_the_copied_past():
    # b copies a's step-10 checkpoint (reported at t=1) at t=2; a itself is exploited later (t=3, from b),
    # which must not change b's history.
    reports = [_report("a", 10, 5.0, 1, 1), _report("b", 10, 6.0, 9, 1), _report("b", 20, 3.0, 2, 4)]
    events = [_exploit("b", "a", 10, 2, 1, 2, 1), _exploit("a", "b", 10, 3, 1, 7, 9)]
    assert schedule_of("b", reports, events).changes == [(0, {"lr": 1}), (10, {"lr": 2})]


def test_best_trial_ignores_failed_and_uses_the_latest_report():
    reports = [_report("a", 10, 1.0, 1, 1), _report("a", 20, 2.0, 1, 2), _report("b", 20, 1.5, 1, 2)]
    reports.append({**_report("c", 20, float("inf"), 1, 2), "failed": True})
    assert best_trial(reports, "min")[0] == "b"
    assert best_trial(reports, "max")[0] == "a"


def test_logs_merge_into_parquet(tmp_path):
    a, b = LineageLog(tmp_path, "a"), LineageLog(tmp_path, "b")
    a.report(10, 3.0, {"lr": 0.1}, failed=False, steps_s=1.0, wall_s=2.0)
    b.report(10, 4.0, {"lr": 0.2}, failed=False, steps_s=1.0, wall_s=2.0)
    b.exploit(10, "a", 1.0, {"lr": 0.2}, {"lr": 0.12}, {"lr": 0.1}, 4.0, 3.0)
    b.report(20, 2.5, {"lr": 0.12}, failed=False, steps_s=1.0, wall_s=2.0)
    b.report(20, 2.4, {"lr": 0.12}, failed=False, steps_s=1.0, wall_s=2.0)  # a restart redid step 20
    with (tmp_path / "lineage" / "b.jsonl").open("a") as f:
        f.write('{"time": 9, "trial": "b", "kind": "rep')  # cut by a kill mid-write
    reports, events = collect(tmp_path)
    assert [(r["trial"], r["step"], r["metric"]) for r in reports] == [
        ("a", 10, 3.0),
        ("b", 10, 4.0),
        ("b", 20, 2.4),
    ]
    assert (tmp_path / "lineage.parquet").is_file() and (tmp_path / "reports.parquet").is_file()
    (event,) = read_events(tmp_path)
    assert (event["trial"], event["donor"], event["step"]) == ("b", "a", 10)
    assert (event["old_hparams"], event["new_hparams"], event["donor_hparams"]) == (
        {"lr": 0.2},
        {"lr": 0.12},
        {"lr": 0.1},
    )
    assert (event["score"], event["donor_score"]) == (4.0, 3.0)


def test_a_redone_step_replaces_the_old_one_but_an_exploit_starts_a_new_life(tmp_path):
    a = LineageLog(tmp_path, "a")
    for step, metric in [(10, 5.0), (20, 4.0), (10, 5.0), (20, 3.9)]:  # resumed from its step-0 checkpoint
        a.report(step, metric, {"lr": 1}, failed=False, steps_s=1.0, wall_s=1.0)
    a.report(30, 3.5, {"lr": 1}, failed=False, steps_s=1.0, wall_s=1.0)
    a.exploit(20, "b", 0.0, {"lr": 1}, {"lr": 2}, {"lr": 3}, 3.5, 3.0)  # back to b's step 20
    a.report(30, 2.9, {"lr": 2}, failed=False, steps_s=1.0, wall_s=1.0)
    reports, _ = collect(tmp_path)
    assert [(r["step"], r["metric"]) for r in reports] == [(10, 5.0), (20, 3.9), (30, 3.5), (30, 2.9)]


def test_an_exploit_is_recorded_once_however_often_it_is_restored(tmp_path):
    b = LineageLog(tmp_path, "b")
    b.report(10, 4.0, {"lr": 0.2}, failed=False, steps_s=1.0, wall_s=2.0)
    exploit = dict(step=10, donor="a", donor_time=1.0, old_hparams={"lr": 0.2}, new_hparams={"lr": 0.12})
    exploit.update(donor_hparams={"lr": 0.1}, score=4.0, donor_score=3.0)
    assert b.exploit(**exploit, exploit_id="d1") is True
    b.report(20, 2.5, {"lr": 0.12}, failed=False, steps_s=1.0, wall_s=2.0)  # then the driver was killed
    assert b.exploit(**exploit, exploit_id="d1") is False  # Tune restored b from a's checkpoint again
    # a second decision that picks the same donor checkpoint (a's next one was not saved yet) is an exploit
    assert b.exploit(**{**exploit, "new_hparams": {"lr": 0.08}}, exploit_id="d2") is True
    kinds = [json.loads(line)["kind"] for line in b.path.read_text().splitlines()]
    assert kinds == ["report", "exploit", "report", "exploit"]
    assert [e["new_hparams"] for e in collect(tmp_path)[1]] == [{"lr": 0.12}, {"lr": 0.08}]


def _pin(tmp_path, name: str, step: int) -> str:
    """A pin as search.trial makes one: its step folder and its metadata (written last)."""
    pin = tmp_path / "pins" / name
    (pin / f"step_{step:08d}").mkdir(parents=True)
    (pin / "meta.json").write_text(json.dumps({"step": step, "step_dir": f"step_{step:08d}"}))
    return str(pin)


def test_a_restarted_trial_continues_from_its_logs_last_row_whatever_tune_saved(tmp_path):
    # Tune saved after b's first report; then, until the driver was killed, b was exploited (the donor's
    # pin), reported again, and a line was cut mid-write: the log, not Tune's save, says where b is
    b = LineageLog(tmp_path, "b")
    assert b.resume_point() is None, "nothing reported: Tune's restore (or a fresh start) stands"
    b.report(10, 4.0, {"lr": 0.2}, failed=False, steps_s=1.0, wall_s=2.0, pin=_pin(tmp_path, "b10", 10))
    donor = _pin(tmp_path, "a10", 10)
    b.exploit(10, "a", 1.0, {"lr": 0.2}, {"lr": 0.12}, {"lr": 0.1}, 4.0, 3.0, exploit_id="e1", pin=donor, from_step=10)
    assert b.resume_point() == {"step": 10, "pin": donor, "hparams": {"lr": 0.12}, "exploit_id": "e1"}, (
        "killed before it loaded (the restarted trial tells the rule it took e1)")
    b.report(20, 2.5, {"lr": 0.12}, failed=False, steps_s=1.0, wall_s=2.0, pin=_pin(tmp_path, "b20", 20))
    with b.path.open("a") as f:
        f.write('{"time": 9, "trial": "b", "kind": "rep')
    b.repair()  # as the restarted trial does before it appends
    assert b.resume_point() == {"step": 20, "pin": str(tmp_path / "pins" / "b20"), "hparams": {"lr": 0.12}}
    b.report(30, 2.0, {"lr": 0.12}, failed=False, steps_s=1.0, wall_s=2.0, pin=_pin(tmp_path, "b30", 30))
    assert [json.loads(line)["step"] for line in b.path.read_text().splitlines()] == [10, 10, 20, 30]
    reports, events = collect(tmp_path)  # the exploit applied before the kill stays in the lineage
    assert [(r["step"], r["abandoned"]) for r in reports] == [(10, False), (20, False), (30, False)]
    assert [e["exploit_id"] for e in events] == ["e1"]
    # a pin deleted since its row was written (retention): the row before it
    shutil.rmtree(tmp_path / "pins" / "b30")
    assert b.resume_point()["step"] == 20


def test_a_failed_trial_restarts_failed_and_a_log_without_pins_keeps_tunes_restore(tmp_path):
    b = LineageLog(tmp_path, "b")
    b.report(10, math.inf, {"lr": 1e6}, failed=True, steps_s=0.0, wall_s=2.0, error="NonFiniteLossError: nan")
    assert b.resume_point() == {"step": 10, "error": "NonFiniteLossError: nan"}
    old = LineageLog(tmp_path, "old")  # written before rows named their pins
    old.report(10, 3.0, {"lr": 0.1}, failed=False, steps_s=1.0, wall_s=2.0)
    assert old.resume_point() is None


def test_a_rollback_marks_the_abandoned_branch_so_each_trial_step_has_one_current_report(tmp_path):
    # async PBT: b reported 10 and 20 on its own, then exploited a's step-10 checkpoint (a was behind)
    b = LineageLog(tmp_path, "b")
    for step, loss in ((10, 5.5), (20, 5.4)):
        b.report(step, loss, {"lr": 1e-4}, failed=False, steps_s=1.0, wall_s=2.0)
    b.exploit(10, "a", 1.0, {"lr": 1e-4}, {"lr": 0.012}, {"lr": 0.01}, 5.4, 3.7, exploit_id="e1", from_step=20)
    for step, loss in ((20, 3.6), (30, 3.5)):
        b.report(step, loss, {"lr": 0.012}, failed=False, steps_s=1.0, wall_s=2.0)
    reports, events = collect(tmp_path)
    assert [(r["step"], r["metric"], r["abandoned"]) for r in reports] == [
        (10, 5.5, False),
        (20, 5.4, True),
        (20, 3.6, False),
        (30, 3.5, False),
    ]
    current = [(r["trial"], r["step"]) for r in reports if not r["abandoned"]]
    assert len(current) == len(set(current))
    ((event_step, from_step),) = [(e["step"], e["from_step"]) for e in events]
    assert from_step > event_step, "the rollback is recorded: from step 20 back to the donor's 10"


def test_the_gate_answers_a_rolled_back_run_anew_at_a_step_it_reaches_again():
    # a live run's gate (search.gate.RunGate), as its workers and its trial call it: the trial answers step 20
    # with an exploit of a donor at step 10; the run trains 11..20 again and must wait for a new answer at 20
    # (the old one loaded the same exploit a second time, issue 29)
    import asyncio

    from search.gate import RunGate

    async def scenario():
        gate = RunGate()
        await gate.answer(10, "go")
        assert await gate.wait(10, 0) == "go"
        await gate.answer(20, {"checkpoint": "step_00000010", "values": {}, "donor": "a", "tags": {}})
        first = await gate.wait(20, 0)  # every rank of the branch that reported 20 gets the exploit
        assert first["branch"] == 1 and await gate.wait(20, 0) == first
        # a group restarted now goes on on the new branch, from the exploit's checkpoint with its values (the
        # run's newest commit is of the branch it left) ...
        assert await gate.current() == {"branch": 1, "values": {}, "restore": first}
        await gate.post({"metrics": {"step": 20}, "path": "run/checkpoints/step_00000020", "branch": 1, "step": 20})
        # ... and once the branch has committed, from that commit, with the exploit's values
        assert await gate.current() == {"branch": 1, "values": {}, "restore": None}
        again = asyncio.ensure_future(gate.wait(20, first["branch"]))  # step 20 again, after the rollback
        await asyncio.sleep(0)
        assert not again.done(), "the old branch's answer is not this one's"
        await gate.answer(20, "go")
        assert await asyncio.wait_for(again, 5) == "go"
        assert await gate.peek(30, 1) == "go"
        await gate.stop_all()
        assert await gate.wait(40, 1) == "stop"

    asyncio.run(scenario())


def test_the_gate_tells_a_group_that_starts_at_a_posted_report_to_wait_and_queues_a_report_once():
    # replica groups (search.hooks.GateLoop): a group Ray starts while the others wait at the report of step 10
    # finds it posted and waits for its answer; one that starts at an exploit's pin (not posted on the new
    # branch) trains on; a report posted again (by a waiting group, its writer lost) is not queued twice
    import asyncio

    from search.gate import RunGate

    async def scenario():
        gate = RunGate()
        report = {"metrics": {"step": 10}, "path": "run/checkpoints/step_00000010", "branch": 0, "step": 10}
        await gate.post(report)
        await gate.post(dict(report))
        assert await gate.take(1.0) == report and await gate.take(0.01) is None
        assert await gate.was_posted(10, 0) and not await gate.was_posted(20, 0)
        waiting = asyncio.ensure_future(gate.wait(10, 0))
        await asyncio.sleep(0)
        assert not waiting.done()
        exploit = {"checkpoint": "pins/x/step_00000010", "values": {}, "donor": "a", "tags": {}}
        await gate.answer(10, exploit)
        assert (await asyncio.wait_for(waiting, 5))["branch"] == 1
        assert not await gate.was_posted(10, 1), "the exploit's pin is not a report of the new branch"
        # a report whose writer was lost before its commit: abandoned by a waiting group, the waiters train on,
        # and its late post is not queued; a posted report is never abandoned
        assert await gate.wait(20, 1, timeout_s=0.01) is None
        await gate.abandon(20, 1)
        assert await gate.wait(20, 1) == "skip" and await gate.was_posted(20, 1)
        await gate.post({**report, "branch": 1, "step": 20})
        assert await gate.take(0.01) is None
        await gate.post({**report, "branch": 1, "step": 30})
        await gate.abandon(30, 1)
        assert (await gate.take(0.01))["step"] == 30 and await gate.wait(30, 1, timeout_s=0.01) is None

    asyncio.run(scenario())


def _kept_and_marked_by_definition(reports, events):
    """The rules as their docstrings state them, one report at a time against every exploit."""
    kept = []
    for r in sorted(reports, key=lambda r: r["time"]):
        lives = [e["time"] for e in events if e["trial"] == r["trial"] and e["time"] < r["time"]]
        since = max(lives, default=-math.inf)
        kept = [k for k in kept if not (k["trial"] == r["trial"] and k["step"] >= r["step"] and k["time"] > since)]
        kept.append(r)
    return [
        {**r, "abandoned": any(e["trial"] == r["trial"] and e["time"] > r["time"] and e["step"] < r["step"] for e in events)}
        for r in kept
    ]


def test_collect_keeps_and_marks_reports_as_the_rules_say_in_one_pass_per_trial():
    # ties in time and step on purpose: redone steps, exploits at a report's time, several lives per trial
    for seed in range(400):
        rng = random.Random(seed)
        trials = [f"t{i}" for i in range(rng.randint(1, 4))]
        reports = [
            {"trial": rng.choice(trials), "step": 10 * rng.randint(0, 10), "time": float(rng.randint(0, 30)), "n": n}
            for n in range(rng.randint(0, 40))
        ]
        events = [
            {"trial": rng.choice(trials), "step": 10 * rng.randint(0, 10), "time": float(rng.randint(0, 30))}
            for _ in range(rng.randint(0, 6))
        ]
        got = lineage._marked_abandoned(lineage._without_redone(reports, events), events)
        assert got == _kept_and_marked_by_definition(reports, events), seed


@pytest.mark.parametrize("committed", [True, False], ids=["writer-lost-after-commit", "writer-lost-before-commit"])
def test_replica_groups_waiting_at_a_report_whose_writer_fell_silent_post_or_abandon_it(monkeypatch, tmp_path,
                                                                                        committed):
    # search.hooks.GateLoop._wait, against a real RunGate (its coroutines run here): the trial has not answered
    # the report of step 20 and the lighthouse says a group of the last quorum fell silent. With the report's
    # checkpoint committed the waiting group posts it (the trial then answers); without, it abandons it and
    # trains on. Nothing is done while no group is silent.
    import asyncio
    import types

    import search.hooks as hooks
    from search.gate import RunGate

    gate, loop = RunGate(), asyncio.new_event_loop()
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_00000020" if committed else checkpoints).mkdir(parents=True)

    class Remote:  # `actor.method.remote(...)`, run on this loop; `ray.get` returns its value
        def __getattr__(self, name):
            return types.SimpleNamespace(remote=lambda *a: loop.run_until_complete(getattr(gate, name)(*a)))

    silences = iter([False, True, True, True])
    engine = types.SimpleNamespace(peers_silent=lambda: next(silences))
    newest = checkpoints / "step_00000020" if committed else None
    trainer = types.SimpleNamespace(engine=engine, checkpointer=types.SimpleNamespace(latest=lambda: newest),
                                    step=20, cfg=None)
    monkeypatch.setattr(hooks.ray, "get", lambda value: value)
    monkeypatch.setattr(hooks, "SILENCE_WAIT_S", 0.01)
    gl = hooks.GateLoop(gate="g", wait_from=0)
    gl.gate = Remote()
    monkeypatch.setattr(gl, "report", lambda trainer, step: {"step": step, "val_loss": 1.0})
    if committed:  # the trial takes the posted report and answers it while the group waits
        real_post = gate.post

        async def post_then_answer(item):
            await real_post(item)
            await gate.answer(item["step"], "go")

        monkeypatch.setattr(gate, "post", post_then_answer)
    try:
        assert gl._wait(trainer, 20) == ("go" if committed else "skip")
    finally:
        loop.close()
    assert loop.is_closed() and gate.posted == {(0, 20)}
    queued = gate.reports.qsize()
    assert queued == (1 if committed else 0), "a report posted once (its checkpoint), or none (abandoned)"
