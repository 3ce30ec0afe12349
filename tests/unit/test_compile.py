"""`train.compile: true` compiles each block (inductor on CPU) after activation checkpointing: the same
losses as eager within fp32 noise, with full and selective checkpointing and the chunked loss, its chunks
eager (the CPU's) or compiled several a call (CUDA's, forced here) (slow tier: inductor compiles C++ for a
few tens of seconds)."""

from __future__ import annotations

import pytest
import torch

from trainers.metrics import read_metrics
from trainers.trainer import Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _inductor_loaded():
    """Inductor sets an environment variable for the process on its first compile: let that happen before
    the leak guard's snapshot (it is not the tests' doing)."""
    torch.compile(lambda x: x + 1)(torch.ones(1))


@pytest.mark.parametrize("ac,chunks", [("every", "eager"), ("selective", "eager"), ("selective", "compiled")])
def test_compiled_blocks_train_like_eager(ac, chunks, tiny_config, monkeypatch):
    from trainers import loss

    if chunks == "compiled":  # the compiled run's chunked loss as on CUDA: 2 chunks a compiled call
        monkeypatch.setattr(loss, "CHUNKS_PER_CALL", 2)
        monkeypatch.setattr(loss, "_COMPILED", {})
        monkeypatch.setattr(loss, "_compiles", lambda device: compiled)  # noqa: B023 (the run's own)
    losses = {}
    for compiled in (False, True):
        cfg = tiny_config(
            f"{ac}-{chunks}-{compiled}",
            train={"steps": 4, "eval_every": 0, "compile": compiled},
            memory={"activation_checkpointing": ac, "loss_chunk": 48},
            schedule={"warmup_steps": 1},
            checkpoint={"every": 0},
        )
        Trainer(cfg, progress=False).fit()
        losses[compiled] = [r["loss"] for r in read_metrics(cfg.out_dir / "metrics.jsonl", "train")]
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    if chunks == "compiled":  # it ran compiled (a failed compile would have fallen back to the eager chunks)
        assert loss._COMPILED["chunks"].compiled is not None
