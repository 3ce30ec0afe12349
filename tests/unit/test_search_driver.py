"""Experiment sizing and the `raytrain tune` command line, without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raytrain_ext.cli import main
from search.config import load_experiment, load_saved, save
from search.driver import max_concurrent_trials
from trainers._base import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def demo(tmp_path, corpus_dir):
    def make(*overrides: str):
        return load_experiment(
            EXAMPLES / "pbt-demo.yaml",
            [f"overrides.data.path={corpus_dir}", f"storage={tmp_path}", *overrides],
        )

    return make


@pytest.mark.parametrize(
    ("cluster", "changes", "expected"),
    [
        ({"CPU": 2.0}, [], 4),  # the demo: 4 trials x 2 workers x 0.25 CPU
        ({"CPU": 2.0}, ["resources.cpus_per_worker=1"], 1),
        ({"CPU": 16.0}, ["resources.cpus_per_worker=1"], 4),  # never more than the population
        ({"CPU": 16.0}, ["resources.cpus_per_worker=1", "max_concurrent_trials=2"], 2),
        ({"CPU": 64.0, "GPU": 4.0}, ["resources.use_gpu=true", "resources.cpus_per_worker=1"], 2),
    ],
)
def test_concurrency_follows_what_the_train_runs_need(demo, cluster, changes, expected):
    assert max_concurrent_trials(demo(*changes), cluster) == expected


def test_a_trial_larger_than_the_cluster_is_an_error(demo):
    with pytest.raises(ConfigError, match=r"a trial needs 4 CPUs \(2 workers\) but the cluster has 2 CPUs"):
        max_concurrent_trials(demo("resources.cpus_per_worker=2"), {"CPU": 2.0})


def test_saved_experiment_reloads_from_its_folder(demo, tmp_path):
    exp = demo()
    save(exp)
    again = load_saved(exp.exp_dir)
    assert again.model_dump() == exp.model_dump() and again.base_raw == exp.base_raw


def test_tune_command_rejects_bad_input_before_ray(tmp_path, capsys):
    bad = tmp_path / "exp.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"base": str(EXAMPLES / "tiny-dense.yaml"), "space": {"optimizer.lr": [1]}, "populaton": 2}
        )
    )
    assert main(["tune", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "raytrain: error: unknown key 'populaton'; fix: did you mean 'population'?"
    assert main(["tune", "report", str(tmp_path)]) == 2
    assert "holds no experiment.json" in capsys.readouterr().err


# ------------------------------------------------------------------ experiment folder state (issue 12)


@pytest.fixture
def demo_cli(tmp_path, corpus_dir):
    """`raytrain tune` arguments for the demo in tmp_path, and its experiment."""
    args = [
        str(EXAMPLES / "pbt-demo.yaml"),
        "--set",
        f"overrides.data.path={corpus_dir}",
        "--set",
        f"storage={tmp_path}",
    ]
    return args, load_experiment(args[0], [args[2], args[4]])


def _saved_state(exp) -> Path:
    """An experiment folder as an interrupted `raytrain tune` leaves it: ours and Tune's files (Tune's are
    stand-ins: readable, as --resume checks them, but not a real Tune state)."""
    import ray.cloudpickle as pickle

    save(exp)
    d = exp.exp_dir
    (d / "tuner.pkl").write_bytes(pickle.dumps({"stand-in": "tuner"}))
    (d / "experiment_state-2026-01-01_00-00-00.json").write_text('{"trial_data": []}')
    (d / "callback-states-2026-01-01_00-00-00.pkl").write_bytes(pickle.dumps({0: {"stand-in": 1}}))
    return d


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(address=None):
        raise AssertionError("a refused command started Ray")

    monkeypatch.setattr("raytrain_ext.launcher.ensure_ray", refuse)


def test_a_refused_tune_command_writes_nothing(demo_cli, no_ray, capsys):
    args, exp = demo_cli
    folder = _saved_state(exp)
    before = _files(folder)
    # the same name again without --resume: experiment.json must keep describing the experiment that ran
    assert main(["tune", *args, "--set", "population=2"]) == 2
    assert "already holds an experiment; fix: pass --resume" in capsys.readouterr().err
    # --resume with another population than the one Tune restores
    assert main(["tune", *args, "--set", "population=3", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("raytrain: error: --resume: population is 3 here but the experiment in")
        and "\n" not in err
    )
    assert "ran with 4; fix: resume with the YAML and --set values it ran with" in err
    assert _files(folder) == before


DAMAGES = {"truncated": lambda b: b[: len(b) // 2], "empty": lambda b: b""}
STATE_FILES = [
    "experiment.json",
    "tuner.pkl",
    "experiment_state-2026-01-01_00-00-00.json",
    "callback-states-2026-01-01_00-00-00.pkl",
]


def test_the_stand_in_state_resumes(demo_cli):
    from search.driver import check_target

    _, exp = demo_cli
    _saved_state(exp)
    check_target(exp, resume=True)  # the control for the damaged cases below


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("name", STATE_FILES)
def test_resume_names_a_damaged_state_file(demo_cli, no_ray, capsys, name, damage):
    args, exp = demo_cli
    folder = _saved_state(exp)
    path = folder / name
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    before = _files(folder)
    assert main(["tune", *args, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raytrain: error: ") and "\n" not in err
    assert f"{path} is damaged" in err and "; fix: " in err
    assert _files(folder) == before


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_report_and_replay_name_a_damaged_state_file(demo_cli, no_ray, capsys, damage):
    _, exp = demo_cli
    folder = _saved_state(exp)
    config = folder / "experiment.json"
    config.write_bytes(DAMAGES[damage](config.read_bytes()))
    for command in (["report"], ["replay", "--trial", "best"]):
        assert main(["tune", *command, str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            f"{config} is damaged" in err
            and "fix: delete it and run `raytrain tune EXP.yaml --resume`" in err
        )
        assert "\n" not in err


def test_interrupted_tune_exits_130_with_how_to_go_on(demo_cli, monkeypatch, capsys):
    import search.driver
    from search.result import experiment_result

    args, exp = demo_cli

    def ctrl_c(address=None):  # while Ray starts: before Tune saved anything
        raise KeyboardInterrupt

    monkeypatch.setattr("raytrain_ext.launcher.ensure_ray", ctrl_c)
    assert main(["tune", *args]) == 130
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        "raytrain: interrupted before the experiment started; run again: raytrain tune "
        f"{args[0]} --set {args[2]} --set {args[4]}\n"
    )

    # Tune caught the Ctrl-C, stopped the trials and returned (before or after their first report)
    def interrupted(exp, resume, verbose, **more):
        return experiment_result(exp, False, [], [], None, [])

    monkeypatch.setattr("raytrain_ext.launcher.ensure_ray", lambda address=None: False)
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 2.0})  # sized before anything is written
    monkeypatch.setattr(search.driver, "run_experiment", interrupted)
    _saved_state(exp)
    assert main(["tune", *args, "--resume"]) == 130
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        f"raytrain: interrupted; resume with: raytrain tune {args[0]} --set {args[2]} --set {args[4]} --resume\n"
    )


def test_a_tune_with_a_failed_trial_exits_1_naming_it(demo_cli, monkeypatch, capsys):
    import search.driver
    from search.result import experiment_result

    args, exp = demo_cli

    def one_failed(exp, resume, verbose, **more):
        reports = [
            {"trial": "a_00000", "step": 10, "time": 0.5, "metric": 3.25, "hparams": {}, "failed": False},
            {"trial": "a_00001", "step": 10, "time": 1.0, "metric": float("inf"), "hparams": {}, "failed": True,
             "error": "RuntimeError: injected\nmore"},
        ]
        return experiment_result(exp, True, reports, [], "a_00000", ["a_00001", "a_00002"])

    monkeypatch.setattr("raytrain_ext.launcher.ensure_ray", lambda address=None: False)
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(search.driver, "run_experiment", one_failed)
    assert main(["tune", *args]) == 1
    out = capsys.readouterr()
    assert out.out.startswith("done: best trial a_00000, val_loss 3.2500;")
    assert out.err == (
        f"raytrain: error: 2 of {exp.population} trials ended failed, short of the budget: a_00001 (RuntimeError: "
        "injected); a_00002 (its trial failed: Tune's table above names the error file); fix: see the tracebacks "
        f"in {exp.exp_dir}/workers.log; `raytrain tune {args[0]} --set {args[2]} --set {args[4]} --resume` "
        "continues those Tune ended\n"
    )


def test_a_tune_refused_for_resources_leaves_no_experiment_behind(demo_cli, monkeypatch, capsys):
    # the cluster (a stand-in: Ray is not started) holds 2 CPUs; a trial of 2 workers x 2 CPUs does not fit
    args, exp = demo_cli
    monkeypatch.setattr("raytrain_ext.launcher.ensure_ray", lambda address=None: False)
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 2.0})
    assert main(["tune", *args, "--set", "resources.cpus_per_worker=2"]) == 2
    assert "a trial needs 4 CPUs (2 workers) but the cluster has 2 CPUs" in capsys.readouterr().err
    assert not exp.exp_dir.exists() or not list(exp.exp_dir.iterdir()), "nothing written: not even experiment.json"
