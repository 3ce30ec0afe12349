"""Search quality where a hyperparameter schedule matters: PBT (asynchronous and synchronous), PB2, ASHA and
random search at equal total training steps, 5 seeds each, at population 8 and 4, against the best fixed
configuration of a large grid (issues 25 and 43).

    .venv/bin/python bench/pbt_quality.py --data data/stdlib [--seeds 5] [--populations 8 4] [--steps 1600]
        [--only pbt random ...] [--summarize-only] [--dry-run --out DIR --work DIR]

The task (`TASK` below; why it was chosen: bench/README.md): a 2-block Llama-form model of width 32 on the
byte-level standard-library corpus, AdamW with a *constant* base learning rate (no warmup, no decay),
`budget` optimizer steps per trial; the space is the learning rate and the weight decay. At this budget the
small model reaches the noise floor of its constant learning rate, so a late decay is worth more than any
choice of a fixed value: any annealing is what the search finds.

The harness (`harness` in the JSON): each trial is a Tune *function* trainable that runs the product's
`trainers.Trainer` in the trial's process (one CPU thread, world size 1, `parallel.engine: none`, no Ray
Train), built from the product's experiment config (`search.config`: base run, overrides, space, seeded
starting members) with the product's population rule (`search.population`: PBT with `BoundedExplore`, PB2
on the search scale), Ray's ASHA and FIFO for random search, and the product's default PBT settings
(`SchedulerConfig()`). A trial reports `val_loss` every `interval` steps; under PBT/PB2 each report pins the
Trainer's committed checkpoint with the lineage its state was trained with (`lineage.json`: the
hyperparameters from each step on, the donors' before each exploit; `origin.json`: the trial, step and
weights' fingerprint that wrote it, checked at each restore), hands it to the population and follows its
decision: an exploit restores the donor's pin in place (`Trainer.restore`), as the product's trials do. Every member of an
experiment runs at once (2 CPUs shared). This measures the search methods' quality; what hosting each trial
as a Ray Train run costs is bench/pbt_overhead.py's subject.

Equal total training steps: PBT, PB2 and random search train `population` trials of `budget` steps; ASHA
samples up to `--asha-samples` configurations and is stopped once the same total is spent (`BudgetStop`);
each method's actual total (counted step by step in the trials) is in the JSON. The grid trains each of
its configurations for the full budget; its total is reported beside it.

The replay check: each PBT seed's best report's lineage is re-trained from scratch in one run
(`replay_lineage`: the Trainer with `set_hparams` at each change) and its val_loss at that step is put
beside the reported one (`replay` in the JSON).

Writes bench/results/pbt_quality.{json,png} (or `--out`); per-experiment logs in bench/_work/pbt_quality
(`--work`), from which `--summarize-only` rewrites the results without training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.provenance import provenance  # noqa: E402
from search.schedulers import SchedulerConfig  # noqa: E402

DEFAULTS = SchedulerConfig()  # the product's PBT settings: what the benchmark measures unless told otherwise

RESULTS, WORK = ROOT / "bench" / "results", ROOT / "bench" / "_work" / "pbt_quality"

METHODS = ("pbt", "pbt_sync", "pb2", "asha", "random")
ALL = (*METHODS, "grid")
LOG = "trials.jsonl"  # in each experiment's folder: one line per report of every trial
SUMMARY = "summary.json"
LINEAGE = "lineage.json"  # in a trial's checkpoint: the hyperparameters its state was trained with, by step
ORIGIN = "origin.json"  # beside it: the trial and step that wrote the checkpoint, and its weights' fingerprint
REPLAYED = ("pbt", "pbt_sync")  # methods whose best lineage is re-trained from scratch (the replay check)

TASK = {
    "what": (
        "learning rate and weight decay of AdamW with a constant base learning rate (no warmup, no decay) for "
        "a 2-block Llama-form model of width 32 (2 heads) on the byte-level standard-library corpus, batch 8 x "
        "128 tokens; best val_loss over the run (128 fixed validation windows)"
    ),
    "why": (
        "at this budget a late decay of the learning rate is worth more than any fixed value: measured under "
        "this harness (`hand_schedules`), the grid's best rate (4.2e-3, weight decay 0) held throughout reached "
        "1.874, the same rate x0.3 for the last eighth 1.838 and x0.5 from 13/16 1.843, while a decay from half "
        "the run (x0.5 at every decision, PBT's greedy path) reached 1.864 and twice the rate then x0.1 for the "
        "last quarter (the first pilot's schedule) 1.918. A schedule found by the search can beat every fixed "
        "configuration here; a fixed one cannot anneal."
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


def checkpoint_step_folder(folder: Path, origin: dict[str, Any] | None) -> Path:
    """The Trainer checkpoint in a trial's Tune checkpoint: the one its `origin.json` names. Tune can persist
    two reports of a trial into one checkpoint folder (after PBT pauses a trial, its restart may reuse the
    index of the report before: Ray 2.60), which then holds two step folders beside the later report's
    lineage and origin; the later one is the state Tune registered (found 2026-11-28, bench/README.md)."""
    from trainers.checkpoint_files import checkpoint_step

    steps = sorted(folder.glob("step_*"), key=checkpoint_step)
    named = [p for p in steps if origin is not None and checkpoint_step(p) == origin["step"]]
    return (named or steps)[-1]  # without an origin (an older checkpoint): the latest step


def fingerprint(model: Any) -> list[float]:
    """The weights' sum and sum of squares (float64): equal for equal states, checked at every restore."""
    import torch

    with torch.no_grad():
        ps = [p.detach().double() for p in model.parameters()]
        return [float(sum(p.sum() for p in ps)), float(sum((p * p).sum() for p in ps))]


def quality_trial(config: dict[str, Any], exp: Any, population: str | None, log: str, pins: str) -> None:
    """One Tune function trial: the product's Trainer in this process, reporting val_loss every `interval`
    steps. Under PBT/PB2 each report's committed checkpoint is pinned (with the lineage its state was trained
    with and its origin) and handed to the experiment's `search.population` actor, whose decision the trial
    follows: an exploit restores the donor's pin with the explored values (`Trainer.restore`), in place."""
    import ray
    import torch
    from ray import tune

    from search.schedulers import MEMBER, TIME_ATTR
    from trainers.checkpoint_files import link_tree
    from trainers.trainer import Trainer

    torch.set_num_threads(1)
    hparams = {k: config[k] for k in exp.search_space}
    trial = tune.get_context().get_trial_id()
    run_dir = Path(log).parent / "runs" / f"{trial}-{uuid.uuid4().hex[:6]}"
    cfg = exp.run_config(
        hparams,
        name=run_dir.name,
        run_dir=str(run_dir),
        **{"checkpoint.resume": "none", "checkpoint.mode": "sync", "checkpoint.keep": 1},
    )
    trainer = Trainer(cfg, progress=False)
    pop = ray.get_actor(population) if population else None
    steps, interval = exp.steps, exp.scheduler.interval
    lineage = [[0, cfg.optimizer.lr, cfg.optimizer.weight_decay]]  # [step, lr, wd] from which each stretch trained
    restored_at = restored_from = restored_path = mismatch = None
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
                "lr": trainer.cfg.optimizer.lr,
                "wd": trainer.cfg.optimizer.weight_decay,
                "restored_at": restored_at,
                "restored_from": restored_from,
                "restored_path": restored_path,
                "restore_mismatch": mismatch,
                "interval_s": time.perf_counter() - start,
                "time": time.time(),
                "lineage": lineage,
            }
            with open(log, "a") as f:  # one short line per write: appends from trials do not interleave
                f.write(json.dumps(row) + "\n")
            restored_at = restored_from = restored_path = mismatch = None
            tune.report({"val_loss": val, TIME_ATTR: trainer.step, "trained": trained})
            if pop is None:
                continue
            path = trainer.save()
            pin = Path(pins) / trial / f"{trainer.step:08d}-{uuid.uuid4().hex[:6]}"  # outlives the trial's run dir
            link_tree(path, pin / path.name)
            (pin / LINEAGE).write_text(json.dumps(lineage))
            written = {"trial": trial, "step": trainer.step, "fingerprint": fingerprint(trainer.model)}
            (pin / ORIGIN).write_text(json.dumps(written))
            values = {k: getattr(trainer.cfg.optimizer, k.removeprefix("optimizer.")) for k in exp.search_space}
            ray.get(pop.report.remote(trial, config[MEMBER], trainer.step, val, values, str(pin)))
            decision = None
            while decision is None:
                decision = ray.get(pop.decision.remote(trial, trainer.step, 5.0))
            if decision == "go":
                continue
            donor = Path(decision["pin"])
            origin = json.loads((donor / ORIGIN).read_text())
            trainer.restore(checkpoint_step_folder(donor, origin), decision["values"], event="exploit")
            restored_at, restored_from, restored_path = trainer.step, origin["trial"], str(donor)
            # a restore whose weights are not the ones saved with its lineage (the replay check would miss it)
            mismatch = origin["step"] != trainer.step or origin["fingerprint"] != fingerprint(trainer.model)
            lineage = [seg for seg in json.loads((donor / LINEAGE).read_text()) if seg[0] < trainer.step]
            lineage.append([trainer.step, trainer.cfg.optimizer.lr, trainer.cfg.optimizer.weight_decay])
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
    overrides = {**task_overrides(args), "data.path": args.data, "seed": args.run_seed}
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


def task_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The task's run overrides, with `--task-set KEY=VALUE` changes (a variant of the task: a value is read as
    JSON where it parses, else kept as a string)."""
    out = dict(OVERRIDES)
    for item in args.task_set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--task-set {item!r}: expected KEY=VALUE, e.g. model.dim=16")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _scheduler_yaml(args: argparse.Namespace, method: str) -> str:
    i = args.interval
    if method in ("pbt", "pbt_sync"):
        f = args.factors
        return (
            f"{{name: pbt, interval: {i}, burn_in: {args.burn_in}, quantile_fraction: {args.quantile}, "
            f"resample_probability: {args.resample}, perturbation_factors: [{f[0]}, {f[1]}], "
            f"linear_step: {args.linear_step}, "
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


def experiment_name(method: str, population: int, seed: int) -> str:
    """Each experiment's folder in --work; the grid's is the same at every population."""
    return f"grid-s{seed}" if method == "grid" else f"{method}-p{population}-s{seed}"


def run_one(args: argparse.Namespace, method: str, seed: int, population: int) -> dict[str, Any]:
    import ray
    from ray import tune

    from search.population import Population, PopulationActor
    from search.schedulers import TIME_ATTR, build_scheduler, population_space

    samples = (args.asha_samples or 8 * population) if method == "asha" else population
    exp = experiment(args, "random" if method == "grid" else method, seed, samples)
    name = experiment_name(method, population, seed)
    exp_dir = Path(args.work) / name
    shutil.rmtree(exp_dir, ignore_errors=True)
    exp_dir.mkdir(parents=True)
    log = exp_dir / LOG
    if method == "grid":
        lrs, wds = grid_values(args)
        space = {"optimizer.lr": tune.grid_search(lrs), "optimizer.weight_decay": tune.grid_search(wds)}
    else:
        space = population_space(exp.members())
    scheduler = build_scheduler(exp.scheduler, exp.steps)
    budget = population * args.steps
    stop = _budget_stop(budget) if method == "asha" else {TIME_ATTR: exp.steps}
    actor = None
    if method in ("pbt", "pbt_sync", "pb2"):  # only these restore (an exploit); the others never do
        rule = Population(exp.scheduler, exp.search_space, "min", exp.steps, population, seed=seed)
        actor = ray.remote(num_cpus=0)(PopulationActor).options(name=f"quality-{name}").remote(rule)
    concurrent = args.concurrent or population  # every member at once: no time-sharing pauses
    cpus = args.cpus_per_trial or math.floor(200 / concurrent) / 100  # 3 x 0.67 would not fit in 2 CPUs
    trainable = tune.with_resources(
        tune.with_parameters(
            quality_trial, exp=exp, population=f"quality-{name}" if actor else None, log=str(log),
            pins=str(exp_dir / "pins"),
        ),
        {"cpu": cpus},
    )
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            scheduler=scheduler, metric="val_loss", mode="min", max_concurrent_trials=concurrent,
        ),
        run_config=tune.RunConfig(
            name="tune",
            storage_path=str(exp_dir),
            stop=stop,
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    started = time.time()
    try:
        tuner.fit()
    finally:
        if actor is not None:
            ray.kill(actor)
    wall = time.time() - started
    for folder in ("tune", "runs", "pins"):  # checkpoints: the log holds what is summarized
        shutil.rmtree(exp_dir / folder, ignore_errors=True)
    summary = summarize_experiment(exp_dir, wall, method, seed)
    summary["population"] = population
    if method in REPLAYED:
        lineage, step = summary["best_lineage"], summary["best_at"]["step"]
        val = ray.get(ray.remote(num_cpus=1)(replay_lineage).remote(exp, lineage, step, str(exp_dir / "replay")))
        summary["replay"] = {"step": step, "val_loss": val, "reported": summary["best_val_loss"], "lineage": lineage}
        shutil.rmtree(exp_dir / "replay", ignore_errors=True)
    (exp_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    return summary


def replay_lineage(exp: Any, lineage: list[list[float]], step: int, run_dir: str, every: int = 0) -> Any:
    """The replay check: a lineage's hyperparameters (from step s on: lr, wd) re-trained from scratch as one
    run of the product's Trainer, `set_hparams` at each change; its val_loss at `step` (with `every`: the
    val_loss every `every` steps up to `step`, as a trial reports it)."""
    import torch

    from trainers.trainer import Trainer

    torch.set_num_threads(1)
    (_, lr, wd), changes = lineage[0], {int(s): (lr, wd) for s, lr, wd in lineage[1:]}
    cfg = exp.run_config(
        {"optimizer.lr": lr, "optimizer.weight_decay": wd},
        name="replay",
        run_dir=run_dir,
        **{"checkpoint.resume": "none", "checkpoint.mode": "sync", "checkpoint.keep": 1},
    )
    trainer, reports = Trainer(cfg, progress=False), []
    try:
        while trainer.step < step:
            if trainer.step in changes:
                lr, wd = changes[trainer.step]
                trainer.set_hparams({"optimizer.lr": lr, "optimizer.weight_decay": wd})
            trainer.train_step()
            if every and trainer.step % every == 0:
                reports.append(trainer.evaluate())
        return reports if every else trainer.evaluate()
    finally:
        trainer.log.close("FINISHED")
        trainer.engine.close()


def hand_schedules(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """What a schedule is worth on this task, measured the way the searches are (best val_loss over the
    reports, training seed `--run-seed`): lineages written by hand around the grid's best fixed learning rate."""
    lrs, _ = grid_values(args)
    lr, end = lrs[len(lrs) // 2], args.steps
    at = lambda share: int(end * share) // args.interval * args.interval  # noqa: E731

    def cascade(factor: float) -> list[list[float]]:  # PBT's greedy path: the factor at every decision
        out, rate = [[0, lr, 0.0]], lr
        for step in range(at(0.5) + args.interval, end, args.interval):
            rate = max(SPACE["optimizer.lr"]["loguniform"][0], rate * factor)
            out.append([step, rate, 0.0])
        return out

    return {
        "constant (the grid's best learning rate, weight decay 0)": [[0, lr, 0.0]],
        "x0.5 at 13/16 of the run": [[0, lr, 0.0], [at(13 / 16), lr * 0.5, 0.0]],
        "x0.3 at 7/8": [[0, lr, 0.0], [at(7 / 8), lr * 0.3, 0.0]],
        "x0.1 at 15/16": [[0, lr, 0.0], [at(15 / 16), lr * 0.1, 0.0]],
        "x0.3 at 7/8, weight decay 0.1": [[0, lr, 0.1], [at(7 / 8), lr * 0.3, 0.1]],
        "x0.5 at every decision after half the run (factors 2, 0.5)": cascade(0.5),
        "x0.8 at every decision after half the run (factors 1.25, 0.8)": cascade(0.8),
        "2x the rate, then x0.1 at 3/4 (the task's first pilot)": [[0, 2 * lr, 0.0], [at(0.75), 0.2 * lr, 0.0]],
    }


def run_hand_schedules(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    exp = experiment(args, "grid", 0, args.populations[0])
    schedules = hand_schedules(args)
    train = ray.remote(num_cpus=1)(replay_lineage)
    started = time.time()
    refs = {name: train.remote(exp, lineage, args.steps, str(Path(args.work) / "hand" / f"s{i}"), args.interval)
            for i, (name, lineage) in enumerate(schedules.items())}
    rows = []
    for name, ref in refs.items():
        reports = ray.get(ref)
        rows.append({"schedule": name, "lineage": schedules[name], "best_val_loss": min(reports),
                     "val_loss_every_interval": reports})
        print(f"hand schedule {name}: best val_loss {min(reports):.4f}", flush=True)
    return {"what": " ".join(hand_schedules.__doc__.split()), "run_seed": args.run_seed, "steps": args.steps, "interval": args.interval,
            "wall_s": time.time() - started, "load_avg_end": os.getloadavg(), "rows": rows}


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
        "restore_mismatches": sum(1 for r in rows if r.get("restore_mismatch")),
        "reports": len(rows),
    }
    # the schedule of the trial that reached the best: its (lr, wd) at each of its reports up to that one
    own = sorted((r for r in rows if r["trial"] == best["trial"] and r["time"] <= best["time"]), key=lambda r: r["time"])
    out["best_trial_schedule"] = [[r["step"], r["lr"], r["wd"], r["val_loss"]] for r in own]
    # what the best report's state was trained with: its donors' hyperparameters up to each exploit, then its own
    out["best_lineage"] = best.get("lineage") or [[0, best["lr"], best["wd"]]]
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


def verdict(methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 43's done-when 1, from the numbers: the better (lower mean) of asynchronous and synchronous PBT
    below random search's and ASHA's mean best val_loss by more than twice the larger of the two methods'
    seed standard deviations; PB2 no worse than random search by the same rule (not above it by more than
    twice the larger deviation); 5 seeds each. The grid's best fixed configuration is shown beside it."""
    pbts = [m for m in ("pbt", "pbt_sync") if m in methods]
    if not pbts:
        return {"holds": None, "why": "neither pbt nor pbt_sync was run"}
    pbt = min(pbts, key=lambda m: methods[m]["stats"]["mean"])
    p = methods[pbt]["stats"]
    out: dict[str, Any] = {"pbt_method": pbt}
    checks = []

    def margin(low: dict[str, float], high: dict[str, float]) -> tuple[float, float]:
        return high["mean"] - low["mean"], 2 * max(low["std"], high["std"])

    for other in ("random", "asha"):
        if other not in methods:
            out[f"beats_{other}"] = None
            continue
        m, needed = margin(p, methods[other]["stats"])
        out[f"beats_{other}"] = {"margin": m, "needed": needed, "holds": m > needed}
        checks.append(m > needed)
    if "pb2" in methods and "random" in methods:
        m, allowed = margin(methods["pb2"]["stats"], methods["random"]["stats"])
        out["pb2_no_worse_than_random"] = {"margin": m, "allowed_below": -allowed, "holds": m >= -allowed}
        checks.append(m >= -allowed)
    else:
        out["pb2_no_worse_than_random"] = None
    if "grid" in methods:
        out["vs_grid_best"] = {"gap": p["mean"] - methods["grid"]["stats"]["mean"]}
    out["paired"] = {other: paired(methods[pbt], methods[other]) for other in ("random", "asha") if other in methods}
    seeds_ok = all(m["stats"]["n"] >= 5 for k, m in methods.items() if k != "grid")
    out["seeds_at_least_5"] = seeds_ok
    out["holds"] = len(checks) == 3 and all(checks) and seeds_ok
    return out


def paired(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any] | None:
    """Beside the rule above (it is the issue's, and compares the methods' means against their spreads over
    seeds): the same seeds compared one by one. Both searches of one seed start from the same members, so
    most of a seed's luck is shared and cancels in its difference; `wins` counts the seeds where `low` is
    below `high`, `t` is the mean difference over its standard error (paired t statistic, n - 1 degrees of
    freedom). None without at least two common seeds."""
    by_seed = dict(zip(high.get("seeds", []), high.get("best_val_loss", [])))
    common = [(s, v) for s, v in zip(low.get("seeds", []), low.get("best_val_loss", [])) if s in by_seed]
    if len(common) < 2:
        return None
    diffs = [by_seed[s] - v for s, v in common]
    mean, std = statistics.fmean(diffs), statistics.stdev(diffs)
    return {
        "seeds": [s for s, _ in common],
        "differences": diffs,
        "wins": sum(d > 0 for d in diffs),
        "mean": mean,
        "std": std,
        "t": mean / (std / math.sqrt(len(diffs))) if std > 0 else None,  # None: every difference the same
    }


def replay_check(methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 43's done-when 3: each PBT seed's best lineage re-trained from scratch in one run lands within
    the method's seed standard deviation of the loss the search reported for it."""
    out: dict[str, Any] = {}
    for name in REPLAYED:
        replays = [r for r in methods.get(name, {}).get("replay", []) if r]
        if not replays:
            continue
        spread = methods[name]["stats"]["std"]
        gaps = [r["val_loss"] - r["reported"] for r in replays]
        out[name] = {"gaps": gaps, "seed_std": spread, "holds": all(abs(g) <= spread for g in gaps)}
    out["holds"] = bool(out) and all(v["holds"] for v in out.values())
    return out


def method_table(rows_by_method: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    methods: dict[str, dict[str, Any]] = {}
    for method in ALL:
        rows = sorted(rows_by_method.get(method, []), key=lambda r: r["seed"])
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
            "best_lineage": [r.get("best_lineage") for r in rows],
            **({"replay": [r.get("replay") for r in rows]} if method in REPLAYED else {}),
            **({"configs": [r["configs"] for r in rows]} if method == "grid" else {}),
        }
    return methods


def write_results(
    args: argparse.Namespace, runs: dict[int, dict[str, list[dict[str, Any]]]], load_before, started
) -> dict:
    """`runs`: population -> method -> one summary per seed (the grid's under every population)."""
    main_pop, *others = args.populations
    methods = method_table(runs.get(main_pop, {}))
    lrs, wds = grid_values(args)
    out = {
        **provenance(started, load_before),
        "dry_run": args.dry_run,
        "task": {**TASK, "overrides": task_overrides(args), "space": SPACE, "data": args.data,
                 **({"variant": args.task_set} if args.task_set else {})},
        "harness": (
            "each trial is a Tune function trainable running the product's trainers.Trainer in its own process "
            "(world size 1, parallel.engine none, 1 torch thread, no Ray Train), with the product's experiment "
            "config (search.config), schedulers (search.schedulers.build_scheduler: PBT's BoundedExplore, PB2 "
            "on the search scale) and seeded starting members; PBT/PB2 exploit through Tune's pause/restore of "
            "the Trainer's committed checkpoints (reuse_actors=True), every member of an experiment running at "
            "once. It measures the search methods' quality; the cost of hosting trials as Ray Train runs is "
            "bench/pbt_overhead.py's subject."
        ),
        "setup": {
            "budget_steps_per_trial": args.steps,
            "interval": args.interval,
            "population": main_pop,
            "other_populations": others,
            "equal_total_steps": main_pop * args.steps,
            "asha": {"max_samples": args.asha_samples or 8 * main_pop, "grace_period": args.asha_grace or args.interval,
                     "reduction_factor": 3, "stopped_at_total_steps": "population x budget_steps_per_trial"},
            "pbt": {"burn_in": args.burn_in, "quantile_fraction": args.quantile,
                    "resample_probability": args.resample, "perturbation_factors": list(args.factors),
                    "linear_step": args.linear_step},
            "pb2": {"quantile_fraction": args.quantile, "scale": "log for log ranges (search.schedulers._SearchScale)"},
            "grid": {"lrs": lrs, "weight_decays": wds, "configs": len(lrs) * len(wds),
                     "steps_each": args.steps, "seeds": args.grid_seeds},
            "run_seed": args.run_seed,
            "seeds_are": "the search's seed (starting members, explore draws); the training run's seed is run_seed for all",
            "concurrent_trials": "the population (every member at once), 2 CPUs shared",
        },
        "methods": methods,
        "done_when": verdict(methods),
        "replay": replay_check(methods),
        "by_population": {},
    }
    for pop in others:
        other = method_table(runs.get(pop, {}))
        out["by_population"][str(pop)] = {"methods": other, "done_when": verdict(other)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = _earlier(out_dir)
    if "hand_schedules" in earlier:  # measured by --hand-schedules, apart from the searches
        out["hand_schedules"] = earlier["hand_schedules"]
    (out_dir / "pbt_quality.json").write_text(json.dumps(out, indent=1))
    plot(out, out_dir / "pbt_quality.png")
    table = {
        f"{k} (population {pop})": f"{v['stats']['mean']:.4f} +- {v['stats']['std']:.4f} "
        f"({v['total_steps_mean']:.0f} steps, {v['wall_s_mean']:.0f} s)"
        for pop, ms in [(main_pop, methods), *((p, out["by_population"][str(p)]["methods"]) for p in others)]
        for k, v in ms.items()
    }
    print(json.dumps({"methods": table, "done_when": out["done_when"], "replay": out["replay"]}, indent=1))
    return out


def _earlier(out_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((out_dir / "pbt_quality.json").read_text())
    except (OSError, ValueError):
        return {}


def plot(out: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8))
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    methods = out["methods"]
    names = [m for m in ALL if m in methods]
    main_pop = out["setup"]["population"]
    tables = [(main_pop, methods)] + [(int(p), v["methods"]) for p, v in out.get("by_population", {}).items()]
    width = 0.8 / len(tables)
    vals = []
    for j, (pop, table) in enumerate(tables):
        for i, m in enumerate(names):
            if m not in table or (m == "grid" and j):
                continue
            x = i - 0.4 + width * (j + 0.5)
            st, pts = table[m]["stats"], table[m]["best_val_loss"]
            a.bar(x, st["mean"], yerr=st["std"], color=f"C{i}", alpha=0.6 if j == 0 else 0.25, capsize=4,
                  width=width * 0.9, hatch=None if j == 0 else "//", label=f"population {pop}" if i == 0 else None)
            a.scatter([x + width * 0.6 * (k - (len(pts) - 1) / 2) / max(len(pts), 1) for k in range(len(pts))],
                      pts, color="k", s=10, zorder=3)
            vals += pts
    if "grid" in methods:
        a.axhline(methods["grid"]["stats"]["mean"], color="k", ls="--", lw=1,
                  label=f"grid's best fixed config ({out['setup']['grid']['configs']} configs)")
    a.legend(loc="upper right", fontsize=8)
    labels = [f"{m}\n{methods[m]['total_steps_mean']:.0f} steps\n{methods[m]['wall_s_mean']:.0f} s" for m in names]
    a.set_xticks(range(len(names)), labels, fontsize=8)
    if vals:
        lo, hi = min(vals), max(vals)
        a.set_ylim(lo - 0.15 * (hi - lo + 1e-3), hi + 0.35 * (hi - lo + 1e-3))
    dw = out["done_when"]
    a.set_ylabel("best val_loss (mean +- std over seeds; dots: seeds)")
    a.set_title(f"equal total steps (population {main_pop}: steps and wall time below); done-when "
                f"{'HOLDS' if dw.get('holds') else 'does not hold'}", fontsize=10)
    for m in ("pbt", "pbt_sync", "pb2"):
        if m not in methods:
            continue
        for k, (lineage, at) in enumerate(zip(methods[m]["best_lineage"], methods[m]["best_at"])):
            if lineage:
                steps = [seg[0] for seg in lineage] + [at["step"]]
                lrs = [seg[1] for seg in lineage] + [lineage[-1][1]]
                b.step(steps, lrs, where="post", color=f"C{names.index(m)}", alpha=0.6, label=m if k == 0 else None)
    if "grid" in methods:
        for k, at in enumerate(methods["grid"]["best_at"]):
            b.axhline(at["lr"], color="k", ls="--", lw=1, label="grid's best fixed lr" if k == 0 else None)
    b.set_yscale("log")
    b.set_xlabel("step")
    b.set_ylabel("learning rate of the best report's lineage")
    b.set_title(f"schedules found at population {main_pop} (one line per seed)", fontsize=10)
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
    ap.add_argument("--first-seed", type=int, default=0,
                    help="the search seeds are first-seed .. first-seed + seeds - 1 (settings are chosen on seeds "
                         "other than the reported 0-4)")
    ap.add_argument("--steps", type=int, default=1600, help="optimizer steps per trial (the budget)")
    ap.add_argument("--interval", type=int, default=100, help="steps between reports (PBT/PB2 decisions)")
    ap.add_argument("--populations", type=int, nargs="+", default=[8, 4],
                    help="PBT/PB2 population, random search's samples: the first is the result, the others beside it")
    ap.add_argument("--asha-samples", type=int, default=None,
                    help="ASHA: most configurations sampled (default 8 x the population: 32 at population 8 ran out "
                         "at 8,000 of its 12,800 steps)")
    ap.add_argument("--asha-grace", type=int, default=None, help="ASHA: steps before the first stop (interval)")
    ap.add_argument("--quantile", type=float, default=DEFAULTS.quantile_fraction,
                    help="PBT/PB2: bottom fraction copies the top")
    ap.add_argument("--burn-in", default=str(DEFAULTS.burn_in),
                    help="PBT: steps before the first exploit, or a share of the budget (50%%)")
    ap.add_argument("--resample", type=float, default=DEFAULTS.resample_probability, help="PBT: resample probability")
    ap.add_argument("--factors", type=float, nargs=2, default=DEFAULTS.perturbation_factors,
                    help="PBT: perturbation factors of log ranges")
    ap.add_argument("--linear-step", type=float, default=DEFAULTS.linear_step,
                    help="PBT: a linear range's move, as a fraction of its width")
    ap.add_argument("--grid-lrs", type=int, default=8, help="grid: learning rates (log-spaced over the space)")
    ap.add_argument("--grid-wds", type=int, default=2, help="grid: weight decays (evenly over the space)")
    ap.add_argument("--grid-seeds", type=int, default=1, help="grid: repeats (same run seed: the grid is deterministic)")
    ap.add_argument("--run-seed", type=int, default=0, help="the training runs' seed (init, data order), for all")
    ap.add_argument("--cpus-per-trial", type=float, default=None, help="default: 2 / concurrent")
    ap.add_argument("--concurrent", type=int, default=None,
                    help="trials of one experiment side by side (default: the population)")
    ap.add_argument("--task-set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="a variant of the task: change its run overrides (e.g. model.dim=16)")
    ap.add_argument("--only", nargs="+", choices=ALL, default=list(ALL))
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--hand-schedules", action="store_true",
                    help="only train the hand-written schedules (what a schedule is worth on the task) into the JSON")
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: rewrite the results from the experiments' summaries in --work")
    ap.add_argument("--dry-run", action="store_true",
                    help="a few steps of a tiny model, 2 seeds, 2x2 grid, into --out (for tests)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.seeds, args.steps, args.interval = min(args.seeds, 2), 8, 4
        args.populations, args.asha_samples, args.grid_lrs, args.grid_wds = [2, 3][: len(args.populations)], 4, 2, 1
        if args.out == str(RESULTS) or args.work == str(WORK):
            ap.error("--dry-run needs its own --out and --work (never over the real results)")
    args.data, args.work = str(Path(args.data).resolve()), str(Path(args.work).resolve())  # Tune takes no relative path
    return args


def _seeds(args: argparse.Namespace) -> range:
    return range(args.first_seed, args.first_seed + args.seeds)


def _load_summaries(args: argparse.Namespace, runs: dict[int, dict[str, list]], methods: tuple[str, ...]) -> None:
    """Earlier experiments' summaries in --work, for `methods` (every population)."""
    for pop in args.populations:
        for m in methods:
            for s in range(args.grid_seeds) if m == "grid" else _seeds(args):
                f = Path(args.work) / experiment_name(m, pop, s) / SUMMARY
                if f.is_file():
                    runs[pop][m].append(json.loads(f.read_text()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before, started = os.getloadavg(), time.time()
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {p: {m: [] for m in ALL} for p in args.populations}
    if args.summarize_only:
        _load_summaries(args, runs, ALL)  # everything in --work, --only or not
        write_results(args, runs, load_before, started)
        return
    import ray

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    if args.hand_schedules:
        try:
            measured = run_hand_schedules(args)
        finally:
            ray.shutdown()
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        out = {**_earlier(out_dir), "hand_schedules": measured}
        (out_dir / "pbt_quality.json").write_text(json.dumps(out, indent=1))
        return
    try:
        # every method and population in turn for each seed: a slow hour of the machine falls on all alike
        for seed in _seeds(args):
            for pop in args.populations:
                for m in args.only:
                    if m == "grid" and (pop != args.populations[0] or seed >= args.grid_seeds):
                        continue
                    row = run_one(args, m, seed, pop)
                    for p in args.populations if m == "grid" else [pop]:
                        runs[p][m].append(row)
                    replay = f", replay {row['replay']['val_loss']:.4f}" if "replay" in row else ""
                    print(f"{m} population {pop} seed {seed}: best val_loss {row['best_val_loss']:.4f} at "
                          f"{row['best_at']}{replay}, {row['total_steps']} steps, {row['trials']} trials, "
                          f"{row['wall_s']:.0f} s", flush=True)
    finally:
        ray.shutdown()
    # methods not run this time keep their last summaries (e.g. --only pbt after a full run)
    _load_summaries(args, runs, tuple(m for m in ALL if m not in args.only))
    write_results(args, runs, load_before, started)


if __name__ == "__main__":
    main()
