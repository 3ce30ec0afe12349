"""Benchmark configurations, each in a fresh process: step times, page faults, peak RSS, peak live tensor bytes.

    python bench/measure.py --variant trainer|plain --data DIR --batch B --seq S --warmup W --measured M
        [--ac off|every] [--lean] --run-dir DIR --out FILE.json

Runs W + M + 1 steps. Step k's time is the gap between the end-of-step timestamps of steps k-1 and k
(Trainer: an `after_step` callback, so per-step logging, metrics and TensorBoard are inside it; plain
loop: right after its `loss.item()`). Steps W+1..W+M are the measured ones. The last step runs under a
tensor-allocation tracker (slow, so it is not timed) that gives the peak of live tensor bytes. `--lean`:
the Trainer with every option off (no TensorBoard, no progress bar).

From another script (bench/run.py, bench/lean.py): `trainer_vs_plain(...)` times the Trainer against the
plain loop in alternated pairs of fresh processes and summarises the per-pair ratios; `run_fresh(...)`
runs one configuration so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # trainers without an install (a bare GPU machine)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils.tensorboard  # noqa: F401, E402  imported before the RSS baseline in both variants
import tqdm.auto  # noqa: F401, E402  (same reason: module imports are not training memory)
from plain_loop import train as train_plain
from torch import nn

from trainers.config import RunConfig, apply_overrides, parse_config
from trainers.data.dataset import TokenWindows
from trainers.metrics import LiveTensorBytes
from trainers.trainer import Trainer, TrainerCallback

__all__ = [
    "LiveTensorBytes",
    "Probe",
    "check_same_math",
    "machine_cpu",
    "other_cpu_share",
    "reference_config",
    "run_fresh",
    "summarize_pairs",
    "summarize_variant",
    "trainer_vs_plain",
]

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / "_work"
SAME_LOSS_STEPS, SAME_LOSS_RTOL = 5, 1e-6


def reference_config(
    data: str,
    batch: int,
    seq: int,
    steps: int,
    ac: str,
    run_dir: str,
    tensorboard: bool = True,
    vocab: int = 257,
    overrides: Sequence[str] = (),
) -> RunConfig:
    """The design's reference model (4 blocks, dim 256, 4 heads, byte vocab), sized for a CPU; `vocab` and
    `overrides` (KEY=VALUE, as `--set`) change it (bench/lean.py: the seed's 50,257 tokens and each technique)."""
    raw = (
        {
            "name": "bench",
            "seed": 0,
            "run_dir": run_dir,
            "model": {"vocab_size": vocab, "dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": seq},
            "data": {"path": data, "seq_len": seq},
            "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "grad_clip": 1.0},
            "schedule": {"name": "warmup_cosine", "warmup_steps": min(10, steps - 1), "min_lr_ratio": 0.1},
            "precision": {"dtype": "fp32"},
            "memory": {"activation_checkpointing": ac},
            # eval only at the end (after the last timed step); TensorBoard on, as users have it
            "train": {
                "steps": steps,
                "global_batch_size": batch,
                "micro_batch_size": batch,
                "eval_every": 0,
                "eval_batches": 1,
                "tensorboard": tensorboard,
            },
            "checkpoint": {"every": 0, "final": False, "resume": "none"},  # nothing to save: a measurement
        }
    )
    return parse_config(apply_overrides(raw, list(overrides)))


# ------------------------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0), so ru_maxrss counts from now on."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def training_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, gradients, buffers and optimizer state: what is live between steps."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


# -------------------------------------------------------------------------------------------- probe


class Probe:
    """End-of-step timestamps and losses; RSS from the baseline; the tracker around the last step."""

    def __init__(self, warmup: int, measured: int, sync_fd: int | None = None) -> None:
        self.warmup, self.measured, self.sync_fd = warmup, measured, sync_fd
        self.stamps: dict[int, tuple[float, float, int]] = {}  # step -> (wall, process CPU, minor faults)
        # step -> the same clocks when the next step may start (lockstep: after the other process's step)
        self.resumed: dict[int, tuple[float, float, int]] = {}
        self.losses: list[float] = []
        self.result: dict[str, Any] = {}
        self.tracker = LiveTensorBytes()

    def baseline(self) -> None:
        """Call after imports and data loading, just before the model is built."""
        self.result["rss_peak_reset"] = reset_peak_rss()
        self.result["rss_baseline_bytes"] = rss_bytes()

    def after_step(self, step: int, loss: float, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.stamps[step] = self.resumed[step] = _clocks()
        self.losses.append(loss)
        last_timed = self.warmup + self.measured
        if step == last_timed:
            self.result["rss_peak_bytes"] = peak_rss_bytes()  # before the tracker adds its own objects
            self.tracker.register(training_state(model, opt))
            self.result["live_tensor_start_bytes"] = self.tracker.current
            self.tracker.__enter__()
        elif step == last_timed + 1:
            self.tracker.__exit__(None, None, None)
            self.result["live_tensor_peak_bytes"] = self.tracker.peak
        if self.sync_fd is not None:  # lockstep (`run_lockstep`): say the step is done, wait for our turn
            os.write(self.sync_fd, b"%d\n" % step)
            if step <= last_timed and not sys.stdin.readline():
                raise SystemExit("lockstep: the benchmark that runs this process has gone")
            self.resumed[step] = _clocks()

    def summary(self) -> dict[str, Any]:
        timed = range(self.warmup + 1, self.warmup + self.measured + 1)  # step 1 has no previous stamp
        out = dict(self.result, losses=self.losses)
        out["warmup_step_times_s"] = [self._gap(k, 0) for k in range(2, self.warmup + 1)]
        out["step_times_s"] = [self._gap(k, 0) for k in timed]
        out["step_cpu_times_s"] = [self._gap(k, 1) for k in timed]  # all threads of this process
        out["step_minor_faults"] = [self._gap(k, 2) for k in timed]
        out["rss_added_bytes"] = out["rss_peak_bytes"] - out["rss_baseline_bytes"]
        return out

    def _gap(self, step: int, clock: int) -> Any:
        return self.stamps[step][clock] - self.resumed[step - 1][clock]


def _clocks() -> tuple[float, float, int]:
    """(wall, process CPU, minor page faults: pages the kernel handed in, zeroed)."""
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _ProbeCallback(TrainerCallback):
    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.probe.after_step(trainer.step, record["loss"], trainer.model, trainer.engine.optimizer)


class _BaselinedTrainer(Trainer):
    """The Trainer unchanged, but the RSS baseline is taken after its data loading, before its model."""

    def __init__(self, cfg: RunConfig, probe: Probe, **kwargs: Any) -> None:
        self.probe = probe
        super().__init__(cfg, **kwargs)

    def _build_model(self, *args: Any) -> nn.Module:
        self.probe.baseline()
        return super()._build_model(*args)


# ------------------------------------------------------------------- from another script: fresh processes


def machine_cpu() -> tuple[float, float, float]:
    """(busy, total) CPU seconds of the machine since boot (/proc/stat), and our finished children's."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    total = user + nice + system + idle + iowait + irq + softirq + steal
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (total - idle - iowait) / tick, total / tick, children.ru_utime + children.ru_stime


def other_cpu_share(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """The share of all the machine's CPUs that processes other than our children used in between."""
    busy, total, ours = (b - a for a, b in zip(before, after))
    return max(busy - ours, 0.0) / total if total > 0 else 0.0


def _command(
    name: str,
    variant: str,
    data: str,
    shape: tuple[int, int, int, int],
    ac: str = "off",
    lean: bool = False,
    threads: int = 0,
    env: dict[str, str] | None = None,
    vocab: int = 257,
    overrides: Sequence[str] = (),
    work: Path = WORK,
) -> tuple[list[str], Path, Path, dict[str, str]]:
    """measure.py's command line for one configuration, its JSON and log files, and its environment."""
    batch, seq, warmup, measured = shape
    work.mkdir(parents=True, exist_ok=True)
    run_dir, out, log = work / name, work / f"{name}.json", work / f"{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(BENCH / "measure.py"), "--variant", variant, "--ac", ac, "--data", data]
    cmd += ["--batch", str(batch), "--seq", str(seq), "--warmup", str(warmup), "--measured", str(measured)]
    cmd += ["--run-dir", str(run_dir), "--out", str(out), "--threads", str(threads)] + ["--lean"] * lean
    cmd += ["--vocab", str(vocab)] + [a for o in overrides for a in ("--set", o)]
    return cmd, out, log, {**os.environ, **(env or {})}


def _result(spec: dict[str, Any], out: Path, log: Path, returncode: int, other: float) -> dict[str, Any]:
    if returncode:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{spec['name']} failed (exit {returncode}); log {log}:\n{tail}")
    result = json.loads(out.read_text())
    _, _, warmup, measured = spec["shape"]
    return dict(result, name=spec["name"], warmup=warmup, measured=measured, other_processes_cpu_share=other)


def _describe(spec: dict[str, Any]) -> str:
    batch, seq = spec["shape"][:2]
    lean = ", lean" if spec.get("lean") else ""
    return f"{spec['name']}: {spec['variant']}{lean}, ac={spec.get('ac', 'off')}, batch {batch} x seq {seq}"


def run_fresh(name: str, variant: str, data: str, shape: tuple[int, int, int, int], **kwargs: Any) -> dict[str, Any]:
    """One configuration in a fresh process (`shape` = batch, seq, warmup, measured steps; keyword
    arguments as `_command` takes them: ac, lean, threads, env, vocab, overrides, work); its measurements,
    with the share of the CPUs other processes used meanwhile."""
    spec = dict(kwargs, name=name, variant=variant, data=data, shape=shape)
    cmd, out, log, env = _command(**spec)
    print(f"  {_describe(spec)} ...", end=" ", flush=True)
    before = machine_cpu()
    with log.open("w") as err:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=err, stderr=subprocess.STDOUT, env=env)
    result = _result(spec, out, log, proc.returncode, other_cpu_share(before, machine_cpu()))
    print(f"median step {statistics.median(result['step_times_s']):.3f} s, "
          f"other processes' CPU {result['other_processes_cpu_share']:.0%}")
    return result


def run_lockstep(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Configurations (each a dict of `run_fresh`'s arguments, all of one shape) in fresh processes that
    take their steps in turn: step k of the first, then step k of the second, ..., then step k+1 of the
    first. Each process waits, between its steps, until the others have taken theirs, and its step times
    leave the waits out. So a slow minute of the machine falls on the steps of all of them alike, not on
    one process: the step-by-step ratios cancel the machine's drift, which separate runs do not."""
    shapes = {tuple(spec["shape"]) for spec in specs}
    if len(shapes) != 1:
        raise ValueError(f"lockstep runs need one shape, not {shapes}")
    _, _, warmup, measured = shapes.pop()
    print("  lockstep: " + " | ".join(_describe(spec) for spec in specs) + " ...", end=" ", flush=True)
    before, children = machine_cpu(), []
    try:
        for spec in specs:
            cmd, out, log, env = _command(**spec)
            read, write = os.pipe()
            with log.open("w") as err:
                proc = subprocess.Popen(cmd + ["--sync-fd", str(write)], cwd=ROOT, stdin=subprocess.PIPE,
                                        stdout=err, stderr=subprocess.STDOUT, env=env, pass_fds=(write,))
            os.close(write)
            children.append((spec, proc, os.fdopen(read), out, log))
        for step in range(1, warmup + measured + 2):  # step 1 starts at once (untimed: no previous stamp)
            for spec, proc, done, _, log in children:
                if step > 1:
                    proc.stdin.write(b"go\n")
                    proc.stdin.flush()
                if done.readline().strip() != str(step):
                    proc.wait()
                    raise RuntimeError(f"{spec['name']} stopped before step {step} (exit {proc.returncode}); "
                                       f"log {log}:\n" + "\n".join(log.read_text().splitlines()[-15:]))
        for _, proc, *_ in children:
            proc.stdin.close()
            proc.wait()
    finally:
        for _, proc, done, *_ in children:
            done.close()
            if proc.poll() is None:  # ours, on an error above
                proc.kill()
                proc.wait()
    other = other_cpu_share(before, machine_cpu())
    results = [_result(spec, out, log, proc.returncode, other) for spec, proc, _, out, log in children]
    print(", ".join(f"{r['name']} {statistics.median(r['step_times_s']):.3f} s" for r in results)
          + f"; other processes' CPU {other:.0%}")
    return results


def trainer_vs_plain(
    data: str,
    pairs: int = 8,
    shape: tuple[int, int, int, int] = (16, 256, 3, 12),
    lean: bool = False,
    threads: int = 0,
    label: str = "overhead",
    work: Path = WORK,
) -> dict[str, Any]:
    """The Trainer (`lean`: every option off) against the plain loop: `pairs` pairs of fresh processes, each
    pair in lockstep (`run_lockstep`) so that drift of the machine hits both; summarised by `summarize_pairs`."""
    loadavg_before, cpu_before = os.getloadavg(), machine_cpu()
    runs = []
    for i in range(pairs):
        trainer = dict(name=f"{label}-trainer-r{i}", variant="trainer", data=data, shape=shape, lean=lean,
                       threads=threads, work=work)
        plain = dict(name=f"{label}-plain-r{i}", variant="plain", data=data, shape=shape, threads=threads,
                     work=work)
        pair = run_lockstep([trainer, plain] if i % 2 == 0 else [plain, trainer])  # who goes first alternates
        runs += sorted(pair, key=lambda r: r["variant"] != "trainer")  # trainer, plain
    return dict(
        summarize_pairs(runs),
        lean=lean,
        loadavg_before=loadavg_before,
        loadavg_after=os.getloadavg(),
        other_processes_cpu_share=other_cpu_share(cpu_before, machine_cpu()),
        runs=runs,
    )


def summarize_pairs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Trainer / plain: each pair's median step-by-step ratio (its median, 10th and 90th percentile:
    the headline), and of all steps pooled, of the fastest steps and of process CPU times."""
    trainer = [r for r in runs if r["variant"] == "trainer"]
    plain = [r for r in runs if r["variant"] == "plain"]
    t, p = summarize_variant(trainer), summarize_variant(plain)
    # Each pair ran in lockstep: the median of its step-by-step ratios (step k of both, taken one after the other)
    per_pair = [statistics.median(a / b for a, b in zip(x["step_times_s"], y["step_times_s"]))
                for x, y in zip(trainer, plain)]
    p10, median, p90 = (float(np.percentile(per_pair, q)) for q in (10, 50, 90))
    return {
        "same_math": check_same_math(trainer, plain),
        "trainer": t,
        "plain": p,
        "ratio_median": median,
        "ratio_p10": p10,
        "ratio_p90": p90,
        "per_pair_ratios": per_pair,
        "per_repeat_ratio": per_pair,  # the same (the older name)
        "ratio": t["median_step_s"] / p["median_step_s"],  # pooled: median of all steps of each variant
        "ratio_cpu_time": t["median_step_cpu_s"] / p["median_step_cpu_s"],
        "ratio_min": t["min_step_s"] / p["min_step_s"],
        "minor_faults_per_step": {"trainer": t["median_minor_faults"], "plain": p["median_minor_faults"]},
    }


def summarize_variant(runs: list[dict[str, Any]]) -> dict[str, Any]:
    pooled = lambda key: statistics.median(x for r in runs for x in r[key])  # noqa: E731
    return {
        "median_step_s": pooled("step_times_s"),
        "median_step_cpu_s": pooled("step_cpu_times_s"),
        "min_step_s": min(t for r in runs for t in r["step_times_s"]),  # other load only adds time
        "per_repeat_median_step_s": [statistics.median(r["step_times_s"]) for r in runs],
        "median_minor_faults": pooled("step_minor_faults"),
        "mean_minor_faults": statistics.fmean(x for r in runs for x in r["step_minor_faults"]),
        "rss_added_bytes": statistics.median(r["rss_added_bytes"] for r in runs),
        "live_tensor_peak_bytes": statistics.median(r["live_tensor_peak_bytes"] for r in runs),
        "live_tensor_start_bytes": statistics.median(r["live_tensor_start_bytes"] for r in runs),
    }


def check_same_math(trainer_runs: list[dict], plain_runs: list[dict]) -> dict[str, Any]:
    """The first losses of both must agree to 1e-6 relative, or the comparison is not like with like."""
    worst_first = worst_all = 0.0
    for a, b in zip(trainer_runs, plain_runs):
        rel = [abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"])]
        worst_first, worst_all = max(worst_first, *rel[:SAME_LOSS_STEPS]), max(worst_all, *rel)
    if worst_first > SAME_LOSS_RTOL:
        raise AssertionError(
            f"trainer and plain loop differ by {worst_first:.2e} (relative) in their first "
            f"{SAME_LOSS_STEPS} losses; they must do the same math (<= {SAME_LOSS_RTOL:g})"
        )
    return {
        "steps_checked": SAME_LOSS_STEPS,
        "rtol": SAME_LOSS_RTOL,
        "max_rel_diff_first": worst_first,
        "max_rel_diff_all_steps": worst_all,
    }


# --------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.warmup + args.measured + 1
    cfg = reference_config(
        args.data, args.batch, args.seq, steps, args.ac, args.run_dir, not args.lean, args.vocab, args.overrides
    )
    probe = Probe(args.warmup, args.measured, args.sync_fd)
    if args.variant == "trainer":
        _BaselinedTrainer(cfg, probe, callbacks=[_ProbeCallback(probe)], progress=not args.lean).fit()
    else:  # plain; naive: the seed's naive loop (zero_grad without set_to_none)
        data = TokenWindows(cfg.data.path, "train", cfg.data.seq_len)
        probe.baseline()
        train_plain(cfg, data, probe.after_step, set_to_none=args.variant == "plain")
    return probe.summary()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("trainer", "plain", "naive"), required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True, help=">= 1: step 1 has no start timestamp")
    p.add_argument("--measured", type=int, required=True)
    p.add_argument("--ac", choices=("off", "selective", "every"), default="off")
    p.add_argument(
        "--lean", action="store_true", help="Trainer: every option off (TensorBoard, progress bar)"
    )
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--vocab", type=int, default=257, help="the model's vocabulary")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--sync-fd", type=int, default=None, help="lockstep with other runs (run_lockstep)")
    args = p.parse_args(argv)
    if args.variant != "trainer" and (args.ac != "off" or args.lean or args.overrides):
        p.error("the plain and naive loops have no options (--ac, --lean, --set)")
    if args.threads:
        torch.set_num_threads(args.threads)
    start, load = time.perf_counter(), os.getloadavg()
    result = run(args)
    result.update(
        variant=args.variant,
        ac=args.ac,
        lean=args.lean,
        batch=args.batch,
        seq=args.seq,
        torch_threads=torch.get_num_threads(),
        malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        loadavg_start=load,
        loadavg_end=os.getloadavg(),
        wall_s=time.perf_counter() - start,
    )
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
