"""DeepSpeed is an optional extra (`raytrain-ext[deepspeed]`): without it, a run that asks for its engine is
refused in one line naming the key and the fix, exit 2, before anything starts; every other path (FSDP among
them) neither imports it nor asks for it. "Not installed" is simulated by `sys.modules["deepspeed"] = None`,
which makes both `importlib.util.find_spec` and `import deepspeed` see no DeepSpeed."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import trainers.launch
from raytrain_ext import launcher  # imports Ray, which sets RAY_CLIENT_MODE: at collection, not in a test
from raytrain_ext.cli import main
from search.config import load_experiment
from tests.conftest import tiny_raw
from trainers._base import ConfigError
from trainers.config import parse_config
from trainers.preflight import check_inputs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LINE = (
    "raytrain: error: parallel.engine=deepspeed needs DeepSpeed, which is not installed; "
    "fix: pip install 'raytrain-ext[deepspeed]' (or set parallel.engine=fsdp)"
)


@pytest.fixture
def no_deepspeed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)


def _fail_if_called(what: str):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} started although DeepSpeed is missing")

    return called


@pytest.mark.parametrize("ray", [False, True], ids=["no-ray", "ray"])
def test_deepspeed_engine_without_deepspeed_is_one_line_and_exit_2(
    ray, no_deepspeed, corpus_dir, tmp_path, monkeypatch, capsys
):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_raw(corpus_dir, tmp_path / "run", parallel={"engine": "deepspeed"})))
    monkeypatch.setattr(launcher, "ensure_ray", _fail_if_called("Ray"))
    monkeypatch.setattr(trainers.launch, "run_local", _fail_if_called("the local run"))
    assert main(["train", str(config), "--no-progress", *([] if ray else ["--no-ray"])]) == 2
    assert capsys.readouterr().err.splitlines() == [LINE]
    assert not (tmp_path / "run").exists()


def test_torchrun_ranks_get_the_same_line(no_deepspeed, tiny_config):
    """`python -m trainers train` builds the engine before the Trainer checks its inputs."""
    from trainers.parallel import build_engine

    with pytest.raises(ConfigError) as e:
        build_engine(tiny_config(parallel={"engine": "deepspeed"}))
    assert f"raytrain: error: {e.value}" == LINE


def test_an_fsdp_run_needs_no_deepspeed(no_deepspeed, tiny_config):
    cfg = tiny_config(parallel={"engine": "fsdp"}, scaling={"num_workers": 2})
    check_inputs(cfg)
    launcher.check_run(cfg)  # everything the driver checks before a worker starts


def test_a_search_that_may_choose_deepspeed_is_refused_naming_the_space_key(no_deepspeed, tmp_path, corpus_dir):
    raw = {
        "name": "exp",
        "base": str(EXAMPLES / "tiny-dense.yaml"),
        "overrides": {"data.path": str(corpus_dir)},
        "space": {"parallel.engine": ["fsdp", "deepspeed"]},
        "scheduler": {"name": "asha", "interval": 10},
        "population": 2,
        "budget": {"steps": 40},
        "storage": str(tmp_path / "runs"),
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_experiment(tmp_path / "exp.yaml")
    assert str(e.value) == (
        "space.parallel.engine: the run at parallel.engine='deepspeed' is invalid: " + LINE.split("error: ")[1]
    )


def test_exporting_a_zero_checkpoint_without_deepspeed_is_one_line(no_deepspeed, tmp_path):
    from trainers.checkpoint_files import DEEPSPEED_TAG
    from trainers.hf.export import _DeepSpeedReader

    (tmp_path / DEEPSPEED_TAG).mkdir()
    (tmp_path / DEEPSPEED_TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        _DeepSpeedReader(tmp_path)
    assert str(e.value) == (
        f"{tmp_path}: a DeepSpeed ZeRO checkpoint needs DeepSpeed, which is not installed; "
        "fix: pip install 'raytrain-ext[deepspeed]'"
    )


def test_no_module_imports_deepspeed_when_imported():
    """Every module of the three packages (the DeepSpeed engine's own included) imports with DeepSpeed
    absent: it is imported only where a DeepSpeed engine or checkpoint is used."""
    names = [
        m.name
        for package in ("trainers", "raytrain_ext", "search")
        for m in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}.")
        if not m.name.endswith("__main__")
    ]
    code = (
        "import importlib, sys\n"
        "sys.modules['deepspeed'] = None\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print('imported', len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]
    assert "trainers.parallel.deepspeed_engine" in names


def test_the_parallel_config_is_unchanged_by_a_missing_deepspeed(no_deepspeed):
    """The YAML alone still validates (a config may be written where DeepSpeed is not installed)."""
    cfg = parse_config({"data": {"path": "d"}, "parallel": {"engine": "deepspeed"}})
    assert cfg.parallel.engine == "deepspeed" and cfg.parallel.stage == 2
