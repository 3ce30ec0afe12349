"""Ray tier: one local Ray per module (CPU only, 2 worker slots), shut down by its handle afterwards."""

from __future__ import annotations

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
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=RUNTIME_ENV, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if auth_mode is None:  # ray.init may have enabled token auth for its children
            os.environ.pop("RAY_AUTH_MODE", None)
