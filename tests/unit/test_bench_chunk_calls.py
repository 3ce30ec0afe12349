"""bench/chunk_calls.py runs its three variants of the chunked loss (eager; compiled a chunk a call; 8 a call)
to the same loss, and 8 chunks a call hold about one chunk's logits more than one (slow tier: inductor's C++
on the CPU). No timing is checked: the bench measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_variants_give_one_loss_and_eight_a_call_about_one_chunk_more(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chunk_calls.py"), "--rounds", "1", "--steps", "1",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    section = json.loads((tmp_path / "chunk_calls.json").read_text())["cpu-tiny"]
    rows = {r["variant"]: r for r in section["rows"]}
    assert set(rows) == {"eager", "compiled-1-a-call", "compiled-8-a-call"}
    assert "runs eager" not in proc.stderr  # the compiled variants compiled
    assert rows["compiled-8-a-call"]["loss"] == pytest.approx(rows["eager"]["loss"], rel=1e-3)
    assert rows["compiled-1-a-call"]["loss"] == pytest.approx(rows["eager"]["loss"], rel=1e-3)
    shape = section["shape"]
    one_chunk = shape["chunk"] * shape["vocab"] * 2  # 16-bit logits; no padding on the CPU
    assert rows["compiled-8-a-call"]["peak_temp_bytes"] <= rows["compiled-1-a-call"]["peak_temp_bytes"] + 1.1 * one_chunk
    assert section["git_commit"] and section["loadavg_before"]
