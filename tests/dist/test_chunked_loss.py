"""The chunked loss under 2-process FSDP2: the first step's loss and every gradient equal those of the
whole-logits loss in the same layout within 1e-6 (fp32; one step, so both see the same weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_raw
from tests.dist.equivalence import merged, rows, train_each
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

MODELS = {
    "dense": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
    "moe": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32, "moe": {"num_experts": 4}},
}


def _raw(corpus: Path, run_dir: Path, model: dict, chunk: int) -> dict:
    train = {"steps": 1, "micro_batch_size": 2, "eval_every": 0, "eval_batches": 2}
    return tiny_raw(
        corpus,
        run_dir,
        model=model,
        parallel={"engine": "fsdp"},
        memory={"loss_chunk": chunk},
        train=train,
        schedule={"name": "constant"},
        checkpoint={"every": 0},
    )


def test_chunked_loss_under_fsdp_equals_the_whole_loss(corpus_dir, tmp_path):
    raws = {
        f"{name}-{chunk}": _raw(corpus_dir, tmp_path / f"{name}-{chunk}", model, chunk)
        for name, model in MODELS.items()
        for chunk in (0, 24)
    }
    grads = merged(run_ranks(train_each, 2, raws))
    for name in MODELS:
        whole, chunked = grads[f"{name}-0"][1], grads[f"{name}-24"][1]
        assert sorted(whole) == sorted(chunked)
        for fqn, g in whole.items():
            assert float((chunked[fqn] - g).norm() / g.norm().clamp_min(1e-30)) <= 1e-6, (name, fqn)
        for kind, key in (("train", "loss"), ("eval", "val_loss")):
            (a,), (b,) = rows(tmp_path / f"{name}-0", kind), rows(tmp_path / f"{name}-24", kind)
            assert b[key] == pytest.approx(a[key], rel=1e-6), (name, key)
