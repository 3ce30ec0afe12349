"""A resume's phases on this machine, before and now, side by side (issue 55, item 1: the CPU figures).

    python3 bench/resume_compare.py --before e76c2e5 [--shape cpu] [--rounds 2] [--out bench/results]

`bench/resume_profile.py` (this checkout's) runs in a git worktree of `--before` and in this checkout, in turns
(before, now, before, now, ...: a load that comes and goes falls on both), each saving one step of `--shape` and
resuming it in a fresh process to its first step. Writes OUT/resume_profile_<shape>.json: each run's phases
(process start to `import torch`, to the trainer's modules imported, the Trainer built with its restore, the first
step), their medians per side and now/before; and the environment (command, commit, load average). The before
side runs with this checkout's virtualenv: what it measures is the code, not the installed libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from corpus import prepared  # noqa: E402
from run import environment  # noqa: E402

PHASES = ("process_start_to_python", "python_started->torch_imported", "torch_imported->cuda_ready",
          "cuda_ready->trainers_imported", "trainers_imported->built", "built->first_step")


def one(side: Path, shape: str, data: Path, work: Path) -> dict:
    """resume_profile.py's figures for the checkout at `side` (its trainers/, this interpreter)."""
    out = work / "out"
    shutil.rmtree(work, ignore_errors=True)
    proc = subprocess.run([sys.executable, str(side / "bench" / "resume_profile.py"), "--device", "cpu", "--shape",
                           shape, "--data", str(data), "--work", str(work), "--out", str(out)], cwd=side,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"resume_profile.py in {side} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-3000:]}")
    got = json.loads((out / "resume_profile.json").read_text())
    phases = {"process_start_to_python": got["process_start_to_python"], **got["split_s"]}
    return {"first_step_after_start_s": got["first_step_after_start_s"], "phases_s": phases,
            "save_run_s": got["save_run_s"], "loadavg_at_end": got["loadavg_at_end"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the commit to compare with (a git worktree of it is made)")
    ap.add_argument("--shape", default="cpu", help="a shape of bench/checkpoint.py (cpu: its 127M model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", help="a prepared corpus (default: the standard library's bytes, made once)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    env = environment(args)
    data = prepared(args.data, ROOT / "bench" / "_work" / "corpus-resume", 4_000_000)
    before_commit = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="resume-compare-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before), before_commit], cwd=ROOT, check=True)
        try:
            # the same measuring script on both sides (the before commit may predate it)
            shutil.copy(ROOT / "bench" / "resume_profile.py", before / "bench" / "resume_profile.py")
            runs: dict[str, list[dict]] = {"before": [], "now": []}
            for r in range(args.rounds):
                for name, side in (("before", before), ("now", ROOT)):
                    got = one(side, args.shape, data, Path(tmp) / f"work-{name}")
                    runs[name].append(got)
                    print(f"round {r + 1} {name}: first step {got['first_step_after_start_s']:.2f} s after start "
                          f"(load {got['loadavg_at_end'][0]:.2f})", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    median = {name: {"first_step_after_start_s": statistics.median(r["first_step_after_start_s"] for r in rs),
                     **{p: statistics.median(r["phases_s"].get(p, 0.0) for r in rs) for p in PHASES}}
              for name, rs in runs.items()}
    ratio = {k: median["now"][k] / median["before"][k] for k in median["now"] if median["before"][k] > 0}
    result = {"environment": env, "device": "cpu", "shape": args.shape, "before_commit": before_commit,
              "rounds": args.rounds, "loadavg_at_end": os.getloadavg(), "median": median,
              "now_over_before": ratio, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"resume_profile_{args.shape}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    for k in ("first_step_after_start_s", *PHASES):
        print(f"{k:34s} before {median['before'][k]:7.2f} s  now {median['now'][k]:7.2f} s  "
              f"now/before {ratio.get(k, float('nan')):.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
