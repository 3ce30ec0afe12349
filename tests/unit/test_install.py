"""What `pip install raytrain-ext` promises a user: their torch stays (the range starts at 2.11 and has no
upper bound), DeepSpeed comes only with the `deepspeed` extra, and the wheel's top-level packages (`trainers`,
`search`, `raytrain_ext`: generic names, kept for the repository's layout) shadow nothing in the standard
library or in another installed distribution.

The slow test installs the working tree into a fresh venv that already holds a torch, as a user's CUDA
environment would; this machine's only torch wheel (2.13.0+cpu, /opt/wheels) stands in for the GPU machines'
2.11, which it cannot install."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_raw
from trainers.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainers", "search", "raytrain_ext")
DISTRIBUTION = "raytrain-ext"
LOCAL_TORCH = "/opt/wheels/torch-*.whl"

# Run in a venv's python: which distributions provide each top-level name, and where each imports from.
SHADOW_REPORT = """
import importlib.util, json, sys
from importlib.metadata import packages_distributions
dists = packages_distributions()
print(json.dumps({name: {"stdlib": name in sys.stdlib_module_names,
                         "dists": sorted(set(dists.get(name, []))),
                         "origin": importlib.util.find_spec(name).origin} for name in %r}))
"""


def _shadow_report(python: str | Path, cwd: Path) -> dict[str, dict]:
    out = subprocess.run([str(python), "-c", SHADOW_REPORT % (PACKAGES,)], cwd=cwd, capture_output=True,
                         text=True, check=True, env=_clean_env())
    return json.loads(out.stdout)


def _check_no_shadowing(report: dict[str, dict], home: Path) -> None:
    for name, seen in report.items():
        assert not seen["stdlib"], f"{name} is a standard-library module name"
        assert seen["dists"] == [DISTRIBUTION], f"top-level {name!r} is also provided by {seen['dists']}"
        assert Path(seen["origin"]).is_relative_to(home / name), (name, seen["origin"])


def test_top_level_packages_shadow_nothing_here():
    """This environment: each name is ours alone and imports from this checkout."""
    assert {name: sorted(set(packages_distributions().get(name, []))) for name in PACKAGES} == {
        name: [DISTRIBUTION] for name in PACKAGES
    }
    _check_no_shadowing(_shadow_report(sys.executable, ROOT), ROOT)


# --------------------------------------------------------------------------- a fresh venv with a user's torch


def _clean_env() -> dict[str, str]:
    # PYTHONDONTWRITEBYTECODE: the venv's installs skip byte-compiling, so its imports write their own .pyc
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PYTHONDONTWRITEBYTECODE")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1"}


def _run(*cmd: str | Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=_clean_env())
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _source_copy(dest: Path) -> Path:
    """The working tree's packaged files, without caches or a build's leftovers (pip builds in the tree)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "constraints.txt"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _constraints_without(path: Path, dest: Path, *names: str) -> Path:
    """constraints.txt less the pins of `names`: the user's torch is whatever they have."""
    keep = [line for line in path.read_text().splitlines() if line.split("==")[0].strip().lower() not in names]
    dest.write_text("\n".join(keep) + "\n")
    return dest


@pytest.mark.slow
def test_install_keeps_the_users_torch_and_leaves_deepspeed_to_its_extra(corpus_dir, tmp_path):
    wheels = sorted(glob.glob(LOCAL_TORCH))
    if not wheels:
        pytest.skip(f"no local torch wheel ({LOCAL_TORCH}) to stand in for a user's torch")
    took: dict[str, float] = {}
    clock = time.monotonic()

    def lap(what: str) -> None:
        nonlocal clock
        took[what] = round(time.monotonic() - clock, 1)
        clock = time.monotonic()

    src = _source_copy(tmp_path / "src")
    constraints = _constraints_without(src / "constraints.txt", tmp_path / "constraints.txt", "torch", "deepspeed")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    py, pip = venv / "bin" / "python", (venv / "bin" / "python", "-m", "pip")
    _run(*pip, "install", "-q", "--no-compile", wheels[-1], cwd=tmp_path)  # no .pyc now: imports make theirs
    lap("venv and the user's torch")

    def torch_version() -> str:
        return _run(py, "-c", "import torch; print(torch.__version__)", cwd=tmp_path).stdout.strip()

    users_torch = torch_version()
    _run(*pip, "install", "-q", "--no-compile", "-c", constraints, src, cwd=tmp_path)
    lap("pip install raytrain-ext")
    assert torch_version() == users_torch
    listed = _run(*pip, "list", "--format", "json", cwd=tmp_path).stdout
    assert "deepspeed" not in {d["name"].lower() for d in json.loads(listed)}

    version = re.search(r'^version = "(.+)"', (src / "pyproject.toml").read_text(), re.MULTILINE)[1]
    assert _run(venv / "bin" / "raytrain", "--version", cwd=tmp_path).stdout == f"raytrain-ext {version}\n"
    _run(py, "-c", "import trainers, raytrain_ext, search", cwd=tmp_path)
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).stdout.strip())
    _check_no_shadowing(_shadow_report(py, tmp_path), site)
    lap("checks in the venv")

    # The extra names DeepSpeed (what it would install; nothing is installed) and still keeps the torch.
    report = _run(*pip, "install", "--dry-run", "--quiet", "--report", "-", "-c", constraints, f"{src}[deepspeed]",
                  cwd=tmp_path).stdout
    would = {item["metadata"]["name"].lower() for item in json.loads(report)["install"]}
    assert "deepspeed" in would and "torch" not in would, would
    lap("pip install --dry-run raytrain-ext[deepspeed]")

    # An FSDP run in the venv that has no DeepSpeed: one rank under torchrun (a process group of one).
    raw = tiny_raw(corpus_dir, tmp_path / "run", parallel={"engine": "fsdp"},
                   schedule={"name": "constant"}, train={"steps": 3, "eval_every": 0},
                   checkpoint={"every": 0, "final": False})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    _run(venv / "bin" / "torchrun", "--nproc-per-node", "1", "--standalone", "-m", "trainers", "train",
         tmp_path / "run.yaml", "--no-progress", cwd=tmp_path, timeout=300)
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl", "train")) == 3
    lap("fsdp run under torchrun")

    # A piece of the unit tier against the installed packages: tests/ and examples/ (which it validates)
    # without trainers/ beside them.
    unit = tmp_path / "unit"
    for name in ("tests", "examples"):
        shutil.copytree(ROOT / name, unit / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "pyproject.toml", unit / "pyproject.toml")  # pytest's settings
    _run(*pip, "install", "-q", "--no-compile", "-c", constraints, "pytest", cwd=tmp_path)
    out = _run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_config.py", cwd=unit).stdout
    assert re.search(r"\d+ passed", out) and "failed" not in out, out[-2000:]
    lap("unit tier piece (test_config.py)")
    print(f"install test times (s): {took}")
