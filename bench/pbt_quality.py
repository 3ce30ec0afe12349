"""Search quality where a hyperparameter schedule matters (issue 66): the product's default PBT against random
search and ASHA at equal total training steps, scored on held-out windows that no decision saw, paired seed by
seed, with the best hand-written schedule beside them.

    .venv/bin/python bench/pbt_quality.py                # the full run: 10 fresh seeds, population 4, 1600 steps
    .venv/bin/python bench/pbt_quality.py --quick --out /tmp/pbt_quality   # 3 seeds x 400 steps: the same code
    .venv/bin/python bench/pbt_quality.py --dry-run --out DIR --work DIR   # a tiny model, for tests

Every field of bench/results/pbt_quality.{json,png} is written by one such command (`--out` elsewhere).

- The judged arm, `pbt`, is the product's default: `SchedulerConfig()` as `raytrain tune` reads an experiment
  with `scheduler: {name: pbt}` (asynchronous, burn-in half the budget, quantile 0.25, resample 0.25, factors
  2 and 0.5, linear step 0.15, a decision every 50 steps), run by the product's rule (`search.population`:
  `Population` in a `PopulationActor`, built as `search.driver.start_population` builds it) and followed by each
  trial as the product's trials follow it: report, ask, go on or restore the donor's pin with the explored
  values in place (`Trainer.restore`). `VERDICT_RULE` was fixed before the run; extra arms (`--methods pbt_sync
  pb2 pb2_before`) are reported, never judged. `pb2_before` is PB2 by the rule before issue 68 (every point,
  each fit cold and unbounded: bench/pb2_window.py's `PopulationBefore`), paired with `pb2` seed by seed in
  `pb2_against_before`.
- Selection and test: every report's `val_loss` (what PBT ranks, ASHA stops and the pick below reads) is the
  product's `Trainer.evaluate`, the first 128 windows of the corpus's validation split. Each arm's score at a
  seed is the loss, on the *test* windows, of the checkpoint the arm itself hands a user (`search.lineage.
  best_trial`: the trial whose latest report is lowest, at that report). The test windows are every
  validation window after the end of the last document the selection windows touch (`split` in the JSON):
  disjoint from the selection, in other documents.
- Seeds: the search seed (starting members, explore draws, ASHA's samples) and the training runs' seed
  (initialisation, data order) = `RUN_SEED_OFFSET` + the search seed, the same for every arm of a seed: the
  comparison is paired over what a user would see. Seeds 0-9 chose the PBT settings (issues 25 and 43, run seed
  0); the full run's seeds 100-109 chose nothing (`seeds_that_chose_settings` in the JSON).
- Equal total steps: every search arm draws its steps from one budget of population x steps (`Budget`, asked
  before each interval): PBT's exploits, which may train steps again, and ASHA's extra samples stop where it
  is spent, and Tune stops the experiment once all of it is reported. Steps are counted as trained; the JSON
  checks each arm within 1% of the budget.
- The hand schedule: the best of `hand_schedules` in the previous round (2df218e): the grid's best rate
  4.17e-3, weight decay 0, x0.3 for the last eighth; one run per seed under the same run seed, scored alike
  (its latest report is its end).

Harness: each trial is a Tune function trial running the product's `trainers.Trainer` in its own process (world
size 1, `parallel.engine: none`, one torch thread, no Ray Train: its cost is bench/pbt_overhead.py's subject),
every member of an experiment at once (4 trials x 0.5 CPU on 2 cores).

Wall time on 2 cores: --quick 6 min (measured, 2026-12-02); the full run ~50 min, estimated from it (each search
arm ~85 s per seed, the hand run ~30 s). Population 4 keeps the full run under an hour; at population 8 every arm
costs twice the steps.
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

DEFAULTS = SchedulerConfig()  # the product's default rule: the judged arm
RESULTS, WORK = ROOT / "bench" / "results", ROOT / "bench" / "_work" / "pbt_quality"

JUDGED, OPPONENTS, HAND = "pbt", ("random", "asha"), "hand"
EXTRAS = ("pbt_sync", "pb2", "pb2_before")  # reported beside, never judged
SEARCHES = (JUDGED, *OPPONENTS, *EXTRAS)
SCHEDULER = {"pbt": {"name": "pbt"}, "pbt_sync": {"name": "pbt", "synch": True}, "pb2": {"name": "pb2"},
             "pb2_before": {"name": "pb2"},  # run by bench/pb2_window.py's PopulationBefore
             "asha": {"name": "asha"}, "random": {"name": "random"}}
RUN_SEED_OFFSET = 1000  # a seed's training runs use run seed 1000 + seed
SEEDS_THAT_CHOSE_SETTINGS = list(range(10))  # issues 25 and 43: PBT's settings were compared on seeds 0-9
FULL_SEEDS, QUICK_SEEDS = list(range(100, 110)), [100, 101, 102]
LOG = "trials.jsonl"  # one line per report of every trial
LINEAGE = "lineage.json"  # beside each pin: [step, lr, wd] from which each stretch of its state trained
# the code whose behaviour the figure measures (bench/stale.py: the result is stale once one changes)
MEASURES = ["bench/pbt_quality.py", "bench/pb2_window.py", "search/population.py", "search/schedulers.py", "search/config.py",
            "search/space.py", "search/lineage.py", "trainers/trainer.py"]
# No retention inside a trial: after an exploit of a donor behind it, a trial's next save is at a lower step than
# checkpoints it already has, and retention by step (keep 1) deleted that save before the trial could pin it
# (FileNotFoundError in link_tree: the full run of 2026-12-02 lost a PBT trial at seeds 103-105). The pins are what
# the reports name; each run dir goes at its trial's end.
CKPT = {"checkpoint.resume": "none", "checkpoint.mode": "sync", "checkpoint.keep": 1_000_000}

TASK = {
    "what": (
        "learning rate and weight decay of AdamW with a constant base learning rate (no warmup, no decay) for "
        "a 2-block Llama-form model of width 32 (2 heads) on the byte-level standard-library corpus "
        "(data/stdlib: `raytrain data prepare --max-bytes 8000000`), batch 8 x 128 tokens"
    ),
    "why": (
        "at 1600 steps the model reaches the noise floor of its constant rate, so a late decay is worth more "
        "than any fixed value (previous round, run seed 0: the grid's best rate held 1.874, the same x0.3 for the "
        "last eighth 1.838): a schedule found by a search can beat every fixed configuration"
    ),
    "base": "examples/tiny-dense.yaml with the overrides below (examples/pbt-demo.yaml's, for one process)",
}
OVERRIDES = {
    "model.dim": 32,
    "model.n_heads": 2,
    "model.n_layers": 2,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 8,
    "train.eval_batches": 16,  # x 8: the 128 selection windows
    "train.log_every": 40,
    "train.tensorboard": False,
    "parallel.engine": "none",
    "schedule.name": "constant",
}
TINY = {"model.max_seq_len": 32, "data.seq_len": 32, "train.eval_batches": 2}  # --dry-run
SPACE = {
    "optimizer.lr": {"loguniform": [3.0e-4, 3.0e-2]},
    "optimizer.weight_decay": {"uniform": [0.0, 0.2]},
}
HAND_LR = 3.0e-4 * 100 ** (4 / 7)  # the 8-rate grid's best, 4.17e-3 (previous round)
HAND_WHAT = "the grid's best rate 4.17e-3, weight decay 0, x0.3 from 7/8 of the run (previous round's best, 1.838)"

VERDICT_RULE = (
    "Fixed before the run. Judged: the arm `pbt`, the product's default rule (search.schedulers.SchedulerConfig() "
    "with name pbt: asynchronous); no other PBT variant can stand in for it. An arm's score at a seed: the loss on "
    "the test windows of the checkpoint the arm picks by its selection val_loss (search.lineage.best_trial: the "
    "trial whose latest report is lowest, at that report). Against random search and against ASHA: the paired "
    "differences d = other's score - pbt's over the seeds (d > 0: PBT better); PBT is 'better' where the exact "
    "two-sided Wilcoxon signed-rank test gives p < 0.05 and the median d > 0, 'worse' where p < 0.05 and the median "
    "d < 0, else 'no difference shown' (wins and the sign test's p beside). done_when holds where PBT is better "
    "than both, over >= 10 seeds of which >= 5 chose no setting, every search arm's total steps within 1% of the "
    "budget. The gap to the best hand schedule (d = hand - pbt, the same statistics) is reported, not judged."
)


# ------------------------------------------------------------------------------------------ trials


def quality_trial(config: dict[str, Any], exp: Any, population: str | None, budget: str, log: str, pins: str) -> None:
    """One Tune function trial: the product's Trainer in this process, `interval` steps at a time as the budget
    grants them, reporting `val_loss` (the selection windows) with its committed checkpoint pinned. Under PBT/PB2
    each report goes to the experiment's `PopulationActor` and the trial follows its decision: an exploit
    restores the donor's pin with the explored values (`Trainer.restore`), in place."""
    import ray
    import torch
    from ray import tune

    from search.schedulers import MEMBER, TIME_ATTR
    from trainers.checkpoint_files import link_tree
    from trainers.trainer import Trainer

    torch.set_num_threads(1)
    trial = tune.get_context().get_trial_id()
    run_dir = Path(log).parent / "runs" / f"{trial}-{uuid.uuid4().hex[:6]}"
    pop, grants = ray.get_actor(population) if population else None, ray.get_actor(budget)
    steps, interval = exp.steps, exp.scheduler.interval
    first = ray.get(grants.take.remote(min(interval, steps)))
    if not first:  # started after the budget was spent (ASHA's next sample): nothing to train
        return
    cfg = exp.run_config({k: config[k] for k in exp.search_space}, name=run_dir.name, run_dir=str(run_dir), **CKPT)
    trainer = Trainer(cfg, progress=False)
    lineage = [[0, cfg.optimizer.lr, cfg.optimizer.weight_decay]]
    exploited_from = None
    try:
        while trainer.step < steps:
            want = min((trainer.step // interval + 1) * interval, steps) - trainer.step
            granted, first = first or ray.get(grants.take.remote(want)), 0
            if not granted:  # the budget is spent: this trial ends at its last report
                if pop is not None:
                    ray.get(pop.leave.remote(trial))  # a synchronous round does not wait for it
                break
            for _ in range(granted):
                trainer.train_step()
            val = trainer.evaluate()
            path = trainer.save()
            pin = Path(pins) / trial / f"{trainer.step:08d}-{uuid.uuid4().hex[:6]}" / path.name
            link_tree(path, pin)  # outlives the run dir's retention
            (pin.parent / LINEAGE).write_text(json.dumps(lineage))
            values = {"optimizer.lr": trainer.cfg.optimizer.lr, "optimizer.weight_decay": trainer.cfg.optimizer.weight_decay}
            row = {"trial": trial, "member": config.get(MEMBER), "step": trainer.step, "metric": val,
                   "trained": granted, "hparams": values, "pin": str(pin), "lineage": lineage,
                   "exploited_from": exploited_from, "time": time.time()}
            with open(log, "a") as f:  # one short line per write: appends from trials do not interleave
                f.write(json.dumps(row) + "\n")
            exploited_from = None
            tune.report({"val_loss": val, TIME_ATTR: trainer.step, "trained": granted})
            if pop is None:
                continue
            decision = ray.get(pop.report.remote(trial, config[MEMBER], trainer.step, val, values, str(pin)))
            while decision is None:
                decision = ray.get(pop.decision.remote(trial, trainer.step, 5.0))
            if decision == "go":
                continue
            donor = Path(decision["pin"])
            trainer.restore(donor, decision["values"], event="exploit")
            ray.get(pop.taken.remote(trial, decision["exploit_id"], True))  # (the trial's word after its row)
            exploited_from = decision["donor"]
            lineage = [seg for seg in json.loads((donor.parent / LINEAGE).read_text()) if seg[0] < trainer.step]
            lineage.append([trainer.step, trainer.cfg.optimizer.lr, trainer.cfg.optimizer.weight_decay])
    finally:
        trainer.log.close("FINISHED" if trainer.step >= steps else "KILLED")
        trainer.engine.close()
        shutil.rmtree(run_dir, ignore_errors=True)


class Budget:
    """The experiment's total steps, granted interval by interval to whichever trial asks first."""

    def __init__(self, total: int) -> None:
        self.left = total

    def take(self, steps: int) -> int:
        granted = min(steps, self.left)
        self.left -= granted
        return granted


def _budget_stop(total: int):
    from ray import tune

    class BudgetStop(tune.Stopper):
        """Ends the experiment once its trials have reported `total` trained steps (all the budget granted):
        ASHA samples no more configurations."""

        def __init__(self) -> None:
            self.seen: set[tuple[str, int]] = set()
            self.reported = 0

        def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
            # Tune hands a stopper a finished function trial's last result a second time (done=True): counted
            # twice, three early finishers ended the last trial 50-100 steps short of the budget (seeds 101-103)
            key = (trial_id, int(result.get("training_iteration", 0)))
            if key not in self.seen:
                self.seen.add(key)
                self.reported += int(result.get("trained", 0))
            return False

        def stop_all(self) -> bool:
            return self.reported >= total

    return BudgetStop()


# ------------------------------------------------------------------------------------- experiments


def run_seed(seed: int) -> int:
    return RUN_SEED_OFFSET + seed


def experiment(args: argparse.Namespace, method: str, seed: int) -> Any:
    """The product's experiment config (`search.config`) of one arm at one seed."""
    from search.config import parse_experiment

    scheduler = dict(SCHEDULER.get(method, SCHEDULER["random"]))
    if args.interval != DEFAULTS.interval:  # --dry-run only
        scheduler["interval"] = args.interval
    overrides = {**OVERRIDES, "data.path": args.data, "seed": run_seed(seed), **(TINY if args.dry_run else {})}
    return parse_experiment({
        "name": f"{method}-s{seed}",
        "base": str(ROOT / "examples" / "tiny-dense.yaml"),
        "overrides": overrides,
        "space": SPACE,
        "scheduler": scheduler,
        "population": args.asha_samples if method == "asha" else args.population,
        "budget": {"steps": args.steps},
        "resources": {"workers": 1, "cpus_per_worker": 1},
        "storage": args.work,
        "seed": seed,
    })


def run_search(args: argparse.Namespace, method: str, seed: int, test_ids: Any) -> dict[str, Any]:
    import ray
    from ray import tune

    from bench.pb2_window import PopulationBefore
    from search.lineage import best_trial
    from search.population import Population, PopulationActor
    from search.schedulers import build_scheduler, population_space

    exp = experiment(args, method, seed)
    exp_dir = Path(args.work) / exp.name
    shutil.rmtree(exp_dir, ignore_errors=True)
    exp_dir.mkdir(parents=True)
    tag = uuid.uuid4().hex[:6]
    total = args.population * args.steps
    budget = ray.remote(num_cpus=0)(Budget).options(name=f"budget-{tag}").remote(total)
    actor = None
    if exp.scheduler.name in ("pbt", "pb2"):  # as search.driver.start_population builds it
        rule = (PopulationBefore if method == "pb2_before" else Population)(
            exp.scheduler, exp.search_space, exp.mode, exp.steps, exp.population, seed=exp.seed)
        actor = ray.remote(num_cpus=0)(PopulationActor).options(name=f"population-{tag}").remote(rule)
    trainable = tune.with_resources(
        tune.with_parameters(quality_trial, exp=exp, population=f"population-{tag}" if actor else None,
                             budget=f"budget-{tag}", log=str(exp_dir / LOG), pins=str(exp_dir / "pins")),
        {"cpu": math.floor(200 / args.population) / 100},  # every member at once on 2 CPUs
    )
    tuner = tune.Tuner(
        trainable,
        param_space=population_space(exp.members()),
        tune_config=tune.TuneConfig(scheduler=build_scheduler(exp.scheduler, exp.steps), metric="val_loss",
                                    mode="min", max_concurrent_trials=args.population, reuse_actors=True),
        run_config=tune.RunConfig(name="tune", storage_path=str(exp_dir), stop=_budget_stop(total), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    started = time.time()
    try:
        tuner.fit()
    finally:
        for a in (actor, budget):
            if a is not None:
                ray.kill(a)
    wall = time.time() - started
    rows = [json.loads(line) for line in (exp_dir / LOG).read_text().splitlines() if line.strip()]
    trial, pick = best_trial(rows, "min")  # what `raytrain tune` hands the user
    score = _score(exp, pick["hparams"], pick["pin"], test_ids, str(exp_dir / "score"))
    out = {
        "method": method, "seed": seed, "run_seed": run_seed(seed),
        "test_loss": score["test"], "selection_loss": pick["metric"],
        "pick_checked": abs(score["selection"] - pick["metric"]) < 1e-5,  # the restored pin is the reported state
        "total_steps": sum(r["trained"] for r in rows), "wall_s": wall,
        "trials": len({r["trial"] for r in rows}), "exploits": sum(1 for r in rows if r["exploited_from"]),
        "picked": {"trial": trial, "step": pick["step"], **pick["hparams"], "lineage": pick["lineage"]},
    }
    for folder in ("tune", "runs", "pins", "score"):  # the log holds what is summarized
        shutil.rmtree(exp_dir / folder, ignore_errors=True)
    (exp_dir / "summary.json").write_text(json.dumps(out, indent=1))
    return out


def _score(exp: Any, hparams: dict[str, Any], pin: str, test_ids: Any, run_dir: str) -> dict[str, float]:
    import ray

    return ray.get(ray.remote(num_cpus=1)(score_pin).remote(exp, hparams, pin, test_ids, run_dir))


def score_pin(exp: Any, hparams: dict[str, Any], pin: str, test_ids: Any, run_dir: str) -> dict[str, float]:
    """A pinned checkpoint's loss on the test windows, and on the selection windows again (the check that it is
    the state that reported)."""
    import torch

    from trainers.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(exp.run_config(hparams, name="score", run_dir=run_dir, **CKPT), progress=False)
    try:
        trainer.restore(Path(pin), hparams, event="restore")
        return {"test": windows_loss(trainer, test_ids), "selection": trainer.evaluate()}
    finally:
        trainer.log.close("FINISHED")
        trainer.engine.close()


def windows_loss(trainer: Any, ids: Any) -> float:
    """The mean loss over validation windows `ids`, batched as `Trainer.evaluate` batches its own."""
    import numpy as np

    chunks = np.array_split(ids, max(len(ids) // trainer.cfg.train.micro_batch_size, 1))
    batches = (tuple(t.to(trainer.device) for t in trainer.val_data.get(c)) for c in chunks)
    return float(trainer.engine.eval_loss(batches)) / len(ids)


def hand_lineage(args: argparse.Namespace) -> list[list[float]]:
    change = int(args.steps * 7 / 8) // args.interval * args.interval
    return [[0, HAND_LR, 0.0], [change, HAND_LR * 0.3, 0.0]]


def run_hand(args: argparse.Namespace, seed: int, test_ids: Any) -> dict[str, Any]:
    import ray

    exp, lineage = experiment(args, "random", seed), hand_lineage(args)
    run_dir = Path(args.work) / f"hand-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.time()
    out = ray.get(ray.remote(num_cpus=1)(train_schedule).remote(exp, lineage, test_ids, str(run_dir)))
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"method": HAND, "seed": seed, "run_seed": run_seed(seed), **out, "wall_s": time.time() - started,
            "picked": {"step": args.steps, "lineage": lineage}}


def train_schedule(exp: Any, lineage: list[list[float]], test_ids: Any, run_dir: str) -> dict[str, Any]:
    """One run of the product's Trainer along `lineage` (`set_hparams` at each change), reporting on the
    selection windows every interval like a trial; scored at its end (its latest report, the pick)."""
    import torch

    from trainers.trainer import Trainer

    torch.set_num_threads(1)
    (_, lr, wd), changes = lineage[0], {int(s): (lr, wd) for s, lr, wd in lineage[1:]}
    cfg = exp.run_config({"optimizer.lr": lr, "optimizer.weight_decay": wd}, name="hand", run_dir=run_dir, **CKPT)
    trainer, reports = Trainer(cfg, progress=False), []
    try:
        while trainer.step < exp.steps:
            if trainer.step in changes:
                lr, wd = changes[trainer.step]
                trainer.set_hparams({"optimizer.lr": lr, "optimizer.weight_decay": wd})
            trainer.train_step()
            if trainer.step % exp.scheduler.interval == 0 or trainer.step == exp.steps:
                reports.append(trainer.evaluate())
        return {"test_loss": windows_loss(trainer, test_ids), "selection_loss": reports[-1],
                "total_steps": trainer.step, "selection_reports": reports}
    finally:
        trainer.log.close("FINISHED")
        trainer.engine.close()


# ------------------------------------------------------------------------------------------- split


def split(args: argparse.Namespace) -> dict[str, Any]:
    """The selection windows (what every report's `val_loss` reads: `Trainer.evaluate`'s first
    eval_batches x micro_batch_size windows) and the test windows (every validation window after the end of
    the last document the selection touches), both fixed by the corpus and the task."""
    from trainers.data.dataset import TokenWindows

    cfg = experiment(args, "random", 0).run_config({}, name="split", run_dir=str(Path(args.work) / "split"))
    windows = TokenWindows(cfg.data.path, "val", cfg.data.seq_len)
    tokens = windows.tokens
    return test_windows(tokens, cfg.data.seq_len, cfg.train.eval_batches * cfg.train.micro_batch_size,
                        int(windows.manifest["tokenizer"]["eos_id"]))


def test_windows(tokens: Any, seq_len: int, selection: int, eos: int) -> dict[str, Any]:
    """Window i covers tokens [i*seq_len, i*seq_len + seq_len]. The test windows start after the first end of
    document at or past the selection's last token; without one (a tiny corpus), right after the selection."""
    import numpy as np

    num = (len(tokens) - 1) // seq_len
    if selection >= num:
        raise SystemExit(f"the validation split has {num} windows, none left after the {selection} selection ones")
    end = selection * seq_len  # the selection's last token
    ends = np.flatnonzero(tokens[end:] == eos)
    first = (end + int(ends[0]) + 1 + seq_len - 1) // seq_len if len(ends) else num
    disjoint = first < num
    first = first if disjoint else selection
    docs = lambda a, b: int(np.count_nonzero(tokens[a:b] == eos) + (tokens[b - 1] != eos))  # noqa: E731 - touched
    return {
        "selection": {"windows": [0, selection - 1], "count": selection, "documents": docs(0, end + 1)},
        "test": {"windows": [first, num - 1], "count": num - first, "documents": docs(first * seq_len, len(tokens)),
                 "document_disjoint": disjoint},
        "seq_len": seq_len,
        "rule": "selection: validation windows 0..n-1 (Trainer.evaluate's); test: every validation window from the "
                "first that starts after the end of the last document the selection touches, to the split's end",
        "ids": list(range(first, num)),
    }


# -------------------------------------------------------------------------------------- statistics


def wilcoxon_p(diffs: list[float]) -> float | None:
    """Exact two-sided p of the Wilcoxon signed-rank test (zeros dropped, tied ranks averaged): the share of
    the 2^n sign assignments whose positive rank sum is at least as far from its mean as the one observed."""
    d = [x for x in diffs if x != 0]
    if not d:
        return None
    order = sorted(range(len(d)), key=lambda i: abs(d[i]))
    ranks = [0.0] * len(d)
    i = 0
    while i < len(d):
        j = i
        while j + 1 < len(d) and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    twice = [round(2 * r) for r in ranks]  # integer rank sums
    counts = {0: 1}
    for r in twice:
        nxt = dict(counts)
        for s, c in counts.items():
            nxt[s + r] = nxt.get(s + r, 0) + c
        counts = nxt
    w = sum(r for r, x in zip(twice, d) if x > 0)
    mean = sum(twice) / 2
    extreme = sum(c for s, c in counts.items() if abs(s - mean) >= abs(w - mean) - 1e-9)
    return min(1.0, extreme / 2 ** len(d))


def sign_p(wins: int, losses: int) -> float | None:
    n = wins + losses
    if not n:
        return None
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(judged: dict[str, Any], other: dict[str, Any]) -> dict[str, Any] | None:
    """`other` against the judged arm over their common seeds: d = other's test loss - the judged arm's."""
    mine = dict(zip(judged["seeds"], judged["test_loss"]))
    common = [(s, v) for s, v in zip(other["seeds"], other["test_loss"]) if s in mine]
    if not common:
        return None
    d = [v - mine[s] for s, v in common]
    wins, losses = sum(x > 0 for x in d), sum(x < 0 for x in d)
    p, median = wilcoxon_p(d), statistics.median(d)
    shown = p is not None and p < 0.05 and median != 0
    return {
        "seeds": [s for s, _ in common], "differences": d, "wins": wins, "losses": losses, "ties": len(d) - wins - losses,
        "median": median, "mean": statistics.fmean(d), "wilcoxon_p": p, "sign_p": sign_p(wins, losses),
        "verdict": ("better" if median > 0 else "worse") if shown else "no difference shown",
    }


# ------------------------------------------------------------------------------------------ results


def results(args: argparse.Namespace, rows: list[dict[str, Any]], sel: dict[str, Any], load, started) -> dict:
    methods: dict[str, dict[str, Any]] = {}
    for m in [m for m in (*SEARCHES, HAND) if m in args.methods]:
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["seed"])
        if not mine:
            continue
        keys = {"seeds": "seed", "run_seeds": "run_seed", "test_loss": "test_loss", "selection_loss": "selection_loss",
                "total_steps": "total_steps", "wall_s": "wall_s", "picked": "picked", "trials": "trials",
                "exploits": "exploits", "pick_checked": "pick_checked"}
        table = {name: [r.get(k) for r in mine] for name, k in keys.items()}
        table.update(median_test_loss=statistics.median(table["test_loss"]),
                     mean_test_loss=statistics.fmean(table["test_loss"]))
        methods[m] = table
    budget = args.population * args.steps
    counted = {m: v["total_steps"] for m, v in methods.items() if m != HAND}
    worst = max((abs(s - budget) / budget for v in counted.values() for s in v), default=0.0)
    equal = {"budget": budget, "counted": counted, "max_relative_deviation": worst, "holds": worst <= 0.01,
             "hand": f"one run of {args.steps} steps per seed (a reference, not a search)"}
    pairs = {m: paired(methods[JUDGED], methods[m]) for m in methods if JUDGED in methods and m != JUDGED}
    fresh = [s for s in args.seeds if s not in SEEDS_THAT_CHOSE_SETTINGS]
    verdicts = {m: (pairs.get(m) or {}).get("verdict") for m in OPPONENTS}
    checks = {"seeds": len(args.seeds) >= 10, "fresh_seeds": len(fresh) >= 5, "equal_steps": equal["holds"],
              "picks_checked": all(all(v["pick_checked"]) for m, v in methods.items() if m != HAND)}
    out = {
        **provenance(started, load, measures=MEASURES),
        "quick": args.quick,
        "dry_run": args.dry_run,
        "verdict_rule": VERDICT_RULE,
        "task": {**TASK, "overrides": OVERRIDES, "space": SPACE, "data": args.data},
        "split": {k: v for k, v in sel.items() if k != "ids"},
        "setup": {
            "judged": JUDGED,
            "scheduler": DEFAULTS.model_dump(mode="json") | ({"interval": args.interval} if args.dry_run else {}),
            "arms": {m: SCHEDULER.get(m, HAND_WHAT) for m in methods},
            "population": args.population,
            "steps_per_trial": args.steps,
            "asha": {"max_samples": args.asha_samples, "grace_period": args.interval, "reduction_factor": 3},
            "hand_schedule": {"what": HAND_WHAT, "lineage": hand_lineage(args)},
            "seeds": args.seeds,
            "fresh_seeds": fresh,
            "seeds_that_chose_settings": SEEDS_THAT_CHOSE_SETTINGS,
            "run_seed": f"{RUN_SEED_OFFSET} + seed, the same for every arm of a seed",
            "pick": "search.lineage.best_trial over the arm's reports: the trial whose latest report's selection "
                    "val_loss is lowest, its checkpoint at that report; scored on the test windows",
            "harness": "Tune function trials running trainers.Trainer in-process (world size 1, one torch thread, "
                       "no Ray Train), the population's members all at once on 2 CPUs; PBT/PB2 by "
                       "search.population's PopulationActor, exploits restored in place",
        },
        "methods": methods,
        "equal_steps": equal,
        "paired": pairs,
        # d = the rule before's test loss - the rule's (> 0: issue 68's rule lower), seed by seed
        "pb2_against_before": paired(methods["pb2"], methods["pb2_before"]) if {"pb2", "pb2_before"} <= set(methods) else None,
        "done_when": {**checks, "verdicts": verdicts,
                      "gap_to_hand": (pairs.get(HAND) or {}).get("median"),
                      "holds": all(checks.values()) and all(v == "better" for v in verdicts.values())},
    }
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    methods = out["methods"]
    names = [m for m in (*OPPONENTS, JUDGED, HAND, *EXTRAS) if m in methods]
    for k, seed in enumerate(out["setup"]["seeds"]):
        ys = [dict(zip(methods[m]["seeds"], methods[m]["test_loss"])).get(seed) for m in names]
        a.plot(range(len(names)), ys, "o-", color=f"C{k % 10}", alpha=0.6, lw=1, ms=4, label=f"seed {seed}")
    a.set_xticks(range(len(names)), [f"{m}\nmedian {methods[m]['median_test_loss']:.4f}" for m in names], fontsize=8)
    a.set_ylabel("test-window loss of the arm's pick")
    a.legend(fontsize=6, ncol=2)
    a.set_title(f"population {out['setup']['population']}, {out['setup']['steps_per_trial']} steps per trial, "
                f"equal total steps ({'within 1%' if out['equal_steps']['holds'] else 'NOT within 1%'})", fontsize=9)
    others = [m for m in names if m != JUDGED and out["paired"].get(m)]
    for i, m in enumerate(others):
        p = out["paired"][m]
        b.scatter([i] * len(p["differences"]), p["differences"], color="k", s=12, zorder=3)
        b.hlines(p["median"], i - 0.3, i + 0.3, color="C3")
    b.axhline(0, color="k", lw=0.8)
    b.set_xticks(range(len(others)),
                 [f"{m} - pbt\n{out['paired'][m]['wins']}/{len(out['paired'][m]['differences'])} pbt lower\n"
                  f"{out['paired'][m]['verdict']}" for m in others], fontsize=8)
    b.set_ylabel("d per seed (> 0: PBT better); red: median")
    b.set_title(f"done_when {'HOLDS' if out['done_when']['holds'] else 'does not hold'}", fontsize=9)
    fig.suptitle(f"default PBT vs random search and ASHA, held-out windows ({out['date'][:10]}, "
                 f"{(out['git_commit'] or '')[:9]}{', quick' if out['quick'] else ''})", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "stdlib"))
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help=f"default {FULL_SEEDS[0]}-{FULL_SEEDS[-1]}")
    ap.add_argument("--population", type=int, default=4, help="PBT's members, random search's and ASHA's concurrent trials")
    ap.add_argument("--steps", type=int, default=None, help="steps per trial (default 1600; --quick 400)")
    ap.add_argument("--asha-samples", type=int, default=None, help="ASHA's most configurations (default population x steps / interval: the budget ends it)")
    ap.add_argument("--methods", nargs="+", choices=(*SEARCHES, HAND), default=[JUDGED, *OPPONENTS, HAND])
    ap.add_argument("--quick", action="store_true", help=f"seeds {QUICK_SEEDS}, 400 steps per trial")
    ap.add_argument("--dry-run", action="store_true", help="2 seeds of a tiny model, 8 steps (tests)")
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    args.interval = DEFAULTS.interval
    steps, seeds = (400, QUICK_SEEDS) if args.quick else (1600, FULL_SEEDS)
    if args.dry_run:
        steps, seeds, args.interval, args.population = 8, [100, 101], 4, 2
        if args.out == str(RESULTS) or args.work == str(WORK):
            ap.error("--dry-run needs its own --out and --work (never over the real results)")
    args.steps, args.seeds = args.steps or steps, args.seeds or seeds
    # ASHA: as many configurations as the budget could start (each trains one interval at least), so that the
    # budget ends it, never its samples: with 32 (8 x population) it ran out at seed 103 of the full run of
    # 2026-12-02 with 5,050 of 6,400 steps trained
    args.asha_samples = args.asha_samples or (4 if args.dry_run else args.population * args.steps // args.interval)
    if args.steps % args.interval:
        ap.error(f"--steps must be a multiple of the interval ({args.interval})")
    args.data, args.work = str(Path(args.data).resolve()), str(Path(args.work).resolve())  # Tune takes no relative path
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load, started = os.getloadavg(), time.time()
    import ray

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"  # a trial started after the budget ends unreported
    sel = split(args)
    rows = []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ids = ray.put(sel["ids"])
        for seed in args.seeds:  # every arm in turn at each seed: a slow stretch of the machine falls on all alike
            for m in args.methods:
                row = run_hand(args, seed, ids) if m == HAND else run_search(args, m, seed, ids)
                rows.append(row)
                print(f"{m} seed {seed}: test {row['test_loss']:.4f} (selection {row['selection_loss']:.4f}), "
                      f"{row['total_steps']} steps, {row['wall_s']:.0f} s", flush=True)
    finally:
        ray.shutdown()
    out = results(args, rows, sel, load, started)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pbt_quality.json").write_text(json.dumps(out, indent=1))
    plot(out, out_dir / "pbt_quality.png")
    print(json.dumps({"paired": {m: {k: p[k] for k in ("wins", "median", "wilcoxon_p", "verdict")}
                                 for m, p in out["paired"].items() if p},
                      "equal_steps": out["equal_steps"]["max_relative_deviation"], "done_when": out["done_when"]},
                     indent=1))
    return out


if __name__ == "__main__":
    main()
