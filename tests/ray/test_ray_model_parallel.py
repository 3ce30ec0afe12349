"""`raytrain train` runs model-parallel layouts on Ray: pp=2, and tp=2 x dp=1 (tensor + sequence parallel),
on 2 Ray Train workers (CPU, gloo) train an MoE model (MoE blocks on both stages) with the losses, router
statistics and validation loss of one process, and the checkpoint is the usual DCP folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raytrain_ext.cli import main
from tests.conftest import tiny_raw
from trainers.checkpoint import Checkpointer
from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.trainer import Trainer

pytestmark = pytest.mark.ray

STEPS = 4
MODEL = {
    "vocab_size": 257,
    "dim": 32,
    "n_layers": 4,
    "n_heads": 2,
    "max_seq_len": 32,
    "moe": {"num_experts": 4, "top_k": 2, "every": 2},
}


def _raw(corpus: Path, run_dir: Path, **sections: dict) -> dict:
    train = {"steps": STEPS, "micro_batch_size": 2, "eval_every": 0, "eval_batches": 4}
    return tiny_raw(
        corpus,
        run_dir,
        model=MODEL,
        train=train,
        schedule={"warmup_steps": 1},
        checkpoint={"every": 2},
        **sections,
    )


def _train_rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl", "train")


LAYOUTS = {"pp2": {"pp": 2, "pipeline_schedule": "1f1b"}, "tp2": {"tp": 2}}


@pytest.mark.parametrize(
    "layout",
    [
        # the slow tier: ~30 s more; a mesh over Ray workers is the default tier's tp2 case, and the pipeline's
        # losses match one process's on gloo ranks (tests/dist)
        pytest.param("pp2", marks=pytest.mark.slow),
        "tp2",
    ],
)
def test_model_parallel_on_two_ray_workers_matches_one_process(layout, ray_local, corpus_dir, tmp_path):
    parallel = {"engine": "fsdp", **LAYOUTS[layout]}
    raw = _raw(corpus_dir, tmp_path / "ray", parallel=parallel, scaling={"num_workers": 2})
    run_yaml = tmp_path / "ray.yaml"
    run_yaml.write_text(yaml.safe_dump(raw))
    assert main(["train", str(run_yaml), "--no-progress"]) == 0

    Trainer(parse_config(_raw(corpus_dir, tmp_path / "one")), progress=False).fit()

    got, want = _train_rows(tmp_path / "ray"), _train_rows(tmp_path / "one")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "each step once, logged by rank 0"
    assert {r["world_size"] for r in got} == {2}
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key
    assert [r["moe_tokens_per_expert"] for r in got] == [r["moe_tokens_per_expert"] for r in want]
    val = [r["val_loss"] for r in read_metrics(tmp_path / "ray" / "metrics.jsonl", "eval")]
    assert val == pytest.approx(
        [r["val_loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl", "eval")]
    )
    checkpoints = tmp_path / "ray" / "checkpoints"
    assert Checkpointer(checkpoints, keep=3).latest() == checkpoints / f"step_{STEPS:08d}"
