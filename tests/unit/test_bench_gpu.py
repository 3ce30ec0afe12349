"""bench/gpu.py --dry-run: the GPU benchmark's rows run on the CPU at a tiny size, so CI proves the script
(configs, the row kinds, the JSON contract, the checks) before a GPU runs it unattended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402

CONTRACT = {"name", "median_step_s", "tokens_per_s", "mfu", "peak_bytes", "planned_bytes"}


@pytest.fixture(scope="module", autouse=True)
def _inductor_loaded():
    """Inductor sets an environment variable for the process when first loaded: let that happen before the
    leak guard's snapshot (as tests/unit/test_compile.py)."""
    import torch

    torch.compile(lambda x: x + 1)(torch.ones(1))


def _dry_run(tmp_path: Path, rows: str = "") -> dict:
    args = ["--dry-run", "--out", str(tmp_path), "--peak-tflops", "1"] + (["--rows", rows] if rows else [])
    assert gpu.main(args) == 0
    return json.loads((tmp_path / "gpu-dry-run.json").read_text())


def test_every_row_is_a_valid_run_at_every_size(tmp_path):
    for size in gpu.SIZES.values():
        for row in gpu.rows_for(size):
            cfg = gpu.row_config(row, size, "unused", tmp_path)  # a bad override fails here
            assert cfg.model.dim == size[row.section]["dim"], row.name


def test_dry_run_rows_on_cpu_write_the_contract(tmp_path, monkeypatch):
    # a lent GPU machine's .git can be older than the tree it ran: the caller names the commit
    monkeypatch.setenv("BENCH_GIT_COMMIT", "0123abc")
    result = _dry_run(tmp_path, "seed/naive-fp32,seed/chunk256,big/hand-mb4-gb16")
    assert result["dry_run"] and result["device_name"] and result["torch_version"]
    assert (result["git_commit"], result["git_commit_source"], result["git_dirty"]) == ("0123abc", "BENCH_GIT_COMMIT",
                                                                                        None)
    rows = {r["name"]: r for r in result["rows"]}
    assert {r["git_commit"] for r in rows.values()} == {"0123abc"}  # rows merge across runs: each names its own
    assert sorted(rows) == ["big/hand-mb4-gb16", "seed/chunk256", "seed/naive-fp32"]
    for r in rows.values():
        assert "error" not in r, r
        assert CONTRACT <= set(r) and r["median_step_s"] > 0 and r["peak_bytes"] > 0 and r["mfu"] > 0
        assert abs(r["planned_bytes"] / r["peak_bytes"] - 1) < 0.25, r  # the CPU planner on its own rows
    assert rows["big/hand-mb4-gb16"]["global_batch_size"] == 16 and rows["big/hand-mb4-gb16"]["micro_batch_size"] == 4
    assert "plan_error_max" in result["checks"]


def test_the_targets_preset_holds_every_row_the_checks_read():
    """--targets (a short GPU lease) runs only these rows: with them alone every target is checked, and with
    any one left out at least one target is not."""
    for size in (gpu.SIZES["1.1b"], gpu.SIZES["small"]):
        names = [gpu._fill(n, size, n.split("/")[0]) for n in gpu.TARGET_ROWS]
        assert set(names) <= {r.name for r in gpu.rows_for(size)} and len(set(names)) == len(names)
        row = {"median_step_s": 0.5, "mfu": 0.5, "peak_bytes": 2**30, "planned_bytes": 2**30}
        every = set(gpu.checks({n: row for n in names}, size))
        assert every == {"chunked_vs_whole_step", "fit_vs_best_hand_mfu", "plan_error_max", "seed_all_memory_ratio",
                         "seed_all_speed_ratio", "big_compile_mfu", "big_compile_ahead_of_peer"}
        for gone in names:
            fewer = set(gpu.checks({n: row for n in names if n != gone}, size))
            assert fewer < every or gone.startswith("big/hand-mb"), gone  # one hand-picked plan is enough


def test_without_bench_git_commit_the_checkout_names_the_commit(monkeypatch):
    from provenance import git_state

    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    state = git_state()
    assert state["git_commit"] == head and state["git_commit_source"] == "git" and isinstance(state["git_dirty"], bool)


def test_without_a_gpu_the_real_run_says_how_to_dry_run():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--rows", "seed/all"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr.strip().splitlines()[-1]
