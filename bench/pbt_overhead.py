"""Where a PBT trial's time goes: starting Train runs, reporting, exploiting, training steps; for PBT with
live runs (asynchronous and synchronous), PBT with a segment per interval (the baseline) and random search.

    .venv/bin/python bench/pbt_overhead.py --data data/stdlib [--steps 160] [--interval 40]
        [--long-steps 800] [--long-interval 400] [--only async_inplace random] [--quick] [--summarize-only]

Four configurations, each at the demo's interval (`--interval`, 40 steps) and at one ten times longer
(`--long-interval`, 400 steps), all in one Ray session on the same machine, the short-interval experiments
first in the order below, then the long-interval ones in the reverse order (so that a drift of the machine
does not always hit the same configuration first):

- `async_inplace`: asynchronous PBT, `trial_runs: live` (one Train run per trial life)
- `sync_inplace`: synchronous PBT, `trial_runs: live`
- `async_segments`: asynchronous PBT, `trial_runs: segments` (a new Train run per interval: the baseline)
- `random`: random search, `trial_runs: live` (no exploits)

Population 4 x 2 Ray Train workers (DDP) of the demo (examples/pbt-demo.yaml: tiny-dense, cpus_per_worker
0.25, so the 4 trials share 2 cores), PBT with burn_in 0 (exploits from the first report on) and
quantile_fraction 0.5. What is measured (definitions in bench/README.md, "PBT overhead"), from each trial's
lineage log (search/lineage.py) and the `metrics.jsonl` of each of its Train runs (EXP_DIR/runs/<trial>/
<run>/), which time-stamps every training step's end (`time`, with its duration `step_time_s`) and every
`start`/`resume`/`checkpoint`/`exploit` event:

- starts_per_trial: Train-run starts (`start` and `resume` events) of each trial
- report_overhead_s: from the `checkpoint` event at a report to the start of the next training step, over
  reports that did not lead to an exploit (evaluation runs before the checkpoint: not included)
- exploit_to_first_step_s: from the recipient's `checkpoint` event at the report that led to an exploit to
  the start of its first training step in the donor's state
- outside_share: 1 - time in training steps / wall time over the trials' reports, each trial's first
  report excluded (it holds the trial's first start, reported as first_start_s)

Both shapes of an exploit are understood: a new Train run restored from the donor (a `resume` event in a
new run folder), or the donor's checkpoint loaded into the running one (an `exploit` event in the same
`metrics.jsonl`, whose records after the donor's step are then dropped). Writes
bench/results/pbt_overhead.{json,png}; `--summarize-only` rewrites them from the experiments left in
--work without running anything. The default run takes about 40 minutes on 2 quiet cores (the long
interval's 4 x 800 steps per trial are ~20 of them); `--quick` (tiny budgets, for development) about 20, and
much longer on a loaded machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS, WORK = ROOT / "bench" / "results", ROOT / "bench" / "_work" / "pbt_overhead"
META = "bench_meta.json"  # in each experiment folder: load, wall time and settings of its run

CONFIGS: dict[str, dict[str, Any]] = {
    "async_inplace": {"scheduler": "pbt", "synch": False, "trial_runs": "live"},
    "sync_inplace": {"scheduler": "pbt", "synch": True, "trial_runs": "live"},
    "async_segments": {"scheduler": "pbt", "synch": False, "trial_runs": "segments"},
    "random": {"scheduler": "random", "synch": False, "trial_runs": "live"},
}
STARTS = ("start", "resume")  # events that begin a Train run (an in-place `exploit` does not)
BUDGETS = {"steps": 160, "interval": 40, "long_steps": 800, "long_interval": 400}  # 4 and 2 reports per trial
QUICK = {"steps": 30, "interval": 10, "long_steps": 40, "long_interval": 20}


# ------------------------------------------------------------------------------ pure measurements


def step_start(rec: dict[str, Any]) -> float:
    """When a training step began: its record is written at the step's end."""
    return rec["time"] - rec["step_time_s"]


def summary(values: Iterable[float]) -> dict[str, Any]:
    """median, p90 (inclusive quantiles), min, max and n; None for each when there are no values."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return {"median": None, "p90": None, "min": None, "max": None, "n": 0}
    p90 = statistics.quantiles(v, n=10, method="inclusive")[-1] if len(v) > 1 else v[0]
    return {"median": statistics.median(v), "p90": p90, "min": v[0], "max": v[-1], "n": len(v)}


def count_starts(runs: dict[str, list[dict[str, Any]]]) -> int:
    """Train-run starts of one trial over its run folders: `start` and `resume` events. A folder with
    training steps but no such event (dropped with the records after an in-place exploit's donor step)
    counts once."""
    n = 0
    for recs in runs.values():
        k = sum(1 for r in recs if r.get("kind") == "event" and r.get("event") in STARTS)
        n += k if k or not any(r.get("kind") == "train" for r in recs) else 1
    return n


def _tagged(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """All records of one trial, each with its run folder's name under `run`."""
    return [{**r, "run": name} for name, recs in runs.items() for r in recs]


def _trains(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return sorted((r for r in _tagged(runs) if r.get("kind") == "train"), key=step_start)


def _events(runs: dict[str, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    return sorted(
        (r for r in _tagged(runs) if r.get("kind") == "event" and r.get("event") == name),
        key=lambda r: r["time"],
    )


def _trial_reports(reports: list[dict[str, Any]], trial: str) -> list[dict[str, Any]]:
    return sorted((r for r in reports if r["trial"] == trial), key=lambda r: r["time"])


def exploit_triggers(
    reports: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each lineage exploit row with the recipient's report that led to it (its last report before the
    exploit was recorded; None if it had none)."""
    out = []
    for e in sorted(events, key=lambda e: e["time"]):
        before = [r for r in _trial_reports(reports, e["trial"]) if r["time"] < e["time"]]
        out.append((e, before[-1] if before else None))
    return out


def report_overheads(
    runs_by_trial: dict[str, dict[str, list[dict[str, Any]]]],
    reports: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per report not followed by an exploit: seconds from the `checkpoint` event at step s to the start
    of the first training step after it, which must be step s + 1 (in whichever of the trial's run folders
    holds it) with no exploit in between; a checkpoint without a report (the run ended first) and the
    budget's last one (no step after it) give nothing."""
    triggers = {(rep["trial"], rep["time"]) for _, rep in exploit_triggers(reports, events) if rep}
    out = []
    for trial, runs in sorted(runs_by_trial.items()):
        mine = _trial_reports(reports, trial)
        trains = _trains(runs)
        exploit_times = sorted(
            [e["time"] for e in events if e["trial"] == trial] + [r["time"] for r in _events(runs, "exploit")]
        )
        for c in _events(runs, "checkpoint"):
            rep = next((r for r in mine if r["step"] == c["step"] and r["time"] >= c["time"]), None)
            if rep is None or (trial, rep["time"]) in triggers:
                continue
            nxt = next((t for t in trains if step_start(t) > c["time"]), None)
            if nxt is None or nxt["step"] != c["step"] + 1:
                continue
            if any(c["time"] < x < step_start(nxt) for x in exploit_times):
                continue
            out.append(
                {
                    "trial": trial,
                    "step": c["step"],
                    "s": step_start(nxt) - c["time"],
                    "same_run": nxt["run"] == c["run"],
                }
            )
    return out


def exploit_latencies(
    runs_by_trial: dict[str, dict[str, list[dict[str, Any]]]],
    reports: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per exploit (lineage row: recipient `trial`, `donor`, `step` = the donor's checkpoint step): seconds
    from the recipient's `checkpoint` event at the report that led to it to the start of its first
    training step in the donor's state (step `step` + 1; after the run's matching `exploit` event when the
    exploit happened in place). The anchor falls back to the lineage report's time when the checkpoint
    event is gone (an in-place exploit to an earlier donor step drops the records after that step)."""
    out = []
    for e, rep in exploit_triggers(reports, events):
        runs = runs_by_trial.get(e["trial"], {})
        if rep is None or not runs:
            continue
        ckpts = [
            c for c in _events(runs, "checkpoint") if c["step"] == rep["step"] and c["time"] <= rep["time"]
        ]
        anchor, source = (ckpts[-1]["time"], "checkpoint_event") if ckpts else (rep["time"], "lineage_report")
        in_place = next(
            (
                x
                for x in _events(runs, "exploit")
                if x["time"] >= anchor and x["step"] == e["step"] and x.get("donor", e["donor"]) == e["donor"]
            ),
            None,
        )
        first = next(
            (
                t
                for t in _trains(runs)
                if t["step"] == e["step"] + 1
                and step_start(t) > anchor
                and (in_place is None or (t["run"] == in_place["run"] and t["time"] > in_place["time"]))
            ),
            None,
        )
        if first is None:  # the recipient never trained again (the budget's end, or it failed)
            continue
        out.append(
            {
                "trial": e["trial"],
                "donor": e["donor"],
                "report_step": rep["step"],
                "donor_step": e["step"],
                "s": step_start(first) - anchor,
                "anchor": source,
                "in_place": in_place is not None,
                "new_run": first["run"] != ckpts[-1]["run"] if ckpts else None,  # None: anchor's run unknown
            }
        )
    return out


def _trained(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r
        for r in reports
        if not r["failed"] and r["wall_s"] is not None and math.isfinite(r["wall_s"]) and r["wall_s"] > 0
    ]


def outside_share(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """1 - sum(steps_s) / sum(wall_s) over the reports that trained, each trial's first report excluded
    (its wall time holds the trial's first Train-run start)."""
    rows = sorted(_trained(reports), key=lambda r: r["time"])
    firsts, kept = set(), []
    for r in rows:
        if r["trial"] in firsts:
            kept.append(r)
        firsts.add(r["trial"])
    wall = sum(r["wall_s"] for r in kept)
    steps = sum(r["steps_s"] for r in kept)
    return {
        "share": 1.0 - steps / wall if wall else None,
        "steps_s": steps,
        "wall_s": wall,
        "reports": len(kept),
    }


def first_starts(
    runs_by_trial: dict[str, dict[str, list[dict[str, Any]]]], reports: list[dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Per trial: `first_start_s`, from the trial's start (its first report's time minus its wall_s: the
    trial's clock starts in its setup) to the start of its first training step; and `first_report_outside_s`
    = wall_s - steps_s of its first report (the first start plus that report's evaluation, save and gate)."""
    out = {}
    for trial, runs in sorted(runs_by_trial.items()):
        mine = _trained(_trial_reports(reports, trial))
        trains = _trains(runs)
        if not mine or not trains:
            continue
        r0 = mine[0]
        out[trial] = {
            "first_start_s": step_start(trains[0]) - (r0["time"] - r0["wall_s"]),
            "first_report_outside_s": r0["wall_s"] - r0["steps_s"],
        }
    return out


def outside_share_span(runs_by_trial: dict[str, dict[str, list[dict[str, Any]]]]) -> float | None:
    """Cross-check from the metrics alone: 1 - time in the training steps on record / the span from each
    trial's first step's start to its last step's end (the gaps between a trial's Train runs, which no
    report's wall_s holds, count here; steps dropped by an in-place exploit count as outside)."""
    span = steps = 0.0
    for runs in runs_by_trial.values():
        trains = _trains(runs)
        if not trains:
            continue
        span += max(t["time"] for t in trains) - step_start(trains[0])
        steps += sum(t["step_time_s"] for t in trains)
    return 1.0 - steps / span if span else None


def measure(
    runs_by_trial: dict[str, dict[str, list[dict[str, Any]]]],
    reports: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> dict[str, Any]:
    """Every figure of one experiment (the contract of bench/results/pbt_overhead.json), with the raw
    per-report and per-exploit rows under `raw`."""
    trials = sorted(set(runs_by_trial) | {r["trial"] for r in reports})
    overheads = report_overheads(runs_by_trial, reports, events)
    exploits = exploit_latencies(runs_by_trial, reports, events)
    firsts = first_starts(runs_by_trial, reports)
    share = outside_share(reports)
    trains = [t for runs in runs_by_trial.values() for t in _trains(runs)]
    return {
        "trials": trials,
        "starts_per_trial": [count_starts(runs_by_trial.get(t, {})) for t in trials],
        "report_overhead_s": summary(o["s"] for o in overheads),
        # of those reports: the next step in a new Train run (the trial was stopped at the report, e.g.
        # Tune paused it), and the overhead of the others (the run went on)
        "reports_restarted": sum(not o["same_run"] for o in overheads),
        "report_overhead_same_run_s": summary(o["s"] for o in overheads if o["same_run"]),
        "exploit_to_first_step_s": summary(x["s"] for x in exploits),
        "exploits": len(events),
        "exploits_in_place": sum(x["in_place"] for x in exploits),
        "outside_share": share["share"],
        "outside_share_rows": {k: v for k, v in share.items() if k != "share"},
        "outside_share_span": outside_share_span(runs_by_trial),
        "first_start_s": summary(f["first_start_s"] for f in firsts.values()),
        "first_report_outside_s": summary(f["first_report_outside_s"] for f in firsts.values()),
        "reports": len(_trained(reports)),
        "train_records": len(trains),
        "step_time_s": summary(t["step_time_s"] for t in trains),
        "raw": {"report_overheads": overheads, "exploits": exploits, "first_starts": firsts},
    }


# ------------------------------------------------------------------------------------------ reading


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
    return rows


def read_runs(exp_dir: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{trial: {run folder: metrics.jsonl records}} from EXP_DIR/runs/<trial>/<run>/metrics.jsonl."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted((Path(exp_dir) / "runs").glob("*/*/metrics.jsonl")):
        out.setdefault(path.parent.parent.name, {})[path.parent.name] = read_jsonl(path)
    return out


def measure_dir(exp_dir: Path) -> dict[str, Any]:
    from search.lineage import collect

    reports, events = collect(exp_dir)
    return measure(read_runs(exp_dir), reports, events)


# ---------------------------------------------------------------------------------------- running


def _name(config: str, interval: int) -> str:
    return f"{config}-i{interval}"


def _experiment(args: argparse.Namespace, config: str, steps: int, interval: int):
    from search.config import load_experiment

    c = CONFIGS[config]
    sched = (
        f"{{name: pbt, interval: {interval}, burn_in: 0, quantile_fraction: 0.5, resample_probability: 0.25, "
        f"synch: {str(c['synch']).lower()}}}"
        if c["scheduler"] == "pbt"
        else f"{{name: random, interval: {interval}}}"
    )
    return load_experiment(
        ROOT / "examples" / "pbt-demo.yaml",
        [
            f"name={_name(config, interval)}",
            f"storage={args.work}",
            f"scheduler={sched}",
            f"budget={{steps: {steps}}}",
            f"trial_runs={c['trial_runs']}",
            "population=4",
            "resources={workers: 2, cpus_per_worker: 0.25}",
            f"overrides.data.path={args.data}",
        ],
    )


def _run(args: argparse.Namespace, config: str, steps: int, interval: int) -> dict[str, Any]:
    from search.config import save
    from search.driver import run_experiment

    exp = _experiment(args, config, steps, interval)
    shutil.rmtree(exp.exp_dir, ignore_errors=True)
    save(exp)
    before, t = os.getloadavg(), time.time()
    result = run_experiment(exp, verbose=0)
    meta = {
        "config": config,
        "steps": steps,
        "interval": interval,
        "wall_s": time.time() - t,
        "finished": result.finished,
        "loadavg": {"before": before, "after": os.getloadavg()},
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        # the tree that ran (a later --summarize-only records its own commit at the top level)
        "git_commit": _git("rev-parse", "--short", "HEAD").strip(),
    }
    (exp.exp_dir / META).write_text(json.dumps(meta, indent=1))
    return _experiment_summary(exp.exp_dir)


def _experiment_summary(exp_dir: Path) -> dict[str, Any] | None:
    """The measures of one finished experiment in --work, with its run's settings and load (None if it is
    missing or was not run by this script)."""
    if not (exp_dir / META).is_file():
        return None
    meta = json.loads((exp_dir / META).read_text())
    return {**meta, "exp_dir": str(exp_dir), **measure_dir(exp_dir)}


def _order(configs: list[str]) -> list[tuple[str, str]]:
    """Short-interval experiments in the given order, then the long-interval ones in the reverse order."""
    return [(c, "short") for c in configs] + [(c, "long") for c in reversed(configs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--steps", type=int, help=f"budget per trial at the short interval ({BUDGETS['steps']})")
    ap.add_argument("--interval", type=int, help=f"the short interval, the demo's ({BUDGETS['interval']})")
    ap.add_argument(
        "--long-steps", type=int, help=f"budget per trial at the long interval ({BUDGETS['long_steps']})"
    )
    ap.add_argument("--long-interval", type=int, help=f"the long interval ({BUDGETS['long_interval']})")
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument(
        "--quick", action="store_true", help=f"tiny budgets for development (flags given win): {QUICK}"
    )
    ap.add_argument(
        "--work",
        default=None,
        help=f"scratch folder for the experiments (default {WORK}, --quick: {WORK}_quick)",
    )
    ap.add_argument(
        "--summarize-only",
        action="store_true",
        help="run nothing: summarize the experiments already in --work (same settings)",
    )
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else BUDGETS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # a quick run keeps its experiments and its JSON/PNG in its own folder: never over a real result
    args.work = args.work or str(WORK.with_name(WORK.name + "_quick") if args.quick else WORK)
    args.out = Path(args.work) if args.quick else RESULTS
    args.data = str(Path(args.data).resolve())
    if not args.summarize_only and not (Path(args.data) / "manifest.json").is_file():
        sys.exit(f"{args.data}: no prepared corpus; fix: raytrain data prepare --output {args.data}")
    load_before, started = os.getloadavg(), time.time()
    budgets = {"short": (args.steps, args.interval), "long": (args.long_steps, args.long_interval)}
    found: dict[tuple[str, str], dict[str, Any]] = {}
    if args.summarize_only:
        for config, which in _order(args.only):
            row = _experiment_summary(Path(args.work) / _name(config, budgets[which][1]))
            if row and row["steps"] != budgets[which][0]:
                print(f"{row['exp_dir']}: ran {row['steps']} steps, not {budgets[which][0]}: left out")
                row = None
            found.update({(config, which): row} if row else {})
    else:
        import ray

        # the dashboard is on: Ray Train's PlacementGroupCleaner needs it when a trial's controller dies
        ray.init(address="local", num_cpus=os.cpu_count(), log_to_driver=False)
        try:
            for config, which in _order(args.only):
                row = _run(args, config, *budgets[which])
                found[(config, which)] = row
                print(
                    f"{config} interval {row['interval']}: {row['wall_s']:.0f} s, starts {row['starts_per_trial']}, "
                    f"report overhead median {_fmt(row['report_overhead_s']['median'])} s, exploit to first "
                    f"step {_fmt(row['exploit_to_first_step_s']['median'])} s ({row['exploits']} exploits), "
                    f"outside {_fmt(row['outside_share'], '.1%')}, load {row['loadavg']['before'][0]:.1f}",
                    flush=True,
                )
        finally:
            ray.shutdown()
    _write(args, found, load_before, started)


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _git(*cmd: str) -> str:
    return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout


def _write(
    args: argparse.Namespace,
    found: dict[tuple[str, str], dict[str, Any]],
    load_before: tuple[float, ...],
    started: float,
) -> None:
    cpus = os.cpu_count() or 1
    busy = [
        f"{_name(c, r['interval'])}: 1-min load {r['loadavg']['before'][0]:.2f} > {cpus} CPUs before it started"
        for (c, _), r in found.items()
        if r["loadavg"]["before"][0] > cpus
    ]
    keys = (
        "starts_per_trial",
        "report_overhead_s",
        "exploit_to_first_step_s",
        "outside_share",
        "first_start_s",
    )
    runs: dict[str, Any] = {}
    for config in args.only:
        short, long = found.get((config, "short")), found.get((config, "long"))
        if short is None and long is None:
            continue
        head = {k: short[k] for k in keys} if short else {k: None for k in keys}
        runs[config] = {
            **CONFIGS[config],
            **head,
            "outside_share_long_interval": long["outside_share"] if long else None,
            "loadavg": {w: r["loadavg"] for w, r in (("short", short), ("long", long)) if r},
            "short_interval": short,
            "long_interval": long,
        }
    out = {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "--short", "HEAD").strip(),
        "git_dirty": [
            line[3:] for line in _git("status", "--porcelain", "--untracked-files=no").splitlines() if line
        ],
        "cpus": cpus,
        "busy": bool(busy),
        "busy_note": busy,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.time() - started,
        "setup": {
            "population": 4,
            "workers_per_trial": 2,
            "cpus_per_worker": 0.25,
            "base": "examples/pbt-demo.yaml (tiny-dense, DDP)",
            "pbt": {"burn_in": 0, "quantile_fraction": 0.5, "resample_probability": 0.25},
            "short": {"steps": args.steps, "interval": args.interval},
            "long": {"steps": args.long_steps, "interval": args.long_interval},
            "order": [
                _name(c, (args.interval if w == "short" else args.long_interval))
                for c, w in _order(args.only)
            ],
        },
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pbt_overhead.json").write_text(json.dumps(out, indent=1))
    if runs:
        _plot(out, args.out / "pbt_overhead.png")
    print(f"wrote {args.out / 'pbt_overhead.json'} and .png")
    _table(out)


def _table(out: dict[str, Any]) -> None:
    print(
        f"{'config':<15} {'starts':<14} {'report med/p90 s':>17} {'exploit med s':>14} {'first start s':>14} "
        f"{'outside':>8} {'long':>6}"
    )
    for config, r in out["runs"].items():
        ro = r["report_overhead_s"] or {}
        print(
            f"{config:<15} {str(r['starts_per_trial']):<14} "
            f"{_fmt(ro.get('median')):>8}/{_fmt(ro.get('p90')):<8} "
            f"{_fmt((r['exploit_to_first_step_s'] or {}).get('median')):>14} "
            f"{_fmt((r['first_start_s'] or {}).get('median')):>14} {_fmt(r['outside_share'], '.0%'):>8} "
            f"{_fmt(r['outside_share_long_interval'], '.0%'):>6}"
        )
    if out["busy"]:
        print("BUSY:", "; ".join(out["busy_note"]))


def _plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["runs"])
    runs = out["runs"]
    x = range(len(names))
    short_i, long_i = out["setup"]["short"]["interval"], out["setup"]["long"]["interval"]

    def get(config: str, which: str, key: str, stat: str | None = None) -> float:
        r = runs[config].get(f"{which}_interval")
        v = r and r[key]
        v = v.get(stat) if stat and v else v
        return math.nan if v is None else v

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        (
            axes[0],
            "report overhead (checkpoint to next step), s",
            [
                (f"median, interval {short_i}", lambda c: get(c, "short", "report_overhead_s", "median")),
                (f"p90, interval {short_i}", lambda c: get(c, "short", "report_overhead_s", "p90")),
                (f"median, interval {long_i}", lambda c: get(c, "long", "report_overhead_s", "median")),
            ],
            "{:.1f}",
        ),
        (
            axes[1],
            "exploit to first step in the donor's state, s (median)",
            [
                (f"interval {short_i}", lambda c: get(c, "short", "exploit_to_first_step_s", "median")),
                (f"interval {long_i}", lambda c: get(c, "long", "exploit_to_first_step_s", "median")),
            ],
            "{:.1f}",
        ),
        (
            axes[2],
            "trial time outside training steps (first start excluded)",
            [
                (f"interval {short_i}", lambda c: get(c, "short", "outside_share")),
                (f"interval {long_i}", lambda c: get(c, "long", "outside_share")),
            ],
            "{:.0%}",
        ),
    ]
    for ax, title, series, label in panels:
        w = 0.8 / len(series)
        for j, (name, fn) in enumerate(series):
            vals = [fn(c) for c in names]
            pos = [i + (j - (len(series) - 1) / 2) * w for i in x]
            ax.bar(pos, [0 if math.isnan(v) else v for v in vals], w, label=name, color=f"C{j}")
            for p, v in zip(pos, vals):
                ax.text(
                    p,
                    0 if math.isnan(v) else v,
                    "n/a" if math.isnan(v) else label.format(v),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(list(x), [n.replace("_", "\n") for n in names])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[2].set_ylim(0, 1.05)
    fig.suptitle(
        f"PBT overhead: population 4 x 2 DDP workers on {out['cpus']} CPUs ({out['date'][:10]}, "
        f"{out['git_commit']}{', BUSY machine' if out['busy'] else ''})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
