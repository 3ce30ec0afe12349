"""Chaos: kill a random process of a running `raytrain train` at random times; the run must end with the
losses of an uninterrupted run, bit for bit, each step once.

    python bench/chaos.py --data data/stdlib [--steps 100 --kills 10 --seed 0] [--out bench/results/chaos.json]
    python bench/chaos.py --data data/stdlib --steps 30 --kills 1 --targets controller     (one kind of kill)

The run (tiny-dense, ddp, 2 workers on the driver's own local Ray, fp32, a checkpoint every 10 steps) is
started as a user starts it. Before each kill the bench picks a target (in shuffled rounds of the three) and a step: a Ray Train worker
(Ray restarts the worker group), the Train controller (the driver starts the run again) or the driver
itself (SIGKILL: its reaper ends its Ray; the bench runs the same command again, as a user would). Each
kill is a SIGKILL of one process found by its Ray process title among the driver's descendants.

Per kill: `recovered` (an attempt resumed after it and trained a step), `recovery_s` (kill -> the first
step of that attempt, from the run's own records), `bit_equal` (every step trained between this kill and the next gave
the uninterrupted run's loss). The losses of every attempt, including the ones a kill cut short, come
from tests/ray/hooks.py:RecordSamples; `metrics.jsonl` keeps each step once (checked at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from run import environment  # noqa: E402

from trainers.metrics import read_metrics  # noqa: E402

TARGETS = ("worker", "controller", "driver")
TITLES = {"worker": "ray::RayTrainWorker", "controller": "ray::TrainController"}
EVERY = 10


def _command(data: str, run_dir: Path, steps: int, mode: str) -> list[str]:
    sets = [
        f"checkpoint.mode={mode}",
        f"data.path={data}",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        f"checkpoint.every={EVERY}",
        "checkpoint.keep=2",
        "train.eval_every=0",
        "train.micro_batch_size=8",
        "parallel.engine=ddp",
        "scaling.num_workers=2",
        "scaling.max_failures=-1",
        "train.tensorboard=false",
    ]
    cmd = [str(Path(sys.executable).parent / "raytrain"), "train", str(ROOT / "examples" / "tiny-dense.yaml")]
    return [
        *cmd,
        *(a for s in sets for a in ("--set", s)),
        "--no-progress",
        "--callback",
        "tests.ray.hooks:RecordSamples",
    ]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with log.open("a") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _steps_done(run_dir: Path) -> int:
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    return rows[-1]["step"] if rows else 0


def _wait(predicate, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def _session_alive(sid: int) -> bool:
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def _find(driver: subprocess.Popen, target: str) -> int | None:
    if target == "driver":
        return driver.pid
    try:
        for p in psutil.Process(driver.pid).children(recursive=True):
            cmdline = p.cmdline()
            if cmdline and cmdline[0].startswith(TITLES[target]):
                return p.pid
    except psutil.Error:
        return None
    return None


def _attempt_losses(run_dir: Path) -> list[dict[str, Any]]:
    """Rank 0's record of every step every attempt trained (killed attempts included), oldest first."""
    path = run_dir / "samples" / "rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _first_step_after_resume(run_dir: Path, since: float) -> float | None:
    """When the first step of the attempt that followed a kill at `since` was trained: the attempt begins
    with the Trainer's resume event, or its start event when the kill came before the first checkpoint (a
    step in flight at the kill may still finish after it)."""
    resumes = [
        e["time"]
        for e in read_metrics(run_dir / "metrics.jsonl", "event")
        if e["event"] in ("start", "resume") and e["time"] > since
    ]
    if not resumes:
        return None
    return min((r["time"] for r in _attempt_losses(run_dir) if r["time"] > resumes[0]), default=None)


def _reference(data: str, out: Path, steps: int, mode: str) -> dict[int, float]:
    run_dir = out / "reference"
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = _start(_command(data, run_dir, steps, mode), out / "reference.log")
    if proc.wait(timeout=1800) != 0:
        raise RuntimeError(f"the uninterrupted run failed: {out / 'reference.log'}")
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", "train")}


def chaos(data: str, out: Path, steps: int, kills: int, seed: int, mode: str = "async",
          targets: tuple[str, ...] = TARGETS) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    reference = _reference(data, out, steps, mode)
    run_dir, log, rng = out / "chaos", out / "chaos.log", random.Random(seed)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = _command(data, run_dir, steps, mode)
    driver, sessions, records = _start(cmd, log), [], []
    sessions.append(driver.pid)
    # Kill k lands in the k-th of `kills` equal stretches of the run, at a random step inside it, all before
    # the last checkpoint interval: a kill after the last step would leave the next attempt nothing to do.
    last = steps - EVERY
    bounds = [round(last * k / (kills + 1)) for k in range(1, kills + 2)]
    # Targets in shuffled rounds of all of them: any len(targets) kills in a row hit each target once.
    order = [t for _ in range(0, kills, len(targets)) for t in rng.sample(targets, len(targets))]
    try:
        for k in range(kills):
            target, at = order[k], rng.randint(bounds[k], max(bounds[k], bounds[k + 1] - 1))
            if not _wait(lambda at=at, d=driver: _steps_done(run_dir) >= at or d.poll() is not None, 900):
                raise RuntimeError(f"no progress to step {at}; see {log}")
            pid = _find(driver, target)
            if driver.poll() is not None or pid is None:
                raise RuntimeError(
                    f"kill {k}: the driver ended ({driver.returncode}) or no {target}; see {log}"
                )
            in_flight = any((run_dir / "checkpoints").glob("step_*.partial"))  # a write under way
            killed_at, t_kill = _steps_done(run_dir), time.time()
            os.kill(pid, signal.SIGKILL)
            if target == "driver":
                _wait(lambda d=driver: not _session_alive(d.pid), 60)
                driver = _start(cmd, log)  # the same command again
                sessions.append(driver.pid)
            recovered = _wait(lambda t=t_kill: _first_step_after_resume(run_dir, t) is not None, 600)
            first = _first_step_after_resume(run_dir, t_kill)
            records.append(
                {
                    "target": target,
                    "step": killed_at,
                    "recovered": recovered,
                    "recovery_s": round(first - t_kill, 2) if first else None,
                    "write_in_flight": in_flight,
                    "kill_time": t_kill,
                }
            )
            print(
                f"kill {k + 1}/{kills}: {target} at step {killed_at}: recovered in {records[-1]['recovery_s']} s",
                flush=True,
            )
        code = driver.wait(timeout=1800)
    finally:
        for sid in sessions:  # only the sessions this bench started
            if _session_alive(sid):
                os.killpg(sid, signal.SIGKILL)
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    attempts = _attempt_losses(run_dir)
    for k, rec in enumerate(records):
        until = records[k + 1]["kill_time"] if k + 1 < len(records) else float("inf")
        between = [r for r in attempts if rec["kill_time"] < r["time"] < until]
        rec["bit_equal"] = bool(between) and all(r["loss"] == reference[r["step"]] for r in between)
        rec["steps_checked"] = len(between)
    each_step_once = [r["step"] for r in rows] == list(range(1, steps + 1))
    final_equal = each_step_once and all(r["loss"] == reference[r["step"]] for r in rows)
    return {
        "kills": [{k: v for k, v in r.items() if k != "kill_time"} for r in records],
        "summary": {
            "kills": len(records),
            "recovered": sum(r["recovered"] for r in records),
            "bit_equal": sum(r["bit_equal"] for r in records),
            "each_step_once": each_step_once,
            "final_losses_bit_equal": final_equal,
            "final_exit_code": code,
            "recovery_s_median": sorted(r["recovery_s"] for r in records if r["recovery_s"])[
                len(records) // 2
            ]
            if records
            else None,
            "targets": {t: sum(r["target"] == t for r in records) for t in TARGETS},
            "checkpoint_mode": mode,
            "kills_during_a_write": sum(r["write_in_flight"] for r in records),
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-mode", default="async", choices=("async", "sync"))
    p.add_argument("--targets", default=",".join(TARGETS), help=f"what a kill may hit, of {','.join(TARGETS)}")
    p.add_argument("--work", default=str(ROOT / "bench" / "_work" / "chaos"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    args = p.parse_args(argv)
    env = environment(args)
    targets = tuple(t for t in args.targets.split(",") if t)
    if not targets or set(targets) - set(TARGETS):
        p.error(f"--targets {args.targets}: choose of {','.join(TARGETS)}")
    result = chaos(str(Path(args.data).resolve()), Path(args.work), args.steps, args.kills, args.seed,
                   args.checkpoint_mode, targets)
    result["environment"] = {**env, "loadavg_at_end": os.getloadavg()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
