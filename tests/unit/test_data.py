"""Data layer: prepare (tokenizers, shards, manifest, split rule), windows, and the global sampler."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_raw
from trainers._base import ConfigError
from trainers.config import parse_config
from trainers.data.dataset import GlobalSampler, TokenWindows, eval_window_ids, shard_for_rank
from trainers.data.prepare import default_corpus, prepare_corpus
from trainers.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from trainers.preflight import check_inputs

TRICKY = "def f(x):\r\n\treturn x  # é ü 🙂 <eos> \x01 end\n"


def _write_corpus(root: Path, n: int = 24) -> Path:
    corpus = root / "corpus"
    for i in range(n):
        sub = corpus / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def func_{i}_{j}(a, b):\n    return a * {j} + b  # note {i}\n\n" for j in range(20))
        (sub / f"mod{i}.py").write_text(f'"""Module {i}: é ü 🙂."""\n' + body)
    (corpus / "README.md").write_text("# Corpus\n\nSome words about the corpus.\n" * 5)
    (corpus / "blob.py").write_bytes(b"\x00\x01binary")  # skipped: NUL bytes
    (corpus / "empty.txt").write_text("")  # skipped: empty
    (corpus / "data.bin").write_bytes(b"not matched by --include")
    return corpus


def _prepare(corpus: Path, out: Path, **kw) -> dict:
    return prepare_corpus([corpus], out, progress=False, **kw)


def _rows(data_dir: Path, split: str) -> list[list[int]]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    rows: list[list[int]] = []
    for shard in manifest["splits"][split]["shards"]:
        rows += pq.read_table(data_dir / shard["file"]).column("tokens").to_pylist()
    return rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module", params=["byte", "bpe"])
def prepared(request: pytest.FixtureRequest, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "data"
    # Small shards so that each split is written as several files.
    _prepare(corpus, out, tokenizer=request.param, vocab_size=400, val_fraction=0.25, shard_tokens=2000)
    return out


# --------------------------------------------------------------------------------------------- prepare


def test_manifest_counts_match_stored_tokens(prepared: Path) -> None:
    manifest = json.loads((prepared / "manifest.json").read_text())
    tok = load_tokenizer(prepared)
    assert manifest["tokenizer"]["vocab_size"] == tok.vocab_size
    assert manifest["source"]["files_read"] == 25 and manifest["source"]["files_skipped"] == 2
    documents = 0
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        rows = _rows(prepared, split)
        assert entry["tokens"] == sum(len(r) for r in rows) == len(TokenWindows(prepared, split, 16).tokens)
        assert entry["documents"] == len(rows) == sum(s["documents"] for s in entry["shards"])
        assert all(r[-1] == tok.eos_id and tok.eos_id not in r[:-1] for r in rows)
        documents += len(rows)
    assert documents == manifest["source"]["files_read"]
    assert len(manifest["splits"]["train"]["shards"]) > 1
    assert pq.read_schema(prepared / "train-00000.parquet").field("tokens").type.value_type == "uint16"
    assert 0 < manifest["unigram_entropy_nats"] < np.log(tok.vocab_size)


def test_stream_decodes_to_the_documents(prepared: Path, corpus: Path) -> None:
    tok = load_tokenizer(prepared)
    texts = {tok.decode(r) for split in ("train", "val") for r in _rows(prepared, split)}
    assert (corpus / "pkg0" / "mod0.py").read_text() in texts
    assert (corpus / "README.md").read_text() in texts


def test_corrupted_shard_is_detected(prepared: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in prepared.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    TokenWindows(copy, "val", 8)  # intact: loads
    shard = copy / "val-00000.parquet"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="val-00000.parquet.*sha256"):
        TokenWindows(copy, "val", 8)


def test_split_is_stable_when_a_file_is_added(tmp_path: Path) -> None:
    corpus = _write_corpus(tmp_path)
    before = _prepare(corpus, tmp_path / "a", val_fraction=0.3)
    (corpus / "pkg1" / "zz_new.py").write_text("x = 1\n" * 50)
    (corpus / "aa_new.md").write_text("new text\n" * 50)
    after = _prepare(corpus, tmp_path / "b", val_fraction=0.3)
    assert after["source"]["files_read"] == before["source"]["files_read"] + 2
    for split in ("train", "val"):
        old = {tuple(r) for r in _rows(tmp_path / "a", split)}
        new = {tuple(r) for r in _rows(tmp_path / "b", split)}
        assert old and old <= new  # every earlier document is still in the same split


def test_seed_changes_the_split(corpus: Path, tmp_path: Path) -> None:
    a = _prepare(corpus, tmp_path / "a", val_fraction=0.3, seed=0)
    b = _prepare(corpus, tmp_path / "b", val_fraction=0.3, seed=1)
    assert {tuple(r) for r in _rows(tmp_path / "a", "val")} != {
        tuple(r) for r in _rows(tmp_path / "b", "val")
    }
    assert a["splits"]["train"]["tokens"] + a["splits"]["val"]["tokens"] == (
        b["splits"]["train"]["tokens"] + b["splits"]["val"]["tokens"]
    )


def test_prepare_overwrites_an_earlier_output_atomically(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    _prepare(corpus, out, val_fraction=0.3)
    manifest = _prepare(corpus, out, tokenizer="bpe", vocab_size=300, val_fraction=0.3)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no temp or old folder left behind


@pytest.mark.parametrize("tok", [ByteTokenizer(), None], ids=["byte", "bpe"])
def test_round_trip(tok: ByteTokenizer | None, corpus: Path) -> None:
    if tok is None:
        texts = [p.read_text() for p in sorted(corpus.rglob("*.py")) if p.name != "blob.py"]
        tok = BPETokenizer.train(texts, vocab_size=320)
        assert tok.vocab_size <= 320 and tok.encode(TRICKY).count(tok.eos_id) == 0
    for text in (TRICKY, "", "plain ascii", (corpus / "pkg0" / "mod0.py").read_text()):
        assert tok.decode(tok.encode(text)) == text
        assert [list(a) for a in tok.encode_batch([text])] == [tok.encode(text)]
    assert tok.decode(tok.encode("a") + [tok.eos_id]) == "a"


# ---------------------------------------------------------------------------------------------- errors


def _one_line_error(match: str, **kw) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        prepare_corpus(progress=False, **kw)
    assert "\n" not in str(err.value) and "fix:" in str(err.value)


def test_bad_inputs_raise_one_line_config_errors(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _one_line_error("--input .*missing.* does not exist", inputs=[tmp_path / "missing"], output=out)
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "image.png").write_bytes(b"\x89PNG")
    _one_line_error("--input .*no files match --include", inputs=[nothing], output=out)
    (nothing / "empty.txt").write_text("")
    _one_line_error("--input .*no text found", inputs=[nothing], output=out)
    for bad in (0.0, 0.6):
        _one_line_error("--val-fraction", inputs=[corpus], output=out, val_fraction=bad)
    _one_line_error("val split is empty.*--val-fraction", inputs=[corpus / "README.md"], output=out)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    _one_line_error("--output .*not a prepared-data folder", inputs=[corpus], output=taken)
    assert (taken / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nothing", "taken"]


def test_default_corpus_is_the_stdlib_source() -> None:
    paths = default_corpus()
    assert paths and all(p.exists() for p in paths)
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))]
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert any(f.name == "argparse.py" for f in files)
    skipped = {"site-packages", "test", "tests", "idlelib"}
    assert not any(skipped & set(f.parts[-4:-1]) for f in files)


# ------------------------------------------------------------------------------ bad manifests and shards


def _copy(folder: Path, to: Path) -> Path:
    to.mkdir()
    for f in folder.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def _edit_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _cut(path: Path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


MANIFEST_DAMAGE = {  # case -> (damage, what the one line says)
    "truncated": (lambda d: _cut(d / "manifest.json"), "manifest.json is not valid JSON"),
    "empty": (lambda d: (d / "manifest.json").write_text(""), "manifest.json is empty"),
    "list": (lambda d: (d / "manifest.json").write_text("[1, 2]"), "manifest.json should be a JSON object, found a JSON list"),
    "no-val-tokens": (
        lambda d: _edit_manifest(d, lambda m: m["splits"]["val"].pop("tokens")),
        "manifest.json: splits.val.tokens should be a JSON integer, found missing",
    ),
    "vocab-as-text": (
        lambda d: _edit_manifest(d, lambda m: m["tokenizer"].update(vocab_size="257")),
        "manifest.json: tokenizer.vocab_size should be a JSON integer, found a JSON string",
    ),
    "shard-without-sha": (
        lambda d: _edit_manifest(d, lambda m: m["splits"]["train"]["shards"][0].pop("sha256")),
        r"manifest.json: splits.train.shards\[0\].sha256 should be a JSON string, found missing",
    ),
}
SHARD_DAMAGE = {
    "shard-missing": (lambda d: (d / "val-00000.parquet").unlink(), "shard val-00000.parquet is missing"),
    "shard-truncated": (lambda d: _cut(d / "val-00000.parquet"), "shard val-00000.parquet is .* bytes, manifest.json says"),
    "shard-flipped": (lambda d: _flip(d / "val-00000.parquet"), "shard val-00000.parquet does not match its sha256"),
}


@pytest.mark.parametrize("case", [*MANIFEST_DAMAGE, *SHARD_DAMAGE])
def test_check_inputs_refuses_a_bad_manifest_or_shard_in_one_line(case, corpus_dir, tmp_path) -> None:
    damage, message = {**MANIFEST_DAMAGE, **SHARD_DAMAGE}[case]
    data = _copy(corpus_dir, tmp_path / "data")
    cfg = parse_config(tiny_raw(data, tmp_path / "run"))
    check_inputs(cfg)  # intact: passes
    damage(data)
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    line = str(e.value)
    assert re.search(message, line) and line.startswith(f"data.path={data}: "), line
    assert "\n" not in line and f"fix: run `raytrain data prepare --input TEXT_DIR --output {data}`" in line


@pytest.mark.parametrize("case", MANIFEST_DAMAGE)
def test_one_manifest_reader_serves_the_dataset_and_the_tokenizer(case, corpus_dir, tmp_path) -> None:
    damage, message = MANIFEST_DAMAGE[case]
    data = _copy(corpus_dir, tmp_path / "data")
    damage(data)
    for read in (lambda: TokenWindows(data, "train", 8), lambda: load_tokenizer(data)):
        with pytest.raises(ConfigError, match=message):
            read()


def test_a_manifest_without_shard_sizes_is_still_read_and_checked(corpus_dir, tmp_path) -> None:
    # manifests written before shards carried their size: the sha256 still catches a changed shard
    data = _copy(corpus_dir, tmp_path / "data")
    _edit_manifest(data, lambda m: [s.pop("bytes") for split in m["splits"].values() for s in split["shards"]])
    cfg = parse_config(tiny_raw(data, tmp_path / "run"))
    check_inputs(cfg)
    _cut(data / "train-00000.parquet")
    with pytest.raises(ConfigError, match="shard train-00000.parquet does not match its sha256"):
        check_inputs(cfg)


def test_the_suggested_fix_works_on_a_damaged_folder(corpus: Path, tmp_path: Path) -> None:
    # `raytrain data prepare --output DIR` must accept a folder whose manifest is damaged...
    out = tmp_path / "data"
    _prepare(corpus, out, val_fraction=0.3)
    _cut(out / "manifest.json")
    manifest = _prepare(corpus, out, val_fraction=0.3)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    # ...but still never a folder holding a user's other files
    _cut(out / "manifest.json")
    (out / "notes.txt").write_text("mine")
    _one_line_error("--output .*not a prepared-data folder", inputs=[corpus], output=out)
    assert (out / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------ windows, sampler


def test_windows_are_shifted_by_one(prepared: Path) -> None:
    data = TokenWindows(prepared, "train", 16)
    assert data.num_windows == (len(data.tokens) - 1) // 16
    last = data.num_windows - 1
    inputs, targets = data.get(np.array([0, last]))
    assert inputs.dtype == targets.dtype and str(inputs.dtype) == "torch.int64"
    assert inputs.shape == targets.shape == (2, 16)
    assert inputs[1].tolist() == data.tokens[last * 16 : last * 16 + 16].tolist()
    assert targets[1].tolist() == data.tokens[last * 16 + 1 : last * 16 + 17].tolist()
    assert inputs[0, 1:].tolist() == targets[0, :-1].tolist()
    with pytest.raises(IndexError):
        data.get([data.num_windows])


def test_sampler_covers_each_epoch_once_in_new_orders() -> None:
    n = 10
    ids = GlobalSampler(n, seed=3, shuffle=True).window_ids(0, 25)  # 2.5 epochs
    epochs = [ids[:10], ids[10:20], ids[20:]]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
    assert len(set(epochs[2])) == 5
    assert list(epochs[0]) != list(epochs[1])
    assert list(GlobalSampler(n, seed=4, shuffle=True).window_ids(0, 10)) != list(epochs[0])
    assert list(GlobalSampler(n, seed=3, shuffle=False).window_ids(5, 10)) == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("k", [0, 1, 7, 10, 13, 19, 20, 33, 40])
def test_sampler_resumes_at_any_sample_count(k: int) -> None:
    full = GlobalSampler(10, seed=0, shuffle=True).window_ids(0, 40)
    head = GlobalSampler(10, seed=0, shuffle=True).window_ids(0, k)
    tail = GlobalSampler(10, seed=0, shuffle=True).window_ids(k, 40 - k)  # a fresh process resuming at k
    assert np.array_equal(np.concatenate([head, tail]), full)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_any_dp_size_sees_the_same_global_batch(dp: int) -> None:
    sampler, batch = GlobalSampler(13, seed=1, shuffle=True), 8
    for step in range(5):  # crosses epoch boundaries (13 windows, 8 per step)
        ids = sampler.window_ids(step * batch, batch)
        parts = [shard_for_rank(ids, r, dp) for r in range(dp)]
        assert all(len(p) == batch // dp for p in parts)
        assert np.array_equal(np.concatenate(parts), ids)
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        shard_for_rank(np.arange(6), 0, 4)


def test_eval_windows_are_the_first_ones() -> None:
    assert eval_window_ids(100, 8).tolist() == list(range(8))
    assert eval_window_ids(5, 8).tolist() == list(range(5))
