"""Shared fixtures: a small prepared corpus, run-config factories, and leak guards."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any

import pytest

# One compute thread in the test process and, inherited, in every process a test starts (torchrun ranks, CLI
# runs, local Rays). Torch's default on 2 cores is 2 threads whose OpenMP barriers spin: beside any other load
# (a second process, the host taking a core away) a step waits for a thread that is not running. Measured
# 2026-11-29 beside a busy core: the examples' two training tests 281 s with 2 threads, 62 s with 1; idle the
# difference is small. The trainer's own choice (`trainers/launch.py`: scaling.cpus_per_worker where
# OMP_NUM_THREADS is unset) has tests of its own that unset it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (sets TORCHINDUCTOR_CACHE_DIR on first import: do it before the leak guard)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from trainers.config import RunConfig, parse_config  # noqa: E402


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """~300 kB of the standard library's own source, byte-tokenized (prepared once per session)."""
    from trainers.data.prepare import prepare_corpus

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("argparse.py", "textwrap.py", "difflib.py", "heapq.py", "bisect.py")]
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    prepare_corpus(files, out, tokenizer="byte", val_fraction=0.2, progress=False)
    return out


def tiny_raw(corpus: Path, run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A 2-block model small enough that a step takes milliseconds on CPU."""
    raw: dict[str, Any] = {
        "name": "t",
        "seed": 0,
        "run_dir": str(run_dir),
        "model": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
        "data": {"path": str(corpus), "seq_len": 32},
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
        "schedule": {"name": "warmup_cosine", "warmup_steps": 5},
        "train": {
            "steps": 40,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "eval_every": 10,
            "eval_batches": 2,
            "tensorboard": False,
        },
        "checkpoint": {"every": 10, "keep": 3},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


@pytest.fixture
def tiny_config(corpus_dir, tmp_path):
    def make(run: str = "run", **sections: dict[str, Any]) -> RunConfig:
        return parse_config(tiny_raw(corpus_dir, tmp_path / run, **sections))

    return make


# pytest-xdist: `make test` and `make test-slow` share a tier over two pytest processes (Makefile: XDIST, `--dist
# loadscope`), by the scopes below. The Ray tests run in turn on one of them (two local Rays on one machine size
# themselves to the same cores), with a unit test whose harness starts a local Ray, but for a slow-tier module
# whose drivers start Rays of their own; the gloo-rank tests in turn too, beside them; the rest, one compute
# thread each, fill in a module at a time (a module's fixtures built once). The bench scripts' dry runs, which
# share bench/_work, run on one process. (xdist's own `loadgroup` and its `xdist_group` marks do nothing on
# pytest 9.2: xdist 3.8 sets a node id attribute that pytest no longer reads.)
_RAY_MODULES = {"test_bench_pbt_quality.py", "test_bench_population_scale.py"}  # a unit test whose harness starts a local Ray
# Ray modules of the slow tier run in a scope of their own, beside the other Ray tests: their drivers are
# subprocesses with a Ray each (no module Ray), and the slow tier's other process, done with its own tests
# by half-time, left a core idle for the other half (2026-11-29: 13 of 27 min at 20-40% idle, vmstat).
_SECOND_RAY = {"test_driver_kill.py"}


def xdist_scope(nodeid: str) -> str:
    """The scope a test runs in under `--dist loadscope`: all of a scope runs in turn on one pytest process."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if path.startswith("tests/ray/") and name in _SECOND_RAY:
        return "ray-2"
    if path.startswith("tests/ray/") or name in _RAY_MODULES:
        return "ray"
    if path.startswith("tests/dist/"):
        return "dist"
    if name.startswith("test_bench_"):
        return "bench"
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByProcesses(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # xdist's extension point for loadscope's units
            return xdist_scope(nodeid)

    return ByProcesses(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("alone") and not item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked alone: only `make test-slow` runs such tests by "
                                    "themselves (Makefile); mark it slow too")
        for mark in ("ray", "dist"):
            if item.get_closest_marker(mark) and xdist_scope(item.nodeid).split("-")[0] != mark:
                raise pytest.UsageError(f"{item.nodeid} is marked {mark} but would not run in the {mark} scope: "
                                        f"move it to tests/{mark}/ or name its module in tests/conftest.py")


# Set by a library, once per process, not by a test: inductor's first CUDA compile points Triton at CUDA's ptxas;
# its first compile anywhere records how to read a tensor's data pointer; Ray's first import sets
# RAY_CLIENT_MODE=0 (ray/_private/client_mode_hook.py: a test run alone that imports Ray was reported as leaking it).
LIBRARY_SET_ENV = {"TRITON_PTXAS_PATH", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "RAY_CLIENT_MODE"}


@pytest.fixture(autouse=True)
def _no_leaks():
    """A test must not leave env vars or a default process group behind."""
    before = dict(os.environ)
    yield
    import torch.distributed as dist

    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
    changed -= {"PYTEST_CURRENT_TEST"} | LIBRARY_SET_ENV
    assert not leaked_pg, "test left a torch.distributed process group initialised"
    assert not changed, f"test leaked environment variables: {sorted(changed)}"


@pytest.fixture(scope="module")
def s3():
    """A local S3 server (moto's server mode on loopback, tests/s3_server.py) for the module, with its endpoint
    and keys in this environment while it runs."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    from tests.s3_server import s3_server

    with s3_server() as server:
        yield server


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache of remote files (RAYTRAIN_CACHE) of the test's own, not the user's ~/.cache/raytrain."""
    monkeypatch.setenv("RAYTRAIN_CACHE", str(tmp_path / "cache"))
