"""PB2 at any history length (issue 68): what a decision costs as the history grows, with the GP fit on the
newest `PB2_WINDOW` points (the product: each fit also starts from the last one's kernel and stops after
`GP_MAX_EVALS` evaluations) and on all of them (the rule before issue 68: every fit from scikit-learn's starting
kernel, unbounded), and what the product's rule does to quality on a toy, the same seeds for both.

- **Decision time**: `search.population.Population` (PB2, six members, two hyperparameters) fed a seeded
  history of N points; then, `--decisions` times, one more report of the worst member (a new point: each
  decision fits again, as in an asynchronous population) and its decision, timed. N = 200 to 25,600 with the
  window; 200 to 1,000 without it (a fit is cubic in its points: beyond that, minutes).
- **Quality**: Ray's triangle-wave learning-rate toy (`ray/tune/examples/pbt_function.py`: the accuracy
  grows fastest at an lr that rises from 1e-3 to 1e-2 and falls back as the accuracy goes from 0 to 200; too
  high an lr loses accuracy), every member starting at lr 1e-4, PB2 over lr in [1e-4, 0.02], a report every
  5 iterations (as Ray's example perturbs), driven through `Population` in one process: a member deciding
  an exploit takes its donor's accuracy at the donor's report. Solved: a member's accuracy past 200 within
  1,000 iterations. Populations 4 and 8, seeds 0-9, window and no window: the iterations to solve, side by
  side.

One command: `python bench/pb2_window.py` -> bench/results/pb2_window.json and .png.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from provenance import provenance  # noqa: E402

from search import population  # noqa: E402
from search.population import PB2_WINDOW, Population  # noqa: E402
from search.schedulers import SchedulerConfig  # noqa: E402
from search.space import parse_space  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MEASURES = ["search/population.py", "bench/pb2_window.py"]
SPACE = parse_space({"optimizer.lr": {"loguniform": [1e-4, 1e-1]}, "optimizer.weight_decay": {"uniform": [0.0, 0.2]}})
WINDOWED = [200, 1_000, 10_000, 25_600]
UNBOUNDED = [200, 500, 1_000]
TOY_SPACE = parse_space({"lr": {"uniform": [1e-4, 0.02]}})
TOY_INTERVAL, TOY_MAX, TOY_SOLVED = 5, 1_000, 200.0
TARGET_S = 0.5  # issue 68: a decision at 10,000 points, p99


def _cfg() -> SchedulerConfig:
    return SchedulerConfig(name="pb2", interval=1, quantile_fraction=0.25)


class PopulationBefore(Population):
    """The rule before issue 68: every point (no window), each fit from scikit-learn's starting kernel, the
    optimiser at scipy's default bound (15,000 evaluations). Picklable: a Ray actor and its fit process run it."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **{**kw, "window": None})

    def fit_job(self) -> Any:
        job = super().fit_job()
        return functools.partial(fit_before, *job.args, **{**job.keywords, "start": None})


def fit_before(*args: Any, **kw: Any) -> Any:
    evals, population.GP_MAX_EVALS = population.GP_MAX_EVALS, 15_000
    try:
        return population.GPFit.fit(*args, **kw)
    finally:
        population.GP_MAX_EVALS = evals


def rule(window: int | None) -> type[Population]:
    """The product's rule (`window`: the newest PB2_WINDOW points, each fit from the last fit's kernel, at most
    GP_MAX_EVALS evaluations), or with `window` None the rule before issue 68."""
    return Population if window is not None else PopulationBefore


def decision_times(points: int, window: int | None, decisions: int) -> dict[str, Any]:
    """Seconds per decision of the worst member, a new point before each."""
    members = 6
    pop = rule(window)(_cfg(), SPACE, "min", 10**9, members, seed=0, window=window)
    rng = random.Random(points)
    loss = [3.0] * members
    hp = [{"optimizer.lr": 10 ** (-4 + 3 * i / (members - 1)), "optimizer.weight_decay": 0.04 * i} for i in range(members)]
    step = 0
    while pop.points < points + members:  # the first report of each member records no point
        step += 1
        for i in range(members):
            loss[i] -= 0.01 * (1 + rng.random()) * (1 - abs(i - 3) / 4) / (1 + step / 500)
            pop.record(f"t{i}", i, step, loss[i], hp[i], f"/pins/t{i}/{step}")
    times = []
    for k in range(decisions + 1):  # the first untimed: the process imports scikit-learn at its first fit
        step += 1
        worst = min(pop.members.values(), key=lambda m: m.score)
        i = worst.index
        loss[i] += 0.01
        pop.record(worst.trial, i, step, loss[i], dict(worst.hparams), f"/pins/{worst.trial}/{step}")
        t = time.perf_counter()
        decision = pop.decide(worst.trial)
        if k:
            times.append(time.perf_counter() - t)
        assert decision is not None, "the worst member explores"
        pop.taken(worst.trial, decision.exploit_id, True)  # (the trial's word once it holds the donor's pin)
        pop.members[worst.trial].step = step  # train on from here (a simulated restore of the donor)
    times.sort()
    return {"points": pop.points, "window": window, "fit_on": pop.gp.size, "decisions": decisions,
            "p50_s": round(statistics.median(times), 4), "p99_s": round(times[min(len(times) - 1, int(0.99 * len(times)))], 4),
            "max_s": round(times[-1], 4)}


def toy(population: int, seed: int, window: int | None) -> dict[str, Any]:
    """Iterations until a member's accuracy passes 200 (None: not within 1,000)."""
    pop = rule(window)(SchedulerConfig(name="pb2", interval=TOY_INTERVAL, quantile_fraction=0.25), TOY_SPACE, "max",
                     TOY_MAX, population, seed=seed, window=window)
    noise = random.Random(seed)
    acc, lr = [0.0] * population, [1e-4] * population
    at_pin: dict[str, float] = {}
    exploits = 0
    for it in range(1, TOY_MAX + 1):
        for i in range(population):
            optimal = min(0.01, max(0.001, 0.01 * acc[i] / 100 if acc[i] < 100 else 0.01 - 0.01 * (acc[i] - 100) / 100))
            q = max(lr[i], optimal) / min(lr[i], optimal)
            if q < 3:
                acc[i] += noise.random() / q
            elif lr[i] > optimal:
                acc[i] -= (q - 3) * noise.random()
            acc[i] = max(0.0, acc[i] + 2 * noise.gauss(0, 1))
            if acc[i] > TOY_SOLVED:
                return {"solved_at": it, "exploits": exploits, "points": pop.points}
        if it % TOY_INTERVAL:
            continue
        for i in range(population):
            pin = f"{i}/{it}"
            at_pin[pin] = acc[i]
            if pop.record(f"m{i}", i, it, acc[i], {"lr": lr[i]}, pin):
                decision = pop.decide(f"m{i}")
                if decision is not None:
                    pop.taken(f"m{i}", decision.exploit_id, True)
                    acc[i], lr[i], exploits = at_pin[decision.pin], decision.values["lr"], exploits + 1
    return {"solved_at": None, "exploits": exploits, "points": pop.points}


def quality(seeds: list[int], populations: list[int]) -> dict[str, Any]:
    out = {}
    for n in populations:
        arms = {}
        for name, window in (("window", PB2_WINDOW), ("no_window", None)):
            runs = [toy(n, s, window) for s in seeds]
            solved = [r["solved_at"] for r in runs if r["solved_at"] is not None]
            arms[name] = {"solved": len(solved), "seeds": len(seeds), "median_iterations": statistics.median(solved) if solved else None,
                          "iterations": [r["solved_at"] for r in runs], "exploits": [r["exploits"] for r in runs],
                          "history_points": [r["points"] for r in runs]}
            print(f"toy population {n} {name}: solved {len(solved)}/{len(seeds)}, median {arms[name]['median_iterations']}",
                  flush=True)
        w, u = arms["window"], arms["no_window"]
        arms["no_worse"] = w["solved"] >= u["solved"] and (w["median_iterations"] or 1e9) <= (u["median_iterations"] or 1e9) * 1.05
        out[str(n)] = arms
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("window", f"newest {PB2_WINDOW} points"), ("no_window", "all points (before)")):
        rows = out["decision"][key]
        left.plot([r["points"] for r in rows], [r["p99_s"] for r in rows], "o-", label=label)
    left.axhline(TARGET_S, color="grey", ls=":", label="target (p99)")
    left.set(xscale="log", yscale="log", xlabel="points of history", ylabel="seconds per decision (p99)",
             title="a PB2 decision, 2 cores")
    left.legend(fontsize=8)
    pops = list(out["toy"])
    for k, (key, label) in enumerate((("window", "window"), ("no_window", "no window"))):
        right.bar([p + k * 0.4 for p in range(len(pops))], [out["toy"][p][key]["median_iterations"] or 0 for p in pops],
                  0.4, label=label)
    right.set_xticks([p + 0.2 for p in range(len(pops))], [f"population {p}" for p in pops])
    right.set(ylabel="median iterations to solve", title="triangle-wave lr toy, PB2, same seeds")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=20, help="timed decisions per history length (no window: 5)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--populations", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--out", default=str(RESULTS / "pb2_window.json"))
    args = ap.parse_args(argv)
    load, started = os.getloadavg(), time.time()
    decision = {"window": [], "no_window": []}
    for points in WINDOWED:
        decision["window"].append(decision_times(points, PB2_WINDOW, args.decisions))
        print("window", decision["window"][-1], flush=True)
    for points in UNBOUNDED:
        decision["no_window"].append(decision_times(points, None, max(2, args.decisions // 4)))
        print("no window", decision["no_window"][-1], flush=True)
    toy_out = quality(list(range(args.seeds)), args.populations)
    at_10k = next(r for r in decision["window"] if r["points"] >= 10_000)
    out = {
        "window": PB2_WINDOW,
        "decision": decision,
        "toy": toy_out,
        "done_when": {"decision_p99_s_at_10000": at_10k["p99_s"], "target_s": TARGET_S,
                      "decision_holds": at_10k["p99_s"] <= TARGET_S,
                      "toy_no_worse": all(v["no_worse"] for v in toy_out.values())},
        **provenance(started, load, measures=MEASURES),
    }
    path = Path(args.out)
    path.write_text(json.dumps(out, indent=1) + "\n")
    plot(out, path.with_suffix(".png"))
    print(json.dumps(out["done_when"]))
    return out


if __name__ == "__main__":
    main()
