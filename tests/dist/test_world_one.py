"""`torchrun --nproc-per-node 1` joins a process group of one (trainers/parallel/distributed.py), so the
data-parallel engines run on one device as on many: the run trains and its losses are the single-process
run's (engine none) within 1e-5."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_raw
from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.trainer import Trainer

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _raw(corpus: Path, run_dir: Path, engine: str) -> dict:
    return tiny_raw(corpus, run_dir, parallel={"engine": engine}, train={"steps": 3, "eval_every": 0},
                    schedule={"name": "constant"}, checkpoint={"every": 0})


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", "train")]


@pytest.mark.parametrize("engine", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_torchrun_with_one_process_runs_every_engine(engine, corpus_dir, tmp_path):
    Trainer(parse_config(_raw(corpus_dir, tmp_path / "alone", "none")), progress=False).fit()
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_raw(corpus_dir, tmp_path / engine, engine)))
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(TORCHRUN), "--nproc-per-node", "1", "--standalone", "-m", "trainers", "train",
                           str(path), "--no-progress"], cwd=ROOT, env={**_env(), **env}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone, ranked = _losses(tmp_path / "alone"), _losses(tmp_path / engine)
    assert len(ranked) == 3 and ranked == pytest.approx(alone, rel=1e-5)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
