"""`raytrain train` on Ray: a Ray Train V2 `TorchTrainer` built from the run YAML.

Run directory (`run_dir`, default `runs/<name>`; its files are named in `trainers.run_dir`): our committed
checkpoints there are the run's only registry, so re-running the same command continues the run from its
newest one. Each invocation is a Ray Train run of its own, in `run_dir/ray/<invocation>` (Ray's
`storage_path` and run `name`): Ray keeps its state there and a pointer to each of our checkpoints
(`raytrain_ext.worker.POINTER`); a controller restart within the invocation continues that Ray run, a new
invocation starts a new one (and removes the old one's folder), so Ray never reads a record of checkpoints
that our retention has deleted since. On a multi-node cluster `run_dir` and `data.path` are URIs of a bucket
(`s3://...`, `gs://...`: `trainers.storage`; Ray gets the same fsspec file system as its
`storage_filesystem`), or folders on a filesystem every node mounts at the same path (NFS, EFS).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_ext import ray_compat
from raytrain_ext.cleanup import (
    end_train_runs,
    placement_groups_of_this_job,
    release_stranded_placement_groups,
    train_controllers_of_this_job,
)
from raytrain_ext.reaper import Reaper
from raytrain_ext.result import RunResult, summarize
from raytrain_ext.run_checks import check_run
from raytrain_ext.worker import (
    FAILURE_KINDS,
    RAY_LOG_LEVEL,
    newest_checkpoint,
    pointed_to,
    train_fn,
)
from raytrain_ext.worker_logs import WorkerLogs, quiet_logger
from trainers._base import ConfigError, env_default, free_port, scoped_environ
from trainers.config import RunConfig, ScalingConfig
from trainers.fault_tolerance import per_step
from trainers.metrics import MetricsTail, read_metrics
from trainers.progress import LineProgress, progress_bar
from trainers.resume import continue_hint
from trainers.run_dir import FAILED, RunDir
from trainers.run_lock import RunDirLock
from trainers.storage import (
    absolute,
    poll_interval,
    ray_storage,
    remove_file,
    remove_tree,
)

if TYPE_CHECKING:
    from trainers.trainer import TrainerCallback

__all__ = [
    "RunResult",
    "RunFailedError",
    "build_trainer",
    "check_run",
    "ensure_ray",
    "event_line",
    "stop_ray",
    "run_config_for_workers",
    "train",
]


logger = logging.getLogger(__name__)


class RunFailedError(RuntimeError):
    """The run ended on an error a restart cannot fix (raised in the driver, with the workers' cause)."""


def run_config_for_workers(cfg: RunConfig) -> RunConfig:
    """Absolute paths: Ray workers do not run in the driver's working directory (URIs stay as they are)."""
    data = cfg.data.model_copy(update={"path": absolute(cfg.data.path)})
    return cfg.model_copy(update={"run_dir": absolute(cfg.out_dir), "data": data})


def check_fits_local(cfg: RunConfig, cpus: float, gpus: int) -> None:
    """A local Ray never grows: refuse, before it starts, a run whose smallest size it cannot hold."""
    s, fewest = cfg.scaling, cfg.scaling.sizes.start
    need_cpu, need_gpu = fewest * s.cpus_per_worker, fewest if s.use_gpu else 0
    if need_cpu <= cpus and need_gpu <= gpus:
        return
    have = f"{cpus:g} CPUs" + (f" and {gpus} GPUs" if s.use_gpu else "")
    raise ConfigError(
        f"scaling: {fewest} workers x {s.cpus_per_worker:g} CPUs"
        + (" and 1 GPU" if s.use_gpu else "")
        + f" do not fit this machine's local Ray ({have}); fix: lower scaling.num_workers (or min_workers) "
        f"or scaling.cpus_per_worker, or join a cluster with --address"
    )


_REAPERS: list[Reaper] = []


def ensure_ray(address: str | None) -> bool:
    """Connect to Ray: an address (`auto`, `ray://...`, `host:port`) joins a cluster; none starts a local
    Ray in this process, sized to the machine, with a reaper that ends that Ray's processes if this one
    dies. Returns whether this call started it (and must stop it with `stop_ray`)."""
    import ray

    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):  # `ray job submit` sets RAY_ADDRESS for its driver
        target = address or os.environ["RAY_ADDRESS"]
        try:
            ray.init(address=target, log_to_driver=True)
        except ConnectionError as e:
            if _refused_token(e):
                raise ConfigError(
                    f"--address {target}: the cluster refused this process's token; fix: use the cluster's "
                    f"token (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token; RAY_AUTH_MODE=token)"
                ) from None
            raise
        return True
    with quiet_logger(ray_compat.TOKEN_SETUP_LOGGER), own_state_api() as port:
        ray.init(
            address="local",  # never another Ray on this machine
            dashboard_port=port,
            num_cpus=os.cpu_count(),
            log_to_driver=True,
            # The raylet warns once its Python workers reach 4x this, as if they were leaked tasks. An
            # experiment's are by design: per trial its actor, a Train controller, the workers and a gate
            # (`make demo`: 26 on any machine). The bound paces workers starting at once: 8 lets 31 live
            # without the warning, and starts no more than 8 Python processes at once on a small machine.
            **ray_compat.ray_init_system_config(worker_maximum_startup_concurrency=max(os.cpu_count() or 1, 8)),
        )
    _REAPERS.append(Reaper.start(Reaper.local_ray_roots()))
    return True


@contextlib.contextmanager
def own_state_api() -> Iterator[int]:
    """A free port for the dashboard of a local Ray about to start, and RAY_API_SERVER_ADDRESS naming it for the
    block. Ray's state API, called inside the local Ray's own processes (Ray Train's PlacementGroupCleaner asks
    it whether the controller lives), looks for "the" Ray of the machine: with two on one machine (two runs at
    once, a test's Ray beside a driver it starts, or a stale /tmp/ray/ray_current_cluster) it asks the wrong one,
    times out and its monitor dies with a traceback on the console. The raylet and every worker inherit the
    environment at `ray.init`: they are told their own dashboard's address (for a Ray without a dashboard, a port
    nothing serves: its calls fail there, never reach another Ray)."""
    port = free_port()
    with scoped_environ(RAY_API_SERVER_ADDRESS=f"http://127.0.0.1:{port}"):
        yield port


def _refused_token(error: BaseException) -> bool:
    """Whether Ray could not connect because the GCS refused the token (Ray 2.60 keeps that cause only as the
    text of the last attempt's traceback, inside the RuntimeError behind its ConnectionError)."""
    seen: BaseException | None = error
    while seen is not None:
        if "InvalidAuthToken" in str(seen) or type(seen).__name__ == "AuthenticationError":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def stop_ray() -> None:
    """`ray.shutdown()` of a Ray that `ensure_ray` started, and its reaper's release. A Train run's `fit()`
    returns while its controller actor is still exiting: shut down then, the controller was SIGTERMed mid-exit
    and printed a traceback under `raytrain tune`'s last table. It is waited for first, briefly."""
    import ray

    deadline = time.monotonic() + 10.0
    while train_controllers_of_this_job() and time.monotonic() < deadline:
        time.sleep(0.1)  # the GCS's actor table: no event to wait on
    ray.shutdown()
    while _REAPERS:
        _REAPERS.pop().stop()


def build_trainer(
    cfg: RunConfig,
    callbacks: Sequence[str | TrainerCallback] = (),
    ray_callbacks: Sequence[Any] = (),
    ray_log_level: str = RAY_LOG_LEVEL,
    loop: Callable[[], Any] | None = None,
    ray_run: str = "run",
):
    """The TorchTrainer for this run (not started), as Ray run `ray_run` (in `RunDir.ray_runs`).
    `callbacks`: TrainerCallback specs ("module:Name"), built inside every worker, or TrainerCallbacks (pickled
    to every worker); `loop`: a factory (called in
    each worker) of a loop that drives the worker's Trainer (a TrainerCallback with `run(trainer)`:
    `raytrain_ext.worker.train_fn`),
    else `fit()`; `ray_callbacks`: `ray.train.UserCallback`s run on the controller;
    `ray_log_level`: of Ray Train's own `ray.train` console lines (INFO: every report and checkpoint)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain_ext.network import NodeAddressTorchConfig, replica_groups_config

    cfg = run_config_for_workers(cfg)
    s = cfg.scaling
    backend = "nccl" if s.use_gpu else "gloo"
    num_workers: int | tuple[int, int] = (s.min_workers, s.max_workers) if s.elastic else s.sizes.start
    scaling = ray.train.ScalingConfig(
        num_workers=num_workers,
        use_gpu=s.use_gpu,
        resources_per_worker={"CPU": s.cpus_per_worker, **({"GPU": 1} if s.use_gpu else {})},
        # Replica groups of one worker each spread over the nodes (best effort): a lost node then costs a run
        # one group, not all of them (a group of several is packed: its FSDP collectives stay within a node).
        placement_strategy="SPREAD" if per_step(s) and s.workers_per_group == 1 else "PACK",
        elastic_resize_monitor_interval_s=s.resize_check_s,
    )
    # A bucket: Ray gets the same fsspec file system we write with (credentials from the environment).
    storage_fs, storage_path = ray_storage(RunDir(cfg.out_dir).ray_runs)
    run = ray.train.RunConfig(
        name=ray_run,
        storage_path=storage_path,
        storage_filesystem=storage_fs,
        failure_config=ray.train.FailureConfig(max_failures=s.max_failures),
        # Our Checkpointer keeps `checkpoint.keep` and deletes older ones; Ray keeps a pointer to the newest.
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
        callbacks=list(ray_callbacks),
        **ray_compat.train_logging_config(ray_log_level),  # ray.train.LoggingConfig where there is one
        worker_runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(int(s.cpus_per_worker), 1)),
                                         # torchft's Rust side logs every quorum and commit at info
                                         **({"RUST_LOG": os.environ.get("RUST_LOG", "warn")} if per_step(s) else {})}},
    )
    return ray_compat.trainer_without_ray_data(TorchTrainer)(
        train_fn,
        train_loop_config={
            "run": json.loads(cfg.model_dump_json()),
            "callbacks": list(callbacks),
            "loop": loop,
            "ray_log_level": ray_log_level,
        },
        torch_config=replica_groups_config(backend, s.workers_per_group) if per_step(s)
        else NodeAddressTorchConfig(backend=backend),
        scaling_config=scaling,
        run_config=run,
    )


def train(
    cfg: RunConfig,
    address: str | None = None,
    progress: bool = True,
    callbacks: Sequence[str | TrainerCallback] = (),
    ray_callbacks: Sequence[Any] = (),
    ray_log_level: str = RAY_LOG_LEVEL,
    loop: Callable[[], Any] | None = None,
    checked: bool = False,
    label: str | None = None,
) -> RunResult:
    """Run `cfg` on Ray and wait for it. Raises ConfigError/NonFiniteLossError/CheckpointError with the
    workers' cause when the run ended on an error that a restart cannot fix, and KeyboardInterrupt
    (naming where the run will continue) on Ctrl-C or SIGTERM. `checked`: the caller ran `check_run` on
    `cfg` and `callbacks` already (`raytrain_ext.train` does, before this module's imports). `label`: what
    the run's event lines start with (a PBT trial's id: its runs share the experiment's console)."""
    import ray

    if not checked:
        check_run(cfg, callbacks)  # before Ray starts
    cfg = run_config_for_workers(cfg)
    run_dir = cfg.out_dir
    local = not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS"))
    if local:
        check_fits_local(cfg, os.cpu_count() or 1, _local_gpus())
    with RunDirLock(run_dir), _interrupts_raise():
        remove_file(RunDir(run_dir).failed)  # a new invocation: an old failure is history
        remove_tree(RunDir(run_dir).ray_runs)  # so is an old invocation's Ray run (ours resume from our checkpoints)
        ray_run = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        started = ensure_ray(address)
        # the bar only with progress; the resume, resize and lost-host lines always
        watcher = _ProgressWatcher(RunDir(run_dir).metrics, cfg.train.steps, cfg.name, bar=progress, label=label)
        try:
            watcher.start()
            with WorkerLogs(run_dir, replica_groups=per_step(cfg.scaling)):  # a lost worker: one line here, the tracebacks in the run's log
                result = _run_restarting_controller(
                    lambda: build_trainer(cfg, callbacks, ray_callbacks, ray_log_level, loop, ray_run), run_dir, cfg
                )
        except KeyboardInterrupt:
            raise KeyboardInterrupt(continue_hint(run_dir)) from None
        finally:
            watcher.stop()
            if started:
                stop_ray()
    failed = _read_failed(run_dir)
    if failed is not None:
        raise _as_error(failed)
    # The checkpoint Ray's pointer names; none reported in this invocation (a finished run run again): the
    # run dir's newest committed one.
    checkpoint = pointed_to(result.checkpoint) if result.checkpoint else newest_checkpoint(cfg)
    return summarize(run_dir, checkpoint)


def _run_restarting_controller(build: Any, run_dir: Path, cfg: RunConfig) -> Any:
    """Fit; when Ray Train's controller actor dies (its workers die with it), start the run again (the same
    Ray run: the new controller restores its state) from its committed checkpoints, as re-running the
    command would (counted against scaling.max_failures)."""
    import ray

    restarts = 0
    while True:
        before = placement_groups_of_this_job()
        try:
            return _run_ray_trainer(build(), run_dir, cfg)
        except ray.exceptions.RayActorError as e:
            limit = cfg.scaling.max_failures
            if limit != -1 and restarts >= limit:
                raise
            restarts += 1
            logger.warning(
                "the run's controller died (%s); restarting the run from its newest checkpoint",
                type(e).__name__,
            )
            # Its workers' placement group outlives it until Ray's cleaner notices (or for good, when that
            # cleaner cannot reach the State API): the new run would wait for those CPUs.
            release_stranded_placement_groups(before)


def _run_ray_trainer(trainer: Any, run_dir: Path, cfg: RunConfig) -> Any:
    """`trainer.fit()` in a thread, so that this one stays free for Ctrl-C/SIGTERM (Ray's own SIGINT
    handler waits on a controller busy placing workers: it ignored Ctrl-C for minutes) and for the
    placement timeout: no worker started within `scaling.placement_timeout_s` ends the wait."""
    box: dict[str, Any] = {}

    def fit() -> None:
        try:
            with env_default(PREEMPTION_WATCHER, "0"), env_default(HEALTH_CHECK, _health_check_s(cfg.scaling)), \
                    _start_timeout(cfg.scaling):
                box["result"] = trainer.fit()
        except BaseException as e:
            box["error"] = e

    since, placed = time.time(), False
    controllers = train_controllers_of_this_job(own=True)
    thread = threading.Thread(target=fit, name="raytrain-fit", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
            placed = placed or _started_since(run_dir, since)
            if not placed and time.time() - since > cfg.scaling.placement_timeout_s:
                raise ConfigError(_unplaced_message(cfg.scaling))
    except BaseException:
        # Ctrl-C, SIGTERM or the placement timeout: end this run's controller and wait for `fit()` to
        # return. A thread left inside Ray's client while Ray shuts down crashes the process (SIGSEGV).
        end_train_runs(train_controllers_of_this_job(own=True) - controllers)
        thread.join(60)
        raise
    if "error" in box:
        failed = _read_failed(run_dir)
        if failed is not None:
            raise _as_error(failed) from box["error"]
        raise box["error"]
    return box["result"]


# Ray Train's preemption watcher (an actor started with every Train run) serves spot-instance drains: off
# unless the user sets it. The controller takes it from the environment of the process that starts it.
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"

# How often Ray Train's controller polls its workers: a finished or lost worker is noticed at the next poll.
# Ray polls every 2 s; a group of up to 64 workers is polled every 0.5 s (a poll is one call per worker), so
# a run ends, and a lost worker's restart begins, 0.75 s sooner on average. A user's value wins.
HEALTH_CHECK = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def _health_check_s(scaling: ScalingConfig) -> str:
    return "0.5" if scaling.sizes[-1] <= 64 else "2"


# How long Ray Train's controller waits for a worker group's placement group before it decides again. An
# elastic run's size is decided from the resources the cluster reports free, so its group places at once
# unless that report was stale: a host just lost, still counted until the GCS declares it dead. Ray's 60 s
# default is then a minute of nothing before the run goes on smaller; ELASTIC_START_TIMEOUT_S bounds it.
# A fixed-size run keeps Ray's default (it may wait for an autoscaler to add nodes).
START_TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
ELASTIC_START_TIMEOUT_S = 10


def _start_timeout(scaling: ScalingConfig):
    if not scaling.elastic:
        return contextlib.nullcontext()
    return env_default(START_TIMEOUT, str(ELASTIC_START_TIMEOUT_S))


def _started_since(run_dir: Path, since: float) -> bool:
    """A worker group of this invocation got as far as the Trainer's start or resume event."""
    rows = read_metrics(RunDir(run_dir).metrics, "event")
    since -= 2.0  # the workers' clocks may lag the driver's a little
    return any(r.get("event") in ("start", "resume") and r.get("time", 0) >= since for r in rows)


def _unplaced_message(s: ScalingConfig) -> str:
    import ray

    have = ray.cluster_resources()
    return (
        f"scaling: no worker started within scaling.placement_timeout_s={s.placement_timeout_s:g}: asked for "
        f"{s.sizes.start} workers x {{CPU: {s.cpus_per_worker:g}{', GPU: 1' if s.use_gpu else ''}}}, the "
        f"cluster has CPU {have.get('CPU', 0):g}, GPU {have.get('GPU', 0):g} in all; fix: fewer or smaller "
        f"workers, more nodes (or an autoscaler that can add them), or a longer placement_timeout_s"
    )


@contextlib.contextmanager
def _interrupts_raise():
    """SIGTERM (`ray job stop`, a scheduler) ends the driver as Ctrl-C does (in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _read_failed(run_dir: Path) -> dict[str, Any] | None:
    path = RunDir(run_dir).failed
    return json.loads(path.read_text()) if path.is_file() else None


def _as_error(failed: dict[str, Any]) -> Exception:
    """The error the driver raises for a FAILED.json record (`worker._write_failed`): by its kind."""
    if failed["kind"] in FAILURE_KINDS:
        return FAILURE_KINDS[failed["kind"]](failed["message"])
    return RunFailedError(
        f"rank {failed['rank']} failed before the first checkpoint: {failed['error']}: {failed['message']} "
        f"(not retried: a restart would redo the same steps; traceback tail in {FAILED})"
    )


class _ProgressWatcher:
    """A progress bar in the driver, fed by the run's own metrics.jsonl (rank 0 of whichever attempt
    is running writes it): step, loss, tokens/s and the current world size. Made before the invocation's
    workers start (under the run dir's lock): the events its log already holds are earlier invocations'
    and are not told again (a run resumed a third time showed the second's "resumed from" line too)."""

    def __init__(self, path: Path, total: int, name: str, interval_s: float = 0.5, bar: bool = True,
                 label: str | None = None):
        self.path, self.total, self.name, self.bar = path, total, name, bar
        self.prefix = f"{label}: " if label else ""
        self.interval_s = poll_interval(path, interval_s)
        self._tail = MetricsTail(path)
        self._first = self._tail.rows()  # the log as earlier invocations left it: read once, told from at start
        self._earlier = {_event_key(row) for row in self._first if row.get("kind") == "event"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        bar = progress_bar(self.total, self.name) if self.bar else LineProgress(self.total, self.name, show=False)
        last, val = None, None
        told = set(self._earlier)  # events already written (a rewound log is read again)
        try:
            while True:
                stopping = self._stop.wait(self.interval_s)
                rows, self._first = self._first + self._tail.rows(), []
                for row in rows:
                    key = _event_key(row)
                    if row.get("kind") == "event" and key in told:
                        continue
                    told.add(key)
                    if row.get("kind") == "eval":
                        val = row["val_loss"]
                    elif row.get("kind") == "train":
                        last = row
                    elif event_line(row) is not None:
                        bar.write(self.prefix + event_line(row))
                if rows and last is not None:
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


def _event_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row.get("event"), row.get("step"), row.get("time"))


def event_line(row: dict[str, Any]) -> str | None:
    """The console line of a run's event (metrics.jsonl), or None for events the progress bar does not tell."""
    if row.get("event") == "resize":
        return (
            f"step {row['step']}: resized {row['old_world_size']} -> {row['new_world_size']} "
            f"workers (accumulation {row['accumulation']})"
        )
    if row.get("event") == "replicas":
        old, new = row["old_replicas"], row["new_replicas"]
        how = "lost a replica group; the others train on" if new < old else "a replica group is back"
        return f"step {row['step']}: {how}: {old} -> {new} groups (accumulation {row['accumulation']})"
    if row.get("event") == "healed":
        return (
            f"step {row['step']}: replica group {row['group']} healed from group {row['from_group']}'s memory in "
            f"{row['heal_s']:.1f} s"
        )
    if row.get("event") == "resume":
        line = f"resumed from step {row['step']} on {row['world_size']} workers"
        skipped = [f"{s['checkpoint'].rstrip('/').rsplit('/', 1)[-1]} ({s['reason']})" for s in row.get("skipped", [])]
        return line + (f"; skipped damaged checkpoint {', '.join(skipped)}" if skipped else "")
    return None


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Poll `predicate` until true (tests and tools that wait on a run's files)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
