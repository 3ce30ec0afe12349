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

from trainers.storage import location, read_bytes, write_text_atomic

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


@dataclass(frozen=True)
class RunDir:
    """A run dir's files as locations (`RunDir(cfg.out_dir).metrics`); it needs not exist."""

    root: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", location(self.root))

    @property
    def config(self) -> Any:
        return self.root / CONFIG

    @property
    def metrics(self) -> Any:
        return self.root / METRICS

    @property
    def checkpoints(self) -> Any:
        return self.root / CHECKPOINTS

    @property
    def lock(self) -> Any:
        return self.root / LOCK

    @property
    def failed(self) -> Any:
        return self.root / FAILED

    @property
    def worker_log(self) -> Any:
        return self.root / WORKER_LOG

    @property
    def ray_runs(self) -> Any:
        return self.root / RAY_RUNS

    @property
    def tensorboard(self) -> Any:
        return self.root / TENSORBOARD

    @property
    def profile(self) -> Any:
        return self.root / PROFILE

    @property
    def report(self) -> Any:
        return self.root / REPORT

    def tracker(self, name: str) -> Any:
        """A tracker's folder (mlflow, wandb): its sent state, MLflow's local store."""
        return self.root / name

    def tracker_state(self, name: str) -> Any:
        """What a tracker has sent, for a resumed run to send the rest."""
        return self.tracker(name) / "state.json"

    def write_config(self, text: str) -> None:
        write_text_atomic(self.config, text)

    def read_config(self) -> str | None:
        data = read_bytes(self.config)
        return None if data is None else data.decode()
