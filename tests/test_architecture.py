"""Guards for the layering: trainers never imports ray; model files hold no distributed code;
every module imports on its own (no cycles)."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str) -> list[str]:
    pkg_dir = ROOT / package
    return [package] + [
        f"{package}.{m.name}" for m in pkgutil.walk_packages([str(pkg_dir)]) if not m.name.startswith("_")
    ]


def test_importing_trainers_imports_no_ray():
    code = (
        "import sys, importlib\n"
        f"for m in {_modules('trainers')!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"trainers pulled in ray modules: {out.stdout[:300]}"


def test_no_ray_import_statements_in_trainers():
    pattern = re.compile(r"^\s*(import ray|from ray)", re.M)
    offenders = [p for p in (ROOT / "trainers").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_model_files_hold_no_distributed_code():
    pattern = re.compile(r"torch\.distributed|DeviceMesh|fully_shard")
    offenders = [p for p in (ROOT / "trainers" / "models").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


# One process imports the heavy third-party libraries once, then forks a child per module of ours that
# imports that module first: each of our modules still imports alone (no other of ours loaded before it,
# so a cycle or a missing import shows), without paying torch's import per module (a minute per package).
_FORK_EACH = """
import importlib, os, sys, traceback
import numpy, pyarrow, pydantic, torch, yaml  # third-party only: none of ours
if {ray}:
    import ray, ray.train, ray.tune
failed = []
for name in {modules!r}:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED:" + ",".join(failed))
"""


@pytest.mark.parametrize("package", ["trainers", "raytrain_ext", "search"])
def test_each_module_imports_alone(package):
    code = _FORK_EACH.format(modules=_modules(package), ray=package != "trainers")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "FAILED:\n" in out.stdout + "\n", out.stdout[-2000:] + out.stderr[-3000:]
