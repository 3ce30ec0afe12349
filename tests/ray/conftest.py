"""Ray tier: one local Ray per module (CPU only, 2 worker slots), shut down by its handle afterwards."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from raytrain_ext.launcher import own_state_api  # each test Ray with its own state API address

ROOT = Path(__file__).resolve().parents[2]

# Workers import tests.ray.hooks; make the repo importable in every process Ray starts.
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": str(ROOT)}}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    assert not ray.is_initialized(), "a Ray from another test module is still running"
    with ray_env_restored():
        # address="local": a new Ray of its own, never one a developer started on this machine (`ray start`)
        with own_state_api() as port:
            ray.init(address="local", num_cpus=2, include_dashboard=False, dashboard_port=port,
                     runtime_env=RUNTIME_ENV, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


# Kept after a module's Ray: this process's Ray client caches the auth mode of its first `ray.init`, so a
# Ray started later from it (ray.cluster_utils.Cluster's nodes inherit this environment) must run in the
# same mode, or every actor the driver creates there dies at once ("Actor may be already destroyed").
_KEPT = {"RAY_AUTH_MODE"}


@contextlib.contextmanager
def ray_env_restored():
    """ray.init sets variables for its children in this process (RAY_AUTH_MODE, PYTHONBREAKPOINT, ...):
    put the environment back as it was, but for the auth mode (see _KEPT)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before) - _KEPT:
            del os.environ[key]
        os.environ.update(before)


@contextlib.contextmanager
def local_ray(runtime_env: dict):
    """A new local Ray for a module that runs Tune (address="local": even when another Ray runs on this
    machine), shut down by its handle. The dashboard is on, as `raytrain tune` has it: Ray Train's
    PlacementGroupCleaner asks the State API (served by the dashboard) whether a Train controller died; an
    interrupted experiment kills its trials' controllers, and without the cleaner their workers' placement
    groups would outlive them in this driver and starve the resumed trials."""
    import ray

    assert not ray.is_initialized(), "a Ray from another test module is still running"
    with ray_env_restored():
        import tensorboardX  # noqa: F401  (Tune's logger imports it, and it sets CRC32C_SW_MODE on import)
        from ray.tune.schedulers.pb2 import PB2  # noqa: F401  (its scikit-learn sets KMP_* on import)

        with own_state_api() as port:
            ray.init(address="local", num_cpus=2, include_dashboard=True, dashboard_port=port,
                     runtime_env=runtime_env, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def ray_on_s3(s3, tmp_path_factory):
    """A local Ray whose workers see the S3 server's endpoint and keys in their environment (tests/conftest.py's
    `s3`), and a cache of their own (not the user's ~/.cache/raytrain)."""
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    cache = str(tmp_path_factory.mktemp("worker-cache"))
    with local_ray({"env_vars": {**RUNTIME_ENV["env_vars"], **aws, "RAYTRAIN_CACHE": cache}}) as ray:
        yield ray
