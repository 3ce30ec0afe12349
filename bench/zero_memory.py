"""Per-rank model-state memory and step time of ddp, fsdp zero2/zero3 and deepspeed ZeRO 1-3 on 2 processes,
next to the ZeRO paper's formula.

    .venv/bin/python bench/zero_memory.py --data data/stdlib        (part of `make bench`)

Each configuration runs the reference model through our Trainer and Engine under `torchrun --nproc-per-node
2` (gloo, 1 torch thread per rank), in fresh processes. On every rank, during step 2 (Adam state exists),
the tensors the engine holds are counted by category (bench/model_state.py) at three moments: after the
first micro-batch's forward, after its backward (gradients accumulating), and after the last backward,
before the optimizer step (the moment the paper's model-state sum describes: the headline). Then
median step time, peak live tensor bytes and peak RSS (bench/measure.py's Probe). Writes
bench/results/zero_memory.{json,png}; see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # torchrun runs this file as a script
from measure import Probe, _BaselinedTrainer, _ProbeCallback, reference_config  # noqa: E402
from model_state import (  # noqa: E402
    MODEL_STATE,
    count,
    ddp_bucket_bytes,
    deepspeed_layout,
    held_tensors,
    unaccounted,
    zero_formula,
)
from plot import NOISY  # noqa: E402
from run import _cpu_seconds, environment  # noqa: E402
from zero_plot import plot_zero  # noqa: E402

from trainers.config import RunConfig, parse_config  # noqa: E402
from trainers.parallel.distributed import init_from_env, leave_groups  # noqa: E402
from trainers.trainer import Trainer, TrainerCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work" / "zero_memory"
MiB = 2**20
WORLD = 2
CENSUS_STEP = 2  # 1-based; Adam's state is created by step 1's update
TOLERANCE = 0.10  # zero3: measured model state within 10% of the formula
HEADLINE = (
    "measured_bytes: local storage bytes of parameters, gradients and optimizer state (fp32 master copies "
    "included) that the engine holds on a rank after the last backward of a step, before the optimizer step: "
    "the moment the ZeRO paper's model-state sum describes. The rank holding the most is reported."
)


@dataclass(frozen=True)
class Setup:
    engine: str
    stage: int  # the ZeRO stage of the formula (0 = plain data parallel)
    keeps: str  # what the engine holds, from its source (torch 2.13, DeepSpeed 0.19.8)
    dtype: str = "fp32"
    deepspeed_extra: dict[str, Any] = field(default_factory=dict)
    grad_accumulation: str | None = None  # parallel.grad_accumulation (fsdp)

    def parallel(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.engine}
        if self.engine != "ddp":
            out["zero_stage"] = self.stage
        if self.deepspeed_extra:
            out["deepspeed_extra"] = self.deepspeed_extra
        if self.grad_accumulation:
            out["grad_accumulation"] = self.grad_accumulation
        return out


_FSDP_ACCUMULATION = (
    "Between micro-batches a rank holds only its gradient shards: FSDP2 reduce-scatters every micro-batch's "
    "gradients and accumulates them in the shards (parallel.grad_accumulation: sharded, the default)."
)
_DS_MASTER = (
    "DeepSpeed keeps an fp32 master copy of the rank's partition (optimizer 'master') even though the model "
    "is fp32"
)
_DS_BUCKET = "reduce_bucket_size (default 5e8 elements) sizes its IPG reduce bucket (comm_buffers)"
_DS_REUSE = (
    "After forward it keeps gathered every parameter that the traced order reuses within "
    "stage3_max_reuse_distance (default 1e9 elements), i.e. all of them for a model this size, until backward "
    "(after_first_forward)."
)
SETUPS = {
    "ddp": Setup(
        "ddp",
        0,
        "Whole parameters, gradients and Adam state on every rank. DDP's reducer also keeps its all-reduce "
        "buckets, a second copy of the gradients (comm_buffers; gradient_as_bucket_view is off).",
    ),
    "fsdp-zero2": Setup(
        "fsdp",
        2,
        "FSDP2 with reshard_after_forward=False: parameters stay gathered from forward to backward "
        "(after_first_forward), but post-backward reshards them and reduce-scatters the gradients whatever "
        "that flag, so at the optimizer step it holds ZeRO-3's state (16P/N), below the ZeRO-2 formula. "
        + _FSDP_ACCUMULATION,
    ),
    "fsdp-zero3": Setup(
        "fsdp",
        3,
        "Parameters, gradients and Adam state are DTensor shards (dim 0 padded to a multiple of N). "
        + _FSDP_ACCUMULATION,
    ),
    "fsdp-zero3-unsharded": Setup(
        "fsdp",
        3,
        "As fsdp-zero3 with parallel.grad_accumulation: unsharded. Gradient sync is off on earlier "
        "micro-batches, so FSDP2 accumulates whole gradients (4P, after_first_backward) and reduce-scatters "
        "once, on the last micro-batch: ZeRO-1's gradient term between micro-batches, 1/k of the traffic.",
        grad_accumulation="unsharded",
    ),
    "deepspeed-zero1": Setup(
        "deepspeed",
        1,
        "Whole parameters in one flat buffer. "
        + _DS_MASTER
        + " (stage_1_and_2.py clones it). Whole gradients between micro-batches; on the last one they are "
        "reduce-scattered into the rank's partition, so at the optimizer step gradients are partitioned as "
        "in stage 2, and the partition holds whole every parameter that overlaps it. "
        + _DS_BUCKET
        + ", allocated for the backward passes of a step.",
    ),
    "deepspeed-zero2": Setup(
        "deepspeed",
        2,
        "As stage 1, but gradients are reduced into the partition on every micro-batch. " + _DS_BUCKET + ".",
    ),
    "deepspeed-zero3": Setup(
        "deepspeed",
        3,
        "Partitioned parameters (ds_tensor), and parameters below stage3_param_persistence_threshold (default "
        "1e5 elements) kept whole on every rank. "
        + _DS_MASTER
        + " (stage3.py's no-copy branch compares a torch.device with a str, which is never equal). A gradient "
        "partition buffer always allocated. " + _DS_BUCKET + ", allocated for the whole run. " + _DS_REUSE,
    ),
    "deepspeed-zero3-persist0": Setup(
        "deepspeed",
        3,
        "As deepspeed-zero3 with stage3_param_persistence_threshold=0 (parallel.deepspeed_extra): every "
        "parameter partitioned.",
        deepspeed_extra={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    ),
    "fsdp-zero3-bf16": Setup(
        "fsdp",
        3,
        "bf16 is the compute dtype only (MixedPrecisionPolicy): shards, gradients (reduce_dtype fp32) and Adam "
        "state stay fp32, so the sharded state is the fp32 one (16P/N); the paper's mixed-precision formula "
        "has the same total, split 2+2+12. " + _FSDP_ACCUMULATION,
        dtype="bf16",
    ),
    "deepspeed-zero3-bf16-persist0": Setup(
        "deepspeed",
        3,
        "The paper's mixed precision: bf16 parameter and gradient partitions, fp32 master + Adam state "
        "(12 bytes per element) per partition; every parameter partitioned.",
        dtype="bf16",
        deepspeed_extra={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    ),
}
MOMENTS = ("after_first_forward", "after_first_backward", "before_optimizer_step")
HEADLINE_MOMENT = "before_optimizer_step"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib", help="prepared corpus (raytrain data prepare)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for the JSON and PNG")
    p.add_argument("--only", nargs="*", choices=list(SETUPS), help="a subset of the configurations")
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--micro-batch", type=int, default=4, help="per rank: 2 micro-batches per step on 2 ranks")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=CENSUS_STEP, help="untimed steps (the census is in step 2)")
    p.add_argument("--measured", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--worker", choices=list(SETUPS), help=argparse.SUPPRESS)  # set by the driver for torchrun
    p.add_argument("--rank-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < CENSUS_STEP:
        p.error(f"--warmup must be >= {CENSUS_STEP}: the census step is not timed")
    return args


def bench_config(args: argparse.Namespace, name: str, run_dir: Path) -> RunConfig:
    """The reference model of bench/run.py with the engine of `name` and 2 micro-batches per rank."""
    setup = SETUPS[name]
    steps = args.warmup + args.measured + 1  # + 1: the step under the live-tensor tracker
    raw = json.loads(
        reference_config(args.data, args.batch, args.seq, steps, "off", str(run_dir)).model_dump_json()
    )
    raw["train"].update(micro_batch_size=args.micro_batch, tensorboard=False)
    raw["precision"]["dtype"] = setup.dtype
    raw["parallel"] = setup.parallel()
    return parse_config(raw)


# -------------------------------------------------------------------------------------------- worker


class Census(TrainerCallback):
    """Counts what the engine holds at the MOMENTS of CENSUS_STEP. Before the step the Probe tracks, registers
    everything the engine holds with its live-tensor tracker (the Probe alone registers model parameters,
    gradients and torch optimizer state, not DeepSpeed's flat buffers)."""

    def __init__(self, trainer: Trainer, probe: Probe):
        self.trainer, self.probe, self.engine = trainer, probe, trainer.engine
        self.moments: dict[str, dict[str, int]] = {}
        self.unaccounted: dict[str, list[tuple[str, int]]] = {}  # the largest, per moment
        self.layout: dict[str, int] = {}
        self._wrap()

    def _wrap(self) -> None:
        engine, backward, step = self.engine, self.engine.backward, self.engine.step

        def counted_backward(loss: torch.Tensor, final_micro_batch: bool) -> None:
            backward(loss, final_micro_batch)
            if not final_micro_batch:
                self._take("after_first_backward")

        def counted_step(max_norm: float | None) -> tuple[float, bool]:
            self._take(HEADLINE_MOMENT)
            return step(max_norm)

        engine.backward, engine.step = counted_backward, counted_step  # this instance only
        self.trainer.model.register_forward_hook(lambda *_: self._take("after_first_forward"))

    def _take(self, moment: str) -> None:
        if self.trainer.step + 1 != CENSUS_STEP or moment in self.moments:
            return
        sizes, storages = count(held_tensors(self.engine))
        sizes["comm_buffers"] += self._ddp_buckets()
        sizes["model_state"] = sum(sizes[c] for c in MODEL_STATE)
        missed = unaccounted(self.engine, storages)
        sizes["unaccounted"] = sum(n for _, n in missed)
        self.moments[moment] = sizes
        self.unaccounted[moment] = missed[:8]
        self.layout = deepspeed_layout(self.engine)

    def _ddp_buckets(self) -> int:
        return ddp_bucket_bytes(self.engine.model) if self.engine.name == "ddp" else 0

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.step != self.probe.warmup + self.probe.measured:  # the Probe tracks the next step
            return
        tensors = [t for group in held_tensors(self.engine).values() for _, t in group]
        tracker = self.probe.tracker
        tracker.register([t.to_local() if isinstance(t, DTensor) else t for t in tensors])
        tracker.current += self._ddp_buckets()  # allocated in C++ at wrap time, live all along
        tracker.peak = max(tracker.peak, tracker.current)


class _ParamCount(TrainerCallback):
    n = 0

    def on_model_built(self, trainer: Trainer, model: torch.nn.Module) -> None:
        self.n = sum(p.numel() for p in model.parameters())  # before any engine shards it


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # 2 ranks share 2 cores
    init_from_env()
    rank = torch.distributed.get_rank()
    cfg = bench_config(args, args.worker, WORK / args.worker / "run")
    probe = Probe(args.warmup, args.measured)
    count = _ParamCount()
    trainer = _BaselinedTrainer(cfg, probe, callbacks=[count], progress=False)
    census = Census(trainer, probe)
    trainer.callbacks += [census, _ProbeCallback(probe)]  # census registers before the Probe's tracker starts
    trainer.fit()
    result = dict(
        probe.summary(),
        rank=rank,
        n_params=count.n,
        moments=census.moments,
        unaccounted_largest=census.unaccounted,
        deepspeed_layout=census.layout,
        torch_threads=torch.get_num_threads(),
    )
    Path(args.rank_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


# -------------------------------------------------------------------------------------------- driver


def launch(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One configuration on 2 fresh processes: per-rank results, the command, the machine's load."""
    rank_dir = WORK / name
    shutil.rmtree(rank_dir, ignore_errors=True)
    rank_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += [str(Path(__file__).resolve()), "--worker", name, "--rank-dir", str(rank_dir), "--data", args.data]
    cmd += ["--batch", str(args.batch), "--micro-batch", str(args.micro_batch), "--seq", str(args.seq)]
    cmd += ["--warmup", str(args.warmup), "--measured", str(args.measured)]
    print(f"  {name:<30}", end=" ", flush=True)
    log, before, load = rank_dir / "log.txt", _cpu_seconds(), os.getloadavg()
    with log.open("w") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    busy, total, ours = (b - a for a, b in zip(before, _cpu_seconds()))
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); log {log}:\n{tail}")
    return {
        "ranks": [json.loads((rank_dir / f"rank{r}.json").read_text()) for r in range(WORLD)],
        "command": shlex.join(cmd),
        # share of all cores that processes other than ours used meanwhile (as bench/run.py records it)
        "other_processes_cpu_share": max(busy - ours, 0.0) / total,
        "loadavg_start": load,
        "loadavg_end": os.getloadavg(),
    }


def formula_text(stage: int, mixed_precision: bool) -> str:
    weights, grads, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    terms = [(weights, 3), (grads, 2), (k, 1)]
    return " + ".join(f"{b}P/N" if stage >= s else f"{b}P" for b, s in terms)


def summarize(name: str, run: dict[str, Any]) -> dict[str, Any]:
    setup, ranks = SETUPS[name], run.pop("ranks")
    n_params = ranks[0]["n_params"]
    mixed = setup.dtype != "fp32"
    formula = zero_formula(n_params, WORLD, setup.stage, mixed_precision=mixed)
    formula["model_state"] = sum(formula.values())
    # The rank that holds the most decides what a device must fit.
    at_step = max((r["moments"][HEADLINE_MOMENT] for r in ranks), key=lambda m: m["model_state"])
    measured = dict(at_step, optimizer=at_step["master"] + at_step["optim_states"])
    ratios = {k: measured[k] / formula[k] for k in ("params", "grads", "optimizer", "model_state")}
    most = {m: max(r["moments"][m]["model_state"] for r in ranks) for m in MOMENTS}
    high_moment = max(most, key=most.get)
    steps = [t for r in ranks for t in r["step_times_s"]]
    return {
        "name": name,
        **asdict(setup),
        "n_params": n_params,
        "world_size": WORLD,
        "formula": formula_text(setup.stage, mixed),
        "formula_bytes": formula,
        "measured_bytes": measured,
        "ratio_measured_to_formula": ratios,
        "within_tolerance": abs(ratios["model_state"] - 1) <= TOLERANCE,
        "model_state_high_water": {
            "moment": high_moment,
            "bytes": most[high_moment],
            "ratio_to_formula": most[high_moment] / formula["model_state"],
        },
        "moments_per_rank": [r["moments"] for r in ranks],
        "unaccounted_largest_rank0": ranks[0]["unaccounted_largest"],
        "deepspeed_layout_rank0": ranks[0]["deepspeed_layout"],
        "median_step_s": statistics.median(steps),
        "min_step_s": min(steps),
        "median_step_s_per_rank": [statistics.median(r["step_times_s"]) for r in ranks],
        "live_tensor_peak_bytes_per_rank": [r["live_tensor_peak_bytes"] for r in ranks],
        "rss_added_bytes_per_rank": [r["rss_added_bytes"] for r in ranks],
        "rss_peak_bytes_per_rank": [r["rss_peak_bytes"] for r in ranks],
        "losses_rank0": ranks[0]["losses"],
        **run,
    }


def print_table(configs: list[dict[str, Any]]) -> None:
    head = (
        "config",
        "formula",
        "params",
        "grads",
        "optim",
        "state",
        "ratio",
        "high-water",
        "peak live",
        "RSS+",
        "step s",
    )
    widths = [30, 20] + [11] * (len(head) - 2)
    print("".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(head, widths))))
    for c in configs:
        m, hw = c["measured_bytes"], c["model_state_high_water"]
        cells = [
            c["formula"],
            *(f"{m[k] / MiB:.2f}" for k in ("params", "grads", "optimizer", "model_state")),
        ]
        cells += [f"{c['ratio_measured_to_formula']['model_state']:.3f}", f"{hw['ratio_to_formula']:.3f}"]
        cells += [
            f"{max(c['live_tensor_peak_bytes_per_rank']) / MiB:.0f}",
            f"{max(c['rss_added_bytes_per_rank']) / MiB:.0f}",
            f"{c['median_step_s']:.2f}",
        ]
        print(f"{c['name']:<30}{cells[0]:<20}" + "".join(f"{x:>11}" for x in cells[1:]))
    print(
        "MiB per rank at the optimizer step; ratio = measured / formula; high-water = most model state held "
        "at any of the three moments / formula; peak live tensors and RSS added: the largest rank."
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        leave_groups()  # after the worker's trainer is garbage: in a live interpreter, not at its exit
        return
    if not (Path(args.data) / "manifest.json").is_file():
        sys.exit(
            f"no prepared data at {args.data}; fix: make (or raytrain data prepare --output {args.data})"
        )
    start, env = time.perf_counter(), environment(args)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    env["git_dirty_paths"] = dirty.stdout.splitlines()  # other work in the tree when this ran
    env.update(targets={"zero3_model_state_ratio": [1 - TOLERANCE, 1 + TOLERANCE]}, headline_memory=HEADLINE)
    names = args.only or list(SETUPS)
    print(f"Per-rank model state on {WORLD} processes, census in step {CENSUS_STEP}:")
    configs = []
    for name in names:
        configs.append(summarize(name, launch(args, name)))
        c = configs[-1]
        print(
            f"model state {c['measured_bytes']['model_state'] / MiB:6.2f} MiB = "
            f"{c['ratio_measured_to_formula']['model_state']:.3f} x formula, median step {c['median_step_s']:.2f} s, "
            f"other processes' CPU {c['other_processes_cpu_share']:.0%}"
        )
    busiest = max(c["other_processes_cpu_share"] for c in configs)
    result = dict(
        env, configs=configs, max_other_processes_cpu_share=busiest, wall_s=time.perf_counter() - start
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zero_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_zero(result, out / "zero_memory.png")
    print()
    print_table(configs)
    if busiest > NOISY:
        print(
            f"NOISY: other processes used up to {busiest:.0%} of the CPUs; step times are unreliable "
            f"(byte counts are exact)"
        )
    print(f"wrote {out / 'zero_memory.json'} and .png in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
