"""bench/pbt_quality.py: the results' contract (issue 25) and the done-when computed from the numbers, over
summaries that the harness's own summarizer makes from trial logs (no Ray, fast); and one `--dry-run` of the
real harness (Tune function trials running the Trainer, PBT restoring from checkpoints) for one method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import pbt_quality  # noqa: E402

CONTRACT = ("best_val_loss", "total_steps", "wall_s")


def _fake_experiment(work: Path, method: str, seed: int, losses: list[float]) -> None:
    """A trial log as the trainable writes it: two trials, two reports each."""
    d = work / f"{method}-s{seed}"
    d.mkdir(parents=True)
    rows = []
    for t, loss in enumerate(losses):
        for step, val in ((50, loss + 0.1), (100, loss)):
            rows.append({"trial": f"t{t}", "step": step, "val_loss": val, "trained": 50, "lr": 1e-3 * (t + 1),
                         "wd": 0.1, "restored_at": None, "interval_s": 1.0, "time": float(step + t)})
    (d / pbt_quality.LOG).write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = pbt_quality.summarize_experiment(d, 12.5, method, seed)
    (d / pbt_quality.SUMMARY).write_text(json.dumps(summary))


def test_summarize_only_writes_the_contract_and_computes_the_verdict(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    base = {"pbt": 1.80, "pbt_sync": 1.81, "pb2": 1.85, "asha": 1.95, "random": 1.97, "grid": 1.82}
    seeds = 5
    for method, loss in base.items():
        for seed in range(1 if method == "grid" else seeds):
            _fake_experiment(work, method, seed, [loss + 0.002 * seed, loss + 0.3])
    pbt_quality.main(["--summarize-only", "--work", str(work), "--out", str(out), "--seeds", str(seeds),
                      "--data", str(tmp_path)])
    result = json.loads((out / "pbt_quality.json").read_text())
    assert set(result["methods"]) == set(pbt_quality.ALL)
    for method, m in result["methods"].items():
        n = 1 if method == "grid" else seeds
        for key in CONTRACT:
            assert len(m[key]) == n, (method, key)
        assert m["best_val_loss"] == pytest.approx([base[method] + 0.002 * s for s in range(n)])
        assert m["total_steps"] == [200] * n  # every report's own steps, summed
    for key in ("task", "harness", "command", "git_commit", "date", "cpus", "loadavg_before", "loadavg_after"):
        assert result[key] is not None, key
    assert {"what", "why"} <= set(result["task"])
    done = result["done_when"]
    assert done["beats_random"]["holds"] and done["beats_asha"]["holds"] and done["near_grid"]["holds"]
    assert done["holds"] is True
    assert done["beats_random"]["margin"] == pytest.approx(0.17)
    assert (out / "pbt_quality.png").stat().st_size > 0


def test_the_verdict_fails_where_the_margin_is_within_the_noise():
    def m(values):
        return {"stats": pbt_quality._stats(values)}

    methods = {"pbt": m([1.80, 1.90, 1.85, 1.82, 1.88]), "random": m([1.86, 1.87, 1.85, 1.90, 1.84]),
               "asha": m([2.0] * 5), "grid": m([1.50])}
    done = pbt_quality.verdict(methods)
    assert not done["beats_random"]["holds"] and done["beats_asha"]["holds"]
    assert not done["near_grid"]["holds"] and done["holds"] is False


def test_dry_run_refuses_the_real_results_folder():
    with pytest.raises(SystemExit):
        pbt_quality.parse_args(["--dry-run"])


@pytest.mark.slow
def test_dry_run_of_the_real_harness(corpus_dir, tmp_path):
    """Tune function trials running the Trainer; PBT reports checkpoints and restores from them."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pbt_quality.py"), "--dry-run", "--data", str(corpus_dir),
         "--out", str(out), "--work", str(work), "--only", "pbt_sync", "grid"],
        check=True, env=env, timeout=600, capture_output=True,
    )
    result = json.loads((out / "pbt_quality.json").read_text())
    assert set(result["methods"]) == {"pbt_sync", "grid"}
    pbt = result["methods"]["pbt_sync"]
    assert len(pbt["best_val_loss"]) == 2 and all(v > 0 for v in pbt["best_val_loss"])
    assert all(t >= 16 for t in pbt["total_steps"])  # population 2 x 8 steps (more if a restore goes back)
    assert sum(pbt["restores"]) > 0  # synchronous PBT pauses every member at each report: restores
    assert len(result["methods"]["grid"]["best_val_loss"]) == 1
