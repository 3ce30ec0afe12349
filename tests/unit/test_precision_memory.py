"""Mixed precision and activation checkpointing inside the Trainer."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from trainers.metrics import read_metrics
from trainers.trainer import Trainer


def _losses(trainer: Trainer) -> list[float]:
    return [r["loss"] for r in read_metrics(trainer.run_dir / "metrics.jsonl", "train")]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_trains_close_to_fp32(tiny_config, dtype):
    ref = Trainer(tiny_config("fp32", train={"steps": 20}), progress=False)
    ref.fit()
    low = Trainer(tiny_config(dtype, precision={"dtype": dtype}, train={"steps": 20}), progress=False)
    low.fit()
    a, b = _losses(ref), _losses(low)
    assert all(math.isfinite(x) for x in b)
    assert b[-1] < b[0] - 0.5  # it learns
    assert max(abs(x - y) / x for x, y in zip(a, b)) < 0.05  # autocast noise, not a different run
    rows = read_metrics(low.run_dir / "metrics.jsonl", "train")
    assert ("loss_scale" in rows[-1]) == (dtype == "fp16")


def test_fp16_loss_scale_state_survives_resume(tiny_config):
    cfg = tiny_config(
        "fp16", precision={"dtype": "fp16", "init_scale": 1024.0, "growth_interval": 3}, train={"steps": 10}
    )
    first = Trainer(cfg, progress=False)
    first.fit()
    scale = first.engine.loss_scale
    assert scale != 1024.0  # it grew (or backed off): the scaler is live
    longer = cfg.model_copy(deep=True)
    longer.train.steps = 11
    assert Trainer(longer, progress=False).engine.loss_scale == scale


@pytest.mark.parametrize("ac", ["every", 2])
def test_activation_checkpointing_changes_memory_not_math(tiny_config, ac):
    plain = Trainer(tiny_config("plain", train={"steps": 6}), progress=False)
    plain.fit()
    ckpt = Trainer(
        tiny_config("ac", memory={"activation_checkpointing": ac}, train={"steps": 6}), progress=False
    )
    wrapped = sum(isinstance(m, CheckpointWrapper) for m in ckpt.model.layers.children())
    assert wrapped == (2 if ac == "every" else 1)
    ckpt.fit()
    assert _losses(plain) == _losses(ckpt)
    for p, q in zip(plain.model.parameters(), ckpt.model.parameters()):
        assert torch.equal(p, q)


@pytest.fixture
def matmul_precision():
    """Restores torch's process-wide TF32 settings after the test."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


@pytest.mark.parametrize(("tf32", "want"), [(True, "high"), (False, "highest")])
def test_precision_tf32_sets_fp32_matmuls_on_cuda_only(matmul_precision, tf32, want):
    from trainers.config import PrecisionConfig
    from trainers.precision import Precision

    torch.set_float32_matmul_precision("medium")  # neither: so that a CPU run is seen to leave it alone
    Precision(PrecisionConfig(tf32=tf32), torch.device("cpu"))
    assert torch.get_float32_matmul_precision() == "medium"
    Precision(PrecisionConfig(tf32=tf32), torch.device("cuda"))  # sets flags only: no GPU needed
    assert torch.get_float32_matmul_precision() == want and torch.backends.cudnn.allow_tf32 == tf32
    assert PrecisionConfig().tf32 is True  # the default
