"""How fast the command line answers: `raytrain --version`, `raytrain train --help`, a run YAML with a misspelt
key (`train`) and an experiment YAML with one (`tune`), each a fresh process of the installed console script,
in lockstep rounds (every command once a round, in turn), so that a load that comes and goes falls on all of
them alike. `ray --help` is timed beside them as the floor a Ray tool has on this machine.

    python bench/cli.py                 7 rounds -> bench/results/cli.{json,png}
    python bench/cli.py --rounds 5 --out DIR

Writes the medians `version_s`, `help_s`, `config_error_s` (train), `tune_config_error_s` (issue 56's contract,
with its targets 0.5 / 0.8 / 1.5 / 2.0 s), every run's time, each command's exit code and one-line answer, and
the command, commit and load average (provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# field -> (the command after `raytrain`, its exit code, target seconds)
COMMANDS: dict[str, tuple[list[str], int, float | None]] = {
    "version_s": (["--version"], 0, 0.5),
    "help_s": (["train", "--help"], 0, 0.8),
    "config_error_s": (["train", "examples/tiny-dense.yaml", "--set", "model.n_head=8"], 2, 1.5),
    "tune_config_error_s": (["tune", "examples/pbt-demo.yaml", "--set", "scheduler.nam=pbt"], 2, 2.0),
}


def _time(argv: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    took = time.perf_counter() - t0
    last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return took, proc.returncode, last[-1] if last else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="fresh processes per command (at least 5)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--no-floor", action="store_true", help="leave out `ray --help` (3 s a run)")
    args = p.parse_args()
    if args.rounds < 5:
        p.error("--rounds must be at least 5 (the medians are of five runs or more)")
    started, load = time.time(), os.getloadavg()
    runs: dict[str, list[float]] = {k: [] for k in [*COMMANDS, *([] if args.no_floor else ["ray_help_s"])]}
    answers: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for field, (argv, code, _) in COMMANDS.items():
            took, rc, line = _time([str(BIN / "raytrain"), *argv])
            if rc != code:
                print(f"bench/cli: raytrain {' '.join(argv)} exited {rc}, expected {code}: {line}", file=sys.stderr)
                return 1
            runs[field].append(took)
            answers[field] = {"command": "raytrain " + " ".join(argv), "exit_code": rc, "answer": line}
        if "ray_help_s" in runs:
            runs["ray_help_s"].append(_time([str(BIN / "ray"), "--help"])[0])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()), flush=True)
    medians = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    targets = {k: t for k, (_, _, t) in COMMANDS.items()}
    result = {
        **medians,
        "targets_s": targets,
        "met": all(medians[k] <= t for k, t in targets.items()),
        "runs_s": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        "answers": answers,
        "note": "medians of fresh processes of the installed console script (python startup included); "
                "ray_help_s: `ray --help` timed in the same rounds, for scale",
        **provenance(started, load),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "cli.png")
    print(json.dumps({k: medians[k] for k in runs} | {"met": result["met"]}))
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["runs_s"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(names, [result[n] for n in names], color=["tab:blue"] * len(COMMANDS) + ["tab:gray"])
    for i, n in enumerate(names):
        for x in result["runs_s"][n]:
            ax.plot(i, x, "k.", ms=3)
        target = result["targets_s"].get(n)
        if target is not None:
            ax.hlines(target, i - 0.4, i + 0.4, colors="tab:red", linestyles="--")
    ax.set_ylabel("seconds (median, dots: each run)")
    ax.set_title(f"raytrain's answers, fresh processes (dashed: targets); load {result['loadavg_before'][0]:.2f}",
                 fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
