"""Search spaces: parsing, bounds-respecting explore, categorical neighbours; experiment config errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from search.config import load_experiment
from search.space import Choice, Fixed, IntRange, Range, parse_space
from trainers._base import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SPACE = {
    "optimizer.lr": {"loguniform": ["1e-4", 1e-2]},  # a YAML `1e-4` arrives as a string
    "optimizer.weight_decay": {"uniform": [0.0, 0.2]},
    "train.micro_batch_size": {"int": [1, 4]},
    "schedule.name": ["constant", "warmup_cosine", "warmup_linear"],
    "optimizer.grad_clip": 1.0,
}


def test_parse_each_kind():
    space = parse_space(SPACE)
    assert space["optimizer.lr"] == Range(1e-4, 1e-2, log=True)
    assert space["optimizer.weight_decay"] == Range(0.0, 0.2)
    assert space["train.micro_batch_size"] == IntRange(1, 4)
    assert space["schedule.name"] == Choice(("constant", "warmup_cosine", "warmup_linear"))
    assert space["optimizer.grad_clip"] == Fixed(1.0)
    assert set(space.mutable) == set(SPACE) - {"optimizer.grad_clip"}


def test_samples_lie_inside_and_log_ranges_spread_over_decades():
    space, rng = parse_space(SPACE), random.Random(0)
    samples = [space.sample(rng) for _ in range(2000)]
    for s in samples:
        assert all(space.contains(k, v) for k, v in s.items()), s
    lrs = [s["optimizer.lr"] for s in samples]
    below_1e3 = sum(lr < 1e-3 for lr in lrs) / len(lrs)
    assert 0.45 < below_1e3 < 0.55  # log-uniform: half the mass in each decade


@pytest.mark.parametrize("resample", [0.0, 0.25, 1.0])
def test_explore_never_leaves_the_bounds(resample):
    """Ray's default multiplies by 1.2/0.8 without clipping (ray #5035); ours stays inside, even after
    many explore steps in a row from values sitting on the bounds."""
    space, rng = parse_space(SPACE), random.Random(1)
    edges = [
        {"optimizer.lr": 1e-2, "optimizer.weight_decay": 0.2, "train.micro_batch_size": 4},
        {"optimizer.lr": 1e-4, "optimizer.weight_decay": 0.0, "train.micro_batch_size": 1},
    ]
    for start in edges:
        config = {**start, "schedule.name": "constant", "optimizer.grad_clip": 1.0}
        for _ in range(300):
            config, ops = space.explore(config, rng, resample_probability=resample, factors=(1.2, 0.8))
            assert all(space.contains(k, v) for k, v in config.items()), (config, ops)
            assert isinstance(config["train.micro_batch_size"], int)
            assert config["optimizer.grad_clip"] == 1.0 and "optimizer.grad_clip" not in ops


def test_explore_multiplies_log_ranges_and_shifts_linear_ones_by_a_step_of_their_width():
    space = parse_space({"lr": {"loguniform": [1e-4, 1.0]}, "wd": {"uniform": [0.0, 0.5]}})
    seen = set()
    for seed in range(40):
        new, ops = space.explore({"lr": 0.1, "wd": 0.25}, random.Random(seed), resample_probability=0.0)
        seen.add((round(new["lr"], 9), round(new["wd"], 9)))
    # lr x 2 or x 0.5 (the default factors); wd +- 0.15 x its width of 0.5, whatever the lr's factor was
    assert {lr for lr, _ in seen} == {0.2, 0.05} and {wd for _, wd in seen} == {0.175, 0.325}
    assert len(seen) == 4  # the two moves are independent
    new, _ = space.explore({"lr": 0.1, "wd": 0.25}, random.Random(3), 0.0, factors=(1.2,), step=0.1)
    assert new["lr"] == pytest.approx(0.12) and new["wd"] in (pytest.approx(0.2), pytest.approx(0.3))


def test_explore_moves_a_value_off_its_bound():
    """A move past a bound is reflected: a weight decay at 0 moves up, never stays at 0 (before: the
    learning-rate rule, (factor - 1) x the width, clipped a decay at 0 to 0 under every factor below 1, and
    with factors 2/0.5 sent it from one bound to the other); the same for a log range and an int."""
    space = parse_space({"lr": {"loguniform": [1e-4, 1e-2]}, "wd": {"uniform": [0.0, 0.2]}, "n": {"int": [1, 8]}})
    for seed in range(50):
        rng = random.Random(seed)
        low, _ = space.explore({"lr": 1e-4, "wd": 0.0, "n": 1}, rng, 0.0)
        high, _ = space.explore({"lr": 1e-2, "wd": 0.2, "n": 8}, rng, 0.0)
        assert low["wd"] == pytest.approx(0.03) and high["wd"] == pytest.approx(0.17)
        assert low["lr"] == pytest.approx(2e-4) and high["lr"] == pytest.approx(5e-3)
        assert (low["n"], high["n"]) == (2, 7)
    near, _ = space.explore({"lr": 8e-3, "wd": 0.19, "n": 7}, random.Random(0), 0.0, factors=(2.0,), step=0.15)
    assert near["lr"] == pytest.approx(1e-2 ** 2 / 1.6e-2)  # 1.6e-2 folded back at the bound 1e-2: 6.25e-3
    assert near["wd"] in (pytest.approx(0.16), pytest.approx(0.18))  # 0.19 - 0.03, or 0.22 folded to 0.18


def test_small_integers_still_move():
    space = parse_space({"a": {"int": [1, 8]}, "b": {"logint": [1, 64]}})
    for seed in range(20):
        new, _ = space.explore({"a": 2, "b": 2}, random.Random(seed), 0.0, factors=(1.2, 0.8))
        assert new["a"] in (1, 3)  # +- max(1, round(0.15 x 7))
        assert new["b"] in (1, 3)  # 2 x 1.2 and 2 x 0.8 round back to 2: one step, in the factor's direction
    # a log int at a bound is reflected on its own scale: 64 x 2 -> 32 and 1 x 0.5 -> 2, not the far bound
    top, _ = space.explore({"a": 8, "b": 64}, random.Random(0), 0.0, factors=(2.0,))
    bottom, _ = space.explore({"a": 1, "b": 1}, random.Random(0), 0.0, factors=(0.5,))
    assert (top["b"], bottom["b"]) == (32, 2) and top["a"] == 7 and bottom["a"] == 2


def test_categorical_moves_to_a_neighbour_only():
    space = parse_space({"k": ["a", "b", "c", "d"]})
    moves = set()
    for seed in range(100):
        for start in "abcd":
            new, op = space.explore({"k": start}, random.Random(seed), resample_probability=0.0)
            moves.add((start, new["k"]))
            assert op["k"].startswith("shift")
    assert moves == {("a", "b"), ("b", "a"), ("b", "c"), ("c", "b"), ("c", "d"), ("d", "c")}


def test_explore_is_a_pure_function_of_the_rng():
    space = parse_space(SPACE)
    config = space.sample(random.Random(5))
    assert space.explore(config, random.Random(9)) == space.explore(config, random.Random(9))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"x": {"normal": [0, 1]}}, "space.x: unknown distribution (normal)"),
        ({"x": {"uniform": [1, 0]}}, "space.x: uniform bounds [1.0, 0.0] are not low < high"),
        ({"x": {"uniform": [0, "a"]}}, "space.x: uniform bounds [0, 'a'] are not numbers"),
        ({"x": {"uniform": [0]}}, "space.x: uniform takes [low, high]"),
        ({"x": {"loguniform": [0, 1]}}, "space.x: loguniform needs low > 0"),
        ({"x": {"int": [1.5, 3]}}, "space.x: int bounds must be integers"),
        ({"x": []}, "space.x: a categorical parameter needs a non-empty list"),
        ({"x": [1, 2, 1]}, "space.x: the list [1, 2, 1] repeats a value"),
        ({}, "space must map run-config keys to ranges"),
    ],
)
def test_space_errors_are_one_line(raw, message):
    with pytest.raises(ConfigError) as e:
        parse_space(raw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert "fix:" in str(e.value)


# ------------------------------------------------------------------------------------ experiment YAML


def _experiment(tmp_path: Path, corpus: Path, **changes) -> Path:
    raw = {
        "name": "exp",
        "base": str(EXAMPLES / "tiny-dense.yaml"),
        "overrides": {"data.path": str(corpus)},
        "space": {
            "optimizer.lr": {"loguniform": [1e-4, 1e-2]},
            "schedule.name": ["constant", "warmup_linear"],
        },
        "scheduler": {"name": "pbt", "interval": 10},
        "population": 2,
        "budget": {"steps": 40},
        "storage": str(tmp_path / "runs"),
    }
    for key, value in changes.items():
        node, *path = key.split("__")
        target = raw
        for part in [node, *path][:-1]:
            target = target.setdefault(part, {})
        target[[node, *path][-1]] = value
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_experiment_builds_each_members_run(tmp_path, corpus_dir):
    exp = load_experiment(_experiment(tmp_path, corpus_dir, initial=[{"optimizer.lr": 1e-3}]))
    members = exp.members()
    assert members[0]["optimizer.lr"] == 1e-3 and len(members) == 2
    cfg = exp.run_config(members[1], run_dir=str(tmp_path / "r"))
    assert cfg.optimizer.lr == members[1]["optimizer.lr"]
    assert (cfg.train.steps, cfg.train.eval_every, cfg.checkpoint.every) == (40, 10, 10)
    assert Path(cfg.data.path).is_absolute()
    assert exp.members() == members  # seeded


def test_relative_paths_are_fixed_where_the_driver_runs(tmp_path, corpus_dir, monkeypatch):
    # Tune runs each trial in its own working directory: every path a trial uses must be absolute already.
    path = _experiment(tmp_path, corpus_dir, storage="runs/tune", base="base/tiny.yaml")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "tiny.yaml").write_text((EXAMPLES / "tiny-dense.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    exp = load_experiment(path)
    cfg = exp.run_config(exp.members()[0], run_dir=str(exp.exp_dir / "r"))
    monkeypatch.chdir(tmp_path / "base")  # as in a trial actor
    assert exp.exp_dir == tmp_path / "runs" / "tune" / "exp"
    assert exp.base == tmp_path / "base" / "tiny.yaml"
    assert exp.run_config(exp.members()[0], run_dir=str(exp.exp_dir / "r")) == cfg


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scheduler__name": "bohb"}, "scheduler.name="),
        ({"scheduler__grace_period": 5}, "grace_period applies to asha only, not pbt"),
        ({"populaton": 3}, "unknown key 'populaton'; fix: did you mean 'population'?"),
        (
            {"space__model.dim": {"int": [32, 64]}},
            "space.model.dim: pbt changes hyperparameters during a run",
        ),
        ({"space__optimizer.name": ["adam", "adamw"]}, "space.optimizer.name: pbt changes hyperparameters"),
        ({"space__train.steps": 10}, "space.train.steps is set by the tune driver"),
        ({"space__scaling.num_workers": 2}, "space.scaling.num_workers is set by the tune driver"),
        (
            {"space__optimizer.lrr": 0.1},
            "space.optimizer.lrr: the run at optimizer.lrr=0.1 is invalid: unknown key 'optimizer.lrr'",
        ),
        (
            {"space__optimizer.lr": {"uniform": [-1, 1]}},
            "space.optimizer.lr: the run at optimizer.lr=-1.0 is invalid: optimizer.lr=-1.0",
        ),
        ({"initial": [{"optimizer.lr": 1.0}]}, "initial[0].optimizer.lr=1.0 lies outside space.optimizer.lr"),
        ({"initial": [{}, {}, {}]}, "initial lists 3 members but population=2"),
        ({"base": "nowhere.yaml"}, "nowhere.yaml: run YAML not found"),
        ({"overrides__data.path": "/nonexistent"}, "data.path=/nonexistent: no manifest.json there"),
        # degenerate schedules: nothing to search within the budget
        ({"scheduler__interval": 0}, "scheduler.interval=0"),
        (
            {"scheduler__interval": 50},
            "scheduler.interval=50 is larger than budget.steps=40: a trial would report only at its end; "
            "fix: set scheduler.interval <= 40 or raise budget.steps",
        ),
        (
            {"budget": {}, "scheduler__interval": 100_000},
            "scheduler.interval=100000 is larger than the base run's train.steps=",
        ),
        ({"budget": {}, "overrides__train.steps": "many"}, "train.steps='many' is not a positive integer"),
        ({"population": 1}, "population=1: pbt compares trials with each other; fix: set population >= 2"),
        (
            {"scheduler__interval": 40},  # the default burn-in, half of the 40 steps, is named with it
            "scheduler.interval=40 and burn_in=50% leave pbt no decision before the end of budget.steps=40",
        ),
        ({"scheduler__burn_in": "half"}, "scheduler.burn_in='half' is neither a step count nor a share of the budget; fix:"),
        (
            {"scheduler__burn_in": 35},
            "scheduler.interval=10 and burn_in=35 leave pbt no decision before the end of budget.steps=40 "
            "(the first would be at step 40)",
        ),
        (
            {"scheduler": {"name": "asha", "interval": 10, "grace_period": 40}},
            "scheduler.grace_period=40 (default: interval) is not below budget.steps=40: asha would stop no",
        ),
    ],
)
def test_experiment_errors_are_one_line(tmp_path, corpus_dir, changes, message):
    with pytest.raises(ConfigError) as e:
        load_experiment(_experiment(tmp_path, corpus_dir, **changes))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "fix:" in str(e.value), str(e.value)


def test_set_overrides_one_space_entry(tmp_path, corpus_dir):
    path = _experiment(tmp_path, corpus_dir)
    exp = load_experiment(
        path,
        [
            "space.optimizer.lr={loguniform: [1e-3, 1e-2]}",  # a range (replaced)
            "space.optimizer.weight_decay=[0.0, 0.1]",  # a list of choices (added)
            "space.optimizer.grad_clip=0.5",  # a fixed value (added)
        ],
    )
    space = exp.search_space
    assert space["optimizer.lr"] == Range(1e-3, 1e-2, log=True)
    assert space["optimizer.weight_decay"] == Choice((0.0, 0.1))
    assert space["optimizer.grad_clip"] == Fixed(0.5)
    assert space["schedule.name"] == Choice(("constant", "warmup_linear"))  # untouched
    cfg = exp.run_config(exp.members()[0], run_dir=str(tmp_path / "r"))
    assert 1e-3 <= cfg.optimizer.lr <= 1e-2 and cfg.optimizer.grad_clip == 0.5


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("space.optimizer.lr={normal: [0, 1]}", "space.optimizer.lr: unknown distribution (normal)"),
        ("space.optimizer.lr={loguniform: [1e-2, 1e-3]}", "space.optimizer.lr: loguniform bounds"),
        ("space.optimizer.lr={loguniform: [1e-3", "--set space.optimizer.lr={loguniform: [1e-3: the value is not"),
        ("space.optimizer.lr=[]", "space.optimizer.lr: a categorical parameter needs a non-empty list"),
        ("space.optimizer.lrr=[0.1, 0.2]", "space.optimizer.lrr: the run at optimizer.lrr=0.1 is invalid"),
        ("space.=[1, 2]", "--set 'space.=[1, 2]': the key has an empty part"),
        ("space.train.steps=10", "space.train.steps is set by the tune driver"),
        # the distribution in the key: the line names the form that works
        (
            "space.optimizer.lr.loguniform=[1e-4, 1e-2]",
            "--set space.optimizer.lr.loguniform: a distribution is the value of its key, not part of the key; "
            "fix: --set 'space.optimizer.lr={loguniform: [1e-4, 1e-2]}'",
        ),
    ],
)
def test_a_bad_space_override_is_one_line(tmp_path, corpus_dir, item, message):
    with pytest.raises(ConfigError) as e:
        load_experiment(_experiment(tmp_path, corpus_dir), [item])
    line = str(e.value)
    assert line.startswith(message) and "fix:" in line and "\n" not in line, line


@pytest.mark.parametrize(
    "changes",
    [
        {"scheduler__burn_in": 30},  # pbt's first decision at step 30 of 40
        {"scheduler": {"name": "asha", "interval": 10, "grace_period": 30}},
        {"scheduler": {"name": "random", "interval": 40}, "population": 1},  # one report per trial is a search
    ],
    ids=["pbt-burn-in", "asha-grace", "random-one-report"],
)
def test_schedules_at_the_edge_of_the_budget_are_accepted(tmp_path, corpus_dir, changes):
    exp = load_experiment(_experiment(tmp_path, corpus_dir, **changes))
    assert exp.steps == 40


@pytest.mark.parametrize(
    ("text", "message"), [("model: [", "is not valid YAML"), ("- a list", "must hold a mapping")]
)
def test_base_run_yaml_errors_name_the_field(tmp_path, corpus_dir, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_experiment(_experiment(tmp_path, corpus_dir, base=str(tmp_path / "bad.yaml")))
    assert f"base={tmp_path / 'bad.yaml'} " in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_pb2_takes_continuous_ranges_only(tmp_path, corpus_dir):
    with pytest.raises(ConfigError, match="pb2 searches continuous ranges only"):
        load_experiment(_experiment(tmp_path, corpus_dir, scheduler={"name": "pb2", "interval": 10}))


def test_asha_may_search_the_model(tmp_path, corpus_dir):
    exp = load_experiment(
        _experiment(
            tmp_path,
            corpus_dir,
            scheduler={"name": "asha", "interval": 10},
            **{"space__model.n_layers": {"int": [1, 2]}},
        )
    )
    assert exp.search_space["model.n_layers"] == IntRange(1, 2)
