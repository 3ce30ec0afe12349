"""Crash-proof runs without Ray: checksummed checkpoints and the fallback past a corrupt one, resumes that
would change the model's shape, bad callbacks and unplaceable sizes refused before Ray starts, and one
writer per run dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raytrain_ext import launcher  # imports Ray, which sets RAY_CLIENT_MODE: at collection, not in a test
from raytrain_ext.cli import main
from raytrain_ext.worker import load_callback
from tests.conftest import tiny_raw
from trainers._base import ConfigError
from trainers.checkpoint import COMMITTED, Checkpointer
from trainers.checkpoint_files import checkpoint_step
from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.run_dir import LOCK
from trainers.run_lock import RunDirLock
from trainers.trainer import Trainer, TrainerCallback

ROOT = Path(__file__).resolve().parents[2]


class _CrashAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def after_checkpoint(self, trainer, path):
        if checkpoint_step(path) == self.step:  # committed; an async save commits a few steps later
            raise KeyboardInterrupt  # a killed process: no clean shutdown


def _largest_file(checkpoint: Path) -> Path:
    return max((p for p in checkpoint.rglob("*.distcp")), key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _run_yaml(corpus: Path, run_dir: Path, **sections) -> Path:
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(tiny_raw(corpus, run_dir, **sections)))
    return path


@pytest.fixture
def no_ray(monkeypatch):
    """The cases below are refused before Ray starts: starting it fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for input that should have been refused first")

    monkeypatch.setattr(launcher, "ensure_ray", refuse)


# ----------------------------------------------------------------------------------- checksums


def test_commit_marker_holds_each_files_checksum_and_verify_finds_damage(tiny_config):
    cfg = tiny_config(train={"steps": 10}, checkpoint={"every": 10})
    Trainer(cfg, progress=False).fit()
    path = Checkpointer(cfg.out_dir / "checkpoints", 3).latest()
    files = json.loads((path / COMMITTED).read_text())["files"]
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != COMMITTED)
    assert sorted(files) == on_disk and "trainer_state.json" in files and ".metadata" in files
    assert Checkpointer.verify(path) is None

    victim = _largest_file(path)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
    victim.write_bytes(bytes(data))
    assert Checkpointer.verify(path) == f"{victim.name} does not match its xxh3_128 checksum"
    _truncate(victim)
    assert "bytes" in Checkpointer.verify(path) and victim.name in Checkpointer.verify(path)
    victim.unlink()
    assert Checkpointer.verify(path) == f"{victim.name} is missing"


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_with_the_same_losses(tiny_config):
    short = {"train": {"steps": 20}, "checkpoint": {"every": 5}}
    straight_cfg = tiny_config("straight", **short)
    Trainer(straight_cfg, progress=False).fit()

    cfg = tiny_config("damaged", **short)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, callbacks=[_CrashAfter(15)], progress=False).fit()
    newest = cfg.out_dir / "checkpoints" / "step_00000015"
    _truncate(_largest_file(newest))

    resumed = Trainer(cfg, progress=False)
    assert resumed.step == 10
    resumed.fit()
    a = read_metrics(straight_cfg.out_dir / "metrics.jsonl", "train")
    b = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in b] == list(range(1, 21)), "each step exactly once"
    assert [r["loss"] for r in a] == [r["loss"] for r in b], "the losses of an uninterrupted run"
    (event,) = [e for e in read_metrics(cfg.out_dir / "metrics.jsonl", "event") if e["event"] == "resume"]
    assert event["checkpoint"].endswith("step_00000010")
    (skipped,) = event["skipped"]
    assert skipped["checkpoint"] == str(newest) and "bytes" in skipped["reason"]


def test_no_readable_checkpoint_left_is_one_line_and_exit_1(corpus_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run = _run_yaml(corpus_dir, run_dir, train={"steps": 20}, checkpoint={"every": 10, "keep": 2})
    assert main(["train", str(run), "--no-ray", "--no-progress"]) == 0
    for checkpoint in Checkpointer(run_dir / "checkpoints", 2).candidates():
        _truncate(_largest_file(checkpoint))
    capsys.readouterr()
    assert main(["train", str(run), "--no-ray", "--no-progress", "--set", "train.steps=30"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytrain: error: no readable checkpoint to resume from")
    assert "step_00000020: " in err[0] and "step_00000010: " in err[0] and "fix:" in err[0]


# ------------------------------------------------------------------ refused before Ray starts


def test_resume_that_changes_the_model_is_refused_before_ray(corpus_dir, tmp_path, capsys, no_ray):
    run_dir = tmp_path / "run"
    run = _run_yaml(corpus_dir, run_dir, train={"steps": 10}, checkpoint={"every": 10})
    assert main(["train", str(run), "--no-ray", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", str(run), "--no-progress", "--set", "model.dim=64", "--set", "train.steps=20"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "model.dim=64" in line and "model.dim=32" in line and "step_00000010" in line
    assert "fix:" in line and "checkpoint.resume=none" in line
    # What PBT and users change on purpose stays allowed: optimizer, schedule, steps, engine, world size.
    cfg = parse_config(
        tiny_raw(
            corpus_dir,
            run_dir,
            optimizer={"lr": 1e-4},
            parallel={"engine": "ddp"},
            scaling={"num_workers": 2},
            train={"steps": 20},
        )
    )
    launcher.check_run(cfg)
    # ... and --no-ray (and torchrun) refuse the same change where the Trainer restores.
    assert main(["train", str(run), "--no-ray", "--no-progress", "--set", "data.seq_len=16"]) == 2
    assert "data.seq_len=16" in capsys.readouterr().err


def test_bad_callback_is_refused_before_ray_and_in_the_worker(corpus_dir, tmp_path, capsys, no_ray):
    run = _run_yaml(corpus_dir, tmp_path / "run")
    assert main(["train", str(run), "--no-progress", "--callback", "nosuchmod.hooks:Foo"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "nosuchmod" in line and "fix:" in line
    # Inside a worker (a module the driver had but a node lacks) it is a ConfigError: FAILED.json, no retry.
    with pytest.raises(ConfigError, match="nosuchmod"):
        load_callback("nosuchmod.hooks:Foo")
    with pytest.raises(ConfigError, match="NoSuchName"):
        load_callback("tests.ray.hooks:NoSuchName")


def test_world_size_a_local_ray_cannot_hold_is_refused_before_ray(corpus_dir, tmp_path, capsys, no_ray):
    workers = 4 * (os.cpu_count() or 1)
    run = _run_yaml(
        corpus_dir,
        tmp_path / "run",
        parallel={"engine": "ddp"},
        train={"global_batch_size": workers, "micro_batch_size": 1},
    )
    assert main(["train", str(run), "--no-progress", "--set", f"scaling.num_workers={workers}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{workers} workers" in line and f"{os.cpu_count()} CPUs" in line and "fix:" in line


# ------------------------------------------------------------------------------- one writer


def _raytrain(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "raytrain_ext.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over(corpus_dir, tmp_path):
    run_dir = tmp_path / "run"
    run = _run_yaml(corpus_dir, run_dir, train={"steps": 10}, checkpoint={"every": 5})
    with RunDirLock(run_dir):  # another process's lock (flock is per open file, so this one counts too)
        out = _raytrain("train", str(run), "--no-ray", "--no-progress")
        assert out.returncode == 2, out.stderr[-2000:]
        (line,) = out.stderr.strip().splitlines()
        assert f"pid {os.getpid()}" in line and "in use by another run" in line and "fix:" in line
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()

    # A holder killed without releasing leaves its name in the file but no flock: the next run takes over.
    (run_dir / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 2**22 + 1, "since": 0}))
    out = _raytrain("train", str(run), "--no-ray", "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl", "train")] == list(range(1, 11))
    assert RunDirLock(run_dir).holder() is None, "released at the end"
