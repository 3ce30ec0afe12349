"""Ray tier: one local Ray per module (CPU only, 2 worker slots), shut down by its handle afterwards."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Workers import tests.ray.hooks; make the repo importable in every process Ray starts.
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": str(ROOT)}}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    assert not ray.is_initialized(), "a Ray from another test module is still running"
    with ray_env_restored():
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=RUNTIME_ENV, log_to_driver=False)
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


@pytest.fixture(scope="module")
def s3():
    """A local S3 server (moto, loopback) for the module, with its endpoint and keys in this environment."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    from tests.s3_server import s3_server

    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def ray_on_s3(s3, tmp_path_factory):
    """A local Ray whose workers see the S3 server's endpoint and keys in their environment, and a cache of
    their own (not the user's ~/.cache/raytrain). The dashboard is on, as `raytrain tune` has it (Ray Train's
    placement-group cleaner asks its State API whether a Train controller died)."""
    import ray

    assert not ray.is_initialized(), "a Ray from another test module is still running"
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    cache = str(tmp_path_factory.mktemp("worker-cache"))
    env = {"env_vars": {**RUNTIME_ENV["env_vars"], **aws, "RAYTRAIN_CACHE": cache}}
    with ray_env_restored():
        import tensorboardX  # noqa: F401  (Tune's logger imports it, and it sets CRC32C_SW_MODE on import)

        ray.init(
            address="local", num_cpus=2, include_dashboard=True, runtime_env=env, log_to_driver=False
        )
        try:
            yield ray
        finally:
            ray.shutdown()
