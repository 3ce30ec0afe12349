"""Bad input: one line naming the field and the fix, a non-zero exit, and no saved checkpoint damaged.

Most cases run the real `raytrain` command in a subprocess against a run directory that already holds a
checkpoint, then check the checkpoint's files are byte-for-byte unchanged and no newer one appeared. Cases
refused before anything starts run `raytrain`'s main in this process, with Ray and the local run replaced
by functions that fail the test if they are called.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import trainers.launch
from raytrain_ext import launcher  # imports Ray, which sets RAY_CLIENT_MODE: at collection, not in a test
from raytrain_ext.cli import main
from tests.conftest import tiny_raw
from trainers.config import parse_config
from trainers.trainer import Trainer


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _raytrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "raytrain_ext.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    """A run dir with a saved checkpoint at step 6, and its YAML."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    raw = tiny_raw(corpus_dir, run_dir, train={"steps": 6}, checkpoint={"every": 6})
    Trainer(parse_config(raw), progress=False).fit()
    path = run_dir.parent / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, run_dir / "checkpoints"


def _error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("raytrain: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["model.n_head=4"], "model.n_head"),  # unknown key
        (["model.n_heads=3"], "model.n_heads"),  # heads not dividing width
        (["data.path=/nonexistent/corpus"], "data.path"),  # missing data path
        (["optimizer.lr=-0.001"], "optimizer.lr"),  # negative learning rate
        (["train.global_batch_size=7"], "train.global_batch_size"),  # batch not divisible
    ],
    ids=["unknown-key", "heads-width", "missing-data", "negative-lr", "batch"],
)
def test_config_errors_exit_2_name_the_field_and_keep_checkpoints(trained, overrides, field, tmp_path):
    config, ckpts = trained
    before = _digest(ckpts)
    args = ["train", str(config), "--no-progress", "--set", "train.steps=12"]
    for o in overrides:
        args += ["--set", o]
    proc = _raytrain(*args, cwd=tmp_path)
    assert proc.returncode == 2
    line = _error_line(proc)
    assert field in line and "fix:" in line
    assert _digest(ckpts) == before


def test_unknown_key_suggests_the_closest(trained, tmp_path):
    config, _ = trained
    line = _error_line(_raytrain("train", str(config), "--set", "model.n_head=4", cwd=tmp_path))
    assert "did you mean 'model.n_heads'" in line


def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.bin").write_bytes(b"\x00\x01")
    proc = _raytrain(
        "data",
        "prepare",
        "--input",
        str(empty),
        "--output",
        str(tmp_path / "out"),
        "--no-progress",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    line = _error_line(proc)
    assert "--input" in line and "fix:" in line
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param(["--no-ray"], id="no-ray"),
        # on a local Ray of its own (~65 s, beside the Ray tests): the slow tier. The default tier has the error's
        # way from a Ray worker to the driver (FAILED.json: tests/unit/test_launcher.py; a worker's error ending
        # the run with its cause: tests/ray/test_train_on_ray.py; a NaN member of a PBT population)
        pytest.param([], id="ray", marks=pytest.mark.slow),
    ],
)
def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(trained, tmp_path, launch):
    """SGD with an absurd learning rate overflows to inf/NaN within a few steps of resuming."""
    config, ckpts = trained
    before = _digest(ckpts)
    proc = _raytrain(
        "train",
        str(config),
        "--no-progress",
        *launch,
        "--set",
        "train.steps=30",
        "--set",
        "optimizer.name=sgd",
        "--set",
        "optimizer.lr=1e30",
        "--set",
        "optimizer.grad_clip=null",
        "--set",
        "optimizer.weight_decay=0",
        "--set",
        "checkpoint.every=0",
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    line = _error_line(proc)
    assert "train.max_bad_steps" in line and "optimizer.lr" in line and "step_00000006" in line
    # No checkpoint of the diverged state: the only complete one is still step 6, byte for byte.
    assert sorted(p.name for p in ckpts.iterdir() if (p / "COMMITTED").exists()) == ["step_00000006"]
    assert _digest(ckpts) == before


# ------------------------------------------------------------------ in this process: what starts nothing


def _fail_if_called(what: str):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} started although the input is bad")

    return called


BAD_DATA = {  # a prepared-data folder damaged after `raytrain data prepare` -> what the line names
    "truncated-manifest": (lambda d: (d / "manifest.json").write_text('{"format": "raytrain-tok'), "manifest.json"),
    "empty-manifest": (lambda d: (d / "manifest.json").write_text(""), "manifest.json"),
    "list-manifest": (lambda d: (d / "manifest.json").write_text("[]"), "manifest.json"),
    "shard-missing": (lambda d: (d / "train-00000.parquet").unlink(), "train-00000.parquet"),
}


@pytest.mark.parametrize("ray", [False, True], ids=["no-ray", "ray"])
@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_folder_exits_2_before_anything_starts(case, ray, corpus_dir, tmp_path, monkeypatch, capsys):
    damage, names = BAD_DATA[case]
    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    damage(data)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_raw(data, tmp_path / "run")))
    monkeypatch.setattr(launcher, "ensure_ray", _fail_if_called("Ray"))
    monkeypatch.setattr(trainers.launch, "run_local", _fail_if_called("the local run"))
    assert main(["train", str(config), "--no-progress", *([] if ray else ["--no-ray"])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrain: error: data.path={data}: "), err
    assert names in err[0] and f"fix: run `raytrain data prepare --input TEXT_DIR --output {data}`" in err[0]
    assert not (tmp_path / "run").exists()
