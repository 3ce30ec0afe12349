"""raytrain_ext.ray_compat holds every private name of Ray that raytrain-ext uses, read from one Ray version.
These tests fail when the installed Ray is another version, or when a name it relies on moved or changed
shape, before any run finds out. (Calls that need a live Ray are run by the Ray tier: cleanup, worker logs,
the reaper, PBT exploits.)"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import ray
from ray.tune.schedulers.pb2 import PB2  # scikit-learn sets KMP_* variables on import: at collection

from raytrain_ext import ray_compat

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_the_installed_ray_is_the_one_the_names_were_read_from():
    assert ray.__version__ == ray_compat.RAY_VERSION, (
        f"Ray {ray.__version__} is installed; raytrain_ext/ray_compat.py was read from {ray_compat.RAY_VERSION}: "
        "check each entry there against the new version, then change RAY_VERSION (and pyproject's range)"
    )


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


def test_a_tune_trials_checkpoints_are_read_and_forgotten_through_its_manager():
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.train._internal.session import _TrainingResult
    from ray.tune import Checkpoint

    class _Trial:  # a Tune trial's checkpoint manager, where Tune keeps it
        class run_metadata:  # noqa: N801
            checkpoint_manager = _CheckpointManager(None)

    trial = _Trial()
    for path in ("/exp/a", "/exp/b", "/exp/c"):
        trial.run_metadata.checkpoint_manager.register_checkpoint(
            _TrainingResult(checkpoint=Checkpoint(path), metrics={})
        )
    assert ray_compat.trial_checkpoints(trial) == ["/exp/a", "/exp/b", "/exp/c"], "oldest first"
    ray_compat.forget_trial_checkpoints(trial, {"/exp/a", "/exp/c"})
    assert ray_compat.trial_checkpoints(trial) == ["/exp/b"]


def test_the_experiment_tag_names_the_new_values():
    tag = ray_compat.experiment_tag("0_lr=0.1", {"lr": 0.25, "member": 0}, {"lr": [0.1, 0.25]})
    assert tag.startswith("0_") and "lr=0.25" in tag


def test_the_pbt_and_pb2_internals_the_schedulers_subclass_are_there():
    """search.schedulers' classes over Ray's PBT and PB2 use exactly what ray_compat lists."""
    import re

    from ray.tune.schedulers import PopulationBasedTraining
    from ray.tune.schedulers.pbt import _PBTTrialState

    import search.schedulers

    pbt = PopulationBasedTraining(time_attr="step", hyperparam_mutations={"lr": [0.1, 0.2]})
    pb2 = PB2(time_attr="step", hyperparam_bounds={"lr": [0.1, 0.2]})
    assert [name for name in ray_compat.PBT_PRIVATE if not hasattr(pbt, name)] == []
    assert [name for name in ray_compat.PB2_PRIVATE if not hasattr(pb2, name)] == []

    class _Trial:
        experiment_tag = "0"

    assert sorted(vars(_PBTTrialState(_Trial()))) == sorted(ray_compat.PBT_TRIAL_STATE)
    assert list(inspect.signature(PopulationBasedTraining._get_new_config).parameters) == [
        "self", "trial", "trial_to_clone",
    ]  # fmt: skip
    source = inspect.getsource(search.schedulers)  # what the schedulers reach of Ray's: listed there
    ours = {name for cls in vars(search.schedulers).values() if isinstance(cls, type) for name in vars(cls)}
    ours |= {"_applied", "_board", "_controller", "_waiting", "_first_wait", "_space"}  # set on instances only
    listed = set(ray_compat.PBT_PRIVATE) | set(ray_compat.PB2_PRIVATE)
    used = set(re.findall(r"self\.(_[a-z][a-z_]*)", source)) - ours
    assert used <= listed, used - listed
    fields = set(re.findall(r"\bstate\.([a-z][a-z_]*)", source)) - {"pop", "json"}
    assert fields <= set(ray_compat.PBT_TRIAL_STATE), fields


def test_ray_init_still_takes_a_system_config():
    """ray_compat.ray_init_system_config: `ray.init` pops `_system_config` from its keyword arguments."""
    from ray._private import worker

    source = inspect.getsource(inspect.unwrap(worker.init))
    assert 'kwargs.pop("_system_config"' in source
    assert ray_compat.ray_init_system_config(a=1) == {"_system_config": {"a": 1}}
