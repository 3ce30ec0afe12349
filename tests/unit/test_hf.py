"""Hugging Face in and out, on one process (issue 14): an exported run loads in transformers' Auto classes
and computes our logits; a model saved by transformers comes back bit for bit through init_from and
export; the exported tokenizer encodes held-out text to our pipeline's ids; bad input is one line.
The multi-process imports (FSDP, pp=2) and DeepSpeed checkpoints are in tests/dist/test_hf_layouts.py."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra

from raytrain_ext.cli import main  # noqa: E402
from tests.conftest import tiny_raw  # noqa: E402
from trainers._base import ConfigError  # noqa: E402
from trainers.config import parse_config  # noqa: E402
from trainers.data.prepare import prepare_corpus  # noqa: E402
from trainers.data.tokenizer import load_tokenizer  # noqa: E402
from trainers.hf.export import export  # noqa: E402
from trainers.hf.pretrained import PretrainedWeights  # noqa: E402
from trainers.preflight import check_inputs  # noqa: E402
from trainers.trainer import Trainer  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
MOE = {"moe": {"num_experts": 4, "top_k": 2}}
TRAIN = {"steps": 3, "global_batch_size": 4, "micro_batch_size": 4, "eval_every": 0, "tensorboard": False}


def _raw(corpus: Path, run_dir: Path, **sections) -> dict:
    return tiny_raw(corpus, run_dir, train=TRAIN, schedule={"name": "constant", "warmup_steps": 0}, **sections)


def _hf_model(kind: str, vocab: int = 260, **extra):
    """A tiny Llama/Mixtral made by transformers with random weights (seeded), as a user's model would be."""
    torch.manual_seed(1)
    shape = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **extra,
    )  # fmt: skip
    if kind == "moe":
        return transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
        )
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    weights = PretrainedWeights(folder)
    return {name: weights.read(name) for name in weights.weight_map}


def _tokens(corpus: Path, n: int = 24) -> torch.Tensor:
    from trainers.data.dataset import TokenWindows

    inputs, _ = TokenWindows(corpus, "val", n).get([0])
    return inputs


# ------------------------------------------------------------------------------------ export (Done 1)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_exported_run_loads_in_transformers_and_computes_our_logits(kind, corpus_dir, tmp_path):
    cfg = parse_config(_raw(corpus_dir, tmp_path / "run", model=MOE if kind == "moe" else {}))
    trainer = Trainer(cfg, progress=False)
    trainer.fit()
    # a small shard limit: the weights are split over files listed by model.safetensors.index.json
    result = export(tmp_path / "run", tmp_path / "hf", max_shard_size=40_000)
    assert len(result.files) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == ("MixtralForCausalLM" if kind == "moe" else "LlamaForCausalLM")
    tokens = _tokens(corpus_dir)
    with torch.no_grad():
        ours = trainer.model.eval()(tokens)
        theirs = model.eval()(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    out = model.generate(tokens[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=256)
    assert out.shape == (1, 12) and torch.equal(out[:, :8], tokens[:, :8])
    # the same folder as bf16: our weights rounded to bf16, and config.json says so
    export(tmp_path / "run", tmp_path / "hf16", dtype="bf16")
    bf16 = _safetensors(tmp_path / "hf16")
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    embed = trainer.model.embed_tokens.weight.detach()
    assert torch.equal(bf16["model.embed_tokens.weight"], embed.to(torch.bfloat16))


# ------------------------------------------------------------------------------- round trip (Done 2)


@pytest.mark.parametrize("kind", ["dense", "dense-tied", "moe"])
def test_transformers_model_comes_back_bit_for_bit(kind, corpus_dir, tmp_path):
    hf = _hf_model("moe" if kind == "moe" else "dense", tie_word_embeddings=kind == "dense-tied")
    hf.save_pretrained(tmp_path / "pretrained")
    raw = _raw(corpus_dir, tmp_path / "run")
    raw["model"] = {"init_from": str(tmp_path / "pretrained")}  # every shape key comes from config.json
    cfg = parse_config(raw)
    assert (cfg.model.dim, cfg.model.n_kv_heads, cfg.model.ffn_dim) == (32, 2, 48)
    assert cfg.model.tie_embeddings == (kind == "dense-tied") and (cfg.model.moe is not None) == (kind == "moe")
    trainer = Trainer(cfg, progress=False)
    trainer.save()  # trained for 0 steps
    export(tmp_path / "run", tmp_path / "back")
    original, back = _safetensors(tmp_path / "pretrained"), _safetensors(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_a_resume_wins_over_init_from(corpus_dir, tmp_path):
    _hf_model("dense").save_pretrained(tmp_path / "pretrained")
    raw = _raw(corpus_dir, tmp_path / "run")
    raw["model"] = {"init_from": str(tmp_path / "pretrained")}
    first = Trainer(parse_config(raw), progress=False)
    first.fit()  # 3 steps from the pretrained weights
    trained = first.model.embed_tokens.weight.detach().clone()
    raw["train"]["steps"] = 4
    again = Trainer(parse_config(raw), progress=False)
    assert again.step == 3 and torch.equal(again.model.embed_tokens.weight, trained)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start = next(e for e in events if e.get("event") == "start")
    assert start["init_from"] == str(tmp_path / "pretrained")


# ------------------------------------------------------------------------------- tokenizer (Done 3)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_exported_tokenizer_encodes_held_out_text_as_our_pipeline(kind, tmp_path):
    train_files = [STDLIB / n for n in ("argparse.py", "textwrap.py", "difflib.py", "heapq.py")]
    data = tmp_path / "data"
    prepare_corpus(train_files, data, tokenizer=kind, vocab_size=600, val_fraction=0.25, progress=False)
    vocab = load_tokenizer(data).vocab_size
    run = _raw(data, tmp_path / "run", model={"vocab_size": vocab})
    Trainer(parse_config(run), progress=False).save()
    export(tmp_path / "run", tmp_path / "hf")

    held_out = (STDLIB / "bisect.py").read_text() + "\nnot <eos> a boundary, ünïcödé 😀\r\n\t"
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    theirs = auto(held_out)["input_ids"]
    assert theirs == load_tokenizer(data).encode_batch([held_out])[0].tolist()  # what prepare writes
    assert auto.eos_token_id == load_tokenizer(data).eos_id and auto.decode(theirs) == held_out
    # and the exported folder tokenizes new data for a fine-tune: prepare --tokenizer HF_DIR
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"{i}.txt").write_text(held_out)
    prepare_corpus([tmp_path / "text"], tmp_path / "d2", tokenizer=str(tmp_path / "hf"), val_fraction=0.5, progress=False)
    import pyarrow.parquet as pq

    docs = pq.read_table(tmp_path / "d2" / "train-00000.parquet")["tokens"].to_pylist()
    assert docs[0] == [*theirs, auto.eos_token_id]


# ---------------------------------------------------------------------------------------- bad input


def test_model_section_is_checked_against_config_json_one_line_per_mismatch(corpus_dir, tmp_path):
    _hf_model("dense").save_pretrained(tmp_path / "pretrained")
    raw = _raw(corpus_dir, tmp_path / "run")
    raw["model"] = {"init_from": str(tmp_path / "pretrained"), "dim": 64, "n_layers": 2, "moe": MOE["moe"]}
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    lines = str(e.value).splitlines()
    assert lines == [
        f"model.dim=64 but {tmp_path / 'pretrained'}/config.json has hidden_size=32; fix: remove model.dim from "
        f"the YAML (init_from sets it) or set it to 32",
        f"model.moe={MOE['moe']!r} but {tmp_path / 'pretrained'}/config.json has model_type='llama' (dense); "
        f"fix: remove model.moe from the YAML (init_from sets it) or set it to None",
    ]
    raw["model"] = {"init_from": str(tmp_path / "nowhere")}
    with pytest.raises(ConfigError, match=r"nowhere: no config.json there; fix: point it at a folder"):
        parse_config(raw)


def test_models_ours_cannot_compute_are_refused(corpus_dir, tmp_path):
    _hf_model("dense", hidden_act="gelu").save_pretrained(tmp_path / "gelu")
    raw = _raw(corpus_dir, tmp_path / "run")
    raw["model"] = {"init_from": str(tmp_path / "gelu")}
    with pytest.raises(ConfigError, match=r"hidden_act='gelu'; our blocks compute hidden_act='silu'"):
        parse_config(raw)


def test_folder_tensors_and_vocabulary_are_checked_before_training(corpus_dir, tmp_path):
    model = _hf_model("dense")
    model.save_pretrained(tmp_path / "pretrained")
    raw = _raw(corpus_dir, tmp_path / "run")
    raw["model"] = {"init_from": str(tmp_path / "pretrained")}
    cfg = parse_config(raw)
    check_inputs(cfg)  # no tokenizer.json in the folder: only the vocabulary size is checked
    # a tokenizer.json that is not the data's (byte) tokenizer: refused in one line
    prepare_corpus([STDLIB / "heapq.py", STDLIB / "bisect.py"], tmp_path / "bpe", tokenizer="bpe", vocab_size=300,
                   val_fraction=0.5, progress=False)  # fmt: skip
    (tmp_path / "pretrained" / "tokenizer.json").write_bytes((tmp_path / "bpe" / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    assert len(str(e.value).splitlines()) == 1 and "was tokenized with another vocabulary" in str(e.value)
    assert f"fix: raytrain data prepare --tokenizer {tmp_path / 'pretrained'}" in str(e.value)
    # weights that do not match config.json
    (tmp_path / "pretrained" / "tokenizer.json").unlink()
    state = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
    from safetensors.torch import save_file

    save_file(state, tmp_path / "pretrained" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing 1: model.norm.weight"):
        check_inputs(cfg)
    # a model whose vocabulary is smaller than the data's: the fix is the model's tokenizer, not vocab_size
    _hf_model("dense", vocab=200).save_pretrained(tmp_path / "small")
    raw["model"] = {"init_from": str(tmp_path / "small")}
    with pytest.raises(ConfigError, match=r"smaller than the tokenizer's 257; fix: tokenize the data with the model"):
        check_inputs(parse_config(raw))


def test_export_refuses_what_the_hf_classes_cannot_hold(corpus_dir, tmp_path, capsys):
    every = _raw(corpus_dir, tmp_path / "every", model={"moe": {"num_experts": 4, "every": 2}})
    Trainer(parse_config(every), progress=False).save()
    assert main(["export", str(tmp_path / "every"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raytrain: error: cannot export") and "model.moe.every=2" in err and "\n" not in err
    dropping = _raw(corpus_dir, tmp_path / "cf", model={"moe": {"num_experts": 4, "capacity_factor": 1.0}})
    Trainer(parse_config(dropping), progress=False).save()
    assert main(["export", str(tmp_path / "cf"), str(tmp_path / "out")]) == 2
    assert "fix: --allow-inexact writes it anyway" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "cf"), str(tmp_path / "out"), "--allow-inexact"]) == 0
    out = capsys.readouterr()
    assert "note: model.moe.capacity_factor=1.0: Mixtral has no expert capacity" in out.err
    assert f"wrote {tmp_path / 'out'}: MixtralForCausalLM" in out.out
    # a damaged checkpoint is named, not exported
    (next((tmp_path / "cf" / "checkpoints").glob("step_*")) / "trainer_state.json").write_text("{}")
    assert main(["export", str(tmp_path / "cf"), str(tmp_path / "out2"), "--allow-inexact"]) == 2
    assert "is damaged: trainer_state.json has 2 bytes" in capsys.readouterr().err
    # an existing, non-empty folder is never overwritten
    assert main(["export", str(tmp_path / "cf"), str(tmp_path / "out"), "--allow-inexact"]) == 2
    assert "exists and is not empty; fix: choose a new OUT_DIR" in capsys.readouterr().err
