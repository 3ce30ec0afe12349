"""The command line answers without torch or Ray: `--version`, `--help` and a YAML with a misspelt key are read
and refused by parsing and pydantic alone (issue 56). Checked from `sys.modules` of a fresh process, not from a
clock (bench/cli.py times them); a planted top-level `import torch` in the CLI module fails it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "numpy", "pyarrow", "transformers", "deepspeed")

# Runs `raytrain ARGS...` as the console script does, then prints the heavy packages it loaded and its exit code.
_RUN_CLI = """
import contextlib, io, json, sys
argv = json.loads(sys.argv[1])
out, err = io.StringIO(), io.StringIO()
code = None
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        from raytrain_ext.cli import main
        code = main(argv)
    except SystemExit as e:  # argparse's --version and --help exit
        code = e.code
heavy = sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"code": code, "heavy": heavy, "stdout": out.getvalue(), "stderr": err.getvalue()}))
"""


def run_cli(*argv: str, cwd: Path = ROOT) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, json.dumps(list(argv)), json.dumps(HEAVY)],
        capture_output=True, text=True, cwd=cwd, check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv, code, says",
    [
        (["--version"], 0, "raytrain-ext "),
        (["train", "--help"], 0, "--set KEY=VALUE"),
        (["tune", "--help"], 0, "--resume"),
        (["train", "examples/tiny-dense.yaml", "--set", "model.n_head=8"], 2, "did you mean 'model.n_heads'?"),
        (["tune", "examples/pbt-demo.yaml", "--set", "scheduler.nam=pbt"], 2, "did you mean 'scheduler.name'?"),
        (["tune", "examples/tiny-dense.yaml"], 2, "missing key 'base'"),
    ],
    ids=["version", "train-help", "tune-help", "train-misspelt-key", "tune-misspelt-key", "run-yaml-to-tune"],
)
def test_the_command_line_answers_without_torch_or_ray(argv, code, says):
    got = run_cli(*argv)
    assert got["code"] == code, got
    assert says in got["stdout"] + got["stderr"], got
    if code == 2:  # one clear line
        assert len(got["stderr"].strip().splitlines()) == 1, got["stderr"]
    assert got["heavy"] == [], f"`raytrain {' '.join(argv)}` imported {got['heavy']}"


@pytest.mark.parametrize(
    "sets, says",
    [
        (["scaling.num_workers=4"], "parallel.engine=none at world size 4"),
        (["scaling.num_workers=3", "parallel.engine=ddp", "train.global_batch_size=8", "train.micro_batch_size=4"],
         "train.global_batch_size=8"),
    ],
    ids=["engine-at-4-workers", "batch-over-3-workers"],
)
def test_a_layout_that_cannot_run_is_refused_without_torch_or_ray(sets, says, corpus_dir, tmp_path):
    """The checks of `launcher.train` (raytrain_ext/run_checks.py) answer before Ray's imports: the inputs on
    disk, the resume point (a committed checkpoint of the run is there, so its record is read) and every world
    size's layout."""
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 10}))
    (step / "COMMITTED").write_text("{}")
    args = ["--set", f"data.path={corpus_dir}", "--set", f"run_dir={run_dir}"]
    for item in sets:
        args += ["--set", item]
    got = run_cli("train", "examples/tiny-dense.yaml", *args)
    assert got["code"] == 2 and says in got["stderr"], got
    assert len(got["stderr"].strip().splitlines()) == 1, got["stderr"]
    assert got["heavy"] == [], f"the layout check imported {got['heavy']}"


def test_the_python_api_imports_without_torch_or_ray():
    code = (
        "import sys\n"
        "from raytrain_ext import train, RunResult\n"
        "from search import tune, ExperimentResult\n"
        "import trainers\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_planted_torch_import_in_the_cli_is_caught(tmp_path):
    """The check above can fail: a copy of the packages with `import torch` at the top of the CLI module."""
    for name in ("trainers", "search", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    planted = tmp_path / "raytrain_ext"
    planted.mkdir()
    for f in (ROOT / "raytrain_ext").glob("*.py"):
        text = f.read_text()
        if f.name == "cli.py":
            text = text.replace("import argparse\n", "import argparse\n\nimport torch  # noqa: F401\n", 1)
            assert "import torch  # noqa" in text
        (planted / f.name).write_text(text)
    got = run_cli("--version", cwd=tmp_path)
    assert got["code"] == 0
    assert "torch" in got["heavy"]


def test_bench_cli_writes_its_contract(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "bench" / "cli.py"), "--rounds", "5", "--no-floor", "--out",
                    str(tmp_path)], check=True, capture_output=True, cwd=ROOT)
    got = json.loads((tmp_path / "cli.json").read_text())
    for field in ("version_s", "help_s", "config_error_s", "tune_config_error_s"):
        assert len(got["runs_s"][field]) == 5 and got[field] == sorted(got["runs_s"][field])[2]
    assert got["answers"]["config_error_s"]["exit_code"] == 2
    assert "did you mean" in got["answers"]["tune_config_error_s"]["answer"]
    assert got["git_commit"] and got["loadavg_before"]
    assert (tmp_path / "cli.png").stat().st_size > 0
