"""The shipped examples learn: on the standard library's source, a shortened run of each already gets
its validation loss well below the unigram entropy (what a model that only knew byte frequencies gets)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from search.config import load_experiment
from trainers.config import load_config
from trainers.data.prepare import default_corpus, prepare_corpus
from trainers.hf.pretrained import PretrainedWeights
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


def test_finetune_example_starts_from_the_model_transformers_saved(tmp_path):
    """examples/finetune-pbt.yaml as `make finetune-demo` runs it, without Ray: the script's model, data
    tokenized with its tokenizer.json, every member validated (init_from checks the folder and the
    vocabulary); a member's run starts from the saved weights and its fine-tune lowers the val loss."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("make_pretrained", EXAMPLES / "make_pretrained.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = script.make(tmp_path / "tiny-llama")
    data = tmp_path / "data"
    prepare_corpus(default_corpus(), data, tokenizer=str(model), max_bytes=1_000_000, progress=False)
    exp = load_experiment(
        EXAMPLES / "finetune-pbt.yaml",
        [f"overrides.model.init_from={model}", f"overrides.data.path={data}", f"storage={tmp_path / 'tune'}"],
    )
    member = {**exp.members()[0], "optimizer.lr": 1e-3}
    run = {"parallel.engine": "none", "train.steps": 40, "train.eval_every": 0, "checkpoint.every": 0}
    trainer = Trainer(exp.run_config(member, run_dir=str(tmp_path / "run"), **run), progress=False)
    saved = PretrainedWeights(model).read("model.embed_tokens.weight")
    assert torch.equal(trainer.model.embed_tokens.weight.detach(), saved)
    before = trainer.evaluate()
    assert trainer.fit().val_loss < before - 0.1, before
