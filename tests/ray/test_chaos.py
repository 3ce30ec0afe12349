"""bench/chaos.py, shortened (slow tier): the Train controller SIGKILLed at a random step of a run (the driver
starts the run again), recovered, with every step trained after the kill giving the uninterrupted run's loss
and each step once. (A worker and the driver killed: tests/ray/test_train_on_ray.py and
tests/ray/test_driver_kill.py; `make bench` runs chaos.py's ten kills of all three.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_chaos_kills_recover_bit_equal(corpus_dir, tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--data", str(corpus_dir), "--steps", "30",
           "--kills", "1", "--targets", "controller", "--seed", "0", "--work", str(tmp_path / "work"),
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [k["target"] for k in result["kills"]] == ["controller"]
    for kill in result["kills"]:
        assert kill["recovered"] and kill["bit_equal"] and kill["steps_checked"] > 0, kill
    summary = result["summary"]
    assert summary["kills"] == summary["bit_equal"] == 1
    assert summary["each_step_once"] and summary["final_losses_bit_equal"] and summary["final_exit_code"] == 0
