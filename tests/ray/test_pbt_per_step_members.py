"""PBT whose members are per-step fault-tolerant runs (`scaling.fault_tolerance: per_step`, two torchft replica
groups of one worker each per member), on one host: synchronous PBT, the weaker member exploits the stronger at
the first interval (the donor's checkpoint loaded by both of its groups at one step boundary), then group 1 of
each member's live run is killed inside a step after the exploit. Each member trains on with its group 0 in the
same process, Ray starts a group 1 in its place, which heals from group 0's memory (the exploit's values with
it); the groups hold the same weights after every step, the exploit is once in the lineage, the loss and the
return are in the trial's reports and the experiment's report (its console lines: the cluster test), and the
best member's replay lands on what it reported. The same across hosts, with a host killed: tests/cluster/test_pbt_replica_groups.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

from search.config import load_experiment, save
from search.driver import run_experiment
from search.lineage import read_events, read_reports
from tests.conftest import tiny_raw
from tests.ray.conftest import RUNTIME_ENV, local_ray
from trainers.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~2 min on 2 cores

INTERVAL, STEPS, KILL_STEP = 10, 60, 15
PACE_S = 0.5  # each step paced until both members have their group back: a replacement starts in seconds
# two groups: the global batch splits over one or two of them
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "tensorboard": False}


@pytest.fixture(scope="module")
def ray_ft():
    with local_ray(RUNTIME_ENV) as ray:
        yield ray


def _replica_lines(run_dir: Path) -> dict[int, list[dict]]:
    """ReplicaLog's line per committed step, by replica group."""
    out: dict[int, list[dict]] = {}
    for path in sorted((run_dir / "replicas").glob("group?.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        out[lines[0]["group"]] = lines
    return out


def _back(run_dir: Path) -> bool:
    """Group 1 was killed and a process in its place committed a step."""
    marker = run_dir / "replicas" / "killed"
    lines = _replica_lines(run_dir) if marker.exists() else {}
    return any(x["pid"] != int(marker.read_text()) for x in lines.get(1, ()))


def _unpace_once_back(exp_dir: Path, unpaced: Path, done: threading.Event) -> None:
    """Waits on the runs' own records (not on the pace): both members' group 1 back, then the pace ends."""
    while not done.wait(0.2):
        runs = list((exp_dir / "runs").glob("*/live-*"))
        if len(runs) == 2 and all(_back(r) for r in runs):
            unpaced.touch()
            return


def test_members_of_replica_groups_lose_a_group_after_an_exploit_and_no_survivor_restarts(
    ray_ft, corpus_dir, tmp_path
):
    base = tiny_raw(corpus_dir, tmp_path / "unused", optimizer={"name": "adamw", "lr": 1e-3}, train=TRAIN,
                    parallel={"engine": "ddp"}, scaling={"fault_tolerance": "per_step", "max_failures": -1})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    exp_yaml = tmp_path / "exp.yaml"
    exp_yaml.write_text(yaml.safe_dump({
        "name": "ft", "base": "base.yaml", "storage": str(tmp_path / "runs"),
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        "initial": [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        "scheduler": {"name": "pbt", "interval": INTERVAL, "burn_in": 0, "quantile_fraction": 0.5, "synch": True,
                      "resample_probability": 0.0},
        "population": 2, "budget": {"steps": STEPS}, "resources": {"workers": 2, "cpus_per_worker": 0.5},
        "callbacks": [f"tests.ray.hooks:ReplicaLog(kill_step={KILL_STEP}, kill_group=1)",
                      f"tests.ray.hooks:Pace(seconds={PACE_S}, until={str(tmp_path / 'unpaced')!r})"],
    }))
    exp = load_experiment(exp_yaml)
    save(exp)  # experiment.json, as `raytrain tune` writes it (report and replay read it)
    done = threading.Event()
    watcher = threading.Thread(target=_unpace_once_back, args=(exp.exp_dir, tmp_path / "unpaced", done))
    watcher.start()
    try:
        result = run_experiment(exp)
    finally:
        done.set()
        watcher.join()
    assert (tmp_path / "unpaced").exists(), "a member's group 1 did not come back within the paced steps"

    reports = [r for r in read_reports(exp.exp_dir) if not r.get("abandoned")]
    trials = sorted({r["trial"] for r in reports})
    assert len(trials) == 2
    for trial in trials:
        assert sorted(r["step"] for r in reports if r["trial"] == trial) == list(range(INTERVAL, STEPS + 1, INTERVAL))
    exploits = read_events(exp.exp_dir)
    strong = next(r["trial"] for r in reports if r["hparams"]["optimizer.lr"] == 1e-2 and r["step"] == INTERVAL)
    weak = next(t for t in trials if t != strong)
    assert (exploits[0]["trial"], exploits[0]["donor"], exploits[0]["step"]) == (weak, strong, INTERVAL)
    assert len({e["exploit_id"] for e in exploits}) == len(exploits), "each exploit once in the lineage"

    for trial in trials:
        (run_dir,) = [p for p in (exp.exp_dir / "runs" / trial).iterdir() if p.name.startswith("live-")]
        lines = _replica_lines(run_dir)
        survivor = lines[0]  # (the group that started later heals from the other: its first line is later)
        assert len({x["pid"] for x in survivor}) == 1, f"{trial}: its group 0 was restarted"
        steps = [x["step"] for x in survivor]
        assert steps == list(range(steps[0], STEPS + 1)), f"{trial}: group 0 trained each step once"
        killed = int((run_dir / "replicas" / "killed").read_text())
        assert killed in {x["pid"] for x in lines[1]} and len({x["pid"] for x in lines[1]}) == 2, trial
        # both groups hold the same weights after every step both committed: the exploit loaded by both,
        # the new group 1 healed from group 0 (with the exploit's learning rate)
        by_step = {x["step"]: x["weights"] for x in survivor}
        assert all(by_step[x["step"]] == x["weights"] for x in lines[1] if x["step"] in by_step), \
            f"{trial}: the groups' weights differ"
        rows = read_metrics(run_dir / "metrics.jsonl", "train")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step once in the run's record"
        assert any(r["replicas"] == 1 and r["step"] > KILL_STEP for r in rows) and rows[-1]["replicas"] == 2
        told = [line for r in reports if r["trial"] == trial for line in r["replica_events"] or ()]
        assert any("lost a replica group" in line for line in told), told
        assert any("a replica group is back" in line for line in told), told
    loaded = [(e["step"], e["donor"]) for t in trials for e in read_metrics(
        next((exp.exp_dir / "runs" / t).glob("live-*/metrics.jsonl")), "event") if e["event"] == "exploit"]
    assert sorted(loaded) == sorted((e["step"], e["donor"]) for e in exploits), "each exploit loaded once, in place"

    from search.replay import replay
    from search.report import write_report

    assert "replica groups lost and healed:" in write_report(exp.exp_dir).summary
    rep = replay(exp.exp_dir, result.best.trial)
    # The replay trains both groups throughout; the member lost one for a few steps, whose samples its other
    # group then trained alone (the same global batch, micro-batches summed in another order): float order only
    assert rep.replayed == pytest.approx(rep.reported, rel=1e-5)
