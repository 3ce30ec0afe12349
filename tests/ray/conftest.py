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
