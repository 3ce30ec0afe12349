"""Run one training job in this process (single process, or one rank under torchrun)."""

from __future__ import annotations

from trainers.config import RunConfig
from trainers.trainer import FitResult, Trainer, TrainerCallback

__all__ = ["run_local"]


def run_local(
    cfg: RunConfig, callbacks: list[TrainerCallback] | tuple = (), progress: bool = True
) -> FitResult:
    return Trainer(cfg, callbacks=callbacks, progress=progress).fit()
