"""The function every Ray Train worker runs: build our Trainer from the run config, restore, train, report.

Checkpoints are written by the Trainer (DCP, atomic) into the run dir, which is their only registry; Ray
gets a pointer to each (`POINTER`), so no tensor is copied. After a restart within the invocation (a
failure or an elastic resize) the Trainer restores the run's newest committed checkpoint and reshards it
to the new world size. Per-step metrics are persisted by the Trainer (`metrics.jsonl`), because Ray keeps only
the metrics reported with a checkpoint.

Failures that retrying cannot fix end the run instead of burning `max_failures` restarts:
- a `ConfigError` or `NonFiniteLossError` raised inside the workers (every rank reaches it at the same
  point, so they all return together) is written to `FAILED.json` and the run ends;
- a `CheckpointError` (no readable checkpoint left; a file one rank could not read) is written to
  `FAILED.json` and re-raised: it may hold on some ranks only, so the attempt must fail as a whole;
- any other error before the run's first checkpoint is written to `FAILED.json` and re-raised; the restart
  that follows sees the file and ends the run at once, with the cause.
The launcher reads `FAILED.json` and raises the error in the driver.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

import ray.train
from ray.train import Checkpoint

from raytrain_ext import ray_compat
from raytrain_ext.network import name_replica_group
from raytrain_ext.run_checks import load_callback
from trainers._base import ConfigError, NonFiniteLossError
from trainers.checkpoint import CheckpointError, checkpoint_step
from trainers.config import RunConfig, parse_config, with_values
from trainers.fault_tolerance import per_step
from trainers.launch import run_local
from trainers.run_dir import RunDir
from trainers.storage import absolute, is_within, location, write_json_atomic
from trainers.trainer import Trainer, TrainerCallback

__all__ = [
    "FAILURE_KINDS",
    "POINTER",
    "LatestMetrics",
    "ReportToRay",
    "load_callback",
    "newest_checkpoint",
    "pointed_to",
    "train_fn",
]

# Errors every rank meets at the same point, which a restart would only meet again: they end the run.
FATAL_ERRORS = (ConfigError, NonFiniteLossError)

# FAILED.json's `kind` for the errors the driver raises again as themselves (`launcher._as_error`); any other error
# is "early" (before the run's first checkpoint: a restart would redo the same steps).
FAILURE_KINDS: dict[str, type[Exception]] = {
    "config": ConfigError,
    "non_finite_loss": NonFiniteLossError,
    "checkpoint": CheckpointError,
}


class LatestMetrics(TrainerCallback):
    """Keeps the latest value of each train/eval metric as of every step not yet reported, for the report of
    a checkpoint: one written in the background commits a few steps after the step it holds, and is reported
    with that step's metrics."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}
        self.at_step: dict[int, dict[str, Any]] = {}
        self.evals: dict[int, dict[str, Any]] = {}  # eval records by step, as given: callbacks after this
        # one may still add their own values to a record

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.latest.update({k: v for k, v in record.items() if isinstance(v, (int, float))})
        self.at_step[trainer.step] = dict(self.latest)

    def after_eval(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.evals[trainer.step] = record

    def report(self, trainer: Trainer, step: int | None = None) -> dict[str, Any]:
        """The metrics as of `step` (default: the trainer's), for its checkpoint's report: the latest train
        values and the latest eval record up to it."""
        step = trainer.step if step is None else step
        metrics = dict(self.at_step.get(step, self.latest))
        upto = sorted(s for s in self.evals if s <= step)
        for at in upto:
            metrics.update(self.evals[at])
        self.at_step = {s: m for s, m in self.at_step.items() if s > step}
        self.evals = {s: r for s, r in self.evals.items() if s > step or s == upto[-1]}  # the newest stays
        return {**metrics, "step": step, "world_size": trainer.engine.world_size}


class ReportToRay(LatestMetrics):
    """Hands each committed checkpoint to Ray, with the latest metrics. Every rank calls `ray.train.report`
    the same number of times (checkpoints are collective); rank 0's report carries the checkpoint."""

    def after_checkpoint(self, trainer: Trainer, path: Path) -> None:
        metrics = self.report(trainer, checkpoint_step(path))
        if not trainer.engine.is_main:
            ray.train.report(metrics, checkpoint=None)
            return
        with tempfile.TemporaryDirectory() as pointer:
            write_pointer(Path(pointer), path)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(pointer))


# Ray holds a *pointer* to each committed checkpoint (Ray Train's documented pattern for checkpoints kept
# outside its run folder), uploaded into its own run folder for this invocation (`RunDir.ray_runs`). Our
# run dir's committed checkpoints are the only registry: a new `raytrain train` resumes from them
# (`checkpoint.resume: auto`), never from Ray's. Ray must hold one for two things only: a worker group Ray
# restarts within the invocation learns from it that the run has a checkpoint of its own, or a donor's
# (`resume_point`), and Ray's `Result.checkpoint` names the run's last one (`pointed_to`).
POINTER = "pointer.json"


def write_pointer(folder: Path, checkpoint: Any) -> None:
    (folder / POINTER).write_text(json.dumps({"uri": str(checkpoint), "step": checkpoint_step(checkpoint)}))


def pointed_to(ray_checkpoint: Checkpoint) -> Any:
    """The committed checkpoint (a location) that a checkpoint Ray holds points to."""
    with ray_checkpoint.as_directory() as folder:
        return absolute(location(json.loads((Path(folder) / POINTER).read_text())["uri"]))


def _write_failed(run_dir: Path, error: BaseException) -> None:
    """FAILED.json: the failure's kind (`FAILURE_KINDS`, else "early"), its message and traceback tail."""
    kind = next((k for k, cls in FAILURE_KINDS.items() if isinstance(error, cls)), "early")
    record = {
        "kind": kind,
        "error": type(error).__name__,  # for the message only
        "message": str(error),
        "traceback": traceback.format_exception(error)[-8:],
        "rank": int(os.environ.get("RANK", "0")),
    }
    write_json_atomic(RunDir(run_dir).failed, record)


# Ray Train's own console lines in trial actors and workers, unless `raytrain train --ray-log-level` says
# otherwise: INFO prints a line per report and per checkpoint it registers.
RAY_LOG_LEVEL = "WARNING"


def set_ray_train_log_level(level: str) -> None:
    """Ray Train's console lines in this process at `level`. Its per-report INFO line ("Reporting training
    result ...") comes from a logger named after its source file, outside `ray.train`, so
    `RunConfig(logging_config=...)` alone misses it."""
    for name in ("ray.train", ray_compat.train_report_logger()):
        logging.getLogger(name).setLevel(level)


def train_fn(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`. `config`: {"run": RunConfig as JSON, "callbacks": [spec, ...],
    "loop": a factory of the loop or None}: a loop is a TrainerCallback with `run(trainer) -> FitResult`, made
    in each worker by calling the factory (e.g. `functools.partial(GateLoop, gate=...)`). A loop may say where
    a (re)started group starts (`start_point()`: values over the run config, a checkpoint to resume: a PBT
    exploit's, which nothing in the run dir records)."""
    cfg: RunConfig = parse_config(config["run"])
    set_ray_train_log_level(config["ray_log_level"])
    run_dir = cfg.out_dir
    failed = RunDir(run_dir).failed
    if failed.exists():  # an earlier attempt failed in a way a restart cannot fix: end now, with its cause
        return
    # A loop that drives the Trainer from outside (a PBT trial's): it is a callback too, right after the
    # report to Ray (it posts each commit's report to its trial before a user's callback runs), and runs
    # the fit calls.
    loop = config["loop"]() if config.get("loop") else None
    start = loop.start_point() if loop is not None and hasattr(loop, "start_point") else {}
    if start.get("values"):
        cfg = with_values(cfg, start["values"])
    given = ray.train.get_checkpoint()
    resume = start.get("checkpoint") or resume_point(cfg, given)
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": str(resume)})})
    had_checkpoint = given is not None or _has_checkpoint(cfg)
    # Per-step fault tolerance: `ray.train.report` is a barrier over every worker, which a lost replica group
    # would hold; the run dir's committed checkpoints are the record (Ray is given none).
    report = [] if per_step(cfg.scaling) else [ReportToRay()]
    if per_step(cfg.scaling):
        name_replica_group(cfg.scaling.workers_per_group)
    try:
        users = [load_callback(c) if isinstance(c, str) else c for c in config.get("callbacks", [])]
        run_local(
            cfg,
            callbacks=[*report, *([loop] if loop is not None else []), *users],
            progress=False,
            hold_lock=False,
            loop=getattr(loop, "run", None),
        )
    except FATAL_ERRORS as e:
        # Deterministic, reached by every rank at the same point: retrying cannot help.
        if ray.train.get_context().get_world_rank() == 0:
            _write_failed(run_dir, e)
        return
    except CheckpointError as e:
        _write_failed(run_dir, e)
        raise
    except Exception as e:
        if not had_checkpoint and not _has_checkpoint(cfg) and not lost_peer(e):
            # Failed before the run's first checkpoint: a restart would repeat the same steps from scratch.
            # Not so where a peer was lost (its collective failed here): Ray restarts the group, from the
            # start. With checkpoints written in the background the first commit lands a few steps after
            # the step it holds, and a worker lost in between failed the whole run before this.
            _write_failed(run_dir, e)
        raise


_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    # torchft's manager client (gRPC) when its replica group's first worker, which serves the group's manager,
    # is gone: the other workers of a group of several, at their next quorum
    'message: "transport error"',
)


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is this rank's side of another rank's loss: a failed collective (gloo's transport
    errors, NCCL's aborted communicator, torch's DistNetworkError) or torchft's lost manager, not a fault of
    its own."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistNetworkError", ())):
        return True
    return any(text in str(e) for text in _PEER_LOST)


def resume_point(cfg: RunConfig, ray_checkpoint: Checkpoint | None) -> str:
    """`checkpoint.resume` for this attempt.

    - A checkpoint Ray hands over that points outside this run's folder (a donor's) wins: the run continues
      from it (that one only: its siblings are not ours to fall back to).
    - One of this run's own (Ray restarted the group within this invocation): `auto`, so the Trainer
      restores our newest committed one whose checksums hold (a worker lost right after a commit may die
      before Ray's controller registered that report, and a committed checkpoint is never thrown away; a
      corrupt one is skipped for the one before).
    - No checkpoint from Ray: `checkpoint.resume` from the run YAML decides."""
    if ray_checkpoint is None:
        return cfg.checkpoint.resume
    given = pointed_to(ray_checkpoint)
    return "auto" if is_within(given, cfg.out_dir) else str(given)


def newest_checkpoint(cfg: RunConfig) -> Any:
    """The run dir's newest committed checkpoint (None: none yet)."""
    from trainers.checkpoint import Checkpointer

    return Checkpointer(RunDir(cfg.out_dir).checkpoints, cfg.checkpoint.keep).latest()


def _has_checkpoint(cfg: RunConfig) -> bool:
    return newest_checkpoint(cfg) is not None
