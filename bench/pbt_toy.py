"""The PBT paper's toy problem over 20 seeds, through the search layer (Tune trials, no Train workers).

    .venv/bin/python bench/pbt_toy.py [--seeds 20] [--steps 40]

Target (issue 5, criterion 2): PBT reaches Q >= 1.19 in at least 18 of 20 seeds within the step budget,
while the grid (the same two workers, fixed h, no exploit or explore) stays below 1.0.
Writes bench/results/pbt_toy.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
TARGET_Q, TARGET_SEEDS = 1.19, 18


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    import ray

    from bench.toy import TOY_LR, run_toy

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    load_before = os.getloadavg()
    started = time.time()
    runs = []
    with tempfile.TemporaryDirectory() as storage:
        grid = run_toy(0, args.steps, Path(storage), pbt=False)
        for seed in range(args.seeds):
            t = time.time()
            r = run_toy(seed, args.steps, Path(storage))
            r["wall_s"] = time.time() - t
            runs.append(r)
            print(f"seed {seed}: best Q {r['best_q']:.4f} ({r['wall_s']:.1f} s)", flush=True)
    ray.shutdown()
    reached = sum(r["best_q"] >= TARGET_Q for r in runs)
    out = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable.replace(str(ROOT) + "/", ""), *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "setup": {
            "steps": args.steps,
            "interval": 4,
            "lr": TOY_LR,
            "population": 2,
            "synch": True,
            "quantile_fraction": 0.5,
            "resample_probability": 0.25,
            "perturbation_factors": [1.2, 0.8],
            "space": "h0, h1 uniform [0, 1]",
            "start": "t=(0.9, 0.9), h=(1,0) and (0,1)",
        },
        "target": {"q": TARGET_Q, "seeds": f">= {TARGET_SEEDS} of 20", "grid_below": 1.0},
        "pbt_reached": reached,
        "pbt_seeds": len(runs),
        "pbt_best_q": [r["best_q"] for r in runs],
        "grid_best_q": grid["best_q"],
        "met": reached >= TARGET_SEEDS * len(runs) / 20 and grid["best_q"] < 1.0,
        "wall_s": time.time() - started,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "curves": {"pbt": [r["curves"] for r in runs], "grid": grid["curves"]},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pbt_toy.json").write_text(json.dumps(out, indent=1))
    _plot(out, RESULTS / "pbt_toy.png")
    print(f"PBT reached Q >= {TARGET_Q} in {reached}/{len(runs)} seeds; grid best Q {grid['best_q']:.3f}")


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [4 * (i + 1) for i in range(len(out["curves"]["grid"][0]))]
    for seed_curves in out["curves"]["pbt"]:
        best = [max(vals) for vals in zip(*seed_curves)]
        ax.plot(steps[: len(best)], best, color="C0", alpha=0.4, lw=1)
    grid_best = [max(vals) for vals in zip(*out["curves"]["grid"])]
    ax.plot(steps[: len(grid_best)], grid_best, color="C3", lw=2, label="grid (no exploit/explore)")
    ax.plot(
        [], [], color="C0", label=f"PBT, {out['pbt_seeds']} seeds ({out['pbt_reached']} reach {TARGET_Q})"
    )
    ax.axhline(TARGET_Q, color="gray", ls="--", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("best Q in the population")
    ax.set_title("PBT toy problem (Jaderberg et al. 2017, fig. 2) through search/")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
