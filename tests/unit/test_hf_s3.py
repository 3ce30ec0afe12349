"""Hugging Face folders in a bucket (issue 17), against a local S3 server (moto, loopback, no Ray):
`model.init_from: s3://...` starts a run exactly as the same local folder does, each tensor read by ranged
reads of its bytes only; `data prepare --tokenizer s3://...` writes what the local folder gives;
`raytrain export` to a bucket writes the local export's files byte for byte (config.json last) and reads a
checkpoint from a bucket; a missing bucket or missing credentials is one line, exit 2, before any work."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra
pytest.importorskip("moto")
pytest.importorskip("s3fs")
pytestmark = pytest.mark.usefixtures("own_cache")

import raytrain_ext.worker  # noqa: E402, F401  at collection: a first `import ray` sets RAY_CLIENT_MODE (the leak guard)
from raytrain_ext.cli import main  # noqa: E402
from tests.conftest import tiny_raw  # noqa: E402
from tests.s3_server import NO_CREDENTIALS, clear_clients  # noqa: E402
from trainers.config import parse_config  # noqa: E402
from trainers.data.tokenizer import load_tokenizer, save_hf  # noqa: E402
from trainers.hf.pretrained import PretrainedWeights  # noqa: E402
from trainers.metrics import read_metrics  # noqa: E402
from trainers.storage import download_folder, location, upload_folder  # noqa: E402
from trainers.trainer import Trainer  # noqa: E402

TRAIN = {"steps": 2, "global_batch_size": 4, "micro_batch_size": 4, "eval_every": 0, "tensorboard": False}
MISSING = "s3://no-such-bucket-raytrain"


@pytest.fixture(scope="module")
def pretrained(s3, corpus_dir, tmp_path_factory) -> tuple[Path, str]:
    """A tiny Llama saved by transformers in shards (an index and several files), with the corpus's
    tokenizer: locally, and the same files in a bucket."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    local = tmp_path_factory.mktemp("hf") / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(local, max_shard_size="40KB")
    save_hf(load_tokenizer(corpus_dir), local, 64)
    uri = f"s3://{s3.make_bucket('models')}/tiny-llama"
    upload_folder(local, location(uri), last="config.json")
    return local, uri


def _raw(corpus: Path, run_dir: Path, init_from: str | Path | None = None) -> dict:
    raw = tiny_raw(corpus, run_dir, train=TRAIN, schedule={"name": "constant", "warmup_steps": 0})
    if init_from is not None:
        raw["model"] = {"init_from": str(init_from)}  # every shape key comes from config.json
    return raw


def _sha256s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------------- model.init_from


def test_init_from_a_bucket_trains_exactly_as_from_the_local_folder(pretrained, corpus_dir, tmp_path):
    local, uri = pretrained
    assert (local / "model.safetensors.index.json").is_file(), "the folder is sharded"
    runs = {}
    for name, source in (("local", local), ("bucket", uri)):
        cfg = parse_config(_raw(corpus_dir, tmp_path / name, source))
        trainer = Trainer(cfg, progress=False)  # checks the tensors and tokenizer.json, then loads
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.fit()
        runs[name] = cfg, start, read_metrics(tmp_path / name / "metrics.jsonl", "train")
    (cfg, start, losses), (ref_cfg, ref_start, ref_losses) = runs["bucket"], runs["local"]
    assert str(cfg.model.init_from) == uri and json.loads(cfg.model_dump_json())["model"]["init_from"] == uri
    assert cfg.model.model_dump(exclude={"init_from"}) == ref_cfg.model.model_dump(exclude={"init_from"})
    assert start.keys() == ref_start.keys() and all(torch.equal(start[n], ref_start[n]) for n in ref_start)
    assert [r["loss"] for r in losses] == [r["loss"] for r in ref_losses] and len(losses) == 2
    assert not (tmp_path / "cache").exists(), "read from the bucket, nothing downloaded into the cache"


def test_a_rank_reads_only_the_bytes_of_its_rows(pretrained, monkeypatch):
    import s3fs

    local, uri = pretrained
    reads: list[tuple[int, int]] = []
    cat_file = s3fs.S3FileSystem._cat_file  # what the sync cat_file runs: every GET of an object's bytes

    async def counted(self, path, start=None, end=None, **kw):
        reads.append((start, end))
        return await cat_file(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", counted)
    clear_clients()  # a client binds its methods when made: make one that counts
    weights = PretrainedWeights(uri)
    reads.clear()  # the index
    rows = weights.read("model.embed_tokens.weight", (10, 20))  # an FSDP rank's rows of the embedding
    assert torch.equal(rows, PretrainedWeights(local).read("model.embed_tokens.weight")[10:20])
    length, header, *data = reads
    assert length == (0, 8) and header[0] == 8, "the header: its length, then the JSON"
    assert [end - start for start, end in data] == [10 * 32 * 4], "then exactly ten fp32 rows of dim 32"
    clear_clients()


def test_data_prepare_takes_the_tokenizer_of_a_bucket_folder(pretrained, tmp_path):
    local, uri = pretrained
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 50)
    for name, tokenizer in (("local", local), ("bucket", uri)):
        args = ["--input", str(tmp_path / "text"), "--output", str(tmp_path / name), "--tokenizer", str(tokenizer)]
        assert main(["data", "prepare", *args, "--no-progress", "--val-fraction", "0.5"]) == 0
    manifest, ref = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("bucket", "local"))
    assert manifest["tokenizer"] == ref["tokenizer"] and manifest["splits"] == ref["splits"]


# ---------------------------------------------------------------------------------------------- export


def test_export_to_and_from_a_bucket_is_byte_for_byte_the_local_export(s3, corpus_dir, tmp_path, monkeypatch):
    import s3fs

    run = tmp_path / "run"
    Trainer(parse_config(_raw(corpus_dir, run)), progress=False).fit()
    shards = ["--max-shard-size", "40000"]  # several files and an index
    assert main(["export", str(run), str(tmp_path / "local-out"), *shards]) == 0
    reference = _sha256s(tmp_path / "local-out")
    assert "model.safetensors.index.json" in reference and len(reference) > 6

    uploaded: list[str] = []
    put_file = s3fs.S3FileSystem._put_file

    async def recorded(self, lpath, rpath, **kw):
        uploaded.append(rpath)
        return await put_file(self, lpath, rpath, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", recorded)
    clear_clients()  # a client binds its methods when made: make one that records
    bucket = s3.make_bucket("export")
    out = f"s3://{bucket}/exports/tiny"
    assert main(["export", str(run), out, *shards]) == 0
    assert uploaded[-1].endswith("/config.json"), "config.json last: who finds it finds every other file"
    clear_clients()
    copy = download_folder(location(out), tmp_path / "downloaded")
    assert _sha256s(copy) == reference
    ours = transformers.AutoModelForCausalLM.from_pretrained(copy).state_dict()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "local-out").state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert main(["export", str(run), out]) == 2, "a non-empty OUT_DIR is refused, in a bucket too"

    # a run's committed checkpoint in a bucket, exported to a local folder and to the bucket
    upload_folder(run, location(f"s3://{bucket}/runs/tiny"))
    (step,) = sorted(p.name for p in (run / "checkpoints").iterdir())
    source = f"s3://{bucket}/runs/tiny/checkpoints/{step}"
    assert main(["export", source, str(tmp_path / "from-bucket"), *shards]) == 0
    assert _sha256s(tmp_path / "from-bucket") == reference
    assert main(["export", f"s3://{bucket}/runs/tiny", f"s3://{bucket}/exports/again", *shards]) == 0
    assert _sha256s(download_folder(location(f"s3://{bucket}/exports/again"), tmp_path / "again")) == reference


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("case", ["missing bucket", "no credentials", "missing shard"])
def test_bad_init_from_bucket_is_one_line_exit_2_before_any_work(case, s3, pretrained, corpus_dir, tmp_path, capsys, monkeypatch):
    local, uri = pretrained
    source = f"{MISSING}/tiny-llama" if case == "missing bucket" else uri
    if case == "missing shard":  # the folder copied without one of the files its index lists
        source = f"s3://{s3.make_bucket('models')}/tiny-llama"
        upload_folder(local, location(source), last="config.json")
        bucket, prefix = source[len("s3://") :].split("/", 1)
        s3.client().delete_object(Bucket=bucket, Key=f"{prefix}/model-00002-of-00004.safetensors")
    if case == "no credentials":
        for key in NO_CREDENTIALS:
            monkeypatch.delenv(key, raising=False)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(_raw(corpus_dir, tmp_path / "run", source)))

    def never(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr("trainers.launch.run_local", never)
    clear_clients()  # no client made with the credentials of before
    try:
        code = main(["train", str(path), "--no-ray", "--no-progress"])
    finally:
        clear_clients()
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"raytrain: error: model.init_from={source}: ") and "fix:" in line, line
    expected = {"missing bucket": "no bucket no-such-bucket-raytrain", "no credentials": "no credentials",
                "missing shard": "model-00002-of-00004.safetensors is not there, though"}[case]  # fmt: skip
    assert expected in line, line
    assert not (tmp_path / "run").exists(), "refused before the run dir was made"


@pytest.mark.parametrize("case", ["missing bucket", "no credentials"])
def test_bad_export_bucket_is_one_line_exit_2(case, s3, tmp_path, capsys, monkeypatch):
    out = f"{MISSING}/out" if case == "missing bucket" else f"s3://{s3.make_bucket('out')}/out"
    if case == "no credentials":
        for key in NO_CREDENTIALS:
            monkeypatch.delenv(key, raising=False)
    try:
        code = main(["export", str(tmp_path / "run"), out])  # refused before the source is looked at
    finally:
        clear_clients()
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"raytrain: error: OUT_DIR={out}: ") and "fix:" in line, line
    assert ("no bucket" if case == "missing bucket" else "no credentials") in line, line
