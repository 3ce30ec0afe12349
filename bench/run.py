"""Trainer overhead vs a plain PyTorch loop, and activation checkpointing off vs every, on CPU.

    .venv/bin/python bench/run.py --data data/stdlib        (what `make bench` runs)

Each configuration runs in its own fresh process (bench/measure.py); a Trainer process and a plain-loop
process form a pair that runs in lockstep (step k of one, then step k of the other: measure.run_lockstep),
so that drift of the machine hits both; a pair's ratio is the median of its step-by-step ratios, and the
headline is the median of the pairs' ratios with their 10th-90th percentiles. Writes bench/results/trainer_overhead.{json,png} and prints a
table. When other processes used more than 10% of the CPUs during the run, the JSON is written with
`headline: null` and the reason, and the exit status is 1. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from measure import (
    WORK,
    machine_cpu,
    other_cpu_share,
    reference_config,
    run_fresh,
    run_lockstep,
    summarize_variant,
)
from measure import trainer_vs_plain as measure_trainer_vs_plain
from plot import NOISY, plot
from provenance import git_state

_cpu_seconds = machine_cpu  # the name bench/zero_memory.py imports

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MiB = 2**20
AC_MODES = ("off", "selective", "every")
TARGETS = {"overhead_ratio_max": 1.03, "ac_memory_cut_min": 2.0, "ac_time_ratio_max": 1.35}
# Above this share of the CPUs used by other processes during the run, no headline is written: on 2 cores
# another busy process stalls a 2-thread torch step (its OpenMP threads wait for each other) by up to 5x.
REFUSE_OTHER_CPU_SHARE = 0.10
HEADLINE_MEMORY = (
    "live_tensor_peak_bytes: the peak bytes of live tensor storages, the CPU counterpart of "
    "torch.cuda.max_memory_allocated (what the Trainer reports on GPU); it is exact and repeatable, while "
    "RSS also moves with glibc malloc's caching and fragmentation. rss_added_bytes is reported beside it."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib", help="prepared corpus (raytrain data prepare)")
    p.add_argument("--out", default=str(BENCH / "results"), help="folder for the JSON and PNG")
    p.add_argument("--repeats", "--pairs", type=int, default=8, help="trainer/plain pairs, alternated")
    p.add_argument("--batch", type=int, default=16, help="global = micro batch, trainer vs plain")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    p.add_argument("--measured", type=int, default=12, help="timed steps per run")
    p.add_argument("--ac-repeats", type=int, default=2, help="AC off/every pairs, alternated")
    p.add_argument("--ac-batch", type=int, default=32)
    p.add_argument("--ac-seq", type=int, default=256)
    p.add_argument("--ac-warmup", type=int, default=3)
    p.add_argument("--ac-measured", type=int, default=6)
    p.add_argument("--threads", type=int, default=0, help="torch threads in the runs (0 = torch's default)")
    p.add_argument(
        "--max-other-cpu",
        type=float,
        default=REFUSE_OTHER_CPU_SHARE,
        help="no headline when other processes used more than this share of the CPUs during the run",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------- sections


def trainer_vs_plain(args: argparse.Namespace) -> dict[str, Any]:
    shape = (args.batch, args.seq, args.warmup, args.measured)
    overhead = measure_trainer_vs_plain(args.data, args.repeats, shape, threads=args.threads)
    met = overhead["ratio_median"] <= TARGETS["overhead_ratio_max"]
    return dict(overhead, target_ratio_max=TARGETS["overhead_ratio_max"], met=met)


def activation_checkpointing(args: argparse.Namespace) -> dict[str, Any]:
    shape = (args.ac_batch, args.ac_seq, args.ac_warmup, args.ac_measured)
    runs = []
    for r in range(args.ac_repeats):
        specs = [dict(name=f"ac-trainer-{ac}-r{r}", variant="trainer", data=args.data, shape=shape, ac=ac,
                      threads=args.threads) for ac in ("off", "selective", "every")]
        group = run_lockstep(specs if r % 2 == 0 else specs[::-1])  # in lockstep; who goes first alternates
        runs += sorted(group, key=lambda run: AC_MODES.index(run["ac"]))
    return summarize_ac(runs)


def summarize_ac(runs: list[dict]) -> dict[str, Any]:
    off = summarize_variant([r for r in runs if r["ac"] == "off"])
    every = summarize_variant([r for r in runs if r["ac"] == "every"])
    selective = summarize_variant([r for r in runs if r["ac"] == "selective"])
    cut_live = off["live_tensor_peak_bytes"] / every["live_tensor_peak_bytes"]
    time_ratio = every["median_step_s"] / off["median_step_s"]
    pairs = zip([r for r in runs if r["ac"] == "every"], [r for r in runs if r["ac"] == "off"])
    per_pair = [statistics.median(a / b for a, b in zip(x["step_times_s"], y["step_times_s"])) for x, y in pairs]
    return {
        "off": off,
        "every": every,
        "selective": selective,
        # selective keeps the matmul and attention outputs: between off and every in memory and in time
        "selective_between": {
            "memory": every["live_tensor_peak_bytes"] < selective["live_tensor_peak_bytes"] < off["live_tensor_peak_bytes"],
            "time": off["median_step_s"] < selective["median_step_s"] < every["median_step_s"],
            "selective_time_ratio": selective["median_step_s"] / off["median_step_s"],
            "selective_memory_cut_live_tensors": off["live_tensor_peak_bytes"] / selective["live_tensor_peak_bytes"],
        },
        "memory_cut_live_tensors": cut_live,
        "memory_cut_rss_added": off["rss_added_bytes"] / every["rss_added_bytes"],
        "time_ratio": time_ratio,
        "time_ratio_min": every["min_step_s"] / off["min_step_s"],
        "time_ratio_cpu_time": every["median_step_cpu_s"] / off["median_step_cpu_s"],
        "per_pair_time_ratios": per_pair,
        "target_memory_cut_min": TARGETS["ac_memory_cut_min"],
        "target_time_ratio_max": TARGETS["ac_time_ratio_max"],
        "memory_met": cut_live >= TARGETS["ac_memory_cut_min"],
        "time_met": time_ratio <= TARGETS["ac_time_ratio_max"],
        "runs": runs,
    }


def run_fixed_mmap_threshold(args: argparse.Namespace) -> dict[str, Any]:
    """RSS of AC off/every with glibc's mmap threshold fixed at 1 MiB (the Trainer otherwise fixes it at
    32 MiB and keeps freed heap, trainers/host_memory.py): shows how much of the RSS gap is the allocator."""
    shape, env = (args.ac_batch, args.ac_seq, 1, 1), {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
    runs = [
        run_fresh(f"mmap-trainer-{ac}", "trainer", args.data, shape, ac=ac, threads=args.threads, env=env)
        for ac in ("off", "every")
    ]
    off, every = (r["rss_added_bytes"] for r in runs)
    return {
        "env": env,
        "rss_added_bytes": {"off": off, "every": every},
        "memory_cut_rss_added": off / every,
        "runs": runs,
    }


# ---------------------------------------------------------------------------------------- headline


def headline(result: dict[str, Any], max_other: float) -> tuple[dict[str, Any] | None, str | None]:
    """(the headline, None), or (None, why there is none): other processes took too much of the CPUs."""
    other = result["other_processes_cpu_share"]
    if other > max_other:
        return None, (
            f"other processes used {other:.0%} of the CPUs during the run (limit {max_other:.0%}; load average "
            f"{result['loadavg_at_start'][0]:.2f} before, {result['loadavg_at_end'][0]:.2f} after)"
        )
    o, ac = result["overhead"], result["activation_checkpointing"]
    return {
        "trainer_over_plain_median": o["ratio_median"],
        "trainer_over_plain_p10": o["ratio_p10"],
        "trainer_over_plain_p90": o["ratio_p90"],
        "pairs": len(o["per_pair_ratios"]),
        "ac_every_time_ratio": ac["time_ratio"],
        "ac_every_memory_cut_live_tensors": ac["memory_cut_live_tensors"],
        "other_processes_cpu_share": other,
        "torch_threads": o["runs"][0]["torch_threads"],
    }, None


# ------------------------------------------------------------------------------------------- output


def environment(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **git_state(),
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
        ("", "median step s", "page faults/step", "peak live MiB", "peak RSS added MiB"),
        ("plain loop", *_cells(overhead["plain"])),
        ("Trainer", *_cells(overhead["trainer"])),
        ("Trainer, AC off", *_cells(ac["off"])),
        ("Trainer, AC selective", *_cells(ac["selective"])),
        ("Trainer, AC every", *_cells(ac["every"])),
    ]
    for row in rows:
        print(f"{row[0]:<20}" + "".join(f"{c:>20}" for c in row[1:]))
    ok = {True: "met", False: "NOT met"}
    per_pair = ", ".join(f"{r:.3f}" for r in overhead["per_pair_ratios"])
    print(
        f"\nTrainer / plain step time: median of {len(overhead['per_pair_ratios'])} pairs "
        f"{overhead['ratio_median']:.3f} (p10-p90 {overhead['ratio_p10']:.3f}-{overhead['ratio_p90']:.3f}; "
        f"target <= {TARGETS['overhead_ratio_max']}: {ok[overhead['met']]}); per pair {per_pair}; pooled "
        f"{overhead['ratio']:.3f}; of min step times {overhead['ratio_min']:.3f}; of process CPU times "
        f"{overhead['ratio_cpu_time']:.3f}"
    )
    print(
        f"AC every vs off: peak live tensors / {ac['memory_cut_live_tensors']:.2f} (target >= 2: "
        f"{ok[ac['memory_met']]}), peak RSS added / {ac['memory_cut_rss_added']:.2f}, "
        f"step time x {ac['time_ratio']:.3f} (target <= {TARGETS['ac_time_ratio_max']}: {ok[ac['time_met']]}; "
        f"of min step times x {ac['time_ratio_min']:.3f}; of process CPU times x {ac['time_ratio_cpu_time']:.3f})"
    )
    sel = ac["selective_between"]
    print(
        f"AC selective vs off: peak live tensors / {sel['selective_memory_cut_live_tensors']:.2f}, step time x "
        f"{sel['selective_time_ratio']:.3f}; between off and every in memory: {sel['memory']}, in time: {sel['time']}"
    )
    fixed = ac["rss_with_fixed_mmap_threshold"]["memory_cut_rss_added"]
    print(f"  diagnostic, MALLOC_MMAP_THRESHOLD_=1MiB: peak RSS added / {fixed:.2f}")
    busiest = result["max_other_processes_cpu_share"]
    print(
        f"other processes' CPU share: {result['other_processes_cpu_share']:.1%} over the run, up to "
        f"{busiest:.0%} in one configuration; load average {result['loadavg_at_start'][0]:.2f} before, "
        f"{result['loadavg_at_end'][0]:.2f} after" + (" (NOISY)" if busiest > NOISY else "")
    )


def _cells(s: dict) -> tuple[str, str, str, str]:
    return (
        f"{s['median_step_s']:.3f}",
        f"{s['mean_minor_faults']:.0f}",
        f"{s['live_tensor_peak_bytes'] / MiB:.0f}",
        f"{s['rss_added_bytes'] / MiB:.0f}",
    )


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    start, env, cpu_before = time.perf_counter(), environment(args), machine_cpu()
    print(f"1. Trainer vs plain loop ({args.repeats} pairs, alternated)")
    overhead = trainer_vs_plain(args)
    print(f"2. Activation checkpointing off, selective, every ({args.ac_repeats} lockstep groups)")
    ac = activation_checkpointing(args)
    print("3. Diagnostic: AC off vs every with glibc's mmap threshold fixed (memory only)")
    ac["rss_with_fixed_mmap_threshold"] = run_fixed_mmap_threshold(args)
    config = reference_config(args.data, args.batch, args.seq, 1 + args.warmup + args.measured, "off", "-")
    timed = overhead["runs"] + ac["runs"]
    result = dict(
        env,
        loadavg_at_end=os.getloadavg(),
        other_processes_cpu_share=other_cpu_share(cpu_before, machine_cpu()),
        max_other_processes_cpu_share=max(r["other_processes_cpu_share"] for r in timed),
        reference_config=json.loads(config.model_dump_json()),
        overhead=overhead,
        activation_checkpointing=ac,
        wall_s=time.perf_counter() - start,
    )
    result["headline"], result["headline_refused"] = headline(result, args.max_other_cpu)
    return result


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
    out = out_dir / "trainer_overhead.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print_table(result)
    if result["headline"] is None:
        sys.exit(
            f"\nno headline: {result['headline_refused']}; wrote {out} with headline null; re-run when quiet"
        )
    plot(result, out_dir / "trainer_overhead.png")
    h = result["headline"]
    print(
        f"\nheadline: Trainer / plain {h['trainer_over_plain_median']:.3f} (p10-p90 "
        f"{h['trainer_over_plain_p10']:.3f}-{h['trainer_over_plain_p90']:.3f}, {h['pairs']} pairs); "
        f"wrote {out} and .png in {result['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
