"""`raytrain train` flags that set config sections: --mlflow, --wandb, --profile, --memory-snapshot."""

from __future__ import annotations

import pytest
import yaml

from raytrain_ext.cli import build_parser, main, train_config


@pytest.fixture
def run_yaml(tiny_config, tmp_path):
    path = tmp_path / "run.yaml"
    raw = yaml.safe_load(tiny_config().to_yaml())
    raw["tracking"] = {"mlflow": {"experiment": "from-yaml"}, "wandb": None}
    path.write_text(yaml.safe_dump(raw))
    return path


def _cfg(run_yaml, *flags):
    return train_config(build_parser().parse_args(["train", str(run_yaml), *flags]))


def test_no_flags_keep_the_yaml(run_yaml):
    cfg = _cfg(run_yaml)
    assert cfg.tracking.mlflow.experiment == "from-yaml" and cfg.tracking.mlflow.tracking_uri is None
    assert cfg.tracking.wandb is None and cfg.profile.start_step is None


def test_tracker_flags_turn_trackers_on_and_keep_the_yaml_settings(run_yaml):
    cfg = _cfg(run_yaml, "--mlflow", "http://127.0.0.1:5000", "--wandb")
    assert cfg.tracking.mlflow.tracking_uri == "http://127.0.0.1:5000"
    assert cfg.tracking.mlflow.experiment == "from-yaml"
    assert cfg.tracking.wandb.project == "raytrain" and cfg.tracking.wandb.mode is None
    cfg = _cfg(run_yaml, "--mlflow", "--wandb", "lm", "--set", "tracking.wandb.mode=offline")
    assert cfg.tracking.mlflow.tracking_uri is None, "--mlflow alone: the YAML's URI, or a local store"
    assert (cfg.tracking.wandb.project, cfg.tracking.wandb.mode) == ("lm", "offline")


def test_profile_flags(run_yaml):
    cfg = _cfg(run_yaml, "--profile", "3:2", "--memory-snapshot")
    assert (cfg.profile.start_step, cfg.profile.steps, cfg.profile.memory_snapshot) == (3, 2, True)


@pytest.mark.parametrize("flag", ["5", "a:b", "3:"])
def test_profile_flag_is_step_count(flag, run_yaml, capsys):
    assert main(["train", str(run_yaml), "--no-ray", "--profile", flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"raytrain: error: --profile {flag} is not STEP:COUNT; fix: e.g. --profile 10:3"


def test_a_tracking_uri_without_scheme_is_one_line(run_yaml, capsys):
    assert main(["train", str(run_yaml), "--no-ray", "--mlflow", "localhost"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tracking_uri=localhost has no scheme" in err
