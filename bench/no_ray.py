"""`raytrain train --no-ray` beside the Ray path on a busy machine: the step time of each, side by side.

    .venv/bin/python bench/no_ray.py --data data/stdlib [--steps 40] [--busy 2] [--rounds 2]

`examples/tiny-dense.yaml` (one worker of 1 CPU on the Ray path), `--steps` steps, no evaluation or
checkpoint, beside `--busy` processes that spin for the whole benchmark (a 2-core machine with two of them
is the busy machine users see). Each round runs, in turn: the Ray path; `--no-ray` as it now computes (on
scaling.cpus_per_worker threads, as a Ray worker does); `--no-ray` on torch's default of a thread per core
(what it did before: OMP_NUM_THREADS set to the core count). The step time is the median of each run's
`step_time_s` after its first 5 steps (start-up excluded); the ratio to the Ray path is taken within each
round, then the median over rounds. Writes bench/results/no_ray.{json,png} with the command, the commit
and the load average. Target (issue 40): `--no-ray` within 1.3x of the Ray path's step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402

RESULTS = ROOT / "bench" / "results"
WARMUP = 5


def run(kind: str, data: str, steps: int, work: Path) -> dict:
    run_dir = work / f"{kind}-{time.monotonic_ns()}"
    cmd = [str(Path(sys.executable).parent / "raytrain"), "train", str(ROOT / "examples" / "tiny-dense.yaml"),
           "--no-progress", "--set", f"data.path={data}", "--set", f"run_dir={run_dir}",
           "--set", f"train.steps={steps}", "--set", "train.eval_every=0", "--set", "checkpoint.every=0",
           "--set", "checkpoint.final=false", "--set", "train.tensorboard=false",
           "--set", f"schedule.warmup_steps={min(20, steps // 2)}"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if kind != "ray":
        cmd.append("--no-ray")
    if kind == "no_ray_thread_per_core":
        env["OMP_NUM_THREADS"] = str(os.cpu_count())
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{kind} failed ({done.returncode}): {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r.get("kind") == "train" and r["step"] > WARMUP]
    return {"kind": kind, "step_time_s": statistics.median(times), "wall_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--busy", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "no_ray.json"))
    args = parser.parse_args()
    started, load_before = time.time(), os.getloadavg()
    data = str(Path(args.data).resolve())
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    rounds = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-no-ray-") as tmp:
            for i in range(args.rounds):
                kinds = ["ray", "no_ray", "no_ray_thread_per_core"]
                rows = {k: run(k, data, args.steps, Path(tmp)) for k in (kinds if i % 2 == 0 else kinds[::-1])}
                ray_s = rows["ray"]["step_time_s"]
                rounds.append({k: {**r, "ratio_to_ray": r["step_time_s"] / ray_s} for k, r in rows.items()})
                print(json.dumps({k: round(r["step_time_s"], 4) for k, r in rows.items()}), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    summary = {k: statistics.median(r[k]["ratio_to_ray"] for r in rounds) for k in rounds[0]}
    result = {
        **provenance(started, load_before),
        "busy_processes": args.busy,
        "steps": args.steps,
        "config": "examples/tiny-dense.yaml (1 worker x 1 CPU on the Ray path), no eval, no checkpoint",
        "rounds": rounds,
        "ratio_to_ray": summary,
        "target_no_ray_ratio": 1.3,
        "meets_target": summary["no_ray"] <= 1.3,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"no_ray / ray step time: {summary['no_ray']:.2f} (target <= 1.3); thread per core: "
          f"{summary['no_ray_thread_per_core']:.2f}; wrote {out}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(result["ratio_to_ray"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, rnd in enumerate(result["rounds"]):
        ax.scatter(kinds, [rnd[k]["step_time_s"] for k in kinds], label=f"round {i + 1}")
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"tiny-dense beside {result['busy_processes']} busy processes ({result['cpus']} cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
