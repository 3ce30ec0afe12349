"""Run one training job in this process: a single process, or one rank under torchrun."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from trainers.autofit import resolve_fit
from trainers.config import RunConfig
from trainers.fault_tolerance import refuse_without_ray
from trainers.layout import ParallelLayout
from trainers.parallel import build_engine
from trainers.parallel.distributed import init_from_env, leave_groups
from trainers.run_lock import RunDirLock
from trainers.trainer import FitResult, Trainer, TrainerCallback

__all__ = ["run_local"]


def run_local(
    cfg: RunConfig,
    callbacks: list[TrainerCallback] | tuple = (),
    progress: bool = True,
    hold_lock: bool = True,
    loop: Callable[[Trainer], FitResult] | None = None,
) -> FitResult:
    """Build the Trainer for `cfg` and run it: `trainer.fit()`, or `loop(trainer)`, a loop that drives it
    from outside (a PBT trial's). Under torchrun this joins the process group and leaves it at the end; a
    group that already exists (Ray Train's) is used and left alone. `hold_lock`: rank 0 holds the run dir's
    lock; Ray Train's workers pass False, their driver holds it."""
    import torch.distributed as dist

    if not dist.is_initialized():  # every layout rule before joining a group: each rank says the same line
        refuse_without_ray(cfg, "torchrun or a single process")
        ParallelLayout.of(cfg, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
    lock = None
    if hold_lock and int(os.environ.get("RANK", "0")) == 0:
        lock = RunDirLock(cfg.out_dir)
        lock.acquire()  # before joining a group: a refused rank 0 fails fast, torchrun ends the others
    owns_group = not dist.is_initialized() and init_from_env()
    threads = torch.get_num_threads()
    if not dist.is_initialized() and "OMP_NUM_THREADS" not in os.environ:
        # As Ray sets OMP_NUM_THREADS for its workers: torch's default, a thread per core, spins against
        # whatever else the machine runs.
        torch.set_num_threads(max(int(cfg.scaling.cpus_per_worker), 1))
    engine = None
    try:
        cfg, choice = resolve_fit(cfg)  # before the engine: the micro-batch size shapes the layout
        if choice is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            print(choice.line, flush=True)
        engine = build_engine(cfg)
        trainer = Trainer(cfg, engine=engine, callbacks=callbacks, progress=progress)
        return trainer.fit() if loop is None else loop(trainer)
    finally:
        torch.set_num_threads(threads)
        if engine is not None:
            engine.close()
            engine = None  # the trainer's cycles go with it in leave_groups' collection
        if owns_group:
            leave_groups()
        if lock is not None:
            lock.release()
