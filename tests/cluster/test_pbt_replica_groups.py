"""A PBT population whose members are per-step fault-tolerant runs (`scaling.fault_tolerance: per_step`: two
torchft replica groups of one worker each), across the test hosts: each member has a group on h2 and one on h3
(a per-step run spreads its groups of one over the nodes), the driver, the population and the trials' gates on
the head. h3 is killed after the first exploit, then booted again: every member trains on with its group on h2
in the same process, gets a group on h3 back, which heals from h2's memory; each exploit is once in the lineage,
the best member's replay lands on what it reported, and its best score is that of the same experiment without
the kill. The same experiment with per-step off: the member whose run lost a worker restarts it from a
checkpoint (the contrast).

The experiments live in the tier's work dir (a folder every host sees, as an NFS mount would be: per-step fault
tolerance needs a run dir on a file system). The kill runs are paced (tests/ray/hooks.py: Pace) until every
member is whole again, so that the run lasts through the fault on any machine; the test waits on the runs' own
records and console, never on that pace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.scenarios import Driver, _wait_for, console_lines, run_raw, write_yaml
from trainers.metrics import read_metrics

pytestmark = pytest.mark.cluster

INTERVAL, STEPS = 10, 60
# Paced after the first report until every member is whole again: h3's return, its Ray's start, a group placed,
# started and healed take ~30 s here (tests/cluster/test_replica_groups.py), 98 s at most before the budget's end
PACE_S = 2.0
WAIT_S = 300
# The kill changes the float order of a few steps' sums only (a lost group's samples summed by the other): a
# score of the experiment without it is met far closer than another seed's (tests/ray/test_fault_tolerance.py:
# 1.6e-6 relative at most over 300 steps).
SAME_SCORE_RTOL = 1e-4


def _experiment(tier, name: str, per_step: bool, paced: Path | None) -> Path:
    scaling = {"fault_tolerance": "per_step", "max_failures": -1} if per_step else {"max_failures": -1}
    base = run_raw(str(tier.workdir() / "unused"), data=str(tier.corpus), parallel={"engine": "ddp"},
                   scaling=scaling, optimizer={"name": "adamw", "lr": 1e-3},
                   train={"steps": STEPS, "eval_every": INTERVAL, "global_batch_size": 8, "micro_batch_size": 4})
    write_yaml(tier.workdir(), f"{name}-base", base)
    callbacks = ["tests.ray.hooks:ReplicaLog"] if per_step else []
    if paced is not None:
        callbacks.append(f"tests.ray.hooks:Pace(seconds={PACE_S}, until={str(paced)!r}, after={INTERVAL})")
    return write_yaml(tier.workdir(), name, {
        "name": name, "base": f"{name}-base.yaml", "storage": str(tier.workdir() / "tune"),
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        "initial": [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        "scheduler": {"name": "pbt", "interval": INTERVAL, "burn_in": 0, "quantile_fraction": 0.5, "synch": True,
                      "resample_probability": 0.0},
        "population": 2, "budget": {"steps": STEPS}, "resources": {"workers": 2, "cpus_per_worker": 0.5},
        "callbacks": callbacks,
    })


def _tune(tier, path: Path) -> Driver:
    log = path.with_suffix(".console")
    return Driver(tier.ray.raytrain(["tune", str(path), "--address", tier.ray.address], log=log), log)


def _live_runs(exp_dir: Path) -> dict[str, list[Path]]:
    return {t.name: sorted(t.glob("live-*")) for t in sorted((exp_dir / "runs").glob("*")) if t.is_dir()}


def _replica_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in (run_dir / "replicas").glob("group?.jsonl")
            for line in path.read_text().splitlines() if line]


def _whole_after_the_kill(exp_dir: Path) -> bool:
    """Every member trained a step on one group, and then one on two again."""
    runs = [r for rs in _live_runs(exp_dir).values() for r in rs]
    if len(runs) != 2:
        return False
    for run in runs:
        path = run / "metrics.jsonl"
        rows = read_metrics(path, "train") if path.exists() else []
        lost = next((r["step"] for r in rows if r["replicas"] == 1 and r["step"] > INTERVAL), None)
        if lost is None or not any(r["replicas"] == 2 and r["step"] > lost for r in rows):
            return False
    return True


def _kill_h3_after_the_first_exploit(tier, driver: Driver, exp_dir: Path | None, paced: Path | None) -> None:
    driver.wait_line("exploit: ", timeout=WAIT_S)
    tier.hosts["h3"].kill()
    driver.wait_line("raytrain: lost host h3", timeout=WAIT_S)
    tier.hosts["h3"].start()
    tier.ray.start_worker("h3")
    if paced is not None:
        _wait_for(lambda: _whole_after_the_kill(exp_dir) or driver.proc.poll() is not None, WAIT_S,
                  "every member on two groups again")
        paced.touch()


def _best(exp_dir: Path) -> tuple[str, float, int]:
    from search.lineage import best_trial, collect

    reports, _ = collect(exp_dir)
    trial, row = best_trial(reports, "min")
    return trial, row["metric"], row["step"]


def test_a_pbt_population_of_replica_groups_loses_a_host_and_no_member_restarts(tier):
    name = f"pbt-ft-{tier.runs}"
    tier.runs += 1
    exp_dir = tier.workdir() / "tune" / name
    paced = tier.workdir() / f"{name}.unpaced"
    driver = _tune(tier, _experiment(tier, name, per_step=True, paced=paced))
    _kill_h3_after_the_first_exploit(tier, driver, exp_dir, paced)
    code = driver.wait(WAIT_S)
    text = driver.text()
    assert code == 0, text[-5000:]
    assert "Traceback" not in text, text[-5000:]
    lines = console_lines(text)
    assert len([x for x in lines if x.startswith("raytrain: lost host h3")]) == 1

    from search.lineage import read_events, read_reports

    reports = [r for r in read_reports(exp_dir) if not r["abandoned"]]
    exploits = read_events(exp_dir)
    assert exploits and len({e["exploit_id"] for e in exploits}) == len(exploits), "each exploit once"
    for trial, runs in _live_runs(exp_dir).items():
        assert len(runs) == 1, f"{trial}: one live run from start to end (never restarted)"
        rows = read_metrics(runs[0] / "metrics.jsonl", "train")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), f"{trial}: each step once"
        replicas = _replica_lines(runs[0])
        on_h2 = {x["pid"] for x in replicas if x["host"] == "h2"}
        on_h3 = {x["pid"] for x in replicas if x["host"] == "h3"}
        assert len(on_h2) == 1, f"{trial}: its group on h2 was restarted"
        assert len(on_h3) == 2, f"{trial}: a new group on h3 after its return"
        # the groups hold the same weights after each step both committed (the exploit loaded by both groups,
        # the new one healed with the exploit's values)
        by_step: dict[int, set[str]] = {}
        for x in replicas:
            by_step.setdefault(x["step"], set()).add(x["weights"])
        assert all(len(w) == 1 for w in by_step.values()), f"{trial}: the groups' weights differ"
        # each report once; a member whose writing group was lost with a report's checkpoint unwritten skips
        # that report (its groups train on to the next: search.hooks.GateLoop._wait)
        steps = [r["step"] for r in reports if r["trial"] == trial]
        every = set(range(INTERVAL, STEPS + 1, INTERVAL))
        assert steps == sorted(set(steps)) and set(steps) <= every and len(every - set(steps)) <= 1, steps
        # (the new group heals from h2's memory, or, when it joins while the others wait for the trial's
        # answer at a report, loads that report's checkpoint and waits with them)
        told = [line for r in reports if r["trial"] == trial for line in r["replica_events"] or ()]
        assert any("lost a replica group" in x for x in told) and any("a replica group is back" in x for x in told)
    # each trial's console lines, named by it
    trial_ids = sorted(_live_runs(exp_dir))
    assert all(f"{t}: step " in text for t in trial_ids) and ": lost a replica group; the others train on" in text

    # The best member's replay (one run of its schedule, from scratch) lands on what it reported.
    trial, score, step = _best(exp_dir)
    replay = tier.ray.raytrain(["tune", "replay", str(exp_dir), "--trial", trial, "--address", tier.ray.address],
                               log=tier.workdir() / f"{name}.replay")
    assert replay.wait(WAIT_S) == 0, (tier.workdir() / f"{name}.replay").read_text()[-4000:]
    (run,) = (exp_dir / "replay").glob(f"{trial}-*")
    replayed = [r["val_loss"] for r in read_metrics(run / "metrics.jsonl", "eval") if r["step"] == step][-1]
    assert replayed == pytest.approx(score, rel=1e-5)

    # The same experiment without the kill: the same best score (the kill moved float order only).
    control = f"{name}-control"
    driver = _tune(tier, _experiment(tier, control, per_step=True, paced=None))
    assert driver.wait(WAIT_S) == 0, driver.text()[-5000:]
    _, control_score, _ = _best(tier.workdir() / "tune" / control)
    assert score == pytest.approx(control_score, rel=SAME_SCORE_RTOL)

    # Per-step off: the member whose run lost a worker restarts that run from a checkpoint.
    off = f"{name}-off"
    driver = _tune(tier, _experiment(tier, off, per_step=False, paced=None))
    _kill_h3_after_the_first_exploit(tier, driver, None, None)
    assert driver.wait(WAIT_S) == 0, driver.text()[-5000:]
    resumed = [t for t, runs in _live_runs(tier.workdir() / "tune" / off).items()
               if any(e["event"] == "resume" for r in runs for e in read_metrics(r / "metrics.jsonl", "event"))]
    assert resumed, "with per-step off, no member restarted its run after losing h3"
