"""Ray Train runs vs torchrun: per-step overhead, start-up, and recovery time after a worker is SIGKILLed.

    python bench/ray_recovery.py --data data/stdlib [--repeats 2] [--out bench/results/ray_recovery.json]

Every run is `raytrain train` (or torchrun) in a fresh process, exactly as a user starts it, on the
same 2-worker FSDP config (examples/tiny-fsdp.yaml, shortened). Times come from the run's own
metrics.jsonl (`time` of each record; `step_time_s` of each step):
- step time: median `step_time_s` over the steps after the first 5, Ray vs torchrun;
- wall per step: (time of the last step - time of step 5) / (steps - 5), checkpoints and Ray's report
  barrier included;
- start-up: from launching the command to the first step's record;
- recovery: the bench SIGKILLs rank 1's process at step KILL_AT (the worker writes its pid and waits,
  tests/ray/hooks.py:KillMeAtStep) and measures to the resumed attempt's `resume` event (failure
  detected, worker group restarted, checkpoint loaded) and to its first completed step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from run import environment  # noqa: E402

from trainers.metrics import read_metrics  # noqa: E402

STEPS, EVERY, KILL_AT, SKIP = 40, 10, 15, 5
BIN = Path(sys.executable).parent


def _overrides(data: str, run_dir: Path) -> list[str]:
    sets = [f"data.path={data}", f"run_dir={run_dir}", f"train.steps={STEPS}", f"checkpoint.every={EVERY}",
            "train.eval_every=0", "schedule.warmup_steps=5", "scaling.num_workers=2", "scaling.max_failures=2",
            "train.tensorboard=false"]
    return [a for s in sets for a in ("--set", s)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _launch(kind: str, run_dir: Path, data: str, callbacks: list[str] = ()) -> subprocess.Popen:
    shutil.rmtree(run_dir, ignore_errors=True)
    example = str(ROOT / "examples" / "tiny-fsdp.yaml")
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "trainers", "train", example]
    else:
        cmd = [str(BIN / "raytrain"), "train", example]
    cmd += [*_overrides(data, run_dir), "--no-progress"]
    for cb in callbacks:
        cmd += ["--callback", cb]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, run_dir: Path) -> None:
    if proc.wait(timeout=900) != 0:
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
        raise RuntimeError(f"{run_dir.name} failed:\n{tail}")


def _timings(run_dir: Path, launched: float) -> dict[str, float]:
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step once"
    later = rows[SKIP:]
    return {
        "median_step_s": statistics.median(r["step_time_s"] for r in later),
        "wall_per_step_s": (rows[-1]["time"] - rows[SKIP - 1]["time"]) / (STEPS - SKIP),
        "startup_s": rows[0]["time"] - launched,
        "final_loss": rows[-1]["loss"],
    }


def overhead(data: str, work: Path, repeats: int) -> dict[str, Any]:
    """torchrun and Ray alternate (t, r, t, r, ...) so that a change in machine load hits both alike."""
    runs: dict[str, list[dict[str, float]]] = {"torchrun": [], "ray": []}
    for i in range(repeats):
        for kind in ("torchrun", "ray"):
            run_dir = work / f"overhead-{kind}-{i}"
            launched = time.time()
            _wait(_launch(kind, run_dir, data), run_dir)
            runs[kind].append(_timings(run_dir, launched))
    med = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}
    return {
        "runs": runs,
        "median": med,
        "step_time_ratio": med["ray"]["median_step_s"] / med["torchrun"]["median_step_s"],
        "step_time_ratio_per_pair": [r["median_step_s"] / t["median_step_s"] for t, r in zip(*runs.values())],
        "wall_per_step_ratio": med["ray"]["wall_per_step_s"] / med["torchrun"]["wall_per_step_s"],
        "same_final_loss": all(r["final_loss"] == t["final_loss"] for t, r in zip(*runs.values())),
    }


def recovery(data: str, work: Path, index: int) -> dict[str, Any]:
    run_dir = work / f"recovery-{index}"
    proc = _launch("ray", run_dir, data, [f"tests.ray.hooks:KillMeAtStep(step={KILL_AT}, rank=1)"])
    pid_file = run_dir / "pids" / "rank1"
    deadline = time.monotonic() + 600
    while not pid_file.exists():  # the worker writes it once it has finished step KILL_AT
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rank 1 never reached step {KILL_AT}")
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    killed = time.time()
    _wait(proc, run_dir)
    events = read_metrics(run_dir / "metrics.jsonl", "event")
    (resume,) = [e for e in events if e["event"] == "resume"]
    first = next(r for r in read_metrics(run_dir / "metrics.jsonl", "train") if r["step"] == resume["step"] + 1)
    return {
        "killed_at_step": KILL_AT,
        "resumed_from_step": resume["step"],
        "steps_recomputed": KILL_AT - resume["step"],
        "to_resume_event_s": resume["time"] - killed,
        "to_first_resumed_step_s": first["time"] - killed,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--repeats", type=int, default=3, help="overhead pairs and recoveries")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "ray_recovery.json"))
    parser.add_argument("--work", default=str(ROOT / "bench" / "_work" / "ray"))
    args = parser.parse_args(argv)
    args.data = str(Path(args.data).resolve())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = environment(args)
    result.pop("headline_memory", None)
    result["targets"] = {}
    result["what"] = __doc__
    started = time.perf_counter()
    result["overhead"] = overhead(args.data, work, args.repeats)
    result["recovery"] = [recovery(args.data, work, i) for i in range(args.repeats)]
    result["recovery_median_s"] = statistics.median(r["to_first_resumed_step_s"] for r in result["recovery"])
    result["loadavg_at_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    o = result["overhead"]
    print(f"step time ray/torchrun: {o['step_time_ratio']:.3f} (wall per step {o['wall_per_step_ratio']:.3f}); "
          f"start-up ray {o['median']['ray']['startup_s']:.1f}s vs torchrun {o['median']['torchrun']['startup_s']:.1f}s")
    for r in result["recovery"]:
        print(f"SIGKILL at step {r['killed_at_step']} -> resume event {r['to_resume_event_s']:.1f}s, "
              f"first resumed step {r['to_first_resumed_step_s']:.1f}s ({r['steps_recomputed']} steps recomputed)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
