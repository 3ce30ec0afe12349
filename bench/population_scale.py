"""The population's control plane at scale (issue 68): the real `search.population.PopulationActor` driven by
simulated members at populations 8 to 256, under asynchronous PBT, synchronous PBT and PB2.

    .venv/bin/python bench/population_scale.py                  # every arm: the JSON and PNG the docs quote
    .venv/bin/python bench/population_scale.py --populations 8 --reports 10 --out /tmp/ps   # a smoke run

- The actor: started as `search.driver.start_population` starts it (`ray.remote(num_cpus=0)(PopulationActor)`,
  named by `population_name(exp_dir)`, holding `Population(cfg, space, mode, steps, size, seed)`), the space
  parsed by the product's `search.space.parse_space`, the starting members drawn as `ExperimentConfig.members`
  draws them. Each arm has a run folder of its own under a temp dir, removed after it is measured.
- The members: one asyncio coroutine each in the driver (no training, no Tune), every one at once. A member does
  what `search.trial.TrialRun` does around a report: its `LineageLog` row first (the fields a trial writes),
  then `actor.report`, then past burn-in (and before the budget's end) `actor.decision(trial, step, 5 s)` until
  it answers; an exploit is logged as a trial logs it (`LineageLog.exploit`) and followed: the donor's step and
  the explored values. A member reports every `interval` steps until its step reaches `REPORTS x interval`, so
  it makes more or fewer than `REPORTS` reports after exploits (counted). Its metric (a loss) is a seeded
  function of its hyperparameters and step plus seeded noise: some starting points are better, so exploits happen.
- Per arm: `report_ms` (each `actor.report` round trip) and `decision_ms` (from sending the report to holding
  its decision: a synchronous round's wait included), p50 / p99 / max; reports and exploits; the actor's RSS
  right after it started and at the end, and their difference per report; the lineage's bytes on disk; `replay_s`,
  what `--resume` does (`search.lineage.collect` and a fresh `Population(...).replay`, as start_population), and
  `replay_equal`: the rebuilt population's `state()` against the live actor's (with the first difference).
- The actor's process: found among this driver's own descendants (the local Ray's processes) by its title
  `ray::PopulationActor`. Ray's state API (`ray.util.state.get_actor`) would name its pid, but it is served by
  the dashboard, which this bench does not start.

Writes bench/results/population_scale.{json,png} whole, with its provenance (bench/provenance.py); flags other
than the defaults need `--out` elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.provenance import provenance  # noqa: E402
from search.lineage import LineageLog, collect  # noqa: E402
from search.population import GO, Population, PopulationActor, population_name  # noqa: E402
from search.schedulers import MEMBER, SchedulerConfig  # noqa: E402
from search.space import parse_space  # noqa: E402

RESULTS = ROOT / "bench" / "results"
POPULATIONS = (8, 32, 128, 256)
SCHEDULERS = {"pbt": SchedulerConfig(name="pbt"), "pbt_sync": SchedulerConfig(name="pbt", synch=True),
              "pb2": SchedulerConfig(name="pb2")}
REPORTS = 100  # per member, at the budget of REPORTS x interval steps
SPACE = {"optimizer.lr": {"loguniform": [1e-4, 1e-1]}, "optimizer.weight_decay": {"uniform": [0.0, 0.2]}}
MODE, SEED, NOISE = "min", 0, 0.02
DECISION_WAIT_S = 5.0  # each `decision` call's wait, as search/trial.py asks
# Each member reports every PERIOD_S (its phase drawn in [0, PERIOD_S)): 256 members send the actor 512 reports
# a second and as many decision calls (a trial of a real population reports every minute or so: this is a
# stress, not a pace a cluster reaches). A member behind its schedule (a decision that waited) reports at once.
PERIOD_S = 0.5
MAX_REPORTS = 5  # x REPORTS: a member stops there whatever its step (never reached in a sane run: `capped`)
TARGETS = {"population": 256, "schedulers": ["pbt", "pb2"], "report_p99_ms": 50.0, "decision_p99_ms": 500.0,
           "replay_s": 10.0, "replay_equal": True}
MEASURES = ["search/population.py", "search/lineage.py", "search/schedulers.py", "search/space.py",
            "bench/population_scale.py"]


def loss(hparams: dict[str, Any], step: int, steps: int, noise: random.Random) -> float:
    """Best at lr 3e-3 and weight decay 0.05; falls with the step; seeded noise on top."""
    off = (math.log10(hparams["optimizer.lr"]) + 2.5) ** 2 + 4 * (hparams["optimizer.weight_decay"] - 0.05) ** 2
    return 2.0 + 2.0 * math.exp(-3.0 * step / steps) + 0.5 * off + noise.gauss(0.0, NOISE)


async def member(actor: Any, exp_dir: Path, index: int, hparams: dict[str, Any], cfg: SchedulerConfig,
                 steps: int, reports: int, times: dict[str, list[float]], period_s: float) -> dict[str, int]:
    """One simulated trial: report on its schedule, ask, follow (search/trial.py's order and lineage rows)."""
    trial, burn_in = f"sim_{index:05d}", cfg.burn_in_steps(steps)
    log, step, made, exploits = LineageLog(exp_dir, trial), 0, 0, 0
    loop = asyncio.get_running_loop()
    start = loop.time() + random.Random(f"{SEED}:phase:{index}").uniform(0, period_s)
    while step < steps and made < MAX_REPORTS * reports:
        await asyncio.sleep(max(0.0, start + made * period_s - loop.time()))  # the schedule (no training)
        step = min((step // cfg.interval + 1) * cfg.interval, steps)
        metric = loss(hparams, step, steps, random.Random(f"{SEED}:{trial}:{step}:{made}"))
        pin = f"{exp_dir}/runs/{trial}/pins/{time.time_ns():020d}-step_{step:08d}"
        log.report(step, metric, hparams, failed=False, steps_s=None, wall_s=None, error=None, pin=pin,
                   yielded=False, running=None, member=index)
        sent = time.perf_counter()
        decision = await actor.report.remote(trial, index, step, metric, hparams, pin, False)
        times["report"].append(time.perf_counter() - sent)
        made += 1
        if step >= steps or step < burn_in:  # search/trial.py asks only past burn-in, never at the end
            continue
        while decision is None:  # not decided at the report (a synchronous round, PB2's first fit): ask
            decision = await actor.decision.remote(trial, step, DECISION_WAIT_S)
        times["decision"].append(time.perf_counter() - sent)
        if decision == GO:
            continue
        values = {k: decision["values"][k] for k in SPACE}
        log.exploit(step=decision["step"], donor=decision["donor"], donor_time=decision["donor_time"],
                    old_hparams=hparams, new_hparams=values, donor_hparams=decision["donor_hparams"], score=metric,
                    donor_score=decision["donor_metric"], exploit_id=decision["exploit_id"],
                    pin=f"{exp_dir}/runs/{trial}/pins/{time.time_ns():020d}-step_{decision['step']:08d}",
                    from_step=step, perturbed=decision.get("perturbed"))
        await actor.taken.remote(trial, decision["exploit_id"], True)
        hparams, step, exploits = values, decision["step"], exploits + 1
    return {"reports": made, "exploits": exploits, "capped": int(step < steps)}


def actor_process() -> Any:
    """The PopulationActor's worker among this driver's descendants (this Ray's processes; the previous arm's
    has exited)."""
    import psutil

    for _ in range(100):
        found = [p for p in psutil.Process().children(recursive=True) if _titled(p)]
        if len(found) == 1:
            return found[0]
        time.sleep(0.1)
    raise RuntimeError(f"the PopulationActor's process: {len(found)} candidates among this driver's descendants")


def _titled(p: Any) -> bool:
    try:
        return " ".join(p.cmdline()).startswith("ray::PopulationActor")
    except Exception:  # noqa: BLE001 - gone meanwhile
        return False


def percentiles(seconds: list[float]) -> dict[str, float | None]:
    import numpy as np

    if not seconds:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    ms = np.array(seconds) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "max": float(ms.max()),
            "n": len(ms)}


def first_difference(live: dict[str, Any], rebuilt: dict[str, Any]) -> dict[str, Any] | None:
    """Where two `Population.state()`s first differ: a member's differing fields, else a top-level key."""
    if live == rebuilt:
        return None
    lm, rm = live.get("members", {}), rebuilt.get("members", {})
    differing = [t for t in sorted(set(lm) | set(rm)) if lm.get(t) != rm.get(t)]
    if differing:
        t, a, b = differing[0], lm.get(differing[0]) or {}, rm.get(differing[0]) or {}
        fields = {k: {"live": a.get(k), "rebuilt": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        return {"member": t, "members_differing": len(differing), "fields": fields}
    for k in sorted(set(live) | set(rebuilt)):
        a, b = live.get(k), rebuilt.get(k)
        if a != b and isinstance(a, list) and isinstance(b, list):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"key": k, "index": i, "lengths": [len(a), len(b)], "live": a[i:i + 1], "rebuilt": b[i:i + 1]}
        if a != b:
            return {"key": k, "live": a, "rebuilt": b}
    return None


def run_arm(size: int, scheduler: str, reports: int, period_s: float = PERIOD_S) -> dict[str, Any]:
    import ray

    cfg, space = SCHEDULERS[scheduler], parse_space(SPACE)
    steps = reports * cfg.interval
    rng = random.Random(SEED)  # as ExperimentConfig.members draws the starting points
    starts = [space.sample(rng) for _ in range(size)]
    exp_dir = Path(tempfile.mkdtemp(prefix=f"population_scale-{scheduler}-{size}-"))
    began = time.perf_counter()
    try:
        actor = ray.remote(num_cpus=0)(PopulationActor).options(name=population_name(exp_dir)).remote(
            Population(cfg, space, MODE, steps, size, seed=SEED))
        ray.get(actor.summary.remote())  # started
        proc = actor_process()
        rss_start = proc.memory_info().rss
        times: dict[str, list[float]] = {"report": [], "decision": []}

        async def drive() -> list[dict[str, int]]:
            return await asyncio.gather(*(member(actor, exp_dir, i, dict(h), cfg, steps, reports, times, period_s)
                                          for i, h in enumerate(starts)))

        members = asyncio.run(drive())
        rss_end = proc.memory_info().rss
        fit_rss = sum(child.memory_info().rss for child in proc.children(recursive=True))  # PB2's fit process
        live, summary = ray.get(actor.state.remote()), ray.get(actor.summary.remote())
        ray.kill(actor)
        proc.wait(timeout=30)  # gone before the next arm looks for its own
        files = list((exp_dir / "lineage").glob("*.jsonl"))
        lineage_bytes = sum(f.stat().st_size for f in files)
        t = time.perf_counter()  # what --resume does (search/driver.py: start_population)
        rows, events = collect(exp_dir)
        rebuilt = Population(cfg, space, MODE, steps, size, seed=SEED)
        rebuilt.replay(rows, events, {r["trial"]: r.get(MEMBER) or 0 for r in rows})
        replay_s = time.perf_counter() - t
        state = rebuilt.state()
    finally:
        shutil.rmtree(exp_dir, ignore_errors=True)
    made = [m["reports"] for m in members]
    return {
        "population": size, "scheduler": scheduler, "steps": steps, "reports": sum(made),
        "reports_per_member": {"min": min(made), "max": max(made)},
        "capped": sum(m["capped"] for m in members), "exploits": sum(m["exploits"] for m in members),
        "actor_exploits": summary["exploits"],
        "report_ms": percentiles(times["report"]), "decision_ms": percentiles(times["decision"]),
        "rss_start_bytes": rss_start, "rss_end_bytes": rss_end, "fit_process_rss_bytes": fit_rss,
        "rss_per_report_bytes": (rss_end - rss_start) / max(sum(made), 1),
        "lineage_bytes": lineage_bytes, "lineage_files": len(files),
        "replay_rows": {"reports": len(rows), "exploits": len(events)}, "replay_s": replay_s,
        "replay_equal": live == state, "replay_difference": first_difference(live, state),
        "history_points": rebuilt.points, "history_kept": len(rebuilt.history),
        "wall_s": time.perf_counter() - began,
    }


# ------------------------------------------------------------------------------------------ results


def done_when(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 68's targets at population 256, asynchronous PBT and PB2 (None where that arm was not run)."""
    at = {a["scheduler"]: a for a in arms if a["population"] == TARGETS["population"]}
    checks: dict[str, Any] = {}
    for s in TARGETS["schedulers"]:
        a = at.get(s)
        checks[s] = None if a is None else {
            "report_p99_ms": a["report_ms"]["p99"] is not None and a["report_ms"]["p99"] <= TARGETS["report_p99_ms"],
            "decision_p99_ms": a["decision_ms"]["p99"] is not None
            and a["decision_ms"]["p99"] <= TARGETS["decision_p99_ms"],
            "replay_s": a["replay_s"] <= TARGETS["replay_s"],
            "replay_equal": a["replay_equal"],
        }
    pb2 = at.get("pb2")
    measured = all(c is not None for c in checks.values())
    return {**checks, "pb2_history_points": pb2["history_points"] if pb2 else None,
            "pb2_history_kept": pb2["history_kept"] if pb2 else None,
            "rss_per_report_bytes": {s: a["rss_per_report_bytes"] for s, a in at.items()},
            "holds": measured and all(all(c.values()) for c in checks.values()) if measured else None}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    twin = right.twinx()
    for i, s in enumerate(out["setup"]["schedulers"]):
        arms = sorted((a for a in out["arms"] if a["scheduler"] == s), key=lambda a: a["population"])
        x = [a["population"] for a in arms]
        left.plot(x, [a["report_ms"]["p99"] for a in arms], "o-", color=f"C{i}", label=f"{s}: report p99")
        left.plot(x, [a["decision_ms"]["p99"] for a in arms], "s--", color=f"C{i}", label=f"{s}: decision p99")
        right.plot(x, [a["rss_per_report_bytes"] / 1024 for a in arms], "o-", color=f"C{i}", label=f"{s}: RSS/report")
        twin.plot(x, [a["replay_s"] for a in arms], "s--", color=f"C{i}", label=f"{s}: replay")
    pops = sorted({a["population"] for a in out["arms"]})
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(pops, [str(p) for p in pops])
        ax.minorticks_off()
    left.axhline(TARGETS["report_p99_ms"], color="k", lw=0.8, ls=":")
    left.axhline(TARGETS["decision_p99_ms"], color="tab:red", lw=0.8, ls=":")
    left.set(yscale="log", xlabel="population", ylabel="ms (dotted: the targets)")
    left.legend(fontsize=7)
    right.set(xlabel="population", ylabel="actor RSS growth per report (KiB), solid")
    twin.set_ylabel("--resume replay (s), dashed")
    right.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="upper center")
    fig.suptitle(f"population control plane, {out['setup']['reports_per_member']} reports per member "
                 f"({out['date'][:10]}, {(out['git_commit'] or '')[:9]}; done_when {out['done_when']['holds']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def first_collect_s() -> float:
    """Arrow's first Parquet write and read in a process (~0.3 s), paid before the arms so that each arm's
    replay_s is alike; a --resume in a fresh process pays it once more (recorded beside)."""
    exp_dir = Path(tempfile.mkdtemp(prefix="population_scale-warm-"))
    try:
        LineageLog(exp_dir, "warm").report(1, 1.0, {}, member=0)
        t = time.perf_counter()
        collect(exp_dir)
        return time.perf_counter() - t
    finally:
        shutil.rmtree(exp_dir, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--populations", type=int, nargs="+", default=list(POPULATIONS))
    ap.add_argument("--schedulers", nargs="+", choices=list(SCHEDULERS), default=list(SCHEDULERS))
    ap.add_argument("--reports", type=int, default=REPORTS, help="per member (the budget: this x interval steps)")
    ap.add_argument("--period", type=float, default=PERIOD_S, help="seconds between a member's reports")
    ap.add_argument("--out", default=str(RESULTS), help="folder of population_scale.{json,png}")
    args = ap.parse_args(argv)
    default = (args.populations, args.schedulers, args.reports, args.period) == (
        list(POPULATIONS), list(SCHEDULERS), REPORTS, PERIOD_S)
    if not default and Path(args.out).resolve() == RESULTS:
        ap.error("a run with other than the default arms needs --out elsewhere (never over the real results)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load, started = os.getloadavg(), time.time()
    import ray

    arms, warm_s = [], first_collect_s()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a `ray start` one
    try:
        for size in args.populations:
            for s in args.schedulers:
                a = run_arm(size, s, args.reports, args.period)
                arms.append(a)
                print(f"population {size} {s}: {a['reports']} reports, {a['exploits']} exploits, report p50/p99 "
                      f"{a['report_ms']['p50']:.1f}/{a['report_ms']['p99']:.1f} ms, decision p50/p99 "
                      f"{a['decision_ms']['p50'] or 0:.1f}/{a['decision_ms']['p99'] or 0:.1f} ms, "
                      f"replay {a['replay_s']:.2f} s, equal {a['replay_equal']}", flush=True)
    finally:
        ray.shutdown()
    out = {
        **provenance(started, load, measures=MEASURES),
        "setup": {
            "populations": args.populations, "schedulers": args.schedulers, "reports_per_member": args.reports,
            "scheduler_configs": {s: SCHEDULERS[s].model_dump(mode="json") for s in args.schedulers},
            "space": SPACE, "mode": MODE, "seed": SEED, "noise": NOISE, "decision_wait_s": DECISION_WAIT_S,
            "metric": "2 + 2 exp(-3 step/steps) + 0.5 ((log10 lr + 2.5)^2 + 4 (wd - 0.05)^2) + N(0, noise), "
                      "the noise seeded by (seed, trial, step, report count)",
            "members": "one asyncio coroutine per member in the driver, following search/trial.py: lineage row, "
                       "report, decision past burn-in, exploit logged and followed; a report every period_s from a "
                       "seeded phase (at once when behind)",
            "period_s": args.period,
            "offered_reports_per_s": {str(n): round(n / args.period, 1) for n in args.populations},
            "rss": "the actor's worker process (this driver's descendant titled ray::PopulationActor), psutil: "
                   "right after its first answer, and after the last member's end; PB2's fits run in a process of "
                   "the actor's own (search.population._fit_process), its RSS at the end apart "
                   "(fit_process_rss_bytes)",
            "replay": "search.lineage.collect + Population(...).replay, timed together (search/driver.py)",
            "first_collect_s": warm_s,
        },
        "arms": arms,
        "targets": TARGETS,
        "done_when": done_when(arms),
    }
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "population_scale.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, folder / "population_scale.png")
    print(json.dumps({"done_when": out["done_when"]}, indent=1))
    return out


if __name__ == "__main__":
    main()
