"""Search quality where a hyperparameter schedule matters: PBT (asynchronous and synchronous), PB2, ASHA and
random search at equal total training steps, several seeds each, against the best fixed configuration of a
large grid (issue 25).

    .venv/bin/python bench/pbt_quality.py --data data/stdlib [--seeds 5] [--steps 1600] [--interval 100]
        [--only pbt random ...] [--summarize-only] [--dry-run --out DIR]

The task (`TASK` below; why it was chosen: bench/README.md): a 2-block Llama-form model of width 32 on the
byte-level standard-library corpus, batch 8 x 128 tokens, AdamW with a *constant* base learning rate (no
warmup, no decay), `budget` optimizer steps per trial; the space is the learning rate and the weight decay.
At this budget the small model reaches the noise floor of its constant learning rate, so a late decay is
worth more than any choice of a fixed value: any annealing is what the search finds.

The harness (`harness` in the JSON): each trial is a Tune *function* trainable that runs the product's
`trainers.Trainer` in the trial's process (one CPU thread, world size 1, `parallel.engine: none`, no Ray
Train), built from the product's experiment config (`search.config`: base run, overrides, space, seeded
starting members) with the product's schedulers (`search.schedulers.build_scheduler`: PBT with
`BoundedExplore`, PB2, ASHA, FIFO for random search). A trial reports `val_loss` every `interval` steps;
under PBT/PB2 each report carries the Trainer's committed checkpoint and Tune pauses and restores trials
(exploit = a restore from the donor's checkpoint, `reuse_actors=True`). This measures the search methods'
quality; what hosting each trial as a Ray Train run costs is bench/pbt_overhead.py's subject.

Equal total training steps: PBT, PB2 and random search train `population` trials of `budget` steps; ASHA
samples up to `--asha-samples` configurations and is stopped once the same total is spent (`BudgetStop`);
each method's actual total (counted step by step in the trials) is in the JSON. The grid trains each of
its configurations for the full budget; its total is reported beside it.

Writes bench/results/pbt_quality.{json,png} (or `--out`); per-experiment logs in bench/_work/pbt_quality
(`--work`), from which `--summarize-only` rewrites the results without training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.provenance import provenance  # noqa: E402

RESULTS, WORK = ROOT / "bench" / "results", ROOT / "bench" / "_work" / "pbt_quality"

METHODS = ("pbt", "pbt_sync", "pb2", "asha", "random")
ALL = (*METHODS, "grid")
LOG = "trials.jsonl"  # in each experiment's folder: one line per report of every trial
SUMMARY = "summary.json"

TASK = {
    "what": (
        "learning rate and weight decay of AdamW with a constant base learning rate (no warmup, no decay) for "
        "a 2-block Llama-form model of width 32 (2 heads) on the byte-level standard-library corpus, batch 8 x "
        "128 tokens; best val_loss over the run (128 fixed validation windows)"
    ),
    "why": (
        "at this budget the small model reaches the noise floor of a constant learning rate: dropping the "
        "learning rate 10x for the last quarter of the run lowered val_loss by about 0.05 below the best "
        "constant one (pilot: 1.946 at lr 4e-3 constant, 1.894 at lr 8e-3 then 8e-4), while with wider models "
        "or shorter budgets a decay gained 0.00-0.02 (they were still far from the floor). A schedule found "
        "by the search can beat every fixed configuration here; a fixed one cannot anneal."
    ),
    "base": "examples/pbt-demo.yaml (examples/tiny-dense.yaml) with the overrides below",
}
OVERRIDES = {
    "model.dim": 32,
    "model.n_heads": 2,
    "model.n_layers": 2,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 8,
    "train.eval_batches": 16,
    "train.tensorboard": False,
    "parallel.engine": "none",
    "schedule.name": "constant",
}
SPACE = {
    "optimizer.lr": {"loguniform": [3.0e-4, 3.0e-2]},
    "optimizer.weight_decay": {"uniform": [0.0, 0.2]},
}


# ------------------------------------------------------------------------------------------ trials


def quality_trial(config: dict[str, Any], exp: Any, save: bool, log: str) -> None:
    """One Tune function trial: the product's Trainer in this process, restored from Tune's checkpoint if it
    has one (a PBT exploit or a resumed pause), reporting val_loss every `interval` steps."""
    import torch
    from ray import tune

    from search.schedulers import TIME_ATTR
    from trainers.checkpoint_files import link_tree
    from trainers.trainer import Trainer

    torch.set_num_threads(1)
    hparams = {k: config[k] for k in exp.search_space}
    trial = tune.get_context().get_trial_id()
    run_dir = Path(log).parent / "runs" / f"{trial}-{uuid.uuid4().hex[:6]}"
    checkpoint = tune.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else contextlib.nullcontext(None) as d:
        resume = next(Path(d).glob("step_*")) if d else None
        cfg = exp.run_config(
            hparams,
            name=run_dir.name,
            run_dir=str(run_dir),
            **{"checkpoint.resume": str(resume) if resume else "none", "checkpoint.mode": "sync",
               "checkpoint.keep": 1},
        )
        trainer = Trainer(cfg, progress=False)
    steps, interval = exp.steps, exp.scheduler.interval
    restored_at = trainer.step if resume else None
    try:
        while trainer.step < steps:
            start, trained = time.perf_counter(), 0
            stop = min((trainer.step // interval + 1) * interval, steps)
            while trainer.step < stop:
                trainer.train_step()
                trained += 1
            val = trainer.evaluate()
            row = {
                "trial": trial,
                "step": trainer.step,
                "val_loss": val,
                "trained": trained,
                "lr": cfg.optimizer.lr,
                "wd": cfg.optimizer.weight_decay,
                "restored_at": restored_at,
                "interval_s": time.perf_counter() - start,
                "time": time.time(),
            }
            with open(log, "a") as f:  # one short line per write: appends from trials do not interleave
                f.write(json.dumps(row) + "\n")
            restored_at = None
            metrics = {"val_loss": val, TIME_ATTR: trainer.step, "trained": trained}
            if not save:
                tune.report(metrics)
                continue
            path = trainer.save()
            with tempfile.TemporaryDirectory(dir=run_dir) as tmp:  # Tune copies the step folder on report
                link_tree(path, Path(tmp) / path.name)
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))
    finally:
        trainer.log.close("FINISHED" if trainer.step >= steps else "KILLED")
        trainer.engine.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _budget_stop(total: int):
    from ray import tune

    class BudgetStop(tune.Stopper):
        """Stops the whole experiment once its trials have trained `total` steps (ASHA at equal compute)."""

        def __init__(self) -> None:
            self.trained = 0

        def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
            self.trained += int(result.get("trained", 0))
            return False

        def stop_all(self) -> bool:
            return self.trained >= total

    return BudgetStop()


# ------------------------------------------------------------------------------------- experiments


def experiment(args: argparse.Namespace, method: str, seed: int, population: int) -> Any:
    """The product's experiment config for one method and seed. The seed is the search's: it draws the starting
    members and the explore decisions. The training run's own seed (model init, data order) is `--run-seed`
    for every method and the grid: they search the same problem (between run seeds alone the best val_loss
    moved by ~0.1, more than any difference between the methods: bench/README.md)."""
    from search.config import load_experiment

    sched = _scheduler_yaml(args, method)
    overrides = {**OVERRIDES, "data.path": args.data, "seed": args.run_seed}
    if args.dry_run:
        overrides.update({"model.max_seq_len": 32, "data.seq_len": 32, "train.eval_batches": 2})
    return load_experiment(
        ROOT / "examples" / "pbt-demo.yaml",
        [
            f"name={method}-s{seed}",
            f"seed={seed}",
            f"storage={args.work}",
            f"population={population}",
            f"scheduler={sched}",
            f"budget={{steps: {args.steps}}}",
            f"space={json.dumps(SPACE)}",
            f"overrides={json.dumps(overrides)}",
            "resources={workers: 1, cpus_per_worker: 1}",
        ],
    )


def _scheduler_yaml(args: argparse.Namespace, method: str) -> str:
    i = args.interval
    if method in ("pbt", "pbt_sync"):
        f = args.factors
        return (
            f"{{name: pbt, interval: {i}, burn_in: {args.burn_in}, quantile_fraction: {args.quantile}, "
            f"resample_probability: {args.resample}, perturbation_factors: [{f[0]}, {f[1]}], "
            f"synch: {str(method == 'pbt_sync').lower()}}}"
        )
    if method == "pb2":
        return f"{{name: pb2, interval: {i}, quantile_fraction: {args.quantile}}}"
    if method == "asha":
        return f"{{name: asha, interval: {i}, grace_period: {args.asha_grace or i}, reduction_factor: 3}}"
    return f"{{name: random, interval: {i}}}"


def grid_values(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    (lo, hi), (wlo, whi) = SPACE["optimizer.lr"]["loguniform"], SPACE["optimizer.weight_decay"]["uniform"]
    n, m = args.grid_lrs, args.grid_wds
    lrs = [lo * (hi / lo) ** (k / (n - 1)) for k in range(n)] if n > 1 else [math.sqrt(lo * hi)]
    wds = [wlo + (whi - wlo) * k / (m - 1) for k in range(m)] if m > 1 else [0.1]
    return lrs, wds


def run_one(args: argparse.Namespace, method: str, seed: int) -> dict[str, Any]:
    from ray import tune

    from search.schedulers import TIME_ATTR, build_scheduler, population_space

    population = args.asha_samples if method == "asha" else args.population
    exp = experiment(args, "random" if method == "grid" else method, seed, population)
    name = f"{method}-s{seed}"
    exp_dir = Path(args.work) / name
    shutil.rmtree(exp_dir, ignore_errors=True)
    exp_dir.mkdir(parents=True)
    log = exp_dir / LOG
    if method == "grid":
        lrs, wds = grid_values(args)
        space = {"optimizer.lr": tune.grid_search(lrs), "optimizer.weight_decay": tune.grid_search(wds)}
    else:
        space = population_space(exp.members())
    scheduler = build_scheduler(exp.scheduler, exp.search_space, exp.steps, seed=seed)
    budget = args.population * args.steps
    stop = _budget_stop(budget) if method == "asha" else {TIME_ATTR: exp.steps}
    save = method in ("pbt", "pbt_sync", "pb2")  # only these restore (an exploit); the others never do
    trainable = tune.with_resources(
        tune.with_parameters(quality_trial, exp=exp, save=save, log=str(log)), {"cpu": args.cpus_per_trial}
    )
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            scheduler=scheduler, metric="val_loss", mode="min", reuse_actors=True,
            max_concurrent_trials=args.concurrent,
        ),
        run_config=tune.RunConfig(
            name="tune",
            storage_path=str(exp_dir),
            stop=stop,
            verbose=0,
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None),  # an exploit needs the donor's
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    started = time.time()
    tuner.fit()
    wall = time.time() - started
    shutil.rmtree(exp_dir / "tune", ignore_errors=True)  # checkpoints: the log holds what is summarized
    shutil.rmtree(exp_dir / "runs", ignore_errors=True)
    summary = summarize_experiment(exp_dir, wall, method, seed)
    (exp_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    return summary


def summarize_experiment(exp_dir: Path, wall: float, method: str, seed: int) -> dict[str, Any]:
    rows = [json.loads(line) for line in (exp_dir / LOG).read_text().splitlines() if line.strip()]
    best = min(rows, key=lambda r: r["val_loss"])
    trials = sorted({r["trial"] for r in rows})
    out: dict[str, Any] = {
        "method": method,
        "seed": seed,
        "best_val_loss": best["val_loss"],
        "best_at": {k: best[k] for k in ("trial", "step", "lr", "wd")},
        "total_steps": sum(r["trained"] for r in rows),
        "wall_s": wall,
        "trials": len(trials),
        "restores": sum(1 for r in rows if r["restored_at"] is not None),
        "reports": len(rows),
    }
    # the schedule of the trial that reached the best: its (lr, wd) at each of its reports up to that one
    own = sorted((r for r in rows if r["trial"] == best["trial"] and r["time"] <= best["time"]), key=lambda r: r["time"])
    out["best_trial_schedule"] = [[r["step"], r["lr"], r["wd"], r["val_loss"]] for r in own]
    if method == "grid":
        per_config: dict[tuple[float, float], float] = {}
        for r in rows:
            key = (r["lr"], r["wd"])
            per_config[key] = min(per_config.get(key, math.inf), r["val_loss"])
        out["configs"] = [{"lr": k[0], "wd": k[1], "best_val_loss": v} for k, v in sorted(per_config.items())]
    return out


# ------------------------------------------------------------------------------------------ results


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def verdict(methods: dict[str, dict[str, Any]], pbt: str = "pbt") -> dict[str, Any]:
    """The issue's done-when, from the numbers: `pbt`'s mean best val_loss below random search's and ASHA's
    by more than twice the larger of the two methods' seed standard deviations, and within twice PBT's
    seed standard deviation of the grid's best fixed configuration (or better)."""
    if pbt not in methods:
        return {"holds": None, "why": f"{pbt} was not run"}
    p = methods[pbt]["stats"]
    out: dict[str, Any] = {}
    checks = []
    for other in ("random", "asha"):
        if other not in methods:
            out[f"beats_{other}"] = None
            continue
        o = methods[other]["stats"]
        margin, needed = o["mean"] - p["mean"], 2 * max(p["std"], o["std"])
        ok = margin > needed
        out[f"beats_{other}"] = {"margin": margin, "needed": needed, "holds": ok}
        checks.append(ok)
    if "grid" in methods:
        g = methods["grid"]["stats"]
        gap, allowed = p["mean"] - g["mean"], 2 * p["std"]
        ok = gap <= allowed
        out["near_grid"] = {"gap_to_grid_best": gap, "allowed": allowed, "holds": ok}
        checks.append(ok)
    else:
        out["near_grid"] = None
    seeds_ok = all(m["stats"]["n"] >= 5 for k, m in methods.items() if k != "grid")
    out["seeds_at_least_5"] = seeds_ok
    out["holds"] = bool(checks) and all(checks) and len(checks) == 3 and seeds_ok
    return out


def write_results(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], load_before, started) -> dict:
    methods: dict[str, dict[str, Any]] = {}
    for method in ALL:
        rows = sorted(runs.get(method, []), key=lambda r: r["seed"])
        if not rows:
            continue
        best = [r["best_val_loss"] for r in rows]
        methods[method] = {
            "seeds": [r["seed"] for r in rows],
            "best_val_loss": best,
            "total_steps": [r["total_steps"] for r in rows],
            "wall_s": [r["wall_s"] for r in rows],
            "stats": _stats(best),
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in rows),
            "total_steps_mean": statistics.fmean(r["total_steps"] for r in rows),
            "trials": [r["trials"] for r in rows],
            "restores": [r["restores"] for r in rows],
            "best_at": [r["best_at"] for r in rows],
            "best_trial_schedule": [r["best_trial_schedule"] for r in rows],
            **({"configs": [r["configs"] for r in rows]} if method == "grid" else {}),
        }
    lrs, wds = grid_values(args)
    out = {
        **provenance(started, load_before),
        "dry_run": args.dry_run,
        "task": {**TASK, "overrides": OVERRIDES, "space": SPACE, "data": args.data},
        "harness": (
            "each trial is a Tune function trainable running the product's trainers.Trainer in its own process "
            "(world size 1, parallel.engine none, 1 torch thread, no Ray Train), with the product's experiment "
            "config (search.config), schedulers (search.schedulers.build_scheduler, PBT's BoundedExplore) and "
            "seeded starting members; PBT/PB2 exploit through Tune's pause/restore of the Trainer's committed "
            "checkpoints (reuse_actors=True). It measures the search methods' quality; the cost of hosting "
            "trials as Ray Train runs is bench/pbt_overhead.py's subject."
        ),
        "setup": {
            "budget_steps_per_trial": args.steps,
            "interval": args.interval,
            "population": args.population,
            "equal_total_steps": args.population * args.steps,
            "asha": {"max_samples": args.asha_samples, "grace_period": args.asha_grace or args.interval,
                     "reduction_factor": 3, "stopped_at_total_steps": args.population * args.steps},
            "pbt": {"burn_in": args.burn_in, "quantile_fraction": args.quantile,
                    "resample_probability": args.resample, "perturbation_factors": list(args.factors)},
            "pb2": {"quantile_fraction": args.quantile},
            "grid": {"lrs": lrs, "weight_decays": wds, "configs": len(lrs) * len(wds),
                     "steps_each": args.steps, "seeds": args.grid_seeds},
            "run_seed": args.run_seed,
            "seeds_are": "the search's seed (starting members, explore draws); the training run's seed is run_seed for all",
            "cpus_per_trial": args.cpus_per_trial,
            "concurrent_trials": args.concurrent,
        },
        "methods": methods,
        "done_when": verdict(methods),
        "done_when_sync_pbt": verdict(methods, "pbt_sync"),
        "done_when_pb2": verdict(methods, "pb2"),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pbt_quality.json").write_text(json.dumps(out, indent=1))
    plot(out, out_dir / "pbt_quality.png")
    table = {k: f"{v['stats']['mean']:.4f} +- {v['stats']['std']:.4f} ({v['total_steps_mean']:.0f} steps, "
                f"{v['wall_s_mean']:.0f} s)" for k, v in methods.items()}
    print(json.dumps({"methods": table, "done_when": out["done_when"]}, indent=1))
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8))
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    methods = out["methods"]
    names = [m for m in ALL if m in methods]
    for i, m in enumerate(names):
        s = methods[m]["stats"]
        a.bar(i, s["mean"], yerr=s["std"], color=f"C{i}", alpha=0.6, capsize=6, width=0.6)
        pts = methods[m]["best_val_loss"]
        a.scatter([i + 0.12 * (k - (len(pts) - 1) / 2) / max(len(pts), 1) * 2 for k in range(len(pts))], pts,
                  color="k", s=12, zorder=3)
    if "grid" in methods:
        a.axhline(methods["grid"]["stats"]["mean"], color="k", ls="--", lw=1,
                  label=f"grid's best fixed config ({out['setup']['grid']['configs']} configs)")
        a.legend(loc="upper right", fontsize=8)
    labels = [f"{m}\n{methods[m]['total_steps_mean']:.0f} steps\n{methods[m]['wall_s_mean']:.0f} s" for m in names]
    a.set_xticks(range(len(names)), labels, fontsize=8)
    vals = [v for m in names for v in methods[m]["best_val_loss"]]
    if vals:
        lo, hi = min(vals), max(vals)
        a.set_ylim(lo - 0.15 * (hi - lo + 1e-3), hi + 0.25 * (hi - lo + 1e-3))
    dw = out["done_when"]
    a.set_ylabel("best val_loss (mean +- std over seeds; dots: seeds)")
    a.set_title(f"equal total steps; done-when {'HOLDS' if dw.get('holds') else 'does not hold'}", fontsize=10)
    for m in ("pbt", "pbt_sync", "pb2"):
        if m not in methods:
            continue
        for k, sched in enumerate(methods[m]["best_trial_schedule"]):
            if sched:
                b.step([r[0] for r in sched], [r[1] for r in sched], where="pre", color=f"C{names.index(m)}",
                       alpha=0.6, label=m if k == 0 else None)
    if "grid" in methods:
        for k, at in enumerate(methods["grid"]["best_at"]):
            b.axhline(at["lr"], color="k", ls="--", lw=1, label="grid's best fixed lr" if k == 0 else None)
    b.set_yscale("log")
    b.set_xlabel("step")
    b.set_ylabel("learning rate of the trial that reached the best")
    b.set_title("schedules found (one line per seed)", fontsize=10)
    b.legend(fontsize=8)
    fig.suptitle(f"PBT vs other searches, {out['task']['what'][:90]}... ({out['date'][:10]}, {out['git_commit']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "stdlib"))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1600, help="optimizer steps per trial (the budget)")
    ap.add_argument("--interval", type=int, default=100, help="steps between reports (PBT/PB2 decisions)")
    ap.add_argument("--population", type=int, default=4, help="PBT/PB2 population, random search's samples")
    ap.add_argument("--asha-samples", type=int, default=32, help="ASHA: most configurations sampled")
    ap.add_argument("--asha-grace", type=int, default=None, help="ASHA: steps before the first stop (interval)")
    ap.add_argument("--quantile", type=float, default=0.25, help="PBT/PB2: bottom fraction copies the top")
    ap.add_argument("--burn-in", type=int, default=0, help="PBT: steps before the first exploit")
    ap.add_argument("--resample", type=float, default=0.25, help="PBT: resample probability")
    ap.add_argument(
        "--factors", type=float, nargs=2, default=(2.0, 0.5),
        help="PBT: perturbation factors (the product's default is 1.2 0.8; 2 0.5 here: bench/README.md)",
    )
    ap.add_argument("--grid-lrs", type=int, default=8, help="grid: learning rates (log-spaced over the space)")
    ap.add_argument("--grid-wds", type=int, default=2, help="grid: weight decays (evenly over the space)")
    ap.add_argument("--grid-seeds", type=int, default=1, help="grid: repeats (same run seed: the grid is deterministic)")
    ap.add_argument("--run-seed", type=int, default=0, help="the training runs' seed (init, data order), for all")
    ap.add_argument("--cpus-per-trial", type=float, default=0.5)
    ap.add_argument("--concurrent", type=int, default=4, help="trials of one experiment side by side")
    ap.add_argument("--only", nargs="+", choices=ALL, default=list(ALL))
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: rewrite the results from the experiments' summaries in --work")
    ap.add_argument("--dry-run", action="store_true",
                    help="a few steps of a tiny model, 2 seeds, 2x2 grid, into --out (for tests)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.seeds, args.steps, args.interval = min(args.seeds, 2), 8, 4
        args.population, args.asha_samples, args.grid_lrs, args.grid_wds = 2, 4, 2, 1
        if args.out == str(RESULTS) or args.work == str(WORK):
            ap.error("--dry-run needs its own --out and --work (never over the real results)")
    args.data = str(Path(args.data).resolve())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before, started = os.getloadavg(), time.time()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ALL}
    plan = [(m, s) for m in args.only for s in range(args.grid_seeds if m == "grid" else args.seeds)]
    if args.summarize_only:
        for m in ALL:  # everything in --work, --only or not
            for s in range(args.grid_seeds if m == "grid" else args.seeds):
                f = Path(args.work) / f"{m}-s{s}" / SUMMARY
                if f.is_file():
                    runs[m].append(json.loads(f.read_text()))
        write_results(args, runs, load_before, started)
        return
    import ray

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    ray.init(num_cpus=2 if not args.dry_run else 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        # the methods in turn for each seed: a slow hour of the machine falls on every method alike
        for seed in range(args.seeds):
            for m, s in plan:
                if s != seed:
                    continue
                row = run_one(args, m, s)
                runs[m].append(row)
                print(f"{m} seed {s}: best val_loss {row['best_val_loss']:.4f} at {row['best_at']}, "
                      f"{row['total_steps']} steps, {row['trials']} trials, {row['wall_s']:.0f} s", flush=True)
    finally:
        ray.shutdown()
    for m in ALL:  # methods not run this time keep their last summaries (e.g. --only pbt after a full run)
        if m in args.only:
            continue
        for s in range(args.grid_seeds if m == "grid" else args.seeds):
            f = Path(args.work) / f"{m}-s{s}" / SUMMARY
            if f.is_file():
                runs[m].append(json.loads(f.read_text()))
    write_results(args, runs, load_before, started)


if __name__ == "__main__":
    main()
