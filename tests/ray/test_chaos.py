"""bench/chaos.py, shortened (slow tier): a worker, the controller and the driver SIGKILLed at random steps
of one run, each recovered, with every step trained after each kill giving the uninterrupted run's loss."""

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
    # Three kills: one each of worker, controller and driver (the bench draws targets in rounds of three).
    cmd = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--data", str(corpus_dir), "--steps", "30",
           "--kills", "3", "--seed", "0", "--work", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {k["target"] for k in result["kills"]} == {"worker", "controller", "driver"}
    for kill in result["kills"]:
        assert kill["recovered"] and kill["bit_equal"] and kill["steps_checked"] > 0, kill
    summary = result["summary"]
    assert summary["kills"] == summary["bit_equal"] == 3
    assert summary["each_step_once"] and summary["final_losses_bit_equal"] and summary["final_exit_code"] == 0
