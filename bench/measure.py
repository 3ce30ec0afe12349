"""One benchmark configuration in this (fresh) process: step times, peak RSS, peak live tensor bytes.

    python bench/measure.py --variant trainer|plain --data DIR --batch B --seq S --warmup W --measured M
        [--ac off|every] --run-dir DIR --out FILE.json

Runs W + M + 1 steps. Step k's time is the gap between the end-of-step timestamps of steps k-1 and k
(Trainer: an `after_step` callback, so per-step logging, metrics and TensorBoard are inside it; plain
loop: right after its `loss.item()`). Steps W+1..W+M are the measured ones. The last step runs under a
tensor-allocation tracker (slow, so it is not timed) that gives the peak of live tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.utils.tensorboard  # noqa: F401  imported before the RSS baseline in both variants
import tqdm.auto  # noqa: F401  (same reason: module imports are not training memory)
from plain_loop import train as train_plain
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainers.config import RunConfig, parse_config
from trainers.data.dataset import TokenWindows
from trainers.trainer import Trainer, TrainerCallback

__all__ = ["LiveTensorBytes", "Probe", "reference_config"]


def reference_config(data: str, batch: int, seq: int, steps: int, ac: str, run_dir: str) -> RunConfig:
    """The design's reference model (4 blocks, dim 256, 4 heads, byte vocab), sized for a CPU."""
    return parse_config(
        {
            "name": "bench",
            "seed": 0,
            "run_dir": run_dir,
            "model": {"vocab_size": 257, "dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": seq},
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
                "tensorboard": True,
            },
            "checkpoint": {"every": 0, "resume": "none"},
        }
    )


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


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages: every op's outputs are counted once per storage until the
    storage is freed (a weakref finalizer; torch keeps one Python object per live storage). Kernel-
    internal scratch buffers are not seen. Storages made before entering must be `register`ed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if size == 0 or key in self.live:
                continue
            self.live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key).atexit = False

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.register([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def training_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, gradients, buffers and optimizer state: what is live between steps."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


# -------------------------------------------------------------------------------------------- probe


class Probe:
    """End-of-step timestamps and losses; RSS from the baseline; the tracker around the last step."""

    def __init__(self, warmup: int, measured: int) -> None:
        self.warmup, self.measured = warmup, measured
        self.stamps: dict[int, tuple[float, float]] = {}  # step -> (wall, process CPU)
        self.losses: list[float] = []
        self.result: dict[str, Any] = {}
        self.tracker = LiveTensorBytes()

    def baseline(self) -> None:
        """Call after imports and data loading, just before the model is built."""
        self.result["rss_peak_reset"] = reset_peak_rss()
        self.result["rss_baseline_bytes"] = rss_bytes()

    def after_step(self, step: int, loss: float, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.stamps[step] = (time.perf_counter(), time.process_time())
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

    def summary(self) -> dict[str, Any]:
        timed = range(self.warmup + 1, self.warmup + self.measured + 1)  # step 1 has no previous stamp
        out = dict(self.result, losses=self.losses)
        out["warmup_step_times_s"] = [self._gap(k, 0) for k in range(2, self.warmup + 1)]
        out["step_times_s"] = [self._gap(k, 0) for k in timed]
        out["step_cpu_times_s"] = [self._gap(k, 1) for k in timed]  # all threads of this process
        out["rss_added_bytes"] = out["rss_peak_bytes"] - out["rss_baseline_bytes"]
        return out

    def _gap(self, step: int, clock: int) -> float:
        return self.stamps[step][clock] - self.stamps[step - 1][clock]


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

    def _build_model(self, pretrained) -> nn.Module:
        self.probe.baseline()
        return super()._build_model(pretrained)


# --------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.warmup + args.measured + 1
    cfg = reference_config(args.data, args.batch, args.seq, steps, args.ac, args.run_dir)
    probe = Probe(args.warmup, args.measured)
    if args.variant == "trainer":
        _BaselinedTrainer(cfg, probe, callbacks=[_ProbeCallback(probe)], progress=True).fit()
    else:
        data = TokenWindows(cfg.data.path, "train", cfg.data.seq_len)
        probe.baseline()
        train_plain(cfg, data, probe.after_step)
    return probe.summary()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("trainer", "plain"), required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True, help=">= 1: step 1 has no start timestamp")
    p.add_argument("--measured", type=int, required=True)
    p.add_argument("--ac", choices=("off", "every"), default="off")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.variant == "plain" and args.ac != "off":
        p.error("the plain loop has no activation checkpointing")
    if args.threads:
        torch.set_num_threads(args.threads)
    start, load = time.perf_counter(), os.getloadavg()
    result = run(args)
    result.update(
        variant=args.variant,
        ac=args.ac,
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
