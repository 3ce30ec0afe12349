"""`scaling.fault_tolerance: per_step`: what a run must be, each refusal one line with exit 2 before anything
starts (Ray, a worker, the local run), and the replica-group engine's averaging against one process's."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

import trainers.launch
from raytrain_ext import launcher  # imports Ray, which sets RAY_CLIENT_MODE: at collection, not in a test
from raytrain_ext.cli import main
from tests.conftest import tiny_raw
from trainers.config import parse_config
from trainers.fault_tolerance import check_fault_tolerance

FT = {"fault_tolerance": "per_step", "num_workers": 3}
GOOD = {"parallel": {"engine": "ddp"}, "scaling": FT, "train": {"global_batch_size": 24, "micro_batch_size": 4}}


def _fail_if_called(what: str):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} started although the input is bad")

    return called


GROUPS_OF_2 = {"parallel": {"engine": "fsdp"}, "scaling": {**FT, "num_workers": 4, "workers_per_group": 2}}
CASES = {  # sections over GOOD -> what the one line says
    "deepspeed": ({"parallel": {"engine": "deepspeed"}}, "parallel.engine=deepspeed"),
    "tp": ({"parallel": {"engine": "fsdp", "tp": 2}}, "tp 2"),
    "ddp-groups-of-2": ({"scaling": {**FT, "num_workers": 4, "workers_per_group": 2}},
                        "scaling.workers_per_group=2 with parallel.engine=ddp"),
    "part-of-a-group": ({**GROUPS_OF_2, "scaling": {**GROUPS_OF_2["scaling"], "num_workers": 5}},
                        "scaling.num_workers=5 with scaling.workers_per_group=2"),
    "one-group-of-2": ({**GROUPS_OF_2, "scaling": {**GROUPS_OF_2["scaling"], "num_workers": 2}},
                       "scaling.num_workers=4 or more"),
    "groups-without-per-step": ({"scaling": {"fault_tolerance": "none", "num_workers": 4, "workers_per_group": 2}},
                                "scaling.workers_per_group=2 without scaling.fault_tolerance=per_step"),
    "batch-over-group-workers": (GROUPS_OF_2, "over the 2 worker(s) of any 2 of the 2 groups; fix: a global batch that is a multiple of 16"),
    "elastic": ({"scaling": {"fault_tolerance": "per_step", "min_workers": 2, "max_workers": 3}},
                "scaling.min_workers/max_workers"),
    "one-group": ({"scaling": {**FT, "num_workers": 1}}, "scaling.num_workers=1"),
    "batch": ({"train": {"global_batch_size": 16, "micro_batch_size": 4}}, "multiple of 24"),
    "tracking": ({"tracking": {"mlflow": {}}}, "tracking with scaling.fault_tolerance=per_step"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_run_that_cannot_be_per_step_is_refused_in_one_line(case, corpus_dir, tmp_path, monkeypatch, capsys):
    sections, says = CASES[case]
    raw = tiny_raw(corpus_dir, tmp_path / "run", **GOOD)
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
        if name == "scaling" and "min_workers" in values:
            raw[name].pop("num_workers")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(launcher, "ensure_ray", _fail_if_called("Ray"))
    assert main(["train", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("raytrain: error: ") and says in err[0] and "fix:" in err[0], err


def test_a_good_run_passes_the_checks(tiny_config):
    check_fault_tolerance(tiny_config(**GOOD))
    check_fault_tolerance(tiny_config(**GROUPS_OF_2, train={"global_batch_size": 16, "micro_batch_size": 4}))


@pytest.mark.parametrize("how", ["--no-ray", "torchrun"])
def test_no_ray_and_torchrun_refuse_it(how, corpus_dir, tmp_path, monkeypatch, capsys):
    raw = tiny_raw(corpus_dir, tmp_path / "run", **GOOD)
    if how == "torchrun":  # run_local outside Ray: what `python -m trainers train` calls under torchrun
        with pytest.raises(ValueError, match="not torchrun or a single process; fix:"):
            trainers.launch.run_local(parse_config(raw), progress=False)
        return
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(trainers.launch, "run_local", _fail_if_called("the local run"))
    assert main(["train", str(config), "--no-ray", "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "not --no-ray" in line and "scaling.fault_tolerance=none" in line


def test_without_torchft_the_key_names_the_extra(tiny_config, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs torchft.*pip install 'raytrain-ext\[ft\]'"):
        check_fault_tolerance(tiny_config(**GOOD))


@pytest.mark.parametrize("workers,runs", [(1, "live"), (2, "live"), (2, "segments")])
def test_a_pbt_trial_takes_it_with_a_peer_for_each_group(corpus_dir, tmp_path, capsys, workers, runs):
    """A trial's workers come from the experiment's `resources.workers`, which the one line names; its groups
    take the trial's answers in one live run."""
    from search.config import load_experiment

    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(tiny_raw(corpus_dir, tmp_path / "run", **GOOD)))
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({
        "name": "e", "base": str(base), "storage": str(tmp_path / "exps"), "population": 2, "metric": "val_loss",
        "scheduler": {"name": "pbt", "interval": 10}, "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        "resources": {"workers": workers}, "trial_runs": runs,
    }))
    if (workers, runs) == (2, "live"):
        assert load_experiment(exp).per_step
        return
    assert main(["tune", str(exp)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    if runs == "segments":
        assert "trial_runs=segments with scaling.fault_tolerance=per_step" in line and "fix: trial_runs=live" in line
        return
    assert "resources.workers=1" in line and "one replica group has no peer" in line
    assert "fix: resources.workers=2" in line
