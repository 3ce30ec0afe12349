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
import stale  # noqa: E402

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
    assert {r["run_id"] for r in rows.values()} == {result["run_id"]} and result["run_id"]  # and its run
    assert stale.lacking(result) == [] and result["measures"] == gpu.MEASURES  # bench/stale.py reads it whole
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
        row = {"median_step_s": 0.5, "mfu": 0.5, "peak_bytes": 2**30, "planned_bytes": 2**30, "run_id": "r"}
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


def _rows(size: dict, run: dict[str, str | None]) -> dict[str, dict]:
    """The target rows, each of the run `run` names for it (default "r1"; None: a row without a run id)."""
    names = [gpu._fill(n, size, n.split("/")[0]) for n in gpu.TARGET_ROWS]
    out = {}
    for i, n in enumerate(names):
        r = {"median_step_s": 0.5 + i / 100, "mfu": 0.5 - i / 100, "peak_bytes": 2**30, "planned_bytes": 2**30}
        rid = run.get(n, "r1")
        out[n] = {**r, "run_id": rid} if rid else r
    return out


def test_a_ratio_compares_rows_of_one_run_only():
    """Issue 66: a check over rows of two runs (or a row whose run is not known) is null and says which rows of
    which runs; the same check over one run's rows has its value; checks of other rows are not touched."""
    size = gpu.SIZES["1.1b"]
    one = gpu.checks(_rows(size, {}), size)
    assert all(c["value"] is not None and c["met"] is not None for c in one.values()), one
    assert one["big_compile_ahead_of_peer"]["run_id"] == "r1"
    mixed = gpu.checks(_rows(size, {"big/peer-hf-compile": "r0", "seed/all": None}), size)
    for key in ("big_compile_ahead_of_peer", "seed_all_speed_ratio", "seed_all_memory_ratio"):
        assert mixed[key]["value"] is None and mixed[key]["met"] is None, key
    assert "big/peer-hf-compile (run r0" in mixed["big_compile_ahead_of_peer"]["note"]
    assert "seed/all (run unknown" in mixed["seed_all_speed_ratio"]["note"]
    for key in ("chunked_vs_whole_step", "fit_vs_best_hand_mfu", "big_compile_mfu", "plan_error_max"):
        assert mixed[key] == one[key], key
    assert gpu.check_line(mixed["seed_all_speed_ratio"]).startswith("null (target 2.0): rows of different runs")


def test_the_fit_is_compared_with_the_hand_picked_plans_of_its_own_run():
    size = gpu.SIZES["1.1b"]
    rows = _rows(size, {"big/hand-mb8-gb32": "r0"})  # one plan of another run: left out, the other one counts
    rows["big/hand-mb8-gb32"]["mfu"] = 0.99
    fit = gpu.checks(rows, size)["fit_vs_best_hand_mfu"]
    assert fit["rows"] == ["big/fit-auto-gb32", "big/hand-mb16-selective-gb32"] and fit["run_id"] == "r1"
    assert fit["value"] == rows["big/fit-auto-gb32"]["mfu"] / rows["big/hand-mb16-selective-gb32"]["mfu"]
    rows["big/hand-mb16-selective-gb32"]["run_id"] = "r0"  # no plan of the fit's run: null
    assert gpu.checks(rows, size)["fit_vs_best_hand_mfu"]["value"] is None
