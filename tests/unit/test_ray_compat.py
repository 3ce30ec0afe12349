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
