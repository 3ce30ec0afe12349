"""Config: unknown keys with suggestions, cross-field checks, overrides, YAML round trip."""

from __future__ import annotations

import pytest
import yaml

from search.config import (
    load_experiment,  # imports ray, which sets RAY_CLIENT_MODE: at collection, not in a test
)
from trainers.config import ConfigError, RunConfig, apply_overrides, load_config, parse_config

BASE = {"data": {"path": "d"}}


def _err(raw: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_unknown_key_names_path_and_closest_key():
    assert (
        _err({**BASE, "model": {"n_head": 4}})
        == "unknown key 'model.n_head'; fix: did you mean 'model.n_heads'?"
    )
    assert "did you mean 'optimizer'" in _err({**BASE, "optimiser": {}})
    assert "model.moe.num_experts" in _err({**BASE, "model": {"moe": {"num_expert": 2}}})


def test_unknown_key_without_close_match_lists_valid_keys():
    msg = _err({**BASE, "checkpoint": {"zzz": 1}})
    assert "checkpoint.zzz" in msg and "every" in msg and "keep" in msg


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"model": {"dim": 100, "n_heads": 3}}, "model.n_heads"),
        ({"model": {"dim": 64, "n_heads": 4, "n_kv_heads": 3}}, "model.n_kv_heads"),
        ({"optimizer": {"lr": -1}}, "optimizer.lr"),
        ({"optimizer": {"name": "lion"}}, "optimizer.name"),
        ({"checkpoint": {"mode": "fast"}}, "checkpoint.mode"),
        ({"train": {"global_batch_size": 10, "micro_batch_size": 4}}, "train.global_batch_size"),
        ({"data": {"path": "d", "seq_len": 512}, "model": {"max_seq_len": 256}}, "data.seq_len"),
        ({"model": {"moe": {"num_experts": 2, "top_k": 3}}}, "model.moe.top_k"),
        ({"schedule": {"warmup_steps": 100}, "train": {"steps": 50}}, "schedule.warmup_steps"),
        ({"train": {"compile": True}, "parallel": {"engine": "deepspeed", "zero_stage": 3}}, "train.compile"),
    ],
)
def test_bad_values_name_the_field(raw, field):
    assert field in _err({**BASE, **raw})


def test_compile_is_refused_only_with_zero3_hooks():
    """ZeRO-3's per-submodule hooks shatter compiled blocks; DeepSpeed's other stages and FSDP2 compile whole."""
    assert "parallel.engine=fsdp" in _err({**BASE, "train": {"compile": True},
                                          "parallel": {"engine": "deepspeed", "zero_stage": 3}})
    for parallel in ({"engine": "deepspeed"}, {"engine": "deepspeed", "zero_stage": 2}, {"engine": "fsdp"}):
        assert parse_config({**BASE, "train": {"compile": True}, "parallel": parallel}).train.compile


def test_missing_section():
    assert _err({}).startswith("missing key 'data'")


def test_overrides_parse_yaml_values_and_create_sections():
    raw = apply_overrides(BASE, ["optimizer.lr=1e-3", "model.moe.num_experts=4", "train.tensorboard=false"])
    cfg = parse_config(raw)
    assert cfg.optimizer.lr == 1e-3 and cfg.model.moe.num_experts == 4 and cfg.train.tensorboard is False
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides(BASE, ["optimizer.lr"])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("optimizer.lr=[1e-3,", "--set optimizer.lr=[1e-3,: the value is not valid YAML"),
        ("optimizer.betas={0.9", "--set optimizer.betas={0.9: the value is not valid YAML"),
        ("optimizer..lr=1", "--set 'optimizer..lr=1': the key has an empty part"),
        ("=1", "--set '=1' is not KEY=VALUE"),
    ],
)
def test_bad_overrides_are_one_line(item, message):
    with pytest.raises(ConfigError) as e:
        apply_overrides(BASE, [item])
    assert str(e.value).startswith(message) and "fix:" in str(e.value) and "\n" not in str(e.value)


def test_flat_sections_take_the_rest_of_the_key_as_one_key():
    raw = {"space": {"optimizer.lr": 1.0}}
    out = apply_overrides(raw, ["space.optimizer.lr=[1, 2]", "space.schedule.name=constant", "a.b=1"], ("space",))
    assert out == {"space": {"optimizer.lr": [1, 2], "schedule.name": "constant"}, "a": {"b": 1}}
    assert raw == {"space": {"optimizer.lr": 1.0}}  # not changed in place


def test_activation_checkpointing_yaml_words():
    for value, every in [("off", 0), (False, 0), ("every", 1), (True, 1), (2, 2)]:
        cfg = parse_config({**BASE, "memory": {"activation_checkpointing": value}})
        assert cfg.memory.ac_every == every


def test_yaml_round_trip(tmp_path):
    cfg = parse_config({**BASE, "model": {"moe": {"num_experts": 4}}, "optimizer": {"betas": [0.8, 0.9]}})
    path = tmp_path / "run.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg
    assert isinstance(yaml.safe_load(path.read_text()), dict)


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_accumulation_keeps_the_global_batch():
    cfg = RunConfig.model_validate({**BASE, "train": {"global_batch_size": 32, "micro_batch_size": 4}})
    assert [cfg.train.accumulation(dp) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ConfigError, match="data-parallel size 3"):
        cfg.train.accumulation(3)


def test_examples_validate(corpus_dir):
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    runs = [p for p in examples if "pbt" not in p.name]  # *pbt*: experiment YAMLs (raytrain tune)
    assert runs and len(runs) < len(examples)
    for path in examples:
        if path.name == "finetune-pbt.yaml":
            continue  # needs the model it fine-tunes: tests/unit/test_examples.py makes it and validates this
        if path not in runs:
            # every member's run is validated, data included: point it at the test corpus (a clean
            # checkout has no data/ until `make demo` prepares it)
            load_experiment(path, [f"overrides.data.path={corpus_dir}"])
            continue
        cfg = load_config(path)
        assert cfg.model.vocab_size >= 257 and cfg.train.steps > 0
