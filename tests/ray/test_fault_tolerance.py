"""Per-step fault tolerance (`scaling.fault_tolerance: per_step`, torchft replica groups on Ray Train): a worker
of one of three groups SIGKILLed inside a step; the others train on in the same processes, Ray replaces that
group alone, and it heals from a live group's memory. Later the records' writer (group 0) stalls past the
quorum's wait: the others train on and it heals in the same process. Every group holds the same weights after
every step it committed, every committed step trains its samples once, and the losses are those of a run that
lost nothing (a single process, the same global batch). The same with groups of two workers holding FSDP2
shards: the lost worker's group is replaced whole and each new worker heals its shards from the same rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raytrain_ext.cli import main
from tests.conftest import tiny_raw
from trainers.config import parse_config
from trainers.data.dataset import GlobalSampler, TokenWindows
from trainers.launch import run_local
from trainers.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.alone]  # a bound on the survivors' gap (3 s)

STEPS, KILL_STEP, GROUPS, BATCH = 300, 40, 3, 24
STALL_S = 2.5  # > the quorum's wait for a live group (1 s)
FT = {"fault_tolerance": "per_step", "num_workers": GROUPS, "cpus_per_worker": 0.5, "max_failures": 3}
TRAIN = {"steps": STEPS, "eval_every": 100, "global_batch_size": BATCH, "micro_batch_size": 4}


def _replica_lines(run_dir: Path, pattern: str = "group?.jsonl") -> dict:
    """ReplicaLog's lines by group (by (group, rank) with groups of several workers: pattern group*.jsonl)."""
    out: dict = {}
    for path in sorted((run_dir / "replicas").glob(pattern)):
        if path.name.endswith((".commits.jsonl", ".attempts.jsonl")):
            continue
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        out[lines[0]["group"] if pattern == "group?.jsonl" else (lines[0]["group"], lines[0]["rank"])] = lines
    return out


def _assert_each_sample_once(corpus_dir: Path, lines: dict, steps: int) -> None:
    """Each committed step trained exactly its samples of the run's order (ReplicaLog's ids of its workers)."""
    sampler = GlobalSampler(TokenWindows(corpus_dir, "train", 32).num_windows, 0, True)
    for step in range(1, steps + 1):
        ids = [i for worker in lines.values() for r in worker if r["step"] == step for i in r["ids"]]
        want = sampler.window_ids((step - 1) * BATCH, BATCH)
        assert sorted(ids) == sorted(int(i) for i in want), f"step {step}: a sample skipped or trained twice"


def _reference_losses(corpus_dir: Path, run_dir: Path, train: dict) -> dict[int, float]:
    """The losses of a run that lost nothing: one process, the same global batch (micro-batches accumulated)."""
    ref = parse_config(tiny_raw(corpus_dir, run_dir, train=train, checkpoint={"every": 0, "final": False}))
    run_local(ref, progress=False)
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", "train")}


def test_a_lost_replica_group_is_healed_while_the_others_train_on(ray_local, corpus_dir, tmp_path, capsys):
    run_dir = tmp_path / "ft"
    run = tmp_path / "ft.yaml"
    run.write_text(yaml.safe_dump(tiny_raw(corpus_dir, run_dir, parallel={"engine": "ddp"}, scaling=FT,
                                           train=TRAIN, checkpoint={"every": 50})))
    hook = f"tests.ray.hooks:ReplicaLog(kill_step={KILL_STEP}, kill_group=1)"
    # Once all three train again, the writer of the records (group 0) stalls past the quorum's wait: it
    # heals from a live group in the same process, and the records go on without it meanwhile.
    stall = f"tests.ray.hooks:StallOnce(group=0, step={KILL_STEP + 1}, seconds={STALL_S}, replicas={GROUPS})"
    assert main(["train", str(run), "--no-progress", "--callback", hook, "--callback", stall]) == 0
    out = capsys.readouterr()
    console = out.out + out.err  # the progress lines go to stderr

    # Each committed step once in the run's record, with the groups that trained it.
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {r["replicas"] for r in rows[KILL_STEP:KILL_STEP + 3]} == {GROUPS - 1}, "trained on without group 1"
    assert rows[-1]["replicas"] == GROUPS, "group 1 came back before the end"
    assert all(0 <= r["quorum_s"] < r["step_time_s"] for r in rows)

    lines = _replica_lines(run_dir)
    killed_pid = int((run_dir / "replicas" / "killed").read_text())
    stalled = int((run_dir / "replicas" / "stalled").read_text())
    for group in (0, 2):  # the survivors: the same processes from their first step to the last
        assert len({r["pid"] for r in lines[group]}) == 1, f"group {group} was restarted"
        steps = [r["step"] for r in lines[group]]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS
        # after the start's joins; group 0's own stall aside
        pairs = [(a, b) for a, b in zip(lines[group], lines[group][1:])
                 if a["step"] >= 5 and not (group == 0 and a["step"] == stalled)]
        gap = max(b["time"] - a["time"] for a, b in pairs)
        assert gap < 3.0, f"group {group}'s longest gap between committed steps: {gap:.2f} s"
    # Every group holds the same weights after each step it committed, bit for bit: those healed in a new
    # process (group 1) and in the same one (group 0, after its stall) alike.
    weights = {}
    for group in lines.values():
        for r in group:
            assert weights.setdefault(r["step"], r["weights"]) == r["weights"], f"step {r['step']}: weights differ"
    behind = [r["step"] for r in lines[0] if r["step"] > stalled][0]
    assert behind > stalled + 1, "group 0 sat out the steps of its stall"
    events = read_metrics(run_dir / "metrics.jsonl", "event")
    assert [(e["group"], e["step"]) for e in events if e["event"] == "healed" and e["group"] == 0
            and e["step"] > stalled] == [(0, behind - 1)], "group 0 healed once, in the quorum after its stall"
    old = [r for r in lines[1] if r["pid"] == killed_pid]
    new = [r for r in lines[1] if r["pid"] != killed_pid]
    assert old and old[-1]["step"] == KILL_STEP - 1, "group 1 died inside step KILL_STEP"
    assert new and len({r["pid"] for r in new}) == 1, "Ray started one process in its place"
    # Healed from memory: bit for bit the weights of a live group at its first step.
    first = new[0]
    peer = next(r for r in lines[0] if r["step"] == first["step"])
    assert first["weights"] == peer["weights"]
    (healed,) = [e for e in events if e["event"] == "healed" and e["group"] == 1 and e["step"] >= KILL_STEP]
    assert healed["from_group"] in (0, 2)
    assert "lost a replica group; the others train on: 3 -> 2 groups" in console
    assert "replica group 1 healed from group" in console

    # Data: each committed step trained exactly its samples of the run's order, split over the live groups
    # (the killed group's step in flight was trained again by the others, in the step's next attempt).
    _assert_each_sample_once(corpus_dir, lines, STEPS)

    # The losses of a run that lost nothing: one process, the same global batch (micro-batches accumulated).
    # Judged at rel 1e-5 (seen: 1.6e-6 at most over 300 steps): the groups' means are averaged in another order
    # than one process sums them, and those float differences grow a little over the steps; a skipped or
    # repeated sample moves a step's loss by ~1e-2.
    want = _reference_losses(corpus_dir, tmp_path / "reference", TRAIN)
    got = {r["step"]: r["loss"] for r in rows}
    assert got == pytest.approx(want, rel=1e-5)


def test_a_lost_worker_of_an_fsdp_replica_group_takes_its_group_which_heals_shard_by_shard(
    ray_local, corpus_dir, tmp_path, capsys
):
    """Two replica groups of two workers, each group the model's FSDP2 shards; group 1's first worker SIGKILLed
    inside step 40. Ray replaces group 1 whole (both workers), group 0's workers train on alone in the same
    processes, and each new worker takes its shards from group 0's worker of its rank."""
    steps, kill, run_dir = 120, 40, tmp_path / "fsdp"
    train = {**TRAIN, "steps": steps, "eval_every": 0, "micro_batch_size": 2}
    scaling = {**FT, "num_workers": 4, "workers_per_group": 2}
    run = tmp_path / "fsdp.yaml"
    run.write_text(yaml.safe_dump(tiny_raw(corpus_dir, run_dir, parallel={"engine": "fsdp"}, scaling=scaling,
                                           train=train, checkpoint={"every": 50})))
    hook = f"tests.ray.hooks:ReplicaLog(kill_step={kill}, kill_group=1)"
    assert main(["train", str(run), "--no-progress", "--callback", hook]) == 0
    out = capsys.readouterr()
    console = out.out + out.err

    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "each step once in metrics.jsonl"
    assert {r["replicas"] for r in rows[kill:kill + 3]} == {1}, "group 0 trained on without group 1"
    assert rows[-1]["replicas"] == 2 and rows[-1]["world_size"] == 4, "group 1 came back, both its workers"
    lines = _replica_lines(run_dir, "group*.jsonl")
    assert set(lines) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for rank in (0, 1):  # group 0: the same two processes throughout, no step skipped after the start's joins
        survivor = lines[(0, rank)]
        assert len({r["pid"] for r in survivor}) == 1, f"group 0's worker {rank} was restarted"
        steps_seen = [r["step"] for r in survivor]
        assert steps_seen == list(range(steps_seen[0], steps + 1))
        gap = max(b["time"] - a["time"] for a, b in zip(survivor, survivor[1:]) if a["step"] >= 5)
        assert gap < 3.0, f"group 0's worker {rank}: longest gap between committed steps {gap:.2f} s"
    killed_pid = int((run_dir / "replicas" / "killed").read_text())
    for rank in (0, 1):  # group 1: both workers replaced (the killed one and its peer), each healed from rank's peer
        old_pid, new_pid = dict.fromkeys(r["pid"] for r in lines[(1, rank)])
        assert rank or old_pid == killed_pid
        old = [r for r in lines[(1, rank)] if r["pid"] == old_pid]
        new = [r for r in lines[(1, rank)] if r["pid"] == new_pid]
        assert old[-1]["step"] == kill - 1 and new[0]["step"] > kill
    # Every worker holds the same shards as the worker of its rank in the other group after each step both
    # committed, bit for bit (group 1's new workers included: healed from memory).
    weights: dict = {}
    for (_, rank), group in lines.items():
        for r in group:
            assert weights.setdefault((rank, r["step"]), r["weights"]) == r["weights"], f"step {r['step']} rank {rank}"
    healed = [e for e in read_metrics(run_dir / "metrics.jsonl", "event") if e["event"] == "healed" and e["step"] >= kill]
    assert [(e["group"], e["from_group"]) for e in healed] == [(1, 0)], "group 1 healed once, told once"
    assert "lost a replica group; the others train on: 2 -> 1 groups" in console
    assert "replica group 1 healed from group 0" in console

    _assert_each_sample_once(corpus_dir, lines, steps)  # over the four workers, or group 0's two

    # Judged at rel 1e-4 (seen: 3.5e-5 at most over 120 steps, growing from 1e-7 at the first steps): FSDP
    # averages each shard's gradients over a group's two workers, and they over the groups, in another order
    # than one process sums its micro-batches; a skipped or repeated sample moves a step's loss by ~1e-2.
    want = _reference_losses(corpus_dir, tmp_path / "reference", train)
    got = {r["step"]: r["loss"] for r in rows}
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("final", [True, False], ids=["final-checkpoint", "no-final-checkpoint"])
def test_a_group_left_behind_by_the_others_end_records_no_step_twice(ray_local, corpus_dir, tmp_path, final):
    """Group 1 stalls after step 101 until the other two have finished the run's 120 steps: alone and behind,
    it goes on from the final checkpoint, or, with none after step 100, trains the last steps again (its rows
    replacing theirs). Each step once in metrics.jsonl, with one process's losses."""
    steps, run_dir = 120, tmp_path / "run"
    train = {**TRAIN, "steps": steps, "eval_every": 0}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(tiny_raw(corpus_dir, run_dir, parallel={"engine": "ddp"}, scaling=FT,
                                           train=train, checkpoint={"every": 50, "final": final})))
    stall = f"tests.ray.hooks:StallOnce(group=1, step=101, seconds=0, replicas={GROUPS}, until_recorded={steps})"
    assert main(["train", str(run), "--no-progress", "--callback", stall]) == 0
    stalled = int((run_dir / "replicas" / "stalled").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "each step once in metrics.jsonl"
    resumes = [e["step"] for e in read_metrics(run_dir / "metrics.jsonl", "event") if e["event"] == "resume"]
    if final:  # restored at the end: nothing trained again
        assert resumes == [steps]
    else:  # the steps after its own trained again, by it alone
        assert resumes == [] and {r["replicas"] for r in rows if r["step"] > stalled} == {1}

    want = _reference_losses(corpus_dir, tmp_path / "reference", train)
    assert {r["step"]: r["loss"] for r in rows} == pytest.approx(want, rel=1e-5)
