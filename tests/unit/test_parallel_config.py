"""Bad parallel layouts and configs fail before training, with one line that names the field."""

from __future__ import annotations

import pytest

from trainers.config import ConfigError, parse_config
from trainers.parallel import ParallelLayout
from trainers.trainer import Trainer


def _message(excinfo: pytest.ExceptionInfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and "fix:" in msg
    return msg


def test_world_size_not_divisible_by_dp():
    with pytest.raises(ConfigError) as e:
        ParallelLayout.build(3, 0, dp=2)
    assert "dp=2 x pp=1 x tp=1 != world size 3" in _message(e)


def test_engine_none_with_two_processes(tiny_config):
    with pytest.raises(ConfigError) as e:
        ParallelLayout.of(tiny_config(), 2)  # what build_engine asks of the running process group
    assert "parallel.engine=none at world size 2" in _message(e)


@pytest.mark.parametrize(
    ("parallel", "field"),
    [
        ({"engine": "deepspeed", "zero_stage": 5}, "parallel.zero_stage=5"),
        ({"engine": "fsdp", "zero_stage": 1}, "parallel.zero_stage=1"),
        ({"engine": "ddp", "zero_stage": 2}, "parallel.zero_stage=2"),
        ({"engine": "ddp", "offload": "all"}, "parallel.offload=all"),
        ({"engine": "none", "offload": "optimizer"}, "parallel.offload=optimizer"),
        ({"engine": "fsdp", "offload": "optimizer"}, "parallel.offload=optimizer"),
        ({"engine": "ddp", "grad_accumulation": "unsharded"}, "parallel.grad_accumulation=unsharded"),
        ({"engine": "fsdp", "pp": 2, "grad_accumulation": "sharded"}, "parallel.grad_accumulation=sharded"),
    ],
)
def test_bad_parallel_config_names_the_field(parallel, field):
    with pytest.raises(ConfigError) as e:
        parse_config({"data": {"path": "d"}, "parallel": parallel})
    assert _message(e).startswith(field)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_sharded_engine_without_a_process_group_fails_before_training(tiny_config, engine):
    cfg = tiny_config(parallel={"engine": engine})
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, progress=False)
    assert f"parallel.engine={engine} needs a process group" in _message(e)
    assert not cfg.out_dir.exists(), "nothing written"
