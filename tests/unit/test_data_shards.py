"""Token shards read where they lie: only the windows asked for, each piece checked on first read, a bucket's
pieces in a bounded cache, fetched ahead; a local shard hashed once per machine, not at every start."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trainers.data.manifest as manifest_module
import trainers.data.shards as shards
from tests.conftest import tiny_raw
from trainers._base import ConfigError
from trainers.config import parse_config
from trainers.data.dataset import TokenWindows
from trainers.data.prepare import CorpusWriter
from trainers.data.tokenizer import ByteTokenizer
from trainers.preflight import check_inputs

PIECE = 4096  # small pieces, so that a shard has many


def _corpus(out: Path, seed: int = 0, docs: int = 120, shard_tokens: int = 20_000) -> Path:
    """Random byte documents written as prepare writes them, in pieces of PIECE bytes."""
    rng = np.random.default_rng(seed)
    tok = ByteTokenizer()
    with CorpusWriter(out, tok, shard_tokens=shard_tokens, piece_bytes=PIECE) as writer:
        for i in range(docs):
            lengths = rng.integers(50, 1500, size=4)
            values = rng.integers(0, 256, size=int(lengths.sum())).astype(np.uint16)
            values[np.cumsum(lengths) - 1] = tok.eos_id
            writer.add("val" if i % 10 == 0 else "train", values, lengths)
        writer.finish(seed=0, val_fraction=0.1, source={})
    return out


def _stream(folder: Path, split: str) -> np.ndarray:
    manifest = json.loads((folder / "manifest.json").read_text())
    parts = [pq.read_table(folder / s["file"]).column("tokens").combine_chunks().flatten().to_numpy()
             for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _corpus(tmp_path_factory.mktemp("shards") / "data")


def test_windows_are_read_in_place_and_are_what_a_parquet_reader_finds(corpus) -> None:
    manifest = json.loads((corpus / "manifest.json").read_text())
    entries = manifest["splits"]["train"]["shards"]
    assert len(entries) > 3 and all("values_offset" in s and s["bytes"] > 5 * PIECE for s in entries)
    assert (corpus / "train.pieces").stat().st_size == 32 * sum(-(-s["bytes"] // PIECE) for s in entries)
    assert pq.read_metadata(corpus / entries[0]["file"]).row_group(0).column(0).compression == "UNCOMPRESSED"
    expected = _stream(corpus, "train")
    data = TokenWindows(corpus, "train", 100)
    assert np.array_equal(data.tokens, expected) and data.tokens.dtype == np.uint16
    boundary = entries[0]["tokens"] // 100  # a window that runs from the first shard into the second
    ids = [0, boundary, data.num_windows - 1, boundary]
    inputs, targets = data.get(ids)
    for row, i in enumerate(ids):
        assert inputs[row].tolist() == expected[i * 100 : i * 100 + 100].tolist()
        assert targets[row].tolist() == expected[i * 100 + 1 : i * 100 + 101].tolist()


def test_opening_reads_one_piece_and_a_damaged_piece_fails_where_it_is_read(corpus, tmp_path, monkeypatch) -> None:
    data_dir = tmp_path / "copy"
    data_dir.mkdir()
    for f in corpus.iterdir():
        (data_dir / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((data_dir / "manifest.json").read_text())
    last = manifest["splits"]["train"]["shards"][-1]
    raw = bytearray((data_dir / last["file"]).read_bytes())
    raw[last["values_offset"] + 5 * PIECE] ^= 0x01  # one token in the last shard's piece 5
    (data_dir / last["file"]).write_bytes(bytes(raw))

    read = []
    real = shards.read_range
    monkeypatch.setattr(shards, "read_range", lambda p, o, n: read.append((Path(p).name, o, n)) or real(p, o, n))
    data = TokenWindows(data_dir, "train", 64)
    first = manifest["splits"]["train"]["shards"][0]
    table = ("train.pieces", 0, 32 * -(-first["bytes"] // PIECE))
    assert sorted(read) == sorted([table, ("train-00000.parquet", 0, PIECE)]), "the first window's piece only"
    start = manifest["splits"]["train"]["tokens"] - last["tokens"]  # the last shard's first token
    fine = [0, 5, start // 64 + 2]
    data.get(fine)
    bad_token = start + (5 * PIECE) // 4
    with pytest.raises(ConfigError) as e:
        data.get([bad_token // 64])
    line = str(e.value)
    assert line.startswith(f"data.path={data_dir}: shard {last['file']} does not match its sha256 in manifest.json (piece ")
    assert "\n" not in line and "fix: run `raytrain data prepare" in line
    assert len(read) == len({(n, o) for n, o, _ in read}), "a piece is checked once"


def test_a_damaged_table_of_piece_checksums_is_named(corpus, tmp_path) -> None:
    data_dir = tmp_path / "copy"
    data_dir.mkdir()
    for f in corpus.iterdir():
        (data_dir / f.name).write_bytes(f.read_bytes())
    raw = bytearray((data_dir / "train.pieces").read_bytes())
    raw[3] ^= 0x01
    (data_dir / "train.pieces").write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as e:
        TokenWindows(data_dir, "train", 64)
    assert str(e.value).startswith(
        f"data.path={data_dir}: shard train-00000.parquet has piece checksums in train.pieces that do not match "
        f"manifest.json; fix: run `raytrain data prepare"
    )


def test_a_truncated_shard_is_named(corpus, tmp_path) -> None:
    data_dir = tmp_path / "copy"
    data_dir.mkdir()
    for f in corpus.iterdir():
        (data_dir / f.name).write_bytes(f.read_bytes())
    last = json.loads((data_dir / "manifest.json").read_text())["splits"]["train"]["shards"][-1]
    (data_dir / last["file"]).write_bytes((data_dir / last["file"]).read_bytes()[: last["bytes"] // 2])
    data = TokenWindows(data_dir, "train", 64)
    with pytest.raises(ConfigError, match=f"shard {last['file']} does not match its sha256"):
        data.get([data.num_windows - 1])


def test_a_folder_of_compressed_shards_is_decoded(corpus, tmp_path) -> None:
    """Shards written before in-place reading (zstd, no values_offset) still read, to the same tokens."""
    old = tmp_path / "old"
    old.mkdir()
    manifest = json.loads((corpus / "manifest.json").read_text())
    for split in ("train", "val"):
        for entry in manifest["splits"][split]["shards"]:
            pq.write_table(pq.read_table(corpus / entry["file"]), old / entry["file"], compression="zstd")
            raw = (old / entry["file"]).read_bytes()
            entry.update(bytes=len(raw), sha256=manifest_module.hashlib.sha256(raw).hexdigest())
            del entry["values_offset"], entry["pieces_offset"], entry["pieces_sha256"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert np.array_equal(TokenWindows(old, "train", 64).tokens, _stream(corpus, "train"))


def test_check_inputs_hashes_a_shard_once_per_machine(corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAYTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(manifest_module, "_records", {})
    monkeypatch.setattr(manifest_module, "_SETTLED_NS", 0)  # files this young count as settled here
    data_dir = _corpus(tmp_path / "data", seed=1)  # written here: recorded as checked
    hashed = []
    real = manifest_module.sha256_of
    monkeypatch.setattr(manifest_module, "sha256_of", lambda p: hashed.append(p.name) or real(p))
    cfg = parse_config(tiny_raw(data_dir, tmp_path / "run"))
    check_inputs(cfg)
    assert hashed == [], "prepare's own shards are not hashed again"
    first = json.loads((data_dir / "manifest.json").read_text())["splits"]["train"]["shards"][0]
    path = data_dir / first["file"]
    raw, mtime = bytearray(path.read_bytes()), path.stat().st_mtime_ns

    def rewrite(seconds_before: int) -> None:  # a new mtime for sure (the clock's tick can be coarser than a test)
        path.write_bytes(bytes(raw))
        os.utime(path, ns=(mtime - seconds_before * 10**9,) * 2)

    raw[len(raw) // 2] ^= 0xFF
    rewrite(1)
    with pytest.raises(ConfigError, match=f"shard {first['file']} does not match its sha256"):
        check_inputs(cfg)
    raw[len(raw) // 2] ^= 0xFF
    rewrite(2)
    check_inputs(cfg)
    check_inputs(cfg)
    assert hashed == [first["file"], first["file"]], "hashed when changed, then remembered"


def test_a_record_of_a_file_changed_within_the_timestamp_granularity_is_not_trusted(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAYTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(manifest_module, "_records", {})
    path = tmp_path / "f"
    path.write_bytes(b"x")
    manifest_module.remember_checked(tmp_path, {"f": "abc"}, checked_ns=path.stat().st_mtime_ns + 1)
    assert not manifest_module._checked_before(path, "abc")  # modified right before it was checked
    manifest_module.remember_checked(tmp_path, {"f": "abc"}, checked_ns=path.stat().st_mtime_ns + 3 * 10**9)
    assert manifest_module._checked_before(path, "abc") and not manifest_module._checked_before(path, "abd")


def test_records_of_folders_that_are_gone_are_forgotten(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAYTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(manifest_module, "_records", {})
    records = tmp_path / "cache" / "checked"
    records.mkdir(parents=True)
    for i in range(70):
        (records / f"gone{i}.json").write_text(json.dumps({"folder": str(tmp_path / f"gone{i}"), "files": {}}))
    (records / "kept.json").write_text(json.dumps({"folder": str(tmp_path), "files": {}}))
    (tmp_path / "f").write_bytes(b"x")
    manifest_module.remember_checked(tmp_path, {"f": "abc"}, checked_ns=0)
    assert sorted(p.name for p in records.iterdir()) == sorted(["kept.json", manifest_module._record_file(tmp_path).name])


# ------------------------------------------------------------------------------------------------ a bucket


@pytest.fixture(scope="module")
def bucket_corpus(s3, corpus):
    from trainers.storage import location, upload_folder

    uri = f"s3://{s3.make_bucket('shards')}/data"
    upload_folder(corpus, location(uri))
    return uri


def _cached(cache: Path) -> list[Path]:
    folder = cache / "blobs"
    return [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []


def test_a_buckets_blocks_stay_within_cache_bytes(bucket_corpus, corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAYTRAIN_CACHE", str(tmp_path / "cache"))
    limit = 400_000  # about four of these shards (one block each)
    fetched = []
    real = shards._PlainShard._fetch_block
    monkeypatch.setattr(shards._PlainShard, "_fetch_block", lambda self, b: fetched.append(b) or real(self, b))
    data = TokenWindows(bucket_corpus, "train", 64, cache=True, cache_bytes=limit)
    ids = np.random.default_rng(0).permutation(data.num_windows)[:300]
    inputs, _ = data.get(ids)
    assert inputs.tolist() == TokenWindows(corpus, "train", 64).get(ids)[0].tolist()
    held = sum(p.stat().st_size for p in _cached(tmp_path / "cache"))
    assert 0 < held <= limit and len(fetched) > len(_cached(tmp_path / "cache")), (held, len(fetched))
    memory = TokenWindows(bucket_corpus, "train", 64, cache=False, cache_bytes=limit)
    assert memory.get(ids)[0].tolist() == inputs.tolist()
    assert 0 < memory.stream.blocks.used <= limit and len(memory.stream.blocks.held) >= 2


def test_a_buckets_blocks_are_fetched_ahead(bucket_corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAYTRAIN_CACHE", str(tmp_path / "cache"))
    data = TokenWindows(bucket_corpus, "train", 64)
    before = len(_cached(tmp_path / "cache"))
    ids = np.linspace(0, data.num_windows - 1, 40).astype(int)  # across every shard: not read yet
    data.prefetch(ids)
    pool = data.stream.blocks.pool
    assert pool is not None
    pool.shutdown(wait=True)  # the fetches finish in the background
    data.stream.blocks.pool = None
    assert len(_cached(tmp_path / "cache")) - before >= len(data.stream.entries) - 1
    reads = []
    monkeypatch.setattr(shards._PlainShard, "_fetch_block", lambda self, b: reads.append(b) or b"")
    data.get(ids)
    assert reads == [], "every block the batch needs was there"


def test_blocks_held_in_memory_are_dropped_oldest_first() -> None:
    store = shards._MemoryBlocks(limit=10)
    for name in "abcd":
        store.store(name, b"x" * 4)
    assert list(store.held) == ["c", "d"] and store.used == 8
    assert store.load("c", 1, 3) == b"xx" and list(store.held) == ["d", "c"]


def test_the_writer_lays_values_out_where_the_manifest_says() -> None:
    values = np.arange(1000, dtype=np.uint16)
    buf, offset = shards.encode_shard(values, np.array([300, 700]))
    assert np.array_equal(np.frombuffer(buf, "<u4", count=1000, offset=offset), values)
    table = pq.read_table(pa.BufferReader(buf))
    assert [len(r) for r in table.column("tokens").to_pylist()] == [300, 700]
    whole, pieces = shards.piece_digests(buf, 256)
    assert len(pieces) == 32 * -(-buf.size // 256) and whole == manifest_module.hashlib.sha256(buf).hexdigest()
    assert pieces[32:64] == manifest_module.hashlib.sha256(buf.to_pybytes()[256:512]).digest()


# ------------------------------------------------------------------------------------------ the order


def test_a_large_epoch_order_is_read_from_its_file_and_is_the_same_order(tmp_path, monkeypatch) -> None:
    from trainers.data.dataset import EpochOrder, GlobalSampler

    monkeypatch.setenv("RAYTRAIN_CACHE", str(tmp_path / "cache"))
    n = GlobalSampler.IN_MEMORY + 12_345
    on_disk = GlobalSampler(n, seed=-3, shuffle=True)
    in_memory = GlobalSampler(n, seed=-3, shuffle=True)
    monkeypatch.setattr(in_memory, "IN_MEMORY", n)
    for start, count in ((0, 64), (n - 10, 40), (2 * n - 7, 3000), (12_345, 1)):
        assert np.array_equal(on_disk.window_ids(start, count), in_memory.window_ids(start, count))
    assert isinstance(on_disk._perms[2], EpochOrder) and isinstance(in_memory._perms[2], np.ndarray)
    files = sorted((tmp_path / "cache" / "order").iterdir())
    assert len(files) == 3 and all(f.stat().st_size == 8 * n + 16 for f in files)
    raw = bytearray(files[0].read_bytes())
    raw[8 * 100] ^= 0x01  # damaged: found by its checksum and written again
    files[0].write_bytes(bytes(raw))
    again = GlobalSampler(n, seed=-3, shuffle=True)
    assert np.array_equal(again.window_ids(0, n), in_memory.window_ids(0, n))
