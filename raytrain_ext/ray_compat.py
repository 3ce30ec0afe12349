"""Private names of Ray that raytrain-ext relies on, in one place, with the version they were read from.

Each entry says what it is for and what to look at when Ray moves. Read from every minor release in
pyproject.toml's range (RAY_VERSIONS_READ); differences between them are shimmed at the end of this file.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

# The Ray releases each entry here was read from: one per minor of pyproject.toml's range, oldest to newest (a
# minor's x.y.0 and x.y.1 had the same files for every name here). tests/unit/test_ray_compat.py checks the names
# on the installed Ray and fails when it is outside the range or the range and these minors drift apart.
RAY_VERSIONS_READ = ("2.55.1", "2.56.1", "2.57.1", "2.58.1", "2.59.0", "2.60.0")

__all__ = [
    "DEFER_PATCH",
    "EXPERIMENT_STATE_LOGGER",
    "HEAD_NODE_RESOURCE",
    "RAY_VERSIONS_READ",
    "TOKEN_SETUP_LOGGER",
    "WORKER_GROUP_PATCH",
    "actor_handle",
    "actors_of_this_job",
    "defer_unplaceable_replacements",
    "error_printer",
    "has_torchft_config",
    "is_staging_temp_race",
    "kuberay_autoscaling_config",
    "local_ray_pids",
    "own_worker_address",
    "placement_group_records",
    "prepare_ray_up_config",
    "ray_init_system_config",
    "refresh_autoscaling_view",
    "replica_groups_of",
    "reporter_text",
    "set_error_printer",
    "torch_backend_with",
    "torchft_config",
    "train_logging_config",
    "train_report_logger",
    "trainer_without_ray_data",
    "worker_output_dispatcher",
]

# ray/_common/constants.py HEAD_NODE_RESOURCE_NAME: a resource of 1 that Ray gives the head node only (a
# request for a share of it places an actor there).
HEAD_NODE_RESOURCE = "node:__internal_head__"


@cache
def torch_backend_with(before_start: Callable[[Any], None]) -> type:
    """Ray Train's torch backend class, running `before_start(worker_group)` before its process group."""
    # ray/train/torch/config.py: `_TorchBackend.on_start(worker_group, backend_config)` makes the process
    # group (MASTER_ADDR from rank 0's node address, then `init_process_group` in every worker). A subclass
    # runs `before_start(worker_group)` first; TorchConfig.backend_cls is the public hook that names it.
    from ray.train.torch.config import _TorchBackend

    class Backend(_TorchBackend):
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            before_start(worker_group)
            super().on_start(worker_group, backend_config)

    return Backend


@cache
def trainer_without_ray_data(trainer_cls: type) -> type:
    """`trainer_cls` (a Ray Train V2 trainer) that leaves Ray Data out of a run given no Ray Datasets."""
    # ray/train/v2/api/data_parallel_trainer.py: `_create_default_callbacks()` always adds a `DatasetsCallback`
    # (ray/train/v2/_internal/callbacks/datasets.py). Without datasets it still starts a `DatasetManager` actor
    # (its own process importing Ray Data) before each worker group's train context and has every worker set a
    # Ray Data `DataContext` nobody reads: 6.9 of the 64 CPU-s of a one-worker run's start on 2 cores (64 -> 56
    # without it, docs/development.md), beside the workers' own imports. A worker's context takes
    # `dataset_shard_provider=None`; `ray.train.get_dataset_shard` is the only reader, and we feed our own data.
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    class Trainer(trainer_cls):
        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    Trainer.__name__ = Trainer.__qualname__ = trainer_cls.__name__
    return Trainer


def has_torchft_config() -> bool:
    """Ray Train's torchft replica groups (`ray.train.v2.torch.torchft_config`) with a lost group replaced alone
    (`WorkerGroup.replace_replica_group`, Ray 2.60 on; Ray 2.55 has the config, and its worker group restarts
    whole)."""
    import importlib.util

    if importlib.util.find_spec("ray.train.v2.torch.torchft_config") is None:
        return False
    from ray.train.v2._internal.execution.worker_group import WorkerGroup

    return hasattr(WorkerGroup, "replace_replica_group")


def torchft_config(
    before_start: Callable[[Any], None],
    lighthouse: dict[str, Any],
    backend: str,
    log_level: str = "warn",
    group_size: int = 1,
) -> Any:
    """Ray Train's `TorchftConfig` (a torchft lighthouse on the driver's node, replica groups of `group_size`
    workers, a failed group replaced alone) whose backend runs `before_start(group)` before each group's
    process group: at the start, on all of them, and on a group that replaces a lost one."""
    # ray/train/v2/torch/torchft_config.py: `_TorchftBackend.on_start(worker_group, backend_config)` starts the
    # lighthouse, then each replica group's process group; `TorchftConfig.backend_cls` names the backend.
    import ray
    from ray.train.v2.torch.torchft_config import LighthouseServerActor, TorchftConfig, _TorchftBackend
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class Backend(_TorchftBackend):
        def __init__(self) -> None:
            super().__init__()
            replica_groups_of(group_size)
            defer_unplaceable_replacements()

        def __setstate__(self, state: dict[str, Any]) -> None:
            # Unpickled in Ray Train's controller (the driver made it), where the worker groups are made.
            self.__dict__.update(state)
            replica_groups_of(group_size)
            defer_unplaceable_replacements()

        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            before_start(worker_group)
            super().on_start(worker_group, backend_config)

        def _maybe_create_lighthouse_actor(self, backend_config: Any) -> str:
            # Ray's, with the lighthouse's Rust log at `log_level` (at INFO it prints every quorum of every
            # step on the driver's console): made here first, Ray's method then reads its address. It asks for
            # no CPU, as Ray Train's own controller beside it does: it is pinned to the driver's node, which may
            # have none (clusters/ start the head with --num-cpus=0), and an actor pinned to a node that lacks
            # its CPU is not schedulable there.
            if self.lighthouse_actor is None:
                self.lighthouse_actor = LighthouseServerActor.options(
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(
                        node_id=ray.get_runtime_context().get_node_id(), soft=False
                    ),
                    runtime_env={"env_vars": {"RUST_LOG": log_level}},
                ).remote(lighthouse_kwargs={"bind": "[::]:0", **backend_config.lighthouse_kwargs})
            return super()._maybe_create_lighthouse_actor(backend_config)

    class Config(TorchftConfig):
        @property
        def backend_cls(self):
            return Backend

    return Config(lighthouse_kwargs=dict(lighthouse), backend=backend)


# ray/train/v2/_internal/execution/worker_group/worker_group.py (Ray 2.60): `WorkerGroup._start_impl` makes replica
# groups of one worker ("TODO: change after we support replica groups of size > 1"): `_create_workers(...,
# replica_group_size=1)` ranks the workers (local ranks per node and group), then one `ReplicaGroup` per worker is
# kept in `_replica_groups` (with `_worker_rank_to_replica_group_rank`, which the controller's failure handling
# reads) before `_init_train_context`; `_replace_replica_group_impl` makes a lost group's workers again with
# `starting_world_rank=<group index>`, `world_size=<groups>`, `replica_group_size=<its workers>`. The rest is
# written for groups of any size: `_assign_worker_ranks` groups the ranked workers in runs of `replica_group_size`,
# the torch backend starts one process group per `ReplicaGroup` (ranks 0..size-1, its own MASTER_ADDR), and a
# failed worker's whole group is replaced. These three places are given the run's size here.
WORKER_GROUP_PATCH = "_raytrain_replica_group_size"


def replica_groups_of(size: int) -> None:
    """In Ray Train's controller process: its worker groups form replica groups of `size` workers."""
    from ray.train.v2._internal.execution.worker_group import ReplicaGroup, WorkerGroup

    if getattr(WorkerGroup, WORKER_GROUP_PATCH, 1) == size:
        return
    create, init = WorkerGroup._create_workers, WorkerGroup._init_train_context
    create, init = getattr(create, "__wrapped__", create), getattr(init, "__wrapped__", init)  # Ray's own
    if size == 1:
        WorkerGroup._create_workers, WorkerGroup._init_train_context = create, init
        setattr(WorkerGroup, WORKER_GROUP_PATCH, 1)
        return

    @functools.wraps(create)
    def _create_workers(self, num_workers, placement_group, resources_per_worker, placement_group_bundle_indices=None,
                        starting_world_rank=0, world_size=None, replica_group_size=None):
        if replica_group_size == 1 and world_size is None:  # the whole group's start
            replica_group_size = size
        elif replica_group_size == size and world_size is not None:  # a lost group's workers again: its index
            starting_world_rank, world_size = starting_world_rank * size, world_size * size
        return create(self, num_workers, placement_group, resources_per_worker, placement_group_bundle_indices,
                      starting_world_rank, world_size, replica_group_size)

    @functools.wraps(init)
    def _init_train_context(self, workers, sync_actor):
        groups = self._replica_groups
        if groups and len(groups) == len(workers) > size:  # the start's groups of one worker each
            callbacks, resources = self._replica_group_callbacks, self._worker_group_context.resources_per_worker
            self._replica_groups = [ReplicaGroup(list(workers[i:i + size]), resources, callbacks)
                                    for i in range(0, len(workers), size)]
            self._worker_rank_to_replica_group_rank = {
                w.distributed_context.world_rank: i for i, g in enumerate(self._replica_groups) for w in g.get_workers()
            }
        return init(self, workers, sync_actor)

    WorkerGroup._create_workers, WorkerGroup._init_train_context = _create_workers, _init_train_context
    setattr(WorkerGroup, WORKER_GROUP_PATCH, size)


# The same file: the controller replaces a lost replica group at once (`replace_replica_group`, from
# `_execute_resize_decision`) on the placement group's bundles of the lost workers. Their node may be dead and not
# yet declared so (the new workers die with it: `WorkerGroupStartupFailedError`, which the controller retries
# through a restart of its state machine), or declared dead with no room elsewhere (the new workers wait for a node
# inside `_init_train_context_on_workers`'s `ray.get`, which holds the controller: it never sees the others finish,
# and the group that starts when a host returns finds the run over and resumes it from its last checkpoint).
# Patched: a replacement whose bundles are not all on live nodes, or whose workers fail to start, is deferred, and
# `_poll_workers_and_collect_errors` (each poll) reads its workers as the live groups' (running while any runs, no
# error) until its bundles are placed again, when it replaces the group there. The run goes on without it meanwhile
# and ends when the others finish.
DEFER_PATCH = "_raytrain_defers_replacements"


def defer_unplaceable_replacements() -> None:
    """In Ray Train's controller process: a lost replica group's replacement waits for room without holding the
    controller, and never fails the run."""
    import ray
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group.poll import WorkerStatus

    if getattr(WorkerGroup, DEFER_PATCH, False):
        return
    replace, collect = WorkerGroup.replace_replica_group, WorkerGroup._poll_workers_and_collect_errors

    def deferred(self: Any) -> dict[int, list[int]]:  # group index -> its workers' world ranks
        return self.__dict__.setdefault("_raytrain_deferred", {})

    def placed(self: Any, index: int) -> bool:
        bundles = [w.placement_group_bundle_index for w in self._replica_groups[index].get_workers()]
        table = ray.util.placement_group_table(self._worker_group_state.placement_group_handle.placement_group)
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        where = table.get("bundles_to_node_id", {})
        return table.get("state") == "CREATED" and all(where.get(b) in alive for b in bundles)

    @functools.wraps(replace)
    def replace_replica_group(self: Any, replica_group_index: int) -> None:
        ranks = [w.distributed_context.world_rank for w in self._replica_groups[replica_group_index].get_workers()]
        deferred(self).pop(replica_group_index, None)
        try:
            if placed(self, replica_group_index):
                return replace(self, replica_group_index)
        except WorkerGroupStartupFailedError as e:  # Ray's own has shut the new workers down
            logger.info("Replica group %d's replacement did not start (%s); tried again when placed",
                        replica_group_index, e)
        deferred(self)[replica_group_index] = ranks

    @functools.wraps(collect)
    def _poll_workers_and_collect_errors(self: Any, timeout: Any) -> list[Any]:
        for index in [i for i in deferred(self) if placed(self, i)]:
            replace_replica_group(self, index)  # deferred again if it fails
        statuses = collect(self, timeout)
        waiting = {rank for ranks in deferred(self).values() for rank in ranks}
        if not waiting:
            return statuses
        running = any(s.running for rank, s in enumerate(statuses) if rank not in waiting)
        return [WorkerStatus(running=running) if rank in waiting else s for rank, s in enumerate(statuses)]

    WorkerGroup.replace_replica_group = replace_replica_group
    WorkerGroup._poll_workers_and_collect_errors = _poll_workers_and_collect_errors
    setattr(WorkerGroup, DEFER_PATCH, True)


# ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py: Ray Train's elastic scaling policy
# sizes a worker group from the resources this detached actor reserves for it, and the actor re-reads the
# node table only every `TICK_INTERVAL_S` (20 s). After a host is lost or joins, a
# `get_reserved_resources(..., recompute=True)` makes it tick at once.
_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # (name, namespace)


def refresh_autoscaling_view() -> bool:
    """Make Ray's autoscaling coordinator re-read the cluster's nodes now; False when there is none (no
    elastic run has started) or it did not answer."""
    import ray

    name, namespace = _COORDINATOR
    try:
        actor = ray.get_actor(name, namespace=namespace)
        ray.get(actor.get_reserved_resources.remote("raytrain-hosts", recompute=True), timeout=10)
    except Exception:  # noqa: BLE001 - none yet, or busy: its own 20 s tick still comes
        return False
    return True


# ------------------------------------------------------------ ray.init's private arguments
# ray/_private/worker.py `init(..., **kwargs)` pops `_system_config` (Ray 2.55.1 to 2.60.0): settings of the
# raylet and GCS that this `ray.init` starts (src/ray/common/ray_config_def.h names them; `ray start` has no
# flag for most), ignored when it joins a running Ray.
def ray_init_system_config(**settings: Any) -> dict[str, Any]:
    """`ray.init`'s keyword arguments that give the local Ray it starts these internal settings."""
    return {"_system_config": settings}


# ------------------------------------------------------------------------- the driver's console
# ray/_private/ray_logging.py: `global_worker_stdstream_dispatcher` hands each batch of the workers' output
# lines to its handlers; the driver's own printer is the one named "ray_print_logs" (raytrain_ext.worker_logs
# puts its own in its place, and back).
def worker_output_dispatcher() -> Any:
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    return global_worker_stdstream_dispatcher


# ray/_private/worker.py: Ray's error listener prints the raylet's "A worker died or was killed ..." lines
# through the module function `print_to_stdstream(data, ignore_prefix)`, looked up by name at each call.
def error_printer() -> Callable[..., None]:
    from ray._private import worker

    return worker.print_to_stdstream


def set_error_printer(printer: Callable[..., None]) -> None:
    from ray._private import worker

    worker.print_to_stdstream = printer


# ray/tune/execution/experiment_state.py: each save of Tune's experiment state writes into the driver's
# staging folder (the searcher's state through ray/tune/utils/util.py `_atomic_save`, ".<uuid>-tmp-<name>"
# then a rename; the scheduler's summary through trainers.storage.write_bytes_atomic, ".<name>.<pid>.<hex>"
# then a rename) while the upload that the previous save launched may still be copying that folder to
# storage. That upload then fails on the renamed temp file, and the next save logs it at ERROR with its
# traceback ("Saving experiment state to storage ... failed") before launching its own upload of the whole
# folder: nothing is lost, nothing to act on (a Ctrl-C's final save races its upload so).
EXPERIMENT_STATE_LOGGER = "ray.tune.execution.experiment_state"
_MISSING_LOCAL_FILE = re.compile(r"Failed to open local file '([^']+)'")  # pyarrow's copy_files


def is_staging_temp_race(record: Any) -> bool:
    """Whether a log record of EXPERIMENT_STATE_LOGGER is that upload's failure on a vanished temp file (a
    hidden file: both writers name their temp files with a leading dot)."""
    exc = record.exc_info[1] if record.exc_info else None
    missing = _MISSING_LOCAL_FILE.search(str(exc)) if isinstance(exc, FileNotFoundError) else None
    return missing is not None and os.path.basename(missing.group(1)).startswith(".")


# ray/_private/authentication/authentication_token_setup.py: the logger of `ray.init`'s line about the
# cluster's token (raytrain_ext.launcher quiets it for a local Ray, which needs none).
TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


# ray/train/v2/_internal/execution/context.py: Ray Train's per-report INFO line ("Reporting training
# result ...") comes from a logger named after this file, outside the `ray.train` logger tree.
def train_report_logger() -> str:
    from ray.train.v2._internal.execution import context

    return context.__file__


# ----------------------------------------------------------------------------- this driver's Ray
# ray/_private/worker.py `_global_node` (a ray._private.node.Node): the processes `ray.init()` started for a
# local Ray, by kind (`all_processes`: {kind: [ProcessInfo(process=Popen, ...)]}).
def local_ray_pids() -> list[int]:
    """Pids of the processes this driver's `ray.init()` started (none when it joined a running Ray)."""
    from ray._private import worker

    node = worker._global_node
    if node is None:
        return []
    return [info.process.pid for infos in node.all_processes.values() for info in infos if info.process]


def actors_of_this_job() -> dict[str, dict[str, Any]]:
    """The GCS's actor table for this driver's job (no State API or dashboard needed): actor id (hex) ->
    {"ActorClassName", "State", "OwnerAddress": {"IPAddress", "Port"}, ...}. ray/_private/state.py
    `GlobalState.actor_table(actor_id, job_id)` with a `ray._raylet.JobID`."""
    import ray
    from ray._private.state import state

    job = ray._raylet.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return state.actor_table(None, job_id=job)


def own_worker_address() -> tuple[str, int]:
    """This process's Ray worker address: the owner address the GCS records for the actors it creates
    (the core worker's `get_owner_address` of an object it owns, a serialized common_pb2.Address)."""
    import ray
    from ray.core.generated.common_pb2 import Address

    core = ray._private.worker.global_worker.core_worker
    address = Address.FromString(core.get_owner_address(ray.put(None)))
    return address.ip_address, address.port


def actor_handle(actor_id: str) -> Any:
    """A handle to the actor with this id (hex), named or not (the core worker's `get_actor_handle`)."""
    import ray

    core = ray._private.worker.global_worker.core_worker
    return core.get_actor_handle(ray._raylet.ActorID.from_hex(actor_id))


def placement_group_records() -> list[Any]:
    """Every placement group in the GCS, as gcs_pb2.PlacementGroupTableData (`creator_actor_id`, `state`,
    `placement_group_id`), from the GCS accessor ray/_private/state.py keeps (the public
    `placement_group_table` does not say who created one)."""
    from ray._private.state import state
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    return [PlacementGroupTableData.FromString(raw) for raw in state._connect_and_get_accessor().get_placement_group_table()]


# ------------------------------------------------------------------------------- cluster configs
# ray/autoscaler/_private/util.py: what `ray up` does to a cluster YAML before it starts anything (fill the
# defaults, check it against Ray's schema).
def prepare_ray_up_config(raw: dict[str, Any]) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(raw)
    validate_config(prepared)
    return prepared


# ray/autoscaler/_private/kuberay/autoscaling_config.py: the autoscaler's view of a RayCluster custom resource
# (its node types with their resources and min/max workers), as KubeRay's autoscaler derives it.
def kuberay_autoscaling_config(cr: dict[str, Any]) -> dict[str, Any]:
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    return _derive_autoscaling_config_from_ray_cr(cr)


# ------------------------------------------------------------------------------------------- Tune
# ray/tune/progress_reporter.py: `CLIReporter.report(trials, done, *sys_info)` prints
# `self._progress_str(trials, done, *sys_info)`, the classic table's text; search.console.ExperimentReporter
# overrides the public `report` and makes its status lines true on that text.
def reporter_text(reporter: Any, trials: list[Any], done: bool, *sys_info: str) -> str:
    """The text a `tune.CLIReporter` would print for `trials` (its table and status lines)."""
    from ray.tune import CLIReporter

    return CLIReporter._progress_str(reporter, trials, done, *sys_info)


# ------------------------------------------------------------------------ other Ray versions (shims)
# Public names that came later than the oldest Ray in pyproject.toml's range; each says when, and what the
# older Ray does instead.

# ray.train.LoggingConfig (2.56; RunConfig's `logging_config`): the level of Ray Train's own `ray.train` console
# lines. On 2.55 RunConfig has no such field and the controller logs `ray.train` at INFO (a line as each worker
# group starts and each checkpoint registers); the workers' level is raytrain_ext.worker's, on every version.
def train_logging_config(log_level: str) -> dict[str, Any]:
    """RunConfig's keyword arguments that set Ray Train's console level: `logging_config=LoggingConfig(...)`,
    or none on a Ray without it."""
    import ray.train

    config = getattr(ray.train, "LoggingConfig", None)
    return {} if config is None else {"logging_config": config(log_level=log_level)}
