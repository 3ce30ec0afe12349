"""`raytrain train` on Ray: a Ray Train V2 `TorchTrainer` built from the run YAML.

Run directory (`run_dir`, default `runs/<name>`) = the Ray run's storage folder:

    runs/<name>/
        config.yaml               the validated run config
        metrics.jsonl             every step, eval and event (resume, resize, checkpoint) exactly once
        checkpoints/step_XXXXXXXX DCP checkpoints (atomic), also registered with Ray (no copy)
        FAILED.json               only when a run ended on an error that a restart cannot fix
        checkpoint_manager_snapshot.json, ...   Ray Train's own state (resume = run it again)

Ray's `storage_path` is the parent folder and its run `name` the folder's name, so re-running the same
command continues the run from its newest checkpoint. On a multi-node cluster `run_dir` and `data.path`
must be on a filesystem every node mounts at the same path (NFS, EFS, Filestore).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ext.worker import FAILED_FILE, RAY_LOG_LEVEL, train_fn
from trainers._base import ConfigError, NonFiniteLossError
from trainers.config import RunConfig, check_inputs
from trainers.metrics import read_metrics
from trainers.parallel.layout import ParallelLayout

__all__ = ["RayRunResult", "RunFailedError", "build_trainer", "check_run", "ensure_ray", "run_config_for_workers", "train"]


class RunFailedError(RuntimeError):
    """The run ended on an error a restart cannot fix (raised in the driver, with the workers' cause)."""


@dataclass
class RayRunResult:
    run_dir: Path
    step: int
    val_loss: float | None
    train_loss: float | None
    checkpoint: Path | None
    world_sizes: list[int]  # the world size of each attempt, in order (resizes and restarts)


def run_config_for_workers(cfg: RunConfig) -> RunConfig:
    """Absolute paths: Ray workers do not run in the driver's working directory."""
    data = cfg.data.model_copy(update={"path": Path(cfg.data.path).resolve()})
    return cfg.model_copy(update={"run_dir": cfg.out_dir.resolve(), "data": data})


def check_run(cfg: RunConfig) -> None:
    """Everything that can be checked before a worker starts: inputs on disk, and that every world size
    the run may take keeps the global batch (micro x accumulation x dp)."""
    check_inputs(cfg)
    if cfg.parallel.engine == "none" and max(cfg.scaling.sizes) > 1:
        raise ConfigError(
            f"parallel.engine=none with up to {max(cfg.scaling.sizes)} workers; fix: set parallel.engine to "
            f"ddp, fsdp or deepspeed, or scaling.num_workers=1"
        )
    pp, ep = cfg.parallel.pp, cfg.parallel.ep
    for world in cfg.scaling.sizes:
        try:
            ParallelLayout.build(world, 0, pp=pp, ep=ep)  # the workers' own check: pp divides, ep divides dp
            cfg.train.accumulation(world // pp)
        except ConfigError as e:
            raise ConfigError(f"at {world} workers (scaling allows {_sizes_text(cfg)}): {e}") from None


def _sizes_text(cfg: RunConfig) -> str:
    sizes = cfg.scaling.sizes
    return f"{sizes.start}" if len(sizes) == 1 else f"{sizes.start}..{sizes.stop - 1}"


def ensure_ray(address: str | None) -> bool:
    """Connect to Ray: an address (`auto`, `ray://...`, `host:port`) joins a cluster; none starts a local
    Ray in this process, sized to the machine. Returns whether this call started it (and must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):  # `ray job submit` sets RAY_ADDRESS for its driver
        ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=True)
        return True
    ray.init(num_cpus=os.cpu_count(), log_to_driver=True)
    return True


def build_trainer(
    cfg: RunConfig,
    callbacks: Sequence[str] = (),
    ray_callbacks: Sequence[Any] = (),
    ray_log_level: str = RAY_LOG_LEVEL,
):
    """The TorchTrainer for this run (not started). `callbacks`: TrainerCallback specs ("module:Name")
    built inside every worker; `ray_callbacks`: `ray.train.UserCallback`s run on the controller;
    `ray_log_level`: of Ray Train's own `ray.train` console lines (INFO: every report and checkpoint)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = run_config_for_workers(cfg)
    s = cfg.scaling
    num_workers: int | tuple[int, int] = (s.min_workers, s.max_workers) if s.elastic else s.sizes.start
    scaling = ray.train.ScalingConfig(
        num_workers=num_workers,
        use_gpu=s.use_gpu,
        resources_per_worker={"CPU": s.cpus_per_worker, **({"GPU": 1} if s.use_gpu else {})},
        elastic_resize_monitor_interval_s=s.resize_check_s,
    )
    run = ray.train.RunConfig(
        name=cfg.out_dir.name,
        storage_path=str(cfg.out_dir.parent),
        failure_config=ray.train.FailureConfig(max_failures=s.max_failures),
        # Our Checkpointer keeps `checkpoint.keep` and deletes older ones; Ray only registers them.
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
        callbacks=list(ray_callbacks),
        logging_config=ray.train.LoggingConfig(log_level=ray_log_level),
        worker_runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(int(s.cpus_per_worker), 1))}},
    )
    return TorchTrainer(
        train_fn,
        train_loop_config={
            "run": json.loads(cfg.model_dump_json()),
            "callbacks": list(callbacks),
            "ray_log_level": ray_log_level,
        },
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        scaling_config=scaling,
        run_config=run,
    )


def train(
    cfg: RunConfig,
    address: str | None = None,
    progress: bool = True,
    callbacks: Sequence[str] = (),
    ray_callbacks: Sequence[Any] = (),
    ray_log_level: str = RAY_LOG_LEVEL,
) -> RayRunResult:
    """Run `cfg` on Ray and wait for it. Raises ConfigError/NonFiniteLossError with the workers' cause
    when the run ended on an error that a restart cannot fix."""
    check_run(cfg)  # before Ray starts
    cfg = run_config_for_workers(cfg)
    run_dir = cfg.out_dir
    (run_dir / FAILED_FILE).unlink(missing_ok=True)  # a new invocation: an old failure is history
    started = ensure_ray(address)
    watcher = _ProgressWatcher(run_dir / "metrics.jsonl", cfg.train.steps, cfg.name) if progress else None
    try:
        trainer = build_trainer(cfg, callbacks, ray_callbacks, ray_log_level)
        if watcher:
            watcher.start()
        try:
            result = trainer.fit()
        except Exception as e:
            failed = _read_failed(run_dir)
            if failed is not None:
                raise _as_error(failed) from e
            raise
    finally:
        if watcher:
            watcher.stop()
        if started:
            import ray

            ray.shutdown()
    failed = _read_failed(run_dir)
    if failed is not None:
        raise _as_error(failed)
    return summarize(run_dir, result.checkpoint.path if result.checkpoint else None)


def summarize(run_dir: Path, checkpoint: str | None = None) -> RayRunResult:
    rows = read_metrics(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    starts = [r for r in rows if r.get("kind") == "event" and r.get("event") in ("start", "resume")]
    return RayRunResult(
        run_dir=run_dir,
        step=train_rows[-1]["step"] if train_rows else 0,
        val_loss=evals[-1]["val_loss"] if evals else None,
        train_loss=train_rows[-1]["loss"] if train_rows else None,
        checkpoint=Path(checkpoint) if checkpoint else None,
        world_sizes=[r["world_size"] for r in starts if "world_size" in r],
    )


def _read_failed(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / FAILED_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _as_error(failed: dict[str, Any]) -> Exception:
    message = failed["message"]
    if failed["type"] == "ConfigError":
        return ConfigError(message)
    if failed["type"] == "NonFiniteLossError":
        return NonFiniteLossError(message)
    where = "before the first checkpoint" if failed["kind"] == "early" else ""
    return RunFailedError(
        f"rank {failed['rank']} failed {where}: {failed['type']}: {message} (not retried: a restart would "
        f"redo the same steps; traceback tail in {FAILED_FILE})"
    )


class _ProgressWatcher:
    """A progress bar in the driver, fed by the run's own metrics.jsonl (rank 0 of whichever attempt
    is running writes it): step, loss, tokens/s and the current world size."""

    def __init__(self, path: Path, total: int, name: str, interval_s: float = 0.5):
        self.path, self.total, self.name, self.interval_s = path, total, name, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total, desc=self.name, unit="step", dynamic_ncols=True)
        offset, last, val = 0, None, None
        try:
            while True:
                stopping = self._stop.wait(self.interval_s)
                lines: list[str] = []
                if self.path.is_file():
                    if self.path.stat().st_size < offset:  # a restart rewound the log to its checkpoint
                        offset = 0
                    with self.path.open("rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                    complete = chunk[: chunk.rfind(b"\n") + 1]
                    offset += len(complete)
                    lines = complete.decode().splitlines()
                for line in lines:
                    row = json.loads(line)
                    if row.get("kind") == "eval":
                        val = row["val_loss"]
                    elif row.get("kind") == "train":
                        last = row
                    elif row.get("event") == "resize":
                        bar.write(
                            f"step {row['step']}: resized {row['old_world_size']} -> {row['new_world_size']} "
                            f"workers (accumulation {row['accumulation']})"
                        )
                    elif row.get("event") == "resume":
                        bar.write(f"resumed from step {row['step']} on {row['world_size']} workers")
                if lines and last is not None:
                    bar.n = last["step"]
                    bar.set_postfix(
                        loss=f"{last['loss']:.3f}",
                        val=val and f"{val:.3f}",
                        tok_s=f"{last['tokens_per_s']:.0f}",
                        workers=last.get("world_size"),
                    )
                if stopping:
                    return
        finally:
            bar.close()


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Poll `predicate` until true (tests and tools that wait on a run's files)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
