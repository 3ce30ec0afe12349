"""Trainer overhead vs a plain PyTorch loop, and activation checkpointing off vs every, on CPU.

    .venv/bin/python bench/run.py --data data/stdlib        (what `make bench` runs)

Each configuration runs in its own fresh process (bench/measure.py); variants alternate A B A B ...
so that drift of the machine hits both. Writes bench/results/trainer_overhead.{json,png} and prints a
table. See bench/README.md for what is measured and why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from measure import reference_config
from plot import NOISY, plot

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
WORK = BENCH / "_work"
MiB = 2**20
TARGETS = {"overhead_ratio_max": 1.05, "ac_memory_cut_min": 2.0, "ac_time_ratio_max": 1.4}
SAME_LOSS_STEPS, SAME_LOSS_RTOL = 5, 1e-6
HEADLINE_MEMORY = (
    "live_tensor_peak_bytes: the peak bytes of live tensor storages, the CPU counterpart of "
    "torch.cuda.max_memory_allocated (what the Trainer reports on GPU); it is exact and repeatable, while "
    "RSS also moves with glibc malloc's caching and fragmentation. rss_added_bytes is reported beside it."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib", help="prepared corpus (raytrain data prepare)")
    p.add_argument("--out", default=str(BENCH / "results"), help="folder for the JSON and PNG")
    p.add_argument("--repeats", type=int, default=3, help="trainer/plain pairs, alternated")
    p.add_argument("--batch", type=int, default=16, help="global = micro batch, trainer vs plain")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    p.add_argument("--measured", type=int, default=30, help="timed steps per run")
    p.add_argument("--ac-repeats", type=int, default=2, help="AC off/every pairs, alternated")
    p.add_argument("--ac-batch", type=int, default=32)
    p.add_argument("--ac-seq", type=int, default=256)
    p.add_argument("--ac-warmup", type=int, default=4)
    p.add_argument("--ac-measured", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads in the runs (0 = torch's default)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- running


def run_one(
    args: argparse.Namespace,
    name: str,
    variant: str,
    ac: str,
    shape: tuple[int, ...],
    env: dict | None = None,
) -> dict[str, Any]:
    """One configuration in a fresh process (with `env` added to its environment); its measurements."""
    batch, seq, warmup, measured = shape
    run_dir, out, log = WORK / name, WORK / f"{name}.json", WORK / f"{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(BENCH / "measure.py"), "--variant", variant, "--ac", ac, "--data", args.data]
    cmd += ["--batch", str(batch), "--seq", str(seq), "--warmup", str(warmup), "--measured", str(measured)]
    cmd += ["--run-dir", str(run_dir), "--out", str(out), "--threads", str(args.threads)]
    print(f"  {name}: {variant}, ac={ac}, batch {batch} x seq {seq} ...", end=" ", flush=True)
    cpu_before = _cpu_seconds()
    with log.open("w") as err:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=err, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    busy, total, ours = (b - a for a, b in zip(cpu_before, _cpu_seconds()))
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); log {log}:\n{tail}")
    result = json.loads(out.read_text())
    other = max(busy - ours, 0.0) / total  # share of all cores that other processes used meanwhile
    print(f"median step {statistics.median(result['step_times_s']):.3f} s, other processes' CPU {other:.0%}")
    return dict(result, name=name, warmup=warmup, measured=measured, other_processes_cpu_share=other)


def _cpu_seconds() -> tuple[float, float, float]:
    """(busy, total) CPU seconds of the machine since boot (/proc/stat), and our children's CPU seconds."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    total = user + nice + system + idle + iowait + irq + softirq + steal
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (total - idle - iowait) / tick, total / tick, children.ru_utime + children.ru_stime


def run_alternating(args, label: str, pairs: list[tuple[str, str]], repeats: int, shape) -> list[dict]:
    runs = []
    for r in range(repeats):
        for variant, ac in pairs:
            runs.append(run_one(args, f"{label}-{variant}-{ac}-r{r}", variant, ac, shape))
    return runs


# ----------------------------------------------------------------------------------------- summaries


def pooled_median(runs: list[dict], key: str = "step_times_s") -> float:
    return statistics.median(t for r in runs for t in r[key])


def check_same_math(trainer_runs: list[dict], plain_runs: list[dict]) -> dict[str, Any]:
    """The first losses of both must agree to 1e-6 relative, or the comparison is not like with like."""
    worst_first = worst_all = 0.0
    for a, b in zip(trainer_runs, plain_runs):
        rel = [abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"])]
        worst_first, worst_all = max(worst_first, *rel[:SAME_LOSS_STEPS]), max(worst_all, *rel)
    if worst_first > SAME_LOSS_RTOL:
        raise AssertionError(
            f"trainer and plain loop differ by {worst_first:.2e} (relative) in their first "
            f"{SAME_LOSS_STEPS} losses; they must do the same math (<= {SAME_LOSS_RTOL:g})"
        )
    return {
        "steps_checked": SAME_LOSS_STEPS,
        "rtol": SAME_LOSS_RTOL,
        "max_rel_diff_first": worst_first,
        "max_rel_diff_all_steps": worst_all,
    }


def summarize_variant(runs: list[dict]) -> dict[str, Any]:
    return {
        "median_step_s": pooled_median(runs),
        "median_step_cpu_s": pooled_median(runs, "step_cpu_times_s"),
        "min_step_s": min(t for r in runs for t in r["step_times_s"]),  # other load only adds time
        "per_repeat_median_step_s": [statistics.median(r["step_times_s"]) for r in runs],
        "rss_added_bytes": statistics.median(r["rss_added_bytes"] for r in runs),
        "live_tensor_peak_bytes": statistics.median(r["live_tensor_peak_bytes"] for r in runs),
        "live_tensor_start_bytes": statistics.median(r["live_tensor_start_bytes"] for r in runs),
    }


def summarize_overhead(runs: list[dict]) -> dict[str, Any]:
    trainer = [r for r in runs if r["variant"] == "trainer"]
    plain = [r for r in runs if r["variant"] == "plain"]
    t, p = summarize_variant(trainer), summarize_variant(plain)
    ratio = t["median_step_s"] / p["median_step_s"]
    return {
        "same_math": check_same_math(trainer, plain),
        "trainer": t,
        "plain": p,
        "ratio": ratio,
        "ratio_cpu_time": t["median_step_cpu_s"] / p["median_step_cpu_s"],
        "ratio_min": t["min_step_s"] / p["min_step_s"],
        "per_repeat_ratio": [
            a / b for a, b in zip(t["per_repeat_median_step_s"], p["per_repeat_median_step_s"])
        ],
        "target_ratio_max": TARGETS["overhead_ratio_max"],
        "met": ratio <= TARGETS["overhead_ratio_max"],
        "runs": runs,
    }


def run_fixed_mmap_threshold(args: argparse.Namespace) -> dict[str, Any]:
    """RSS of AC off/every with glibc's mmap threshold fixed at 1 MiB (its default adapts upwards, after
    which freed activation buffers stay in the heap): shows how much of the RSS gap is the allocator."""
    shape, env = (args.ac_batch, args.ac_seq, 1, 1), {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
    runs = [run_one(args, f"mmap-trainer-{ac}", "trainer", ac, shape, env) for ac in ("off", "every")]
    off, every = (r["rss_added_bytes"] for r in runs)
    return {
        "env": env,
        "rss_added_bytes": {"off": off, "every": every},
        "memory_cut_rss_added": off / every,
        "runs": runs,
    }


def summarize_ac(runs: list[dict]) -> dict[str, Any]:
    off = summarize_variant([r for r in runs if r["ac"] == "off"])
    every = summarize_variant([r for r in runs if r["ac"] == "every"])
    cut_live = off["live_tensor_peak_bytes"] / every["live_tensor_peak_bytes"]
    time_ratio = every["median_step_s"] / off["median_step_s"]
    return {
        "off": off,
        "every": every,
        "memory_cut_live_tensors": cut_live,
        "memory_cut_rss_added": off["rss_added_bytes"] / every["rss_added_bytes"],
        "time_ratio": time_ratio,
        "time_ratio_min": every["min_step_s"] / off["min_step_s"],
        "target_memory_cut_min": TARGETS["ac_memory_cut_min"],
        "target_time_ratio_max": TARGETS["ac_time_ratio_max"],
        "memory_met": cut_live >= TARGETS["ac_memory_cut_min"],
        "time_met": time_ratio <= TARGETS["ac_time_ratio_max"],
        "runs": runs,
    }


# ------------------------------------------------------------------------------------------- output


def environment(args: argparse.Namespace) -> dict[str, Any]:
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    return {
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": bool(dirty),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": os.getloadavg(),
        "settings": vars(args),
        "targets": TARGETS,
        "headline_memory": HEADLINE_MEMORY,
    }


def print_table(result: dict[str, Any]) -> None:
    overhead, ac = result["overhead"], result["activation_checkpointing"]
    rows = [
        ("", "median step s", "peak live MiB", "peak RSS added MiB"),
        ("plain loop", *_cells(overhead["plain"])),
        ("Trainer", *_cells(overhead["trainer"])),
        ("Trainer, AC off", *_cells(ac["off"])),
        ("Trainer, AC every", *_cells(ac["every"])),
    ]
    for row in rows:
        print(f"{row[0]:<20}" + "".join(f"{c:>20}" for c in row[1:]))
    ok = {True: "met", False: "NOT met"}
    per_repeat = ", ".join(f"{r:.3f}" for r in overhead["per_repeat_ratio"])
    print(
        f"\nTrainer / plain step time: {overhead['ratio']:.3f} (target <= 1.05: {ok[overhead['met']]}); "
        f"per repeat {per_repeat}; of min step times {overhead['ratio_min']:.3f}; of process CPU times "
        f"{overhead['ratio_cpu_time']:.3f}"
    )
    print(
        f"AC every vs off: peak live tensors / {ac['memory_cut_live_tensors']:.2f} (target >= 2: "
        f"{ok[ac['memory_met']]}), peak RSS added / {ac['memory_cut_rss_added']:.2f}, "
        f"step time x {ac['time_ratio']:.3f} (target <= 1.4: {ok[ac['time_met']]}; of min step times "
        f"x {ac['time_ratio_min']:.3f})"
    )
    fixed = ac["rss_with_fixed_mmap_threshold"]["memory_cut_rss_added"]
    print(f"  diagnostic, MALLOC_MMAP_THRESHOLD_=1MiB: peak RSS added / {fixed:.2f}")
    busiest = result["max_other_processes_cpu_share"]
    if busiest > NOISY:
        print(
            f"NOISY: other processes used up to {busiest:.0%} of the CPUs during a run; re-run on a quiet machine"
        )


def _cells(s: dict) -> tuple[str, str, str]:
    return (
        f"{s['median_step_s']:.3f}",
        f"{s['live_tensor_peak_bytes'] / MiB:.0f}",
        f"{s['rss_added_bytes'] / MiB:.0f}",
    )


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    start, env = time.perf_counter(), environment(args)
    print(f"1. Trainer vs plain loop ({args.repeats} repeats, alternated)")
    shape = (args.batch, args.seq, args.warmup, args.measured)
    pairs = [("trainer", "off"), ("plain", "off")]
    overhead = summarize_overhead(run_alternating(args, "overhead", pairs, args.repeats, shape))
    print(f"2. Activation checkpointing off vs every ({args.ac_repeats} repeats, alternated)")
    shape = (args.ac_batch, args.ac_seq, args.ac_warmup, args.ac_measured)
    pairs = [("trainer", "off"), ("trainer", "every")]
    ac = summarize_ac(run_alternating(args, "ac", pairs, args.ac_repeats, shape))
    print("3. Diagnostic: AC off vs every with glibc's mmap threshold fixed (memory only)")
    ac["rss_with_fixed_mmap_threshold"] = run_fixed_mmap_threshold(args)
    config = reference_config(args.data, args.batch, args.seq, 1 + args.warmup + args.measured, "off", "-")
    timed = overhead["runs"] + ac["runs"]
    return dict(
        env,
        reference_config=json.loads(config.model_dump_json()),
        overhead=overhead,
        activation_checkpointing=ac,
        max_other_processes_cpu_share=max(r["other_processes_cpu_share"] for r in timed),
        wall_s=time.perf_counter() - start,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not (Path(args.data) / "manifest.json").is_file():
        sys.exit(
            f"no prepared data at {args.data}; fix: make (or raytrain data prepare --output {args.data})"
        )
    WORK.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = measure_all(args)
    (out_dir / "trainer_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out_dir / "trainer_overhead.png")
    print()
    print_table(result)
    print(f"\nwrote {out_dir / 'trainer_overhead.json'} and .png in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
