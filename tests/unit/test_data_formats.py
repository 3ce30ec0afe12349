"""`raytrain data prepare` on the formats users keep their corpora in: each prepares to the same tokens as
the same text given as plain files; what is left out or cannot be read is said in one line each."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from trainers._base import ConfigError
from trainers.data.prepare import prepare_corpus
from trainers.data.tokenizer import BPETokenizer, save_hf

# Quotes, commas, tabs, line ends, non-ASCII and the eos token's text: what breaks a careless reader.
DOCS = [
    'def f(x):\n    return x  # é ü 🙂 "quoted", commas\n',
    'He said "hi, there", then left.\r\nA second line.',
    "tab\tseparated\tvalues inside text",
    "<eos> stays text here",
    "plain words " * 40,
    *(f"document {i}: " + "lorem ipsum dolor sit amet, " * (i % 7 + 1) for i in range(35)),
]
ONE_LINE = [d for d in DOCS if "\t" not in d and "\n" not in d and "\r" not in d]  # what TSV can hold


def _rows(data: Path) -> list[tuple[int, ...]]:
    """Every document's tokens, both splits, sorted (the split of a record differs from a file's: its key does)."""
    manifest = json.loads((data / "manifest.json").read_text())
    rows = []
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            rows += [tuple(r) for r in pq.read_table(data / shard["file"]).column("tokens").to_pylist()]
    return sorted(rows)


def _prepare(inputs: list[Path], out: Path, notes: list[str] | None = None, **kw) -> dict:
    kw.setdefault("val_fraction", 0.3)
    return prepare_corpus(inputs, out, progress=False, say=(notes if notes is not None else []).append, **kw)


def _plain(root: Path, docs: list[str]) -> Path:
    folder = root / "plain"
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_bytes(doc.encode())
    return folder


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    lines = "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs))
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(lines)
    return path


def _table(docs: list[str], field: str = "text") -> pa.Table:
    return pa.table({"id": list(range(len(docs))), field: docs})


def _arrow(path: Path, docs: list[str], stream: bool) -> Path:
    table = _table(docs)
    with pa.OSFile(str(path), "wb") as sink:
        writer = ipc.new_stream(sink, table.schema) if stream else ipc.new_file(sink, table.schema)
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
        writer.close()
    return path


def _datasets_folder(folder: Path, docs: list[str], files: int = 2) -> Path:
    """What `datasets.Dataset.save_to_disk` writes (checked against datasets 5.2): Arrow streams listed by
    state.json, the features in dataset_info.json."""
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
    for i, name in enumerate(names):
        part = docs[len(docs) * i // files : len(docs) * (i + 1) // files]
        table = _table(part).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": {}}})})
        with pa.OSFile(str(folder / name), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    features = {"id": {"dtype": "int64", "_type": "Value"}, "text": {"dtype": "string", "_type": "Value"}}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    return folder


def _write(kind: str, root: Path) -> Path:
    """DOCS in the format `kind`, under `root`."""
    if kind == "jsonl":
        return _jsonl(root / "docs.jsonl", DOCS)
    if kind == "jsonl.gz":
        return _jsonl(root / "docs.jsonl.gz", DOCS)
    if kind == "jsonl.zst":
        if not pa.Codec.is_available("zstd"):
            pytest.skip("no zstd codec in this pyarrow")
        raw = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
        (root / "docs.jsonl.zst").write_bytes(pa.compress(raw, "zstd", asbytes=True))
        return root / "docs.jsonl.zst"
    if kind == "json-array":
        (root / "docs.json").write_text(json.dumps([{"text": d} for d in DOCS]))
        return root / "docs.json"
    if kind == "parquet":
        pq.write_table(_table(DOCS), root / "docs.parquet", row_group_size=9)
        return root / "docs.parquet"
    if kind == "parquet.gz":
        sink = pa.BufferOutputStream()
        pq.write_table(_table(DOCS), sink)
        (root / "docs.parquet.gz").write_bytes(gzip.compress(sink.getvalue().to_pybytes()))
        return root / "docs.parquet.gz"
    if kind in ("arrow-file", "arrow-stream"):
        return _arrow(root / "docs.arrow", DOCS, stream=kind == "arrow-stream")
    if kind == "csv":
        pcsv.write_csv(_table(DOCS), root / "docs.csv")
        return root / "docs.csv"
    if kind == "txt.gz":
        folder = root / "gz"
        folder.mkdir()
        for i, doc in enumerate(DOCS):
            (folder / f"doc{i:02d}.txt.gz").write_bytes(gzip.compress(doc.encode()))
        return folder
    if kind == "datasets":
        return _datasets_folder(root / "saved", DOCS)
    raise AssertionError(kind)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, ...]]:
    root = tmp_path_factory.mktemp("plain")
    _prepare([_plain(root, DOCS)], root / "out")
    return _rows(root / "out")


@pytest.mark.parametrize(
    "kind",
    ["jsonl", "jsonl.gz", "jsonl.zst", "json-array", "parquet", "parquet.gz", "arrow-file", "arrow-stream", "csv",
     "txt.gz", "datasets"],
)
def test_each_format_prepares_to_the_tokens_of_the_same_text_as_plain_files(kind, reference, tmp_path) -> None:
    notes: list[str] = []
    manifest = _prepare([_write(kind, tmp_path)], tmp_path / "out", notes)
    assert _rows(tmp_path / "out") == reference
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == len(DOCS)
    assert notes == [] and manifest["source"]["notes"] == []


def test_tsv_and_a_folder_of_jsonl_found_by_the_default_include(tmp_path) -> None:
    plain = _prepare([_plain(tmp_path, ONE_LINE)], tmp_path / "ref")
    folder = tmp_path / "shards"
    folder.mkdir()
    half = len(ONE_LINE) // 2
    _jsonl(folder / "part-0.jsonl", ONE_LINE[:half])
    _jsonl(folder / "part-1.jsonl.gz", ONE_LINE[half:])
    tsv = tmp_path / "docs.tsv"
    tsv.write_text("id\ttext\n" + "".join(f"{i}\t{d}\n" for i, d in enumerate(ONE_LINE)))
    for inputs, out in (([folder], "from-folder"), ([tsv], "from-tsv")):
        manifest = _prepare(inputs, tmp_path / out)
        assert _rows(tmp_path / out) == _rows(tmp_path / "ref"), out
        assert manifest["source"]["bytes"] == plain["source"]["bytes"]


def test_a_text_column_by_another_name_and_the_pretrained_tokenizer(tmp_path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    save_hf(BPETokenizer.train(DOCS, vocab_size=300), hf, model_max_length=64)
    _prepare([_plain(tmp_path, DOCS)], tmp_path / "ref", tokenizer=str(hf))
    pq.write_table(_table(DOCS, field="content"), tmp_path / "docs.parquet")
    _prepare([tmp_path / "docs.parquet"], tmp_path / "out", tokenizer=str(hf), text_field="content")
    assert _rows(tmp_path / "out") == _rows(tmp_path / "ref")


def test_a_real_datasets_folder(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    _prepare([_plain(tmp_path, DOCS)], tmp_path / "ref")
    saved = tmp_path / "saved"
    datasets.Dataset(InMemoryTable(_table(DOCS)), fingerprint="0").save_to_disk(str(saved), num_shards=3)
    _prepare([saved], tmp_path / "out")
    assert _rows(tmp_path / "out") == _rows(tmp_path / "ref")


def test_a_dataset_dict_folder_reads_every_split(tmp_path) -> None:
    _prepare([_plain(tmp_path, DOCS)], tmp_path / "ref")
    saved = tmp_path / "saved"
    _datasets_folder(saved / "train", DOCS[:30])
    _datasets_folder(saved / "test", DOCS[30:], files=1)
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    _prepare([saved], tmp_path / "out")
    assert _rows(tmp_path / "out") == _rows(tmp_path / "ref")


def test_processes_write_what_one_process_writes(tmp_path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    save_hf(BPETokenizer.train(DOCS, vocab_size=300), hf, model_max_length=64)
    source = _jsonl(tmp_path / "docs.jsonl", DOCS * 40)
    one = _prepare([source], tmp_path / "one", tokenizer=str(hf), workers=1, shard_tokens=5000)
    two = _prepare([source], tmp_path / "two", tokenizer=str(hf), workers=2, shard_tokens=5000)
    assert two["source"]["workers"] == 2 and len(two["splits"]["train"]["shards"]) > 2
    assert one["splits"] == two["splits"]  # same shards, byte for byte (their sha256)


def test_a_long_text_file_is_cut_at_line_ends(tmp_path, monkeypatch) -> None:
    import trainers.data.sources as sources

    monkeypatch.setattr(sources, "TEXT_PART_BYTES", 1000)
    lines = [f"line {i} " + "x" * (i % 50) + "\n" for i in range(400)]
    (tmp_path / "big.txt").write_text("".join(lines))
    manifest = _prepare([tmp_path / "big.txt"], tmp_path / "out", val_fraction=0.5)
    rows = _rows(tmp_path / "out")
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == len(rows) > 10
    texts = sorted(bytes(r[:-1]).decode() for r in rows)
    assert all(t.endswith("\n") and len(t) <= 1100 for t in texts)
    assert sorted("".join(texts).splitlines()) == sorted(line.rstrip("\n") for line in lines)


# ------------------------------------------------------------------------------------------ said in one line


def test_files_left_out_and_unreadable_are_said_in_one_line_each(tmp_path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(DOCS[:20]):
        (corpus / f"doc{i}.md").write_text(doc)
    for name in ("a.bin", "b.bin", "c.dat"):
        (corpus / name).write_bytes(b"\x00\x01")
    (corpus / "notes.txt").write_bytes(b"\xff\xfe\x00binary")
    _jsonl(corpus / "other.jsonl", DOCS[:5], field="body")  # no text field
    with (corpus / "some.jsonl").open("w") as f:  # two good records, one without text, one not JSON
        f.write('{"text": "one"}\n{"body": "x"}\nnot json\n{"text": "two"}\n')
    notes: list[str] = []
    manifest = _prepare([corpus], tmp_path / "out", notes)
    assert all("\n" not in n for n in notes) and notes == manifest["source"]["notes"]
    assert len(notes) == 5, notes
    left, binary, fields, record, not_json = notes
    assert left.startswith("3 files left out by --include *.py,") and "(corpus/a.bin, corpus/b.bin, corpus/c.dat)" in left
    assert binary == "1 file skipped: binary or not UTF-8, and of no format prepare reads (by its suffix) (corpus/notes.txt)"
    assert fields == "1 file skipped: no text in 'text'; its fields: body, id (fix: --text-field NAME) (corpus/other.jsonl)"
    assert record == "1 record skipped: no field 'text' (fix: --text-field NAME) (corpus/some.jsonl#1)"
    assert not_json == "1 record skipped: not JSON (corpus/some.jsonl#2)"
    source = manifest["source"]
    assert (source["files_left_out"], source["files_skipped"], source["records_skipped"]) == (3, 2, 2)
    assert source["files_read"] == 21 and manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 22


def test_a_csv_without_the_column_and_a_damaged_gzip_are_said(tmp_path) -> None:
    (tmp_path / "a.csv").write_text("title,body\nx,y\n")
    (tmp_path / "b.jsonl.gz").write_bytes(b"not gzip at all")
    _plain(tmp_path, DOCS)
    notes: list[str] = []
    _prepare([tmp_path], tmp_path / "out", notes)
    assert notes[0] == "1 file skipped: no column 'text'; its columns: title, body (fix: --text-field NAME) (" + tmp_path.name + "/a.csv)"
    assert notes[1].startswith(f"1 file skipped: unreadable as json gzip ({tmp_path.name}/b.jsonl.gz: ")


def test_nothing_readable_is_one_error_line_with_the_reasons(tmp_path) -> None:
    _jsonl(tmp_path / "docs.jsonl", DOCS, field="body")
    with pytest.raises(ConfigError) as e:
        _prepare([tmp_path / "docs.jsonl"], tmp_path / "out")
    line = str(e.value)
    assert "\n" not in line and "no text found (1 file skipped: no text in 'text'; its fields: body, id" in line
    assert "fix:" in line and not (tmp_path / "out").exists()
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "x.bin").write_bytes(b"\x00")
    with pytest.raises(ConfigError, match=r"no files match --include .* \(1 file left out by --include .*only/x.bin\)"):
        _prepare([tmp_path / "only"], tmp_path / "out")


def test_cli_prepares_one_jsonl_file_and_says_its_notes(tmp_path, capsys) -> None:
    from raytrain_ext.cli import main

    _jsonl(tmp_path / "docs.jsonl", DOCS)
    (tmp_path / "extra.bin").write_bytes(b"\x00")
    code = main(["data", "prepare", "--input", str(tmp_path), "--output", str(tmp_path / "out"), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0 and "tokens/s on 1 process" in out
    assert err.strip() == f"raytrain data prepare: 1 file left out by --include *.py,*.txt,*.md,*.rst,*.jsonl,*.ndjson,*.json,*.parquet,*.arrow,*.csv,*.tsv ({tmp_path.name}/extra.bin)"
    assert np.sum([s["documents"] for s in json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"].values()]) == len(DOCS)
