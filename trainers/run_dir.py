"""The files of a run dir, by name: every file and folder that any part of a run writes into `RUN_DIR`
(local or in a bucket) is named here once, and read or written through `trainers.storage`.

    RUN_DIR/
        config.yaml                       the validated run config (the trainer's rank 0)
        metrics.jsonl                     every step, eval and event (trainers.metrics)
        checkpoints/step_XXXXXXXX         committed checkpoints (trainers.checkpoint)
        .lock                             one writer per run dir (trainers.run_lock)
        FAILED.json                       a run ended on an error a restart cannot fix (raytrain_ext.worker)
        workers.log                       the workers' tracebacks taken off the console
        ray/<invocation>/                 Ray Train's own run folder for one `raytrain train` (its state and
                                          pointers to our checkpoints; raytrain_ext.launcher)
        tb/, profile/, <tracker>/         TensorBoard events, profiler traces, a tracker's sent state
        report/                           `raytrain report`'s summary and plots
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainers.storage import location, write_text_atomic

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "FAILED",
    "LOCK",
    "METRICS",
    "PROFILE",
    "RAY_RUNS",
    "REPORT",
    "TENSORBOARD",
    "WORKER_LOG",
    "RunDir",
]

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LOCK = ".lock"
FAILED = "FAILED.json"
WORKER_LOG = "workers.log"
RAY_RUNS = "ray"
TENSORBOARD = "tb"
PROFILE = "profile"
REPORT = "report"


def _file(name: str) -> property:
    """A property: the run dir's file or folder `name`."""
    return property(lambda self: self.root / name)


@dataclass(frozen=True)
class RunDir:
    """A run dir's files as locations (`RunDir(cfg.out_dir).metrics`); it needs not exist."""

    root: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", location(self.root))

    config = _file(CONFIG)
    metrics = _file(METRICS)
    checkpoints = _file(CHECKPOINTS)
    lock = _file(LOCK)
    failed = _file(FAILED)
    worker_log = _file(WORKER_LOG)
    ray_runs = _file(RAY_RUNS)
    tensorboard = _file(TENSORBOARD)
    profile = _file(PROFILE)
    report = _file(REPORT)

    def tracker(self, name: str) -> Any:
        """A tracker's folder (mlflow, wandb): its sent state, MLflow's local store."""
        return self.root / name

    def tracker_state(self, name: str) -> Any:
        """What a tracker has sent, for a resumed run to send the rest."""
        return self.tracker(name) / "state.json"

    def write_config(self, text: str) -> None:
        write_text_atomic(self.config, text)
