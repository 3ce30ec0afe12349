"""raytrain_ext.ray_compat holds every private name of Ray that raytrain-ext uses, read from each minor release
in pyproject.toml's range. These tests fail when the installed Ray is outside that range, or when a name it
relies on moved or changed shape, before any run finds out: `make test` runs them on the newest Ray of the
range, `make test-compat` on the oldest. (Calls that need a live Ray are run by the Ray tier: cleanup, worker
logs, the reaper, PBT exploits.)"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import ray
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from raytrain_ext import ray_compat

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _declared_ray() -> SpecifierSet:
    """The Ray range that pyproject.toml's `dependencies` declare."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    (spec,) = [Requirement(d).specifier for d in project["dependencies"] if Requirement(d).name == "ray"]
    return spec


def _minor(version: str) -> tuple[int, int]:
    return Version(version).release[:2]


def test_the_installed_ray_is_in_the_declared_range_and_its_names_were_read_from_its_minor():
    declared, read = _declared_ray(), ray_compat.RAY_VERSIONS_READ
    assert Version(ray.__version__) in declared, (
        f"Ray {ray.__version__} is installed; pyproject.toml declares ray{declared}: check each entry of "
        "raytrain_ext/ray_compat.py against it, add it to RAY_VERSIONS_READ, then widen the range"
    )
    assert _minor(ray.__version__) in {_minor(v) for v in read}, (ray.__version__, read)


def test_the_versions_read_are_the_declared_range_one_per_minor():
    declared, read = _declared_ray(), ray_compat.RAY_VERSIONS_READ
    assert list(read) == sorted(read, key=Version) and all(Version(v) in declared for v in read), (read, declared)
    minors = [_minor(v) for v in read]
    assert minors == [(minors[0][0], m) for m in range(minors[0][1], minors[-1][1] + 1)], "one per minor, none left out"
    lower, upper = _minor(read[0]), _minor(read[-1])
    assert Version(f"{lower[0]}.{lower[1]}.0") in declared, "the oldest minor read is admitted from its x.y.0"
    assert Version(f"{lower[0]}.{lower[1] - 1}.99") not in declared, "no older minor admitted than the oldest read"
    assert Version(f"{upper[0]}.{upper[1] + 1}.0") not in declared, "no newer minor admitted than the newest read"


def test_ray_train_logging_config_where_there_is_one():
    import ray.train

    kwargs = ray_compat.train_logging_config("WARNING")
    if _minor(ray.__version__) >= (2, 56):
        assert kwargs["logging_config"].log_level == "WARNING"
    else:
        assert kwargs == {} and not hasattr(ray.train, "LoggingConfig")
    ray.train.RunConfig(**kwargs)  # a field RunConfig takes


def test_tunes_experiment_state_logs_its_upload_failures_where_the_console_filters_them():
    from ray.tune.execution import experiment_state
    from ray.tune.utils import util

    assert experiment_state.logger.name == ray_compat.EXPERIMENT_STATE_LOGGER
    assert "Saving experiment state to storage" in inspect.getsource(experiment_state)
    assert '-{tmp_file_name}' in inspect.getsource(util._atomic_save)  # ".<uuid>-tmp-<name>" at its callers


def test_the_driver_console_hooks_are_there():
    dispatcher = ray_compat.worker_output_dispatcher()
    assert callable(dispatcher.add_handler) and callable(dispatcher.remove_handler)
    assert isinstance(dict(dispatcher.handlers), dict)  # (name, handler) pairs; worker_logs looks one up by name
    printer = ray_compat.error_printer()
    assert list(inspect.signature(printer).parameters)[:2] == ["data", "ignore_prefix"]
    ray_compat.set_error_printer(print)
    try:
        assert ray_compat.error_printer() is print
    finally:
        ray_compat.set_error_printer(printer)
    assert ray_compat.error_printer() is printer


def test_the_loggers_named_by_file_or_module_exist():
    logger = ray_compat.train_report_logger()
    assert Path(logger).is_file() and Path(logger).name == "context.py"
    module = importlib.import_module(ray_compat.TOKEN_SETUP_LOGGER)
    assert "logging.getLogger(__name__)" in inspect.getsource(module)  # its logger is named after the module


def test_the_gcs_and_core_worker_accessors_are_there():
    from ray._private.node import Node
    from ray._private.state import GlobalState
    from ray._raylet import ActorID, CoreWorker, JobID

    assert ray_compat.local_ray_pids() == []  # no Ray started by this process
    assert "self.all_processes: dict = {}" in inspect.getsource(Node.__init__)  # {kind: [ProcessInfo]}
    assert {"actor_id", "job_id"} <= set(inspect.signature(GlobalState.actor_table).parameters)
    assert hasattr(GlobalState, "_connect_and_get_accessor")
    assert all(hasattr(CoreWorker, name) for name in ("get_owner_address", "get_actor_handle"))
    assert callable(JobID.from_hex) and callable(ActorID.from_hex)


def test_the_reporters_text_is_what_its_report_prints(capsys):
    from ray.tune import CLIReporter

    reporter = CLIReporter(metric_columns=["loss"])
    text = ray_compat.reporter_text(reporter, [], False, "extra line")
    assert "extra line" in text
    reporter.report([], False, "extra line")
    assert capsys.readouterr().out.strip() == text.strip()


def test_ray_init_still_takes_a_system_config():
    """ray_compat.ray_init_system_config: `ray.init` pops `_system_config` from its keyword arguments."""
    from ray._private import worker

    source = inspect.getsource(inspect.unwrap(worker.init))
    assert 'kwargs.pop("_system_config"' in source
    assert ray_compat.ray_init_system_config(a=1) == {"_system_config": {"a": 1}}


def test_a_trainer_without_ray_datasets_starts_no_ray_data():
    """ray_compat.trainer_without_ray_data: Ray Train's default callbacks hold its datasets callback (a
    DatasetManager actor per worker group); the trainer we build leaves it out unless it is given datasets."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    def kinds(trainer) -> set[type]:
        return {type(c) for c in trainer._create_default_callbacks()}

    ours = ray_compat.trainer_without_ray_data(TorchTrainer)
    assert ours.__name__ == "TorchTrainer" and issubclass(ours, TorchTrainer)
    assert DatasetsCallback in kinds(TorchTrainer(lambda: None))  # what Ray does: the premise
    assert DatasetsCallback not in kinds(ours(lambda: None))
    assert DatasetsCallback in kinds(ours(lambda: None, datasets={"train": lambda: None}))  # a dataset factory


def test_replica_groups_of_several_workers_where_ray_has_torchft_groups():
    """ray_compat.replica_groups_of: Ray 2.60's worker group makes replica groups of one worker in three places,
    each given the run's size; the rest of Ray's code is written for groups of any size."""
    if _minor(ray.__version__) < (2, 60):
        assert not ray_compat.has_torchft_config()  # a per-step run is refused there (run_checks)
        return
    from ray.train.v2._internal.execution.worker_group import ReplicaGroup, WorkerGroup

    ours = WorkerGroup._create_workers, WorkerGroup._init_train_context
    size = getattr(WorkerGroup, ray_compat.WORKER_GROUP_PATCH, 1)
    ray_compat.replica_groups_of(1)  # Ray's own methods (a test before may have given another size)
    rays = WorkerGroup._create_workers, WorkerGroup._init_train_context
    start = inspect.getsource(WorkerGroup._start_impl)
    assert "replica_group_size=1 if self._manages_replica_groups else None" in start
    assert start.index("self._replica_groups = [") < start.index("self._init_train_context(workers, sync_actor)")
    assert "self._worker_rank_to_replica_group_rank = {" in start
    replace = inspect.getsource(WorkerGroup._replace_replica_group_impl)
    assert "starting_world_rank=replica_group_index" in replace and "world_size=len(self._replica_groups)" in replace
    assert "replica_group_size=len(old_workers)" in replace
    assert list(inspect.signature(WorkerGroup._create_workers).parameters) == [
        "self", "num_workers", "placement_group", "resources_per_worker", "placement_group_bundle_indices",
        "starting_world_rank", "world_size", "replica_group_size"]
    assert list(inspect.signature(WorkerGroup._init_train_context).parameters) == ["self", "workers", "sync_actor"]
    assert list(inspect.signature(ReplicaGroup).parameters) == ["workers", "resources_per_worker", "callbacks"]
    init = inspect.getsource(WorkerGroup.__init__)
    assert "self._replica_group_callbacks = [" in init and "self._worker_group_context" in init
    assert "group_idx = idx // replica_group_size" in inspect.getsource(WorkerGroup._assign_worker_ranks)
    try:
        ray_compat.replica_groups_of(2)
        assert (WorkerGroup._create_workers, WorkerGroup._init_train_context) != rays
        assert WorkerGroup._create_workers.__wrapped__ is rays[0]
        ray_compat.replica_groups_of(1)
        assert (WorkerGroup._create_workers, WorkerGroup._init_train_context) == rays
    finally:
        WorkerGroup._create_workers, WorkerGroup._init_train_context = ours
        setattr(WorkerGroup, ray_compat.WORKER_GROUP_PATCH, size)


def test_all_names_every_public_name():
    import types

    public = {n for n, v in vars(ray_compat).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
              and getattr(v, "__module__", ray_compat.__name__) == ray_compat.__name__ and n != "logger"}
    assert public - {"annotations", "Any", "Callable", "cache"} == set(ray_compat.__all__)


def test_a_replacement_with_no_room_waits_without_holding_the_controller(monkeypatch):
    """ray_compat.defer_unplaceable_replacements: a lost group whose bundles are not on live nodes, or whose new
    workers fail to start, is not replaced now; each poll reads its workers as the live groups' (running while any
    runs, no error) and replaces it once its bundles are placed."""
    if _minor(ray.__version__) < (2, 60):
        assert not ray_compat.has_torchft_config()
        return
    from types import SimpleNamespace

    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.controller import controller
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group.poll import WorkerStatus

    # What Ray does, the premise: the controller replaces each failing group at once, on its old bundles, and
    # waits for the new workers with no timeout; a poll's statuses are a list in world-rank order.
    assert "self._worker_group.replace_replica_group(rg_index)" in inspect.getsource(
        controller.TrainController._replace_bad_workers)
    impl = inspect.getsource(WorkerGroup._replace_replica_group_impl)
    assert "placement_group_bundle_indices=old_placement_group_bundle_indices" in impl
    assert "self._worker_group_state.placement_group_handle.placement_group" in impl
    assert "ray.get(context_init_tasks)" in inspect.getsource(WorkerGroup._init_train_context_on_workers)
    assert "worker_statuses=dict(enumerate(poll_results))" in inspect.getsource(WorkerGroup.poll_status)
    assert list(inspect.signature(WorkerGroup.replace_replica_group).parameters) == ["self", "replica_group_index"]
    assert list(inspect.signature(WorkerGroup._poll_workers_and_collect_errors).parameters) == ["self", "timeout"]

    replaced, fail, running = [], [False], [True]

    def rays_replace(self, index):
        replaced.append(index)
        if fail[0]:
            raise WorkerGroupStartupFailedError("The node the worker was on died")

    def rays_collect(self, timeout):
        return [WorkerStatus(running=running[0]), WorkerStatus(running=False, error=RuntimeError("actor died"))]

    monkeypatch.setattr(WorkerGroup, "replace_replica_group", rays_replace)
    monkeypatch.setattr(WorkerGroup, "_poll_workers_and_collect_errors", rays_collect)
    monkeypatch.setattr(WorkerGroup, ray_compat.DEFER_PATCH, False, raising=False)
    ray_compat.defer_unplaceable_replacements()
    nodes, where, state = {"a": True, "b": False}, {0: "a", 1: "b"}, ["CREATED"]
    monkeypatch.setattr(ray.util, "placement_group_table",
                        lambda pg: {"state": state[0], "bundles_to_node_id": dict(where)})
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": alive} for n, alive in nodes.items()])
    group = WorkerGroup.__new__(WorkerGroup)  # two replica groups of one worker, on bundles 0 and 1

    def workers(rank):
        return lambda: [SimpleNamespace(placement_group_bundle_index=rank,
                                        distributed_context=SimpleNamespace(world_rank=rank))]

    group._replica_groups = [SimpleNamespace(get_workers=workers(0)), SimpleNamespace(get_workers=workers(1))]
    group._worker_group_state = SimpleNamespace(placement_group_handle=SimpleNamespace(placement_group="pg"))

    group.replace_replica_group(1)  # its bundle on a dead node: not tried
    assert replaced == []
    assert [(s.running, s.error) for s in group._poll_workers_and_collect_errors(1.0)] == [(True, None), (True, None)]
    where[1], state[0] = "", "RESCHEDULING"  # Ray declared the node dead: the bundle waits for room
    assert [(s.running, s.error) for s in group._poll_workers_and_collect_errors(1.0)] == [(True, None), (True, None)]
    assert replaced == []
    where[1], state[0], fail[0] = "a", "CREATED", True  # placed again, on a node that dies as the workers start
    assert [(s.running, s.error) for s in group._poll_workers_and_collect_errors(1.0)] == [(True, None), (True, None)]
    assert replaced == [1]
    running[0] = False  # the live group finished: so does the run, without the one that waits
    assert [(s.running, s.error) for s in group._poll_workers_and_collect_errors(1.0)] == [(False, None), (False, None)]
    fail[0] = False
    statuses = group._poll_workers_and_collect_errors(1.0)  # placed and started: polled as Ray polls it
    assert replaced == [1, 1, 1] and isinstance(statuses[1].error, RuntimeError)


def test_the_torch_backends_run_our_step_before_rays_process_group(monkeypatch):
    """ray_compat.torch_backend_with and torchft_config: subclasses of Ray's private backends whose on_start runs
    `before_start(worker_group)` first, then Ray's; the torchft one makes its lighthouse actor itself (no CPU,
    Rust log level), which Ray's method then finds and only reads."""
    from ray.train.torch.config import TorchConfig, _TorchBackend

    calls = []
    monkeypatch.setattr(_TorchBackend, "on_start", lambda self, group, config: calls.append(("ray", group)))
    backend = ray_compat.torch_backend_with(lambda group: calls.append(("ours", group)))
    assert issubclass(backend, _TorchBackend)
    assert list(inspect.signature(TorchConfig.backend_cls.fget).parameters) == ["self"]  # the hook that names it
    backend().on_start("group", TorchConfig())
    assert calls == [("ours", "group"), ("ray", "group")]
    if not ray_compat.has_torchft_config():
        return
    from ray.train.v2.torch.torchft_config import TorchftConfig, _TorchftBackend

    made = inspect.getsource(_TorchftBackend._maybe_create_lighthouse_actor)
    assert made.index("if self.lighthouse_actor is not None:") < made.index("LighthouseServerActor.options(")
    assert "self._maybe_create_lighthouse_actor(" in inspect.getsource(_TorchftBackend.on_start)
    patched = []
    monkeypatch.setattr(ray_compat, "replica_groups_of", lambda size: patched.append(("groups of", size)))
    monkeypatch.setattr(ray_compat, "defer_unplaceable_replacements", lambda: patched.append(("defer",)))
    calls.clear()
    monkeypatch.setattr(_TorchftBackend, "on_start", lambda self, group, config: calls.append(("ray", group)))
    config = ray_compat.torchft_config(lambda group: calls.append(("ours", group)), {"min_replicas": 1}, "gloo",
                                       group_size=2)
    assert isinstance(config, TorchftConfig) and config.lighthouse_kwargs == {"min_replicas": 1}
    made = config.backend_cls()  # in the driver
    made.__setstate__(dict(made.__dict__))  # as Ray Train's controller unpickles it: the patches there too
    assert issubclass(config.backend_cls, _TorchftBackend)
    assert patched == [("groups of", 2), ("defer",)] * 2
    made.on_start("group", config)
    assert calls == [("ours", "group"), ("ray", "group")]
