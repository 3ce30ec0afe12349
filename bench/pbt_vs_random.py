"""PBT (population 4) vs random search with the same total training steps, on the tiny model and the
standard-library corpus; and the time a trial spends outside training steps, live runs vs segments.

    .venv/bin/python bench/pbt_vs_random.py --data data/stdlib [--seeds 3] [--steps 240] [--interval 30]
        [--quantile 0.5]

Both searches start from the same 4 sampled configurations per seed (the experiment seed draws them), so
PBT differs from random search only by exploit and explore. The base run uses a constant learning rate:
any annealing is what PBT finds. Each trial is a Ray Train run of 2 workers (DDP); the 4 trials share the
machine's cores (cpus_per_worker 0.25). Writes bench/results/pbt_vs_random.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS, WORK = ROOT / "bench" / "results", ROOT / "bench" / "_work" / "pbt"


def _experiment(args: argparse.Namespace, name: str, seed: int, scheduler: str, runs: str):
    from search.config import load_experiment

    sched = (
        f"{{name: pbt, interval: {args.interval}, quantile_fraction: {args.quantile}}}"
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
    from search.report import outside_steps_fraction

    shutil.rmtree(exp.exp_dir, ignore_errors=True)
    save(exp)
    t = time.time()
    result = run_experiment(exp, verbose=0)
    wall = time.time() - t
    last: dict[str, dict] = {}
    for r in sorted(result.reports, key=lambda r: r["time"]):
        last[r["trial"]] = r
    trained = [r for r in result.reports if not r["failed"]]
    return {
        "name": exp.name,
        "best_val_loss": result.best_metric,
        "final_val_loss": sorted(r["metric"] for r in last.values()),
        "exploits": len(result.events),
        "outside_steps_fraction": outside_steps_fraction(result.reports),
        "steps_s": sum(r["steps_s"] for r in trained),
        "trial_wall_s": sum(r["wall_s"] for r in trained),
        "wall_s": wall,
        "exp_dir": str(exp.exp_dir),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--interval", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quantile", type=float, default=0.5, help="PBT: the bottom fraction copies the top one")
    ap.add_argument("--no-segments", action="store_true", help="skip the segments-mode overhead run")
    ap.add_argument("--work", default=str(WORK), help="scratch folder for the experiments")
    args = ap.parse_args()
    args.data = str(Path(args.data).resolve())

    import ray

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    load_before, started = os.getloadavg(), time.time()
    rows: dict[str, list[dict[str, Any]]] = {"pbt": [], "random": []}
    for seed in range(args.seeds):
        for kind in ("pbt", "random"):
            row = _run(_experiment(args, f"{kind}-s{seed}", seed, kind, "live"))
            rows[kind].append(row)
            print(
                f"{kind} seed {seed}: best val_loss {row['best_val_loss']:.4f}, {row['exploits']} exploits, "
                f"outside steps {row['outside_steps_fraction']:.1%}, {row['wall_s']:.0f} s",
                flush=True,
            )
    segments = None
    if not args.no_segments:
        segments = _run(_experiment(args, "pbt-segments-s0", 0, "pbt", "segments"))
        print(f"pbt (segments) seed 0: outside steps {segments['outside_steps_fraction']:.1%}", flush=True)
    ray.shutdown()

    med = {k: statistics.median(r["best_val_loss"] for r in v) for k, v in rows.items()}
    out = {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.time() - started,
        "setup": {
            "population": 4,
            "steps_per_trial": args.steps,
            "interval": args.interval,
            "workers_per_trial": args.workers,
            "base": "examples/pbt-demo.yaml (tiny-dense), constant lr",
            "space": "optimizer.lr loguniform [3e-4, 3e-2], optimizer.weight_decay uniform [0, 0.2]",
            "total_training_steps_each": 4 * args.steps,
        },
        "median_best_val_loss": med,
        "pbt_wins": med["pbt"] < med["random"],
        "runs": rows,
        "outside_steps_fraction": {
            "live": statistics.median(r["outside_steps_fraction"] for r in rows["pbt"]),
            "segments": segments["outside_steps_fraction"] if segments else None,
        },
        "segments_run": segments,
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
    names = [k for k in ("live", "segments") if fr[k] is not None]
    b.bar(names, [fr[k] for k in names], color=["C2", "C3"][: len(names)])
    for x, k in enumerate(names):
        b.text(x, fr[k], f"{fr[k]:.0%}", ha="center", va="bottom")
    b.set_ylim(0, 1)
    b.set_title("trial time outside training steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
