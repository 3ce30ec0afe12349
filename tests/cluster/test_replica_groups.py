"""Per-step fault tolerance across hosts (`scaling.fault_tolerance: per_step`, torchft replica groups): two
groups, one on h2 and one on h3, the driver and the lighthouse on the head (which has no CPU for workers, as
clusters/ starts it). h3 is killed, then booted again; later it is cut off, then its link restored. Each time
the group on h2 trains on in the same process, Ray places a new group on h3 when it is back (no hand) and it
heals from h2's memory; every committed step trains its samples once, in the run's order, and the losses are
those of one process that lost nothing.

The run dir is a folder every host mounts (the tier's work dir, as an NFS mount would be: per-step fault
tolerance refuses a run dir in a bucket, docs/ray-and-elasticity.md). The run is paced (tests/ray/hooks.py:
Pace) until the test has done what it does to it, so that it lasts through both faults on any machine; the
test waits on the run's own records and console, never on that pace."""

from __future__ import annotations

import json
import time
from itertools import groupby
from pathlib import Path

import pytest

from tests.cluster.scenarios import (
    _wait_for,
    console_lines,
    reference_losses,
    run_raw,
    start_train,
    train_rows,
    write_yaml,
)
from trainers.data.dataset import GlobalSampler, TokenWindows
from trainers.metrics import read_metrics

pytestmark = pytest.mark.cluster

STEPS, BATCH, PACE_S = 1200, 8, 0.4  # paced: 480 s at most, for ~110 s of faults and waits here
# What Ray and torchft take here (2 cores, idle): a killed host is noticed by its peers' sockets at once and
# by Ray in ~10 s (clusters/local.yaml's health checks); a cut-off one by torchft's lighthouse once its heartbeat
# is 1.5 s old; a booted host's Ray joins and a group is placed, imports and heals in ~20 s.
WAIT_S = 300


def _lines(run_dir: Path, kind: str = "") -> list[dict]:
    """ReplicaLog's lines of every process: a line per committed step of each group's first worker (`kind` ""),
    or every worker's "commits" or "attempts"."""
    pattern = f"group*.{kind}.jsonl" if kind else "group?.jsonl"
    return [json.loads(line) for path in (run_dir / "replicas").glob(pattern)
            for line in path.read_text().splitlines() if line]


def _committed_ids(run_dir: Path, by_host: dict[str, list[dict]]) -> dict[int, list[int]]:
    """The window ids each step's commit trained, by step: each group's as its vote committed them, and, for a
    step the survivor (h2) committed with two groups live where h3's group wrote no vote for it, the last attempt
    at that step of the one other process that read samples for it: its gradients were averaged into the step
    (an all-reduce ends only with every input) and it was lost or cut off before its own vote."""
    committed: dict[int, list[int]] = {}
    voted: dict[int, set[int]] = {}  # step -> the pids whose vote committed it
    for x in _lines(run_dir, "commits"):
        committed.setdefault(x["step"], []).extend(x["ids"])
        voted.setdefault(x["step"], set()).add(x["pid"])
    tried: dict[tuple[int, int], dict[int, list[int]]] = {}  # (pid, step) -> attempt -> ids read
    for x in _lines(run_dir, "attempts"):
        tried.setdefault((x["pid"], x["step"]), {}).setdefault(x["attempt"], []).extend(x["ids"])
    for x in by_host["h2"]:
        if x["replicas"] != 2 or len(voted.get(x["step"], ())) != 1:
            continue
        lost = [a for (pid, step), a in tried.items()
                if step == x["step"] and pid not in voted[step]]
        if len(lost) == 1:
            committed[x["step"]] += lost[0][max(lost[0])]
    return committed


def test_replica_groups_train_on_through_a_killed_and_a_cut_off_host(tier):
    name = f"ft-{tier.runs}"
    tier.runs += 1
    run_dir = tier.workdir() / name
    raw = run_raw(str(run_dir), data=str(tier.corpus), parallel={"engine": "ddp"},  # scaling.allreduce_timeout_s: 10
                  scaling={"fault_tolerance": "per_step", "num_workers": 2, "cpus_per_worker": 1, "max_failures": -1},
                  train={"steps": STEPS, "eval_every": 0, "global_batch_size": BATCH, "micro_batch_size": 4},
                  checkpoint={"every": 100, "keep": 2})
    run_yaml = write_yaml(tier.workdir(), name, raw)
    unpaced = run_dir / "unpaced"
    # paced inside each step, after its quorum: the cut below falls where h2's group is bound to average its
    # gradients with h3's, so that its all-reduce waits on the silent host
    driver = start_train(tier, run_yaml, "--callback", "tests.ray.hooks:ReplicaLog",
                         "--callback", f"tests.ray.hooks:Pace(seconds={PACE_S}, until={str(unpaced)!r}, inside=True)")
    h3 = tier.hosts["h3"]

    def full_size_after(step: int):
        return lambda rows: any(r["replicas"] == 2 and r["step"] > step for r in rows)

    def h3_pids() -> set[int]:
        return {x["pid"] for x in _lines(run_dir) if x["host"] == "h3"}

    driver.wait_rows(run_dir, full_size_after(10), "10 steps on two groups", WAIT_S)
    before_kill = h3_pids()
    t_kill = time.time()
    h3.kill()
    driver.wait_line("raytrain: lost host h3", timeout=WAIT_S)
    h3.start()
    tier.ray.start_worker("h3")
    _wait_for(lambda: h3_pids() - before_kill or driver.proc.poll() is not None, WAIT_S, "a new group on h3")
    driver.wait_rows(run_dir, lambda rows: rows and rows[-1]["replicas"] == 2, "two groups again", WAIT_S)
    kill_back = train_rows(run_dir)[-1]["step"]

    driver.wait_rows(run_dir, full_size_after(kill_back + 10), "10 steps on two groups after the kill", WAIT_S)
    before_cut = h3_pids()
    in_step = run_dir / "replicas" / "in_step.h2"
    last = in_step.read_text()
    _wait_for(lambda: in_step.read_text() != last, WAIT_S, "h2's group inside a step")  # its next step's quorum
    t_cut, cut_step = time.time(), int(in_step.read_text())
    h3.cut()
    _wait_for(lambda: driver.text().count("raytrain: lost host h3") >= 2 or driver.proc.poll() is not None,
              WAIT_S, "Ray to declare the cut-off h3 lost")
    h3.heal()
    # The cut-off process may rejoin and heal in place first; Ray ends it (its node was declared dead), the
    # host's Ray starts again and a new group is placed there: the run is paced until that one trains.
    _wait_for(lambda: h3_pids() - before_cut or driver.proc.poll() is not None, WAIT_S, "a new group on h3")
    driver.wait_rows(run_dir, lambda rows: rows and rows[-1]["replicas"] == 2, "two groups after the cut", WAIT_S)
    assert train_rows(run_dir)[-1]["step"] < STEPS - 20, "the pace did not last through both faults"
    unpaced.touch()
    code = driver.wait(WAIT_S)
    text = driver.text()
    assert code == 0, text[-5000:]
    assert "Traceback" not in text, text[-5000:]
    lines = [x for x in console_lines(text) if x.startswith(("raytrain:", "step "))]
    told = "\n".join(lines)
    assert len([x for x in lines if x.startswith("raytrain: lost host h3")]) == 2, told
    assert len([x for x in lines if "is back in the cluster" in x and "replica group" in x]) == 2, told

    # Each committed step once; two stretches on h2's group alone, and two groups at the end.
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step once in metrics.jsonl"
    first_full = next(r["step"] for r in rows if r["replicas"] == 2)  # a group may join the start late
    stretches = [k for k, _ in groupby(r["replicas"] for r in rows if r["step"] >= first_full)]
    assert stretches[-1] == 2 and stretches.count(1) >= 2, stretches
    heals = [e for e in read_metrics(run_dir / "metrics.jsonl", "event") if e["event"] == "healed"]
    assert len(heals) == len([x for x in lines if "healed from group" in x]) >= 2, told

    by_host = {host: sorted((x for x in _lines(run_dir) if x["host"] == host), key=lambda x: x["step"])
               for host in ("h2", "h3")}
    survivor, lost = by_host["h2"], by_host["h3"]
    assert len({x["pid"] for x in survivor}) == 1, "the group on h2 was restarted"
    steps = [x["step"] for x in survivor]
    assert steps == list(range(steps[0], STEPS + 1)) and steps[0] <= first_full  # from its start's quorum on
    # Its longest gap between committed steps while h3 was away, under the 3 s with this run's pace in
    # it: a killed host's sockets close at once; a cut-off one's do not, and a step's all-reduce gives up on it
    # once the lighthouse has not heard from it for 1.5 s (the default `allreduce_timeout_s`, 10 s, is not
    # reached), the process group is set aside and the next quorum leaves the host out.
    times = [(x["time"], x["step"]) for x in survivor]
    kill_gap = max(b - a for (a, s), (b, _) in zip(times, times[1:]) if t_kill <= b and s <= kill_back)
    cut_gap = max(b - a for (a, _), (b, _) in zip(times, times[1:]) if t_cut <= b)
    assert kill_gap < 3.0 + PACE_S, f"the survivor's longest gap after the kill: {kill_gap:.2f} s"
    assert cut_gap < 3.0 + PACE_S, f"the survivor's longest gap after the cut: {cut_gap:.2f} s"
    # The step in flight at the cut did not commit with h3 in it: h2's group trained it again (samples below).
    tries = {x["attempt"] for x in _lines(run_dir, "attempts")
             if x["pid"] == survivor[0]["pid"] and x["step"] == cut_step}
    assert len(tries) >= 2, f"step {cut_step}, in flight at the cut, was tried {len(tries)} time(s) on h2"

    # On h3, a process after the kill (and, after the cut, the cut-off one back in the quorum, healed in
    # place, until its Ray learns it was declared dead, and one Ray starts then): each holds h2's weights
    # after every step it committed, bit for bit.
    assert len({x["pid"] for x in lost}) >= 3  # the first, one after the kill, one after the cut
    at = {x["step"]: x["weights"] for x in survivor}
    # (the steps both trained: at the start either group may have joined the other's first quorum late)
    assert [x["step"] for x in lost if x["step"] in at and x["weights"] != at[x["step"]]] == [], \
        "h3's group drifted from h2's"

    # Data: each committed step trained exactly its samples of the run's order, split over its live groups.
    sampler = GlobalSampler(TokenWindows(tier.corpus, "train", 32).num_windows, 0, True)
    # (as their votes committed them: a group lost after the gradients were averaged trained its share of a
    # step the others commit, and never reached that step's end)
    committed = _committed_ids(run_dir, by_host)
    for step in range(1, STEPS + 1):
        want = sampler.window_ids((step - 1) * BATCH, BATCH)
        assert sorted(committed[step]) == sorted(int(i) for i in want), f"step {step}: a sample skipped or twice"

    # The losses of one process that lost nothing (the same global batch, accumulated).
    want = reference_losses(tier, raw, nproc=1)
    assert {r["step"]: r["loss"] for r in rows} == pytest.approx(want, rel=1e-5)


def _two_groups_paced(tier, steps: int):
    """A per-step run of two groups (h2, h3), paced until its `unpaced` file exists, 10 steps in on both:
    (run dir, driver, unpaced)."""
    name = f"ft-{tier.runs}"
    tier.runs += 1
    run_dir = tier.workdir() / name
    raw = run_raw(str(run_dir), data=str(tier.corpus), parallel={"engine": "ddp"},
                  scaling={"fault_tolerance": "per_step", "num_workers": 2, "cpus_per_worker": 1},
                  train={"steps": steps, "eval_every": 0, "global_batch_size": BATCH, "micro_batch_size": 4},
                  checkpoint={"every": 100, "keep": 2})
    unpaced = run_dir / "unpaced"
    driver = start_train(tier, write_yaml(tier.workdir(), name, raw), "--callback", "tests.ray.hooks:ReplicaLog",
                         "--callback", f"tests.ray.hooks:Pace(seconds={PACE_S}, until={str(unpaced)!r})")
    driver.wait_rows(run_dir, lambda rows: any(r["replicas"] == 2 and r["step"] > 10 for r in rows),
                     "10 steps on two groups", WAIT_S)
    return run_dir, driver, unpaced


AWAY_S = 50  # the "longer than Ray takes to declare it dead" (~10 s here): a crashed machine stays down


def test_a_host_away_past_its_death_gets_its_group_back_and_nobody_restarts(tier):
    """h3 killed and kept down for AWAY_S: Ray's controller asks for a group in its place at once (on a node not
    yet declared dead, then with no room anywhere), and that never turns into a restart of the worker group; the
    group on h2 trains on in one process from the fault to the end, and the run is at two groups again within
    20 s of h3's return (its Ray's start)."""
    run_dir, driver, unpaced = _two_groups_paced(tier, STEPS)
    h3 = tier.hosts["h3"]
    t_kill = time.time()
    h3.kill()
    driver.wait_line("raytrain: lost host h3", timeout=WAIT_S)
    # The fault's length is the scenario (not a synchronisation): the host stays down, its node declared dead.
    time.sleep(max(0.0, t_kill + AWAY_S - time.time()))
    assert driver.proc.poll() is None, driver.text()[-4000:]
    away_until = train_rows(run_dir)[-1]["step"]
    h3.start()
    t_back = time.time()
    tier.ray.start_worker("h3")
    driver.wait_rows(run_dir, lambda rows: any(r["replicas"] == 2 and r["step"] > away_until for r in rows),
                     "two groups after h3's return", WAIT_S)
    back = next(r for r in train_rows(run_dir) if r["replicas"] == 2 and r["step"] > away_until)
    assert back["step"] < STEPS - 20, "the pace did not last through the fault"
    unpaced.touch()
    code = driver.wait(WAIT_S)
    text = driver.text()
    assert code == 0, text[-5000:]
    lines = [x for x in console_lines(text) if x.startswith(("raytrain:", "step ", "resumed"))]
    told = "\n".join(lines)
    assert not [x for x in lines if "resumed from step" in x], told  # no restart of the worker group
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step once in metrics.jsonl"
    assert rows[-1]["replicas"] == 2, told
    survivor = [x for x in _lines(run_dir) if x["host"] == "h2"]
    assert len({x["pid"] for x in survivor}) == 1, "the group on h2 was restarted"
    # Full size again within 20 s of the host's return: from its Ray's start (the node's start time in Ray's
    # table), a group is placed there, starts, imports and heals. Before that, the boot's `ray start` (3 s on a
    # quiet machine, more beside another tier on the same two cores) is the host's own, said beside.
    probe = f"from tests.cluster.probe import node_started; node_started({tier.ray.address!r}, {h3.address!r})"
    started = float(tier.ray.python("h1", probe).stdout.split()[-1])
    back_s = back["time"] - started
    assert back_s <= 20.0, (f"two groups again {back_s:.1f} s after h3's Ray started "
                            f"({started - t_back:.1f} s after its boot)\n{told}")


def test_a_run_whose_lost_host_stays_away_ends_when_the_others_finish(tier):
    """h3 killed and not booted before the end: its group's replacement finds no room (Ray places a lost group's
    workers on its old bundles, which wait for a node); the group on h2 trains to the end alone and the run ends
    then, with no group started later that resumes it from a checkpoint."""
    run_dir, driver, unpaced = _two_groups_paced(tier, 300)
    h3 = tier.hosts["h3"]
    h3.kill()
    try:
        driver.wait_line("raytrain: lost host h3", timeout=WAIT_S)
        unpaced.touch()
        code = driver.wait(WAIT_S)
    finally:
        h3.start()
        tier.ray.start_worker("h3")
    text = driver.text()
    assert code == 0, text[-5000:]
    assert "resumed from step" not in text and "Traceback" not in text, text[-5000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 301)) and rows[-1]["replicas"] == 1
    assert len({x["pid"] for x in _lines(run_dir) if x["host"] == "h2"}) == 1, "the group on h2 was restarted"
