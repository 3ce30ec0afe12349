"""bench/gpu_check.sh, the one call a short GPU lease gets (issue 44): its --dry-run runs every part on the CPU
at tiny sizes, so a typo fails here and not on the lease, and each part's JSON holds the fields its checks
read. bench/checkpoint.py's 1b rows merge beside the CPU rows of checkpoint.json (and the CPU run keeps them).
A failed part fails the script and is named in its last line (issue 55): checked here with a PYTHON that is a
wrapper script, in a copy of the script under tmp_path, so nothing heavy runs and the checkout is not written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import checkpoint  # noqa: E402
import torch  # noqa: E402

PARTS = ("corpus", "checkpoint.py --shape 1b", "gpu.py seed rows", "moe.py", "gpu.py 1.1B compile and peer rows")
ALL = (*PARTS, "tests", "summary")  # every step the last line counts


def _interpreter(tmp_path: Path, cases: str, otherwise: str) -> Path:
    """A PYTHON that runs the script's torch check for real, then `cases` (bash case arms on its arguments)."""
    path = tmp_path / "python"
    path.write_text(f"""#!/usr/bin/env bash
case "$*" in
  -c*"import torch"*) exec {sys.executable} "$@" ;;
{cases}
esac
{otherwise}
""")
    path.chmod(0o755)
    return path


def _run_copy(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """bench/gpu_check.sh run from a copy in an empty checkout under tmp_path (its bench/_work lands there)."""
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True, exist_ok=True)
    (repo / "bench" / "gpu_check.sh").write_text((ROOT / "bench" / "gpu_check.sh").read_text())
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "OUT", "BUDGET_S")}
    return subprocess.run(["bash", str(repo / "bench" / "gpu_check.sh"), *args], cwd=repo,
                          env={**base, "OUT": str(tmp_path / "out"), **env}, capture_output=True, text=True,
                          timeout=300)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.rstrip("\n").rsplit("\n", 1)[-1]


def test_every_part_failing_fails_the_script_and_each_is_named(tmp_path):
    proc = _run_copy(tmp_path, "--dry-run", PYTHON=str(_interpreter(tmp_path, "", "exit 1")))
    last = _last_line(proc)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert last.startswith("== FAILED: ") and f"({len(ALL)} parts;" in last, last
    for step in ALL:
        assert f"{step} (rc 1)" in last, (step, last)
    log = (tmp_path / "out" / "log.txt").read_text() + (tmp_path / "out" / "tests.txt").read_text()
    for step in (*PARTS, "tests"):  # each later part still ran after the failed ones
        assert f"== {step} rc=1 " in log, (step, log)


def test_the_last_line_names_only_the_failed_parts_and_one_out_of_time(tmp_path):
    cases = """  *bench/moe.py*) exit 3 ;;
  *seed/naive-fp32*) exec sleep 600 ;;"""
    proc = _run_copy(tmp_path, "--dry-run", PYTHON=str(_interpreter(tmp_path, cases, "exit 0")), BUDGET_S="5")
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert _last_line(proc).startswith(
        f"== FAILED: gpu.py seed rows (rc 124, out of time), moe.py (rc 3) ({len(ALL)} parts; "), proc.stdout


def test_a_part_that_ends_0_with_a_row_in_error_fails(tmp_path):
    """bench/gpu.py writes a row's error in its JSON and exits 0: the part fails on the rows it was to measure."""
    rows = '{"rows": [{"name": "seed/naive-fp32", "run_id": "r1"}, {"name": "seed/all", "error": "exit 1: boom"}]}'
    cases = f"""  "- "*) exec {sys.executable} "$@" ;;
  *bench/gpu.py*seed/naive-fp32*) echo '{rows}' >"$OUT/gpu-dry-run.json" ;;"""
    proc = _run_copy(tmp_path, "--dry-run", PYTHON=str(_interpreter(tmp_path, cases, "exit 0")), BENCH_RUN_ID="r1")
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "gpu.py seed rows (rc 0, not measured: seed/all,seed/all-chunk-a-call)" in _last_line(proc), proc.stdout
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "== gpu.py seed rows: row seed/all: exit 1: boom" in log and "== gpu.py seed rows rc=0 " in log, log


def test_a_row_this_run_did_not_write_fails_its_part(tmp_path):
    """Issue 66: a headline row must be this run's. Planted: a gpu.py row of an earlier run (another run id,
    another commit) and one with no run id beside this run's own; a checkpoint.py row (its writer records no run
    id) left as the copied earlier results held it, beside one this run rewrote; moe.py's pair left as it was
    (moe.py's stand-in writes nothing). Each foreign row fails its
    part by name; this run's rows pass (the 1.1B part, all its own, is not named)."""
    def row(name: str, run: str | None) -> dict:
        return {"name": name, "median_step_s": 0.1, "git_commit": "9383718" if run != "this-run" else "abc1234",
                **({"run_id": run} if run else {})}
    seed = {"rows": [row("seed/naive-fp32", "an-earlier-run"), row("seed/all", "this-run"),
                     row("seed/all-chunk-a-call", None)]}
    big = {"rows": [row("big/bf16-compile", "this-run"), row("big/peer-hf-compile", "this-run")]}
    earlier = {"rows": [{"shape": "1b", "mode": m, "blocking_s": {"median": 0.25}} for m in ("async", "sync")]}
    (tmp_path / "repo" / "bench" / "results").mkdir(parents=True)
    (tmp_path / "repo" / "bench" / "results" / "checkpoint.json").write_text(json.dumps(earlier))
    moe = {"rows": [{"name": "gpu-moe", "path": p, "device": "cuda", "mfu": 0.3} for p in ("loop", "grouped")]}
    (tmp_path / "repo" / "bench" / "results" / "moe.json").write_text(json.dumps(moe))  # moe.py is to rewrite
    rewrite = tmp_path / "rewrite_async.py"  # checkpoint.py's stand-in: measures 1b/async again, not 1b/sync
    rewrite.write_text("import json, os, pathlib\n"
                       "p = pathlib.Path(os.environ['OUT']) / 'checkpoint_dry_run.json'\n"
                       "d = json.loads(p.read_text()); d['rows'][0]['blocking_s'] = {'median': 0.31}\n"
                       "p.write_text(json.dumps(d))\n")
    cases = f"""  "- "*) exec {sys.executable} "$@" ;;
  *bench/checkpoint.py*) exec {sys.executable} {rewrite} ;;
  *bench/gpu.py*seed/naive-fp32*) echo '{json.dumps(seed)}' >"$OUT/gpu-dry-run.json" ;;
  *bench/gpu.py*big/bf16-compile*) echo '{json.dumps(big)}' >"$OUT/gpu-dry-run.json" ;;"""
    proc = _run_copy(tmp_path, "--dry-run", PYTHON=str(_interpreter(tmp_path, cases, "exit 0")),
                     BENCH_RUN_ID="this-run")
    last = _last_line(proc)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "checkpoint.py --shape 1b (rc 0, not measured: 1b/sync)" in last, last
    assert "gpu.py seed rows (rc 0, not measured: seed/naive-fp32,seed/all-chunk-a-call)" in last, last
    assert "1.1B compile and peer rows" not in last, last
    assert "moe.py (rc 0, not measured: gpu-moe/loop,gpu-moe/grouped)" in last, last  # kept as they were
    log = (tmp_path / "out" / "log.txt").read_text()
    assert ("== gpu.py seed rows: row seed/naive-fp32: not written by this run: run an-earlier-run (commit 9383718), "
            "this run is this-run") in log, log
    assert "row seed/all-chunk-a-call: not written by this run: run not recorded" in log, log
    assert "row 1b/sync: not written by this run: the row the earlier results held" in log, log
    assert "== moe.py: row gpu-moe/grouped: not written by this run: the row the earlier results held" in log, log


def test_an_interpreter_without_torch_stops_the_script_before_any_part(tmp_path):
    no_torch = tmp_path / "python"
    no_torch.write_text("#!/usr/bin/env bash\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    no_torch.chmod(0o755)
    proc = _run_copy(tmp_path, "--dry-run", PYTHON=str(no_torch))
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1, proc.stdout
    why = "ModuleNotFoundError: No module named 'torch'"
    assert proc.stdout == f'== FAILED before any part: {no_torch} -c "import torch": {why}\n'
    assert not (tmp_path / "out").exists()


def test_this_checkouts_venv_is_the_default_interpreter(tmp_path):
    venv_python = tmp_path / "repo" / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("#!/usr/bin/env bash\necho 'the venv python, without torch' >&2\nexit 1\n")
    venv_python.chmod(0o755)
    proc = _run_copy(tmp_path, "--dry-run")
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.startswith("== FAILED before any part: .venv/bin/python -c ")
    assert proc.stdout.rstrip().endswith("the venv python, without torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA device")
def test_without_a_cuda_device_the_lease_run_stops_before_any_part(tmp_path):
    proc = _run_copy(tmp_path, PYTHON=sys.executable)
    assert proc.returncode == 2 and "torch sees no CUDA device" in proc.stdout, proc.stdout
    assert not (tmp_path / "out").exists()


def _row(shape: str, mode: str, **more) -> dict:
    return {"device": "cuda" if shape == "1b" else "cpu", "shape": shape, "mode": mode, **more}


def test_1b_rows_merge_beside_the_cpu_rows(tmp_path):
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps({"rows": [_row("cpu", "sync"), _row("cpu", "async")], "verdicts": {"met": True}}))
    for tag in ("first", "second"):  # a later 1b run replaces the earlier one's rows
        result = {"rows": [_row("1b", "async", tag=tag), _row("1b", "sync", tag=tag)], "checks": {}, "every": 100}
        path.write_text(json.dumps(checkpoint.merged(path, result)))
    data = json.loads(path.read_text())
    assert [(r["shape"], r["mode"], r.get("tag")) for r in data["rows"]] == [
        ("cpu", "sync", None), ("cpu", "async", None), ("1b", "async", "second"), ("1b", "sync", "second")]
    assert data["verdicts"] == {"met": True} and data["1b"] == {"checks": {}, "every": 100}


def test_the_1b_checks_read_the_three_targets():
    spread = {"median": 0.4, "p90": 0.6, "max": 0.6, "n": 2}
    run = _row("1b", "async", blocking_s=spread, first_blocking_s=2.0, resume_first_step_s=16.0,
               throughput_ratio=0.98, every=100)
    checks = checkpoint.checks_1b([run, _row("1b", "sync", blocking_s=spread)])
    assert {k: (v["value"], v["met"]) for k, v in checks.items()} == {
        "blocking_s": (0.6, True), "resume_first_step_s": (16.0, False), "throughput_ratio": (0.98, True)}
    assert "resume_first_step_s" not in checkpoint.checks_1b([dict(run, resume_first_step_s=None)])  # not measured
    assert checkpoint.checks_1b([]) == {}


@pytest.mark.slow
def test_dry_run_runs_every_part_and_writes_what_the_checks_read(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "BUDGET_S": "540"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    log = (tmp_path / "log.txt").read_text()
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-2000:])
    assert _last_line(proc).startswith("== done in ") and _last_line(proc).endswith(
        f": all {len(ALL)} parts passed"), proc.stdout[-3000:]
    for part in PARTS:
        assert f"== {part} rc=0 " in log, (part, log[-3000:])
    assert "== tests rc=0 " in (tmp_path / "tests.txt").read_text()
    assert "checkpoint 1b throughput_ratio:" in proc.stdout  # the summary

    ckpt = json.loads((tmp_path / "checkpoint_dry_run.json").read_text())
    rows = {r["mode"]: r for r in ckpt["rows"] if r["shape"] == "1b"}
    assert set(rows) == {"async", "sync"} and {r["device"] for r in rows.values()} == {"cpu"}
    run = rows["async"]
    assert run["resume_first_step_s"] > 0 and run["throughput_ratio"] > 0 and run["every"] == 4, run
    assert run["resume_split_s"]["build_restore_verify"] > 0 and run["restore_s"] > 0
    for r in rows.values():
        assert r["blocking_s"]["max"] > 0 and r["first_blocking_s"] > 0
        assert {"stage_s", "write_s", "checksum_s", "commit_s", "state_bytes"} <= set(r)
    assert set(ckpt["1b"]["checks"]) == {"blocking_s", "resume_first_step_s", "throughput_ratio"}
    assert ckpt["1b"]["parts_done"] == ["async", "resume", "sync"]
    assert {r["shape"] for r in ckpt["rows"]} >= {"cpu", "cpu-lm"}  # bench/results' CPU rows kept

    gpu = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    by_name = {r["name"]: r for r in gpu["rows"]}
    assert {"seed/naive-fp32", "seed/all", "seed/all-chunk-a-call", "big/bf16-compile", "big/peer-hf-compile"} <= set(
        by_name)
    for name in ("seed/naive-fp32", "seed/all", "seed/all-chunk-a-call", "big/bf16-compile"):
        assert "error" not in by_name[name] and by_name[name]["median_step_s"] > 0, by_name[name]
    assert by_name["seed/all-chunk-a-call"]["env"] == {"RAYTRAIN_LOSS_CHUNKS_PER_CALL": "1"}
    assert {"seed_all_speed_ratio", "seed_all_memory_ratio"} <= set(gpu["checks"])
    # the script's two gpu.py parts are one run: one id on their rows, and the ratios between them have values
    assert len({by_name[n]["run_id"] for n in ("seed/naive-fp32", "seed/all", "big/bf16-compile")}) == 1
    assert gpu["checks"]["seed_all_speed_ratio"]["value"] is not None

    moe = json.loads((tmp_path / "moe-dry-run.json").read_text())["gpu"]
    assert moe["dry_run"] and "gpu-moe_mfu" in moe["targets_met"]
    assert sorted(r["path"] for r in moe["rows"]) == ["grouped", "loop"]
    assert all(r["name"] == "gpu-moe" and r["median_step_s"] > 0 and "mfu" in r for r in moe["rows"])


def test_resume_profile_dry_run_splits_a_resume_into_its_parts(tmp_path, corpus_dir):
    """bench/resume_profile.py (where a resume's 30 s went on the H200) on the CPU, tiny: a checkpoint, then a
    fresh process that resumes it; its parts add up to the time from that process's start to its first step."""
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "bench/resume_profile.py"), "--dry-run", "--data", str(corpus_dir),
                    "--work", str(tmp_path / "work"), "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    result = json.loads((out / "resume_profile.json").read_text())
    split = result["split_s"]
    assert list(split) == ["python_started->torch_imported", "torch_imported->cuda_ready",
                           "cuda_ready->trainers_imported", "trainers_imported->built", "built->first_step"]
    assert all(v >= 0 for v in split.values())
    total = result["process_start_to_python"] + sum(split.values())
    assert total == pytest.approx(result["first_step_after_start_s"], abs=1e-6)
    assert any(r["module"] == "torch" for r in result["imports_top"])
    assert "trainers/trainer.py" in (out / "build_profile.txt").read_text()  # the Trainer's build was profiled
