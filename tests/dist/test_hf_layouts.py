"""Hugging Face in and out across layouts (issue 14): a model saved by transformers, imported with
model.init_from on 2 gloo processes (FSDP, pp=2, FSDP x ep=2), gives the first loss one process gives;
each rank reads only its part of the weights (the bytes read over all ranks add up to the model once);
DDP's ranks each read it all; the checkpoints those layouts write export on one process to exactly the weights the ranks held; and
the deepspeed engine's checkpoints (ZeRO-2 and ZeRO-3) export to the weights DeepSpeed trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_raw
from tests.dist.harness import run_ranks
from trainers.config import parse_config
from trainers.hf.export import export
from trainers.hf.format import expert_index, hf_names
from trainers.hf.pretrained import PretrainedWeights, clean_fqn
from trainers.trainer import Trainer

transformers = pytest.importorskip("transformers")  # the `hf` extra

pytestmark = pytest.mark.dist

TRAIN = {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2, "eval_every": 0, "tensorboard": False}
LAYOUTS = {  # name: (model kind, parallel section), each on 2 processes
    "ddp": ("dense", {"engine": "ddp"}),  # replicated: each rank reads the whole model
    "fsdp": ("dense", {"engine": "fsdp", "zero_stage": 3}),
    "pp2": ("dense", {"engine": "fsdp", "pp": 2}),
    "fsdp-ep2": ("moe", {"engine": "fsdp", "ep": 2}),
}


def _save_hf(kind: str, folder: Path) -> int:
    """A tiny Llama/Mixtral with random weights, saved by transformers; returns its bytes of weights."""
    torch.manual_seed(3)
    shape = dict(vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    if kind == "moe":
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
        )
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _raw(corpus: Path, run_dir: Path, pretrained: Path, parallel: dict | None = None) -> dict:
    raw = tiny_raw(corpus, run_dir, train=TRAIN, schedule={"name": "constant"}, parallel=parallel or {})
    raw["model"] = {"init_from": str(pretrained)}
    return raw


def _first_step(rank: int, world: int, raw: dict) -> dict:
    """One step from the pretrained weights, then a checkpoint; returns the loss, the bytes of weights
    this rank read, and the whole tensors of the parameters this rank holds (gathered over its mesh)."""
    from torch.distributed.tensor import DTensor

    import trainers.trainer as trainer_module

    read = []
    load = trainer_module.load_pretrained
    trainer_module.load_pretrained = lambda model, folder: read.append(load(model, folder))
    try:
        trainer = Trainer(parse_config(raw), progress=False)
    finally:
        trainer_module.load_pretrained = load
    held = {
        clean_fqn(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in trainer.model.named_parameters()
    }  # before the step: what was loaded
    loss = trainer.train_step()["loss"]
    trainer.save()
    after = {
        clean_fqn(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in trainer.model.named_parameters()
    }
    return {"loss": loss, "read": sum(read), "loaded": held, "trained": after}


def _hf_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters under their HF names (stacked experts split)."""
    out = {}
    for fqn, value in state.items():
        if expert_index(fqn) is None:
            out[hf_names(fqn)[0]] = value
        else:
            out.update(dict(zip(hf_names(fqn, value.shape[0]), value)))
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    root = tmp_path_factory.mktemp("pretrained")
    return {kind: (root / kind, _save_hf(kind, root / kind)) for kind in ("dense", "moe")}


@pytest.mark.parametrize("name", LAYOUTS)
def test_import_on_two_processes_gives_one_process_first_loss(name, pretrained, corpus_dir, tmp_path):
    kind, parallel = LAYOUTS[name]
    folder, model_bytes = pretrained[kind]
    reference = Trainer(parse_config(_raw(corpus_dir, tmp_path / "one", folder)), progress=False)
    ref_loss = reference.train_step()["loss"]

    ranks = run_ranks(_first_step, 2, _raw(corpus_dir, tmp_path / "two", folder, parallel))
    for r in ranks:
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=0), (name, r["loss"], ref_loss)
    if parallel["engine"] == "ddp":
        assert [r["read"] for r in ranks] == [model_bytes] * 2
    else:  # each rank read its shard (fsdp, ep) or its stage (pp) only: together, the model exactly once
        assert sum(r["read"] for r in ranks) == model_bytes and all(r["read"] < model_bytes for r in ranks)
    original = {n: PretrainedWeights(folder).read(n) for n in PretrainedWeights(folder).weight_map}
    loaded = {k: v for r in ranks for k, v in _hf_tensors(r["loaded"]).items()}
    assert loaded.keys() == original.keys() and all(torch.equal(loaded[n], original[n]) for n in original)

    # that layout's checkpoint, exported on this one process: the weights the ranks held after the step
    export(tmp_path / "two", tmp_path / "hf")
    exported = PretrainedWeights(tmp_path / "hf")
    trained = {k: v for r in ranks for k, v in _hf_tensors(r["trained"]).items()}
    assert set(exported.weight_map) == set(trained)
    for name_, value in trained.items():
        assert torch.equal(exported.read(name_), value), name_


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpoint_exports_the_weights_it_trained(stage, corpus_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # importing deepspeed sets it; undone after
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's ZeRO-3 reads it even on one process
    import deepspeed

    raw = tiny_raw(corpus_dir, tmp_path / "run", train=TRAIN, schedule={"name": "constant"},
                   parallel={"engine": "deepspeed", "zero_stage": stage},
                   memory={"activation_checkpointing": "every"})  # fmt: skip
    trainer = Trainer(parse_config(raw), progress=False)
    try:
        trainer.fit()
        params = list(trainer.engine.ds.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
            weights = {clean_fqn(n): p.detach().float().clone() for n, p in params}
    finally:
        trainer.engine.close()
    export(tmp_path / "run", tmp_path / "hf")
    exported = PretrainedWeights(tmp_path / "hf")
    expected = _hf_tensors(weights)
    assert set(exported.weight_map) == set(expected)
    for name, value in expected.items():
        assert torch.equal(exported.read(name), value), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_run_from_pretrained_exports_it_bit_for_bit(stage, pretrained, corpus_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    folder, _ = pretrained["dense"]
    raw = _raw(corpus_dir, tmp_path / "run", folder, {"engine": "deepspeed", "zero_stage": stage})
    trainer = Trainer(parse_config(raw), progress=False)
    try:
        trainer.save()  # 0 steps: DeepSpeed's partitions hold the imported weights
    finally:
        trainer.engine.close()
    export(tmp_path / "run", tmp_path / "hf")
    original, back = PretrainedWeights(folder), PretrainedWeights(tmp_path / "hf")
    assert set(back.weight_map) == set(original.weight_map)
    for name in original.weight_map:
        assert torch.equal(back.read(name), original.read(name)), name
