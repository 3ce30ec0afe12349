"""Pipeline schedules' idle fraction vs theory, MoE vs dense at equal active parameters, and the
all-to-all share of an expert-parallel step, on CPU (gloo, one torch thread per process).

    .venv/bin/python bench/pipeline.py --data data/stdlib        (what `make bench` runs)

Writes bench/results/pipeline.{json,png} and prints tables. How idle time is measured (see also
bench/README.md): every forward, backward (full, input-only, weight-only) and loss computation of every
stage is timed with the thread's CPU clock (`time.thread_time`), which counts only time on a core, so
it does not grow when other processes take the CPU; the idle fraction is then 1 - busy / (ranks x
makespan), the makespan obtained by replaying each rank's actions in the order the schedule really ran
them, each starting when its rank is free and its inputs exist (previous stage's forward, next stage's
backward), communication taken as free. The wall-clock idle fraction (time inside `schedule.step` not
spent in an action, waits for neighbours included) is reported beside it: it is only meaningful when
every process has a core of its own (pp=2 here on 2 quiet cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORK = ROOT / "bench" / "_work" / "pipeline"

SEQ = 128
# 16 blocks: the head (dim x vocab) is ~1% of a stage at pp=2, so stages are balanced as the theory assumes
DENSE = {"vocab_size": 257, "dim": 256, "n_layers": 16, "n_heads": 4, "max_seq_len": SEQ}
SCHEDULES = {  # name: (pipeline_schedule, virtual stages per rank)
    "gpipe": ("gpipe", 1),
    "1f1b": ("1f1b", 1),
    "interleaved_1f1b": ("interleaved_1f1b", 2),
    "interleaved_zb": ("interleaved_zb", 2),
    "zbv": ("zbv", 2),
}
GRID = {2: [2, 4, 8, 16], 4: [4, 16]}  # pp: microbatch counts m
SMALL = {**DENSE, "dim": 128, "n_layers": 4}
MOE_MODELS = {  # equal active parameters per token: one 512-wide SwiGLU (dense), 1 of 4 such, 2 of 4 half-width
    "dense": {**SMALL, "ffn_dim": 512},
    "moe-4x-top1": {**SMALL, "ffn_dim": 512, "moe": {"num_experts": 4, "top_k": 1}},
    "moe-4x-top2-half": {**SMALL, "ffn_dim": 256, "moe": {"num_experts": 4, "top_k": 2}},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--micro-batch", type=int, default=2, help="samples per pipeline microbatch")
    p.add_argument("--steps", type=int, default=3, help="timed pipeline steps (after 1 untimed)")
    p.add_argument("--moe-steps", type=int, default=150, help="steps of each MoE-vs-dense run")
    p.add_argument("--a2a-steps", type=int, default=6, help="timed steps of the all-to-all run")
    p.add_argument(
        "--only", choices=["schedules", "moe", "a2a"], action="append", help="run only these parts"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(data: str, run_dir: Path, model: dict, parallel: dict, train: dict) -> Any:
    from trainers.config import parse_config

    raw = {
        "name": run_dir.name,
        "run_dir": str(run_dir),
        "seed": 0,
        "model": model,
        "data": {"path": data, "seq_len": SEQ},
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
        "schedule": {"name": "constant"},
        "parallel": parallel,
        "train": {"eval_every": 0, "eval_batches": 4, "tensorboard": False, **train},
        "checkpoint": {"every": 0, "resume": "none"},
    }
    return parse_config(raw)


# ------------------------------------------------------------------------------------------- workers


class ActionLog:
    """Wraps each stage's forward/backward/weight methods and the loss: (kind, stage, microbatch, wall
    start, wall end, CPU seconds) per action, and the wall span of each `schedule.step`."""

    def __init__(self, engine: Any):
        self.actions: list[tuple] = []
        self.steps: list[tuple[float, float]] = []
        self.on = False
        for stage in engine.stages:
            self._wrap(stage, "forward_one_chunk", "F", stage.stage_index)
            self._wrap(stage, "backward_one_chunk", "B", stage.stage_index)
            self._wrap(stage, "backward_weight_one_chunk", "W", stage.stage_index)
        self._wrap(engine.pipeline_schedule, "_loss_fn", "L", engine.num_stages - 1)
        step = engine.pipeline_schedule.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = step(*args, **kwargs)
            if self.on:
                self.steps.append((t0, time.perf_counter()))
            return out

        engine.pipeline_schedule.step = timed_step

    def _wrap(self, obj: Any, method: str, kind: str, stage: int) -> None:
        original = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = original(*args, **kwargs)
            if self.on:
                k = "I" if kind == "B" and kwargs.get("full_backward") is False else kind
                mb = args[0] if args and kind != "L" else -1
                self.actions.append((k, stage, int(mb), t0, time.perf_counter(), time.thread_time() - c0))
            return out

        setattr(obj, method, timed)


def schedule_worker(spec: dict) -> dict:
    from trainers.trainer import Trainer

    rank = torch.distributed.get_rank()
    schedule, virtual = SCHEDULES[spec["schedule"]]
    m, mb = spec["m"], spec["micro_batch"]
    par = {
        "engine": "fsdp",
        "zero_stage": 2,
        "pp": spec["pp"],
        "pipeline_schedule": schedule,
        "n_microbatches": m,
    }
    if virtual > 1:
        par["virtual_stages"] = virtual
    train = {"steps": 1 + spec["steps"], "global_batch_size": m * mb, "micro_batch_size": mb}
    trainer = Trainer(_config(spec["data"], WORK / spec["name"] / "run", DENSE, par, train), progress=False)
    log = ActionLog(trainer.engine)
    trainer.train_step()  # untimed: first-step allocations
    log.on = True
    for _ in range(spec["steps"]):
        trainer.train_step()
    return {"rank": rank, "actions": log.actions, "steps": log.steps, "split": trainer.engine.split}


def moe_worker(spec: dict) -> dict:
    from trainers.metrics import read_metrics
    from trainers.models import active_param_count, param_count
    from trainers.trainer import Trainer

    cfg = _config(spec["data"], WORK / spec["name"] / "run", spec["model"], {}, spec["train"])
    trainer = Trainer(cfg, progress=False)
    trainer.fit()
    rows = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    evals = read_metrics(cfg.out_dir / "metrics.jsonl", "eval")
    return {
        "params": param_count(cfg.model),
        "active_params": active_param_count(cfg.model),
        "loss": [r["loss"] for r in rows],
        "step_time_s": [r["step_time_s"] for r in rows],
        "tokens_per_step": cfg.train.global_batch_size * SEQ,
        "val_loss": evals[-1]["val_loss"],
        "moe_load_imbalance": [r.get("moe_load_imbalance") for r in rows],
    }


def a2a_worker(spec: dict) -> dict:
    """dp=2 x ep=2: each step's wall time, and the main thread's time inside all-to-all ops (issue and
    wait, forward and backward) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from trainers.trainer import Trainer

    par = {"engine": "fsdp", "ep": 2}
    cfg = _config(
        spec["data"], WORK / spec["name"] / "run", MOE_MODELS["moe-4x-top2-half"], par, spec["train"]
    )
    trainer = Trainer(cfg, progress=False)
    trainer.train_step()
    step_s = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            trainer.train_step()
            step_s.append(time.perf_counter() - t0)

    def is_a2a(event: Any) -> bool:
        name = event.name
        return "all_to_all" in name or "alltoall" in name or name.endswith("wait_tensor")

    def outermost(event: Any) -> bool:  # not inside another all-to-all event: counted once
        parent = event.cpu_parent
        while parent is not None:
            if is_a2a(parent):
                return False
            parent = parent.cpu_parent
        return True

    a2a_us = sum(e.cpu_time_total for e in prof.events() if is_a2a(e) and outermost(e))
    return {"rank": torch.distributed.get_rank(), "step_s": step_s, "all_to_all_s": a2a_us / 1e6}


def worker(args: argparse.Namespace) -> None:
    from trainers.parallel.distributed import init_from_env, leave_groups

    torch.set_num_threads(1)
    spec = json.loads(args.spec)
    init_from_env()
    fn = {"schedule": schedule_worker, "moe": moe_worker, "a2a": a2a_worker}[args.worker]
    result = fn(spec)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (WORK / spec["name"] / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        leave_groups()  # in a live interpreter: a gloo group left to exit can abort the rank there


# -------------------------------------------------------------------------------------------- driver


def _cpu_seconds() -> tuple[float, float, float]:
    """(busy, total) CPU seconds of the machine since boot, and our children's CPU seconds."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    children = os.times()
    return (sum(fields) - idle) / tick, sum(fields) / tick, children.children_user + children.children_system


def launch(kind: str, spec: dict, world: int) -> dict:
    """One configuration on `world` fresh processes (torchrun); per-rank results and the machine's load."""
    folder = WORK / spec["name"]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]
    before = _cpu_seconds()
    with (folder / "log.txt").open("w") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    busy, total, ours = (b - a for a, b in zip(before, _cpu_seconds()))
    if proc.returncode:
        tail = "\n".join((folder / "log.txt").read_text().splitlines()[-25:])
        raise RuntimeError(f"{spec['name']} failed (exit {proc.returncode}):\n{tail}")
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    return {"ranks": ranks, "other_processes_cpu_share": max(busy - ours, 0.0) / total}


def replay(ranks: list[dict], step: int, num_stages: int) -> dict:
    """Idle fraction of one step when each action takes its measured CPU time: each rank runs its actions
    in the recorded order; an action starts when its rank is free and its inputs exist. Also: the same
    with every action at the median cost of its (stage, kind), which removes transient slow-downs (a
    diagnostic), and the stage imbalance (busiest rank's busy time / the mean)."""
    per_rank = []
    for r in ranks:
        start, end = r["steps"][step]
        per_rank.append([a for a in r["actions"] if start <= a[3] and a[4] <= end])
    costs: dict[tuple, list[float]] = {}
    for actions in per_rank:
        for a in actions:
            costs.setdefault((a[0], a[1]), []).append(a[5])
    typical = [[(*a[:5], statistics.median(costs[(a[0], a[1])])) for a in actions] for actions in per_rank]
    busy = [sum(a[5] for a in actions) for actions in per_rank]
    wall_busy = [sum(a[4] - a[3] for a in actions) for actions in per_rank]
    wall_span = [r["steps"][step][1] - r["steps"][step][0] for r in ranks]
    makespan = _makespan(per_rank, num_stages)
    return {
        "idle_replay": 1 - sum(busy) / (len(per_rank) * makespan),
        "idle_replay_typical": 1
        - sum(a[5] for t in typical for a in t) / (len(typical) * _makespan(typical, num_stages)),
        "idle_wall": 1 - sum(wall_busy) / sum(wall_span),
        "stage_imbalance": max(busy) / statistics.fmean(busy),
        "makespan_s": makespan,
        "busy_cpu_s": sum(busy),
        "step_wall_s": max(wall_span),
        "actions_per_rank": [len(a) for a in per_rank],
    }


def _makespan(per_rank: list[list[tuple]], num_stages: int) -> float:

    def key(action: tuple) -> tuple:
        kind, stage, mb = action[:3]
        return ("G" if kind in ("B", "I") else kind, stage, mb)

    def deps(action: tuple) -> list[tuple]:
        kind, stage, mb = action[:3]
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind in ("B", "I"):
            return [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < num_stages - 1 else [])
        return [("G", stage, mb)] if kind == "W" else []

    done: dict[tuple, float] = {}
    free, pos = [0.0] * len(per_rank), [0] * len(per_rank)
    while any(p < len(a) for p, a in zip(pos, per_rank)):
        progressed = False
        for r, actions in enumerate(per_rank):
            while pos[r] < len(actions) and all(d in done for d in deps(actions[pos[r]])):
                action = actions[pos[r]]
                begin = max([free[r]] + [done[d] for d in deps(action)])
                free[r] = begin + action[5]
                if action[0] != "L":
                    done[key(action)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("replay is stuck: the recorded order has an unmet dependency")
    return max(free)


def theory(schedule: str, p: int, m: int, v: int) -> float | None:
    """Idle fraction of the ideal schedule (equal stages, equal F and B): (p-1)/(m+p-1) for GPipe and
    1F1B; the bubble shrinks by v with interleaving: (p-1)/(v*m+p-1) (Narayanan et al. 2021)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return None  # zero-bubble: ~0 with equal F, B and W; reported, not bounded


def run_schedules(args: argparse.Namespace) -> list[dict]:
    rows = []
    for pp, ms in GRID.items():
        for m in ms:
            for name, (_, v) in SCHEDULES.items():
                spec = {"name": f"{name}-pp{pp}-m{m}", "schedule": name, "pp": pp, "m": m}
                spec |= {"micro_batch": args.micro_batch, "steps": args.steps, "data": args.data}
                print(f"  {spec['name']:<26}", end=" ", flush=True)
                out = launch("schedule", spec, pp)
                stages = pp * v
                steps = [replay(out["ranks"], s, stages) for s in range(args.steps)]
                row = {
                    "schedule": name,
                    "pp": pp,
                    "m": m,
                    "virtual_stages": v,
                    "theory": theory(name, pp, m, v),
                    "idle_replay": statistics.median(s["idle_replay"] for s in steps),
                    "idle_wall": statistics.median(s["idle_wall"] for s in steps),
                    "idle_replay_typical": statistics.median(s["idle_replay_typical"] for s in steps),
                    "stage_imbalance": statistics.median(s["stage_imbalance"] for s in steps),
                    "steps": steps,
                    "split": out["ranks"][0]["split"],
                    "other_processes_cpu_share": out["other_processes_cpu_share"],
                }
                rows.append(row)
                t = row["theory"]
                print(
                    f"idle {row['idle_replay']:.3f} (typical costs {row['idle_replay_typical']:.3f}, wall "
                    f"{row['idle_wall']:.3f}, imbalance {row['stage_imbalance']:.3f})"
                    + (f"  theory {t:.3f}  ratio {row['idle_replay'] / t:.2f}" if t else "")
                    + f"  others' CPU {row['other_processes_cpu_share']:.0%}"
                )
    return rows


def run_moe(args: argparse.Namespace) -> dict:
    out = {}
    train = {"steps": args.moe_steps, "global_batch_size": 16, "micro_batch_size": 16, "eval_batches": 4}
    for name, model in MOE_MODELS.items():
        spec = {"name": f"moe-{name}", "model": model, "train": train, "data": args.data}
        print(f"  {name:<20}", end=" ", flush=True)
        res = launch("moe", spec, 1)
        r = res["ranks"][0]
        timed = r["step_time_s"][5:]
        r |= {
            "tokens_per_s": r["tokens_per_step"] / statistics.median(timed),
            "final_loss_mean10": statistics.fmean(r["loss"][-10:]),
            "other_processes_cpu_share": res["other_processes_cpu_share"],
        }
        out[name] = r
        print(
            f"params {r['params'] / 1e6:.2f}M (active {r['active_params'] / 1e6:.2f}M)  "
            f"{r['tokens_per_s']:.0f} tok/s  loss(last 10) {r['final_loss_mean10']:.3f}  val {r['val_loss']:.3f}"
        )
    return out


def run_a2a(args: argparse.Namespace) -> dict:
    train = {"steps": 1 + args.a2a_steps, "global_batch_size": 16, "micro_batch_size": 8}
    spec = {"name": "a2a-dp2-ep2", "train": train, "steps": args.a2a_steps, "data": args.data}
    print("  dp=2 x ep=2 (moe-4x-top2-half)", end=" ", flush=True)
    res = launch("a2a", spec, 2)
    shares = [r["all_to_all_s"] / sum(r["step_s"]) for r in res["ranks"]]
    out = {
        "ranks": res["ranks"],
        "share": statistics.fmean(shares),
        "share_per_rank": shares,
        "other_processes_cpu_share": res["other_processes_cpu_share"],
    }
    print(f"all-to-all share of step time {out['share']:.1%}")
    return out


def check(rows: list[dict]) -> dict:
    """The targets: idle within 1.25x of theory for GPipe and 1F1B at m >= 4p; interleaved below 1F1B."""
    bounded = [r for r in rows if r["schedule"] in ("gpipe", "1f1b") and r["m"] >= 4 * r["pp"]]
    ratios = {f"{r['schedule']}-pp{r['pp']}-m{r['m']}": r["idle_replay"] / r["theory"] for r in bounded}
    by = {(r["schedule"], r["pp"], r["m"]): r["idle_replay"] for r in rows}
    lower = {
        f"pp{pp}-m{m}": by[("interleaved_1f1b", pp, m)] < by[("1f1b", pp, m)]
        for (s, pp, m) in by
        if s == "1f1b" and ("interleaved_1f1b", pp, m) in by
    }
    return {
        "ratio_to_theory": ratios,
        "within_1.25x": all(x <= 1.25 for x in ratios.values()),
        "interleaved_below_1f1b": lower,
        "interleaved_always_below": all(lower.values()),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = dict(zip(SCHEDULES, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
    for ax, pp in zip(axes[:2], GRID):
        rows = [r for r in result.get("schedules", []) if r["pp"] == pp]
        for name in SCHEDULES:
            mine = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["m"])
            if not mine:
                continue
            ms = [r["m"] for r in mine]
            ax.plot(
                ms, [r["idle_replay"] for r in mine], "o-", color=colors[name], label=f"{name} (measured)"
            )
            if mine[0]["theory"] is not None and name != "gpipe":  # gpipe's theory is 1f1b's
                ax.plot(
                    ms,
                    [r["theory"] for r in mine],
                    "--",
                    color=colors[name],
                    alpha=0.6,
                    label=f"{name} theory",
                )
        ax.axvline(4 * pp, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches per step (m); dotted: m = 4p")
        ax.set_ylabel("idle fraction of the pipeline")
        ax.set_title(f"pp={pp}: idle = 1 - busy / (p x makespan), CPU-time replay")
        ax.legend(fontsize=7)
    ax = axes[2]
    for name, r in result.get("moe_vs_dense", {}).items():
        loss = r["loss"]
        smooth = [statistics.fmean(loss[max(0, i - 9) : i + 1]) for i in range(len(loss))]
        ax.plot(
            range(1, len(loss) + 1),
            smooth,
            label=f"{name}: {r['tokens_per_s']:.0f} tok/s, val {r['val_loss']:.3f}",
        )
    a2a = result.get("all_to_all")
    title = "MoE vs dense, equal active params (10-step mean)"
    if a2a:
        title += f"\nall-to-all share of a dp=2 x ep=2 step: {a2a['share']:.1%}"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    parts = args.only or ["schedules", "moe", "a2a"]
    out_dir = Path(args.out)
    path = out_dir / "pipeline.json"
    result = json.loads(path.read_text()) if path.is_file() and args.only else {}
    start = time.perf_counter()
    if "schedules" in parts:
        print("Pipeline schedules (idle fraction: CPU-time replay; wall clock beside it)")
        result["schedules"] = run_schedules(args)
        result["checks"] = check(result["schedules"])
    if "moe" in parts:
        print("MoE vs dense at equal active parameters (one process)")
        result["moe_vs_dense"] = run_moe(args)
    if "a2a" in parts:
        print("All-to-all share of an expert-parallel step")
        result["all_to_all"] = run_a2a(args)
    run = {  # one entry per invocation: `--only` re-runs a part and keeps the others' results
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "parts": parts,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "wall_s": time.perf_counter() - start,
    }
    result["runs"] = [*result.get("runs", [result["env"]] if "env" in result else []), run]
    result["env"] = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch_threads_per_process": 1,
        "model": DENSE,
        "seq_len": SEQ,
        "micro_batch": args.micro_batch,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "pipeline.png")
    if "checks" in result:
        print(json.dumps(result["checks"], indent=1))
    print(f"wrote {path} and {out_dir / 'pipeline.png'}")


if __name__ == "__main__":
    main()
