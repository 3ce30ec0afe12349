"""The shipped examples learn: on the standard library's source, a shortened run of each already gets
its validation loss well below the unigram entropy (what a model that only knew byte frequencies gets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.config import load_config
from trainers.data.prepare import default_corpus, prepare_corpus
from trainers.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stdlib") / "data"
    prepare_corpus(default_corpus(), out, max_bytes=2_000_000, progress=False)
    return out


@pytest.mark.parametrize(("example", "steps"), [("tiny-dense.yaml", 150), ("tiny-moe.yaml", 120)])
def test_example_beats_unigram_entropy(stdlib_data, tmp_path, example, steps):
    cfg = load_config(
        EXAMPLES / example,
        [
            f"data.path={stdlib_data}",
            f"run_dir={tmp_path / 'run'}",
            f"train.steps={steps}",
            "train.tensorboard=false",
            "checkpoint.every=0",
        ],
    )
    result = Trainer(cfg, progress=False).fit()
    entropy = json.loads((stdlib_data / "manifest.json").read_text())["unigram_entropy_nats"]
    assert result.val_loss < 0.8 * entropy, (result.val_loss, entropy)
