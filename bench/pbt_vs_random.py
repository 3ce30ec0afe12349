"""PBT (population 4) vs random search with the same total training steps, on the tiny model and the
standard-library corpus; and the time a trial spends outside training steps, live runs vs segments.

    .venv/bin/python bench/pbt_vs_random.py --data data/stdlib [--seeds 3] [--steps 240] [--interval 30]
        [--burn-in 60] [--quantile 0.5] [--no-overhead] [--summarize-only]

Both searches start from the same 4 sampled configurations per seed (the experiment seed draws them), so
PBT differs from random search only by exploit and explore. PBT is synchronous: the population is ranked
at the same step (asynchronously, a trial that lags after a restart looks worse only for being behind).
The base run uses a constant learning rate: any annealing is what PBT finds. PBT's first exploit waits
for a quarter of the budget (`--burn-in 60`): without it, the member with the smallest learning rate
looks worst at step 30 and is replaced, though it would have been the best at step 240 (seed 1 in
`bench/results/pbt_vs_random_burnin0.json`: PBT 2.218 vs random 2.135), the short-horizon greediness the
PBT literature warns about. The time outside training steps is measured on seed 0 with asynchronous PBT
(where a trial is stopped only when exploited), for live runs and for segments. Each trial is a Ray Train
run of 2 workers (DDP); the 4 trials share the machine's cores (cpus_per_worker 0.25). Writes
bench/results/pbt_vs_random.{json,png}; `--summarize-only` rewrites them from the experiments left in
--work without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.provenance import provenance  # noqa: E402

RESULTS, WORK = ROOT / "bench" / "results", ROOT / "bench" / "_work" / "pbt"


def _experiment(
    args: argparse.Namespace, name: str, seed: int, scheduler: str, runs: str, synch: bool = True
):
    from search.config import load_experiment

    sched = (
        f"{{name: pbt, interval: {args.interval}, burn_in: {args.burn_in}, quantile_fraction: {args.quantile}, "
        f"synch: {str(synch).lower()}}}"
        if scheduler == "pbt"
        else f"{{name: random, interval: {args.interval}}}"
    )
    return load_experiment(
        ROOT / "examples" / "pbt-demo.yaml",
        [
            f"name={name}",
            f"seed={seed}",
            f"storage={args.work}",
            f"scheduler={sched}",
            f"budget={{steps: {args.steps}}}",
            f"trial_runs={runs}",
            f"resources={{workers: {args.workers}, cpus_per_worker: {2 / (4 * args.workers)}}}",
            f"overrides={{data.path: {args.data}, parallel.engine: ddp, train.micro_batch_size: "
            f"{16 // args.workers}, train.eval_batches: 4, train.tensorboard: false, schedule.name: constant}}",
        ],
    )


def _run(exp) -> dict[str, Any]:
    from search.config import save
    from search.driver import run_experiment

    shutil.rmtree(exp.exp_dir, ignore_errors=True)
    save(exp)
    t = time.time()
    run_experiment(exp, verbose=0)
    return _summary(exp.name, exp.exp_dir, time.time() - t)


def _summary(name: str, exp_dir: Path, wall: float) -> dict[str, Any]:
    from search.lineage import best_trial, collect, latest_reports
    from search.report import outside_steps_fraction

    reports, events = collect(exp_dir)
    last = latest_reports(reports)
    trained = [r for r in reports if not r["failed"]]
    # per report: the seconds outside training steps (the median is a report inside a running Train run;
    # the largest ones include starting a worker group, after the trial's start or an exploit)
    outside = sorted(r["wall_s"] - r["steps_s"] for r in trained)
    return {
        "name": name,
        "best_val_loss": best_trial(reports, "min")[1]["metric"],
        "final_val_loss": sorted(r["metric"] for r in last.values()),
        "exploits": len(events),
        "outside_steps_fraction": outside_steps_fraction(reports),
        "outside_s_per_report": {
            "median": statistics.median(outside),
            "max": outside[-1],
            "reports": len(outside),
        },
        "steps_s": sum(r["steps_s"] for r in trained),
        "trial_wall_s": sum(r["wall_s"] for r in trained),
        "wall_s": wall,
        "exp_dir": str(exp_dir),
    }


def _summary_of_dir(exp_dir: Path, steps: int) -> dict[str, Any] | None:
    """`--summarize-only`: the summary of a finished experiment left in --work (None if it is missing or
    did not finish); its wall time from file times (experiment.json is written just before it starts)."""
    from search.lineage import collect, latest_reports

    if not (exp_dir / "experiment.json").is_file():
        return None
    reports, _ = collect(exp_dir)
    last = latest_reports(reports)
    if len(last) < 4 or any(r["step"] < steps for r in last.values()):
        return None
    wall = max(r["time"] for r in reports) - (exp_dir / "experiment.json").stat().st_mtime
    return _summary(exp_dir.name, exp_dir, wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--interval", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quantile", type=float, default=0.5, help="PBT: the bottom fraction copies the top one")
    ap.add_argument(
        "--burn-in",
        type=int,
        default=60,
        help="PBT: steps before the first exploit (a quarter of the budget)",
    )
    ap.add_argument("--no-overhead", action="store_true", help="skip the live vs segments overhead runs")
    ap.add_argument("--work", default=str(WORK), help="scratch folder for the experiments")
    ap.add_argument(
        "--summarize-only",
        action="store_true",
        help="run nothing: summarize the finished experiments already in --work (same names and settings)",
    )
    args = ap.parse_args()
    args.data = str(Path(args.data).resolve())
    load_before, started = os.getloadavg(), time.time()
    rows: dict[str, list[dict[str, Any]]] = {"pbt": [], "random": []}
    overhead = {}
    if args.summarize_only:
        for seed in range(args.seeds):
            for kind in ("pbt", "random"):
                row = _summary_of_dir(Path(args.work) / f"{kind}-s{seed}", args.steps)
                rows[kind] += [row] if row else []
        for runs in ("live", "segments"):
            row = _summary_of_dir(Path(args.work) / f"pbt-async-{runs}-s0", args.steps)
            overhead.update({runs: row} if row else {})
        _write(args, rows, overhead, load_before, started)
        return

    import ray

    # the dashboard is on: Ray Train's PlacementGroupCleaner needs it when a trial's controller dies
    ray.init(address="local", num_cpus=os.cpu_count(), log_to_driver=False)
    for seed in range(args.seeds):
        for kind in ("pbt", "random"):
            row = _run(_experiment(args, f"{kind}-s{seed}", seed, kind, "live"))
            rows[kind].append(row)
            print(
                f"{kind} seed {seed}: best val_loss {row['best_val_loss']:.4f}, {row['exploits']} exploits, "
                f"outside steps {row['outside_steps_fraction']:.1%}, {row['wall_s']:.0f} s",
                flush=True,
            )
    if not args.no_overhead:  # asynchronous PBT: a trial is stopped only when exploited (synch stops all)
        for runs in ("live", "segments"):
            overhead[runs] = _run(_experiment(args, f"pbt-async-{runs}-s0", 0, "pbt", runs, synch=False))
            print(
                f"pbt async ({runs}) seed 0: outside steps {overhead[runs]['outside_steps_fraction']:.1%}, "
                f"best val_loss {overhead[runs]['best_val_loss']:.4f}",
                flush=True,
            )
    ray.shutdown()
    _write(args, rows, overhead, load_before, started)


def _write(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, Any]]],
    overhead: dict[str, dict[str, Any]],
    load_before: tuple[float, ...],
    started: float,
) -> None:
    med = {k: statistics.median(r["best_val_loss"] for r in v) for k, v in rows.items()}
    out = {
        **provenance(started, load_before),
        "setup": {
            "population": 4,
            "steps_per_trial": args.steps,
            "interval": args.interval,
            "burn_in": args.burn_in,
            "quantile_fraction": args.quantile,
            "workers_per_trial": args.workers,
            "base": "examples/pbt-demo.yaml (tiny-dense), constant lr",
            "space": "optimizer.lr loguniform [3e-4, 3e-2], optimizer.weight_decay uniform [0, 0.2]",
            "total_training_steps_each": 4 * args.steps,
        },
        "median_best_val_loss": med,
        "pbt_wins": med["pbt"] < med["random"],
        "runs": rows,
        "outside_steps_fraction": {
            "synch_live": statistics.median(r["outside_steps_fraction"] for r in rows["pbt"]),
            "random_live": statistics.median(r["outside_steps_fraction"] for r in rows["random"]),
            **{f"async_{k}": v["outside_steps_fraction"] for k, v in overhead.items()},
        },
        "outside_s_per_report_median": {
            "synch_live": statistics.median(r["outside_s_per_report"]["median"] for r in rows["pbt"]),
            "random_live": statistics.median(r["outside_s_per_report"]["median"] for r in rows["random"]),
            **{f"async_{k}": v["outside_s_per_report"]["median"] for k, v in overhead.items()},
        },
        "overhead_runs": overhead,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pbt_vs_random.json").write_text(json.dumps(out, indent=1))
    _plot(out, RESULTS / "pbt_vs_random.png")
    print(
        json.dumps(
            {k: out[k] for k in ("median_best_val_loss", "pbt_wins", "outside_steps_fraction")}, indent=1
        )
    )


def _plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    for i, kind in enumerate(("random", "pbt")):
        runs = out["runs"][kind]
        for j, r in enumerate(runs):
            a.scatter(
                [j + (i - 0.5) * 0.2] * len(r["final_val_loss"]),
                r["final_val_loss"],
                color=f"C{i}",
                alpha=0.35,
                s=15,
            )
            a.scatter(
                [j + (i - 0.5) * 0.2],
                [r["best_val_loss"]],
                color=f"C{i}",
                s=60,
                label=f"{kind} (median best {out['median_best_val_loss'][kind]:.3f})" if j == 0 else None,
            )
    a.set_xticks(range(len(out["runs"]["pbt"])), [f"seed {j}" for j in range(len(out["runs"]["pbt"]))])
    a.set_ylabel("final val_loss (big dot: best of 4)")
    a.set_title(f"PBT vs random search, {out['setup']['total_training_steps_each']} steps each")
    a.legend()
    a.grid(alpha=0.3)
    fr = out["outside_steps_fraction"]
    names = [k for k in ("async_live", "async_segments", "synch_live", "random_live") if k in fr]
    b.bar(
        [n.replace("_", "\n") for n in names],
        [fr[k] for k in names],
        color=[f"C{i + 2}" for i in range(len(names))],
    )
    for x, k in enumerate(names):
        b.text(x, fr[k], f"{fr[k]:.0%}", ha="center", va="bottom")
    b.set_ylim(0, 1)
    b.set_title("trial time outside training steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
