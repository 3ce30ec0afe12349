"""Token shards on disk, and reading a split's tokens in place.

A shard is a Parquet file, one row per document (column `tokens`, list<uint16|uint32>, each row ends in eos),
written PLAIN, uncompressed, in one row group and one data page: its values are then one run of little-endian
int32 at `values_offset` (Parquet has no 16-bit type), read in place by positioned reads while any Parquet
reader still reads the file. Shards without `values_offset` (compressed, older) are decoded whole.

Each `piece_bytes` piece's sha256 is in the split's `.pieces` file; a reader checks a piece the first time it
reads from it. A bucket's shard is fetched in blocks of `FETCH_BYTES` (a store's latency, not its bandwidth,
is the cost) into this machine's cache, or memory with `data.cache: false`.
Reads use `os.pread`, not a memory map: a map's touched pages would stay in the worker's resident memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainers._base import ConfigError
from trainers.data.manifest import MANIFEST_FILE, fetch_shard, shard_problem
from trainers.storage import cache_root, local_path, location, read_range

__all__ = ["DIGEST_BYTES", "FETCH_BYTES", "PIECE_BYTES", "SplitStream", "encode_shard", "piece_digests"]

PIECE_BYTES = 1 << 16  # what a reader checks at a time: ~8 windows of 2,048 tokens, ~50 us of sha256
DIGEST_BYTES = 32  # a piece's sha256, raw
FETCH_BYTES = 1 << 20  # what one ranged GET of a bucket's shard brings (whole pieces)
DISK_CACHE_BYTES = 20 << 30  # a bucket's blocks kept on this machine when data.cache_bytes is not set
MEMORY_CACHE_BYTES = 256 << 20  # ... kept in each process with data.cache: false
_VALUE = np.dtype("<u4")  # how Parquet stores uint16 and uint32 values: INT32, little-endian
_OPEN_SHARDS = 256  # shards a reader keeps open: a file and an 8 KiB digest table each (16 MB shards)
_FETCH_THREADS = 8
_PARQUET = {
    "compression": "NONE",
    "use_dictionary": False,
    "write_statistics": False,
    "data_page_size": 1 << 30,  # one page per column chunk: the values stay one run
    "write_batch_size": 1 << 20,
}
try:  # pyarrow >= 21 also cuts pages every 20,000 rows unless told otherwise
    pq.ParquetWriter(pa.BufferOutputStream(), pa.schema([]), max_rows_per_page=1 << 30).close()
    _PARQUET["max_rows_per_page"] = 1 << 30
except TypeError:
    pass


def encode_shard(values: np.ndarray, lengths: np.ndarray) -> tuple[pa.Buffer, int | None]:
    """A shard's Parquet bytes for documents `lengths` long laid end to end in `values`, and where their
    values start in it (None if this pyarrow lays the page out otherwise: readers then decode the shard)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"tokens": column}), sink, row_group_size=max(1, len(lengths)), **_PARQUET)
    buf = sink.getvalue()
    meta = pq.read_metadata(pa.BufferReader(buf))
    chunk = meta.row_group(0).column(0)
    start = chunk.data_page_offset + chunk.total_compressed_size - _VALUE.itemsize * len(values)
    found = np.frombuffer(buf, _VALUE, count=len(values), offset=start) if start >= 0 else None
    ok = meta.num_row_groups == 1 and found is not None and np.array_equal(found, values)
    return buf, int(start) if ok else None


def piece_digests(data: Any, piece_bytes: int = PIECE_BYTES) -> tuple[str, bytes]:
    """(sha256 of the whole as hex, the raw sha256 of each `piece_bytes` piece end to end)."""
    view = memoryview(data).cast("B")
    pieces = b"".join(hashlib.sha256(view[i : i + piece_bytes]).digest() for i in range(0, len(view), piece_bytes))
    return hashlib.sha256(view).hexdigest(), pieces or hashlib.sha256(b"").digest()


class SplitStream:
    """The tokens of one split's shards as one stream: `read(start, count)` returns tokens
    [start, start + count) as uint32, reading (and checking) only the pieces of the shards they lie in."""

    def __init__(self, data_dir: Any, manifest: dict[str, Any], split: str, cache: bool = True,
                 cache_bytes: int | None = None) -> None:
        self.data_dir = location(data_dir)
        entry = manifest["splits"][split]
        self.entries: list[dict[str, Any]] = entry["shards"]
        self.piece_bytes = int(manifest.get("piece_bytes", PIECE_BYTES))
        self.digest_file = self.data_dir / entry["pieces_file"] if isinstance(entry.get("pieces_file"), str) else None
        self.bounds = np.cumsum([0, *(int(s["tokens"]) for s in self.entries)], dtype=np.int64)
        self.total = int(self.bounds[-1])
        self.remote = local_path(self.data_dir) is None
        self.cache = cache
        limit = cache_bytes or (DISK_CACHE_BYTES if cache else MEMORY_CACHE_BYTES)
        store = _DiskBlocks if cache else _MemoryBlocks
        self.blocks: _BlockStore | None = store(limit) if self.remote else None
        self._open: OrderedDict[int, _Shard] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, start: int, count: int) -> np.ndarray:
        if start < 0 or start + count > self.total:
            raise IndexError(f"tokens [{start}, {start + count}) are outside [0, {self.total})")
        parts = [self.shard(i).values(a, n) for i, a, n in self._spans(start, count)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def prefetch(self, starts: Iterable[int], count: int) -> None:
        """Start fetching what `read(s, count)` for each of `starts` will need (a bucket's blocks; on a local
        disk, a hint to the kernel); returns at once."""
        for start in starts:
            for i, a, n in self._spans(start, min(count, self.total - start)):
                self.shard(i).prefetch(a, n)

    def _spans(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(shard, first token in it, tokens) of each shard that tokens [start, start + count) lie in."""
        out, end = [], start + count
        i = int(np.searchsorted(self.bounds, start, side="right")) - 1
        while start < end:
            stop = min(end, int(self.bounds[i + 1]))
            out.append((i, start - int(self.bounds[i]), stop - start))
            start, i = stop, i + 1
        return out

    def shard(self, i: int) -> _Shard:
        with self._lock:
            if i in self._open:
                self._open.move_to_end(i)
                return self._open[i]
            entry = self.entries[i]
            plain = self.digest_file is not None and "values_offset" in entry and "pieces_offset" in entry
            shard = _PlainShard(self, entry) if plain else _DecodedShard(self, entry)
            self._open[i] = shard
            if len(self._open) > _OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
            return shard

    def problem(self, entry: dict[str, Any], what: str) -> ConfigError:
        return shard_problem(self.data_dir, entry, what)


class _Shard:
    def values(self, start: int, count: int) -> np.ndarray:
        raise NotImplementedError

    def prefetch(self, start: int, count: int) -> None:
        pass

    def close(self) -> None:
        pass


class _DecodedShard(_Shard):
    """A shard whose values cannot be read in place: fetched whole, checked against its sha256, decoded."""

    def __init__(self, stream: SplitStream, entry: dict[str, Any]) -> None:
        path = fetch_shard(stream.data_dir, entry, stream.cache)
        source = pa.BufferReader(path) if isinstance(path, bytes) else path
        column = pq.read_table(source, columns=["tokens"], memory_map=True).column("tokens")
        chunks = [chunk.flatten().to_numpy() for chunk in column.chunks]  # flatten() honours list offsets
        self.tokens = np.concatenate(chunks).astype(np.uint32) if chunks else np.zeros(0, np.uint32)
        if len(self.tokens) != entry["tokens"]:
            raise stream.problem(entry, f"holds {len(self.tokens)} tokens, {MANIFEST_FILE} says {entry['tokens']}")

    def values(self, start: int, count: int) -> np.ndarray:
        return self.tokens[start : start + count]


class _PlainShard(_Shard):
    """A shard whose values are one int32 run: read where they lie, each piece checked on first use (a
    bucket's: each block as it arrives)."""

    def __init__(self, stream: SplitStream, entry: dict[str, Any]) -> None:
        self.stream, self.entry = stream, entry
        self.path = stream.data_dir / entry["file"]
        self.offset = int(entry["values_offset"])
        self.size = int(entry.get("bytes", self.offset + _VALUE.itemsize * entry["tokens"]))
        self.piece = stream.piece_bytes
        self.pieces = max(1, -(-self.size // self.piece))
        self.block = max(1, FETCH_BYTES // self.piece) * self.piece
        self.checked: set[int] = set()
        self.fd: int | None = None
        self._digests: bytes | None = None
        self._lock = threading.Lock()

    def _range(self, start: int, count: int) -> tuple[int, int]:
        begin = self.offset + _VALUE.itemsize * start
        return begin, begin + _VALUE.itemsize * count

    @staticmethod
    def _units(begin: int, end: int, unit: int) -> range:
        return range(begin // unit, (max(end, begin + 1) - 1) // unit + 1)

    def values(self, start: int, count: int) -> np.ndarray:
        begin, end = self._range(start, count)
        data = self._from_blocks(begin, end) if self.stream.remote else self._from_file(begin, end)
        if len(data) != end - begin:
            raise self.stream.problem(self.entry, f"ends before byte {end} (truncated?)")
        return np.frombuffer(data, _VALUE)

    def _from_file(self, begin: int, end: int) -> bytes:
        for k in self._units(begin, end, self.piece):
            if k not in self.checked:
                first = k * self.piece
                self._check(k, read_range(self.path, first, min(self.piece, self.size - first)))
                self.checked.add(k)
        return os.pread(self._fd(), end - begin, begin)

    def prefetch(self, start: int, count: int) -> None:
        begin, end = self._range(start, count)
        if self.stream.remote:
            for b in self._units(begin, end, self.block):
                self.stream.blocks.prefetch(self._key(b), lambda b=b: self._fetch_block(b))
        elif hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(), begin, end - begin, os.POSIX_FADV_WILLNEED)

    def _digest(self, k: int) -> bytes:
        """Piece k's sha256, from this shard's table in the digest file (checked against the manifest)."""
        with self._lock:
            if self._digests is None:
                offset = int(self.entry["pieces_offset"])
                table = read_range(self.stream.digest_file, offset, DIGEST_BYTES * self.pieces)
                if hashlib.sha256(table).hexdigest() != self.entry.get("pieces_sha256"):
                    name = self.stream.digest_file.name
                    raise self.stream.problem(self.entry, f"has piece checksums in {name} that do not match "
                                                          f"{MANIFEST_FILE}")
                self._digests = bytes(table)
        return self._digests[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]

    def _check(self, k: int, data: Any) -> None:
        length = min(self.piece, self.size - k * self.piece)
        if len(data) != length or hashlib.sha256(data).digest() != self._digest(k):
            raise self.stream.problem(self.entry, f"does not match its sha256 in {MANIFEST_FILE} (piece {k} "
                                                  f"of {self.pieces}: corrupted or changed)")

    def _fd(self) -> int:
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                raise self.stream.problem(self.entry, "is missing") from None
        return self.fd

    def _key(self, b: int) -> str:
        return f"{self.entry['sha256']}-{self.piece}-{b}"  # what the block holds, whatever the path

    def _fetch_block(self, b: int) -> bytes:
        first = b * self.block
        data = bytes(read_range(self.path, first, min(self.block, self.size - first)))
        view = memoryview(data)
        for k in self._units(first, first + len(data), self.piece):
            self._check(k, view[k * self.piece - first : (k + 1) * self.piece - first])
        return data

    def _from_blocks(self, begin: int, end: int) -> bytes:
        parts = []
        for b in self._units(begin, end, self.block):
            first = b * self.block
            lo, hi = max(begin - first, 0), min(end - first, self.block)
            parts.append(self.stream.blocks.get(self._key(b), lambda b=b: self._fetch_block(b), lo, hi))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class _BlockStore:
    """Checked blocks by key: `get` returns one (fetched, or from the store), waiting for a prefetch of it."""

    limit: int
    pending: dict[str, Future] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor | None = None

    def get(self, key: str, fetch: Any, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) of the block `key` (fetched with `fetch` when it is not held)."""
        with self.lock:
            future = self.pending.get(key)
        if future is not None:
            future.result()  # what the fetch raised, raise here
        data = self.load(key, lo, hi)
        if data is None:
            block = fetch()
            self.store(key, block)
            data = block[lo:hi]
        return data

    def prefetch(self, key: str, fetch: Any) -> None:
        with self.lock:
            if key in self.pending or self.has(key):
                return
            if self.pool is None:
                self.pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="data-fetch")
            future = self.pool.submit(lambda: self.store(key, fetch()))
            self.pending[key] = future
        future.add_done_callback(lambda _: self._done(key))

    def _done(self, key: str) -> None:
        with self.lock:
            self.pending.pop(key, None)

    def has(self, key: str) -> bool:
        raise NotImplementedError

    def load(self, key: str, lo: int, hi: int) -> bytes | None:
        raise NotImplementedError

    def store(self, key: str, data: bytes) -> None:
        raise NotImplementedError


@dataclass
class _MemoryBlocks(_BlockStore):
    """Blocks kept in this process, least recently used out past `limit` bytes."""

    held: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    used: int = 0

    def has(self, key: str) -> bool:
        return key in self.held

    def load(self, key: str, lo: int, hi: int) -> bytes | None:
        with self.lock:
            data = self.held.get(key)
            if data is None:
                return None
            self.held.move_to_end(key)
            return data[lo:hi]

    def store(self, key: str, data: bytes) -> None:
        with self.lock:
            if key not in self.held:
                self.held[key], self.used = data, self.used + len(data)
            while self.used > self.limit and len(self.held) > 1:
                self.used -= len(self.held.popitem(last=False)[1])


@dataclass
class _DiskBlocks(_BlockStore):
    """Blocks in this machine's cache folder, shared by its processes; least recently used (by modification
    time, touched on first use here) are deleted once the folder holds more than `limit` bytes."""

    folder: Path = field(default_factory=lambda: cache_root() / "blobs")
    used: int | None = None  # this process's estimate of the folder's size; recounted when past the limit
    touched: set[str] = field(default_factory=set)

    def has(self, key: str) -> bool:
        return (self.folder / key).is_file()

    def load(self, key: str, lo: int, hi: int) -> bytes | None:
        try:
            with open(self.folder / key, "rb") as f:
                data = os.pread(f.fileno(), hi - lo, lo)
        except FileNotFoundError:  # not fetched yet, or evicted by another process
            return None
        if key not in self.touched:
            self.touched.add(key)
            with contextlib.suppress(OSError):
                os.utime(self.folder / key)
        return data

    def store(self, key: str, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.folder / key)
        finally:
            tmp.unlink(missing_ok=True)
        with self.lock:
            self.touched.add(key)
            if self.used is None:
                self.used = sum(size for _, size, _ in self._entries())
            self.used += len(data)
            if self.used > self.limit:
                self.used = self._evict()

    def _entries(self) -> list[tuple[float, int, str]]:
        out = []
        with os.scandir(self.folder) as it:
            for e in it:
                if not e.name.startswith("."):
                    with contextlib.suppress(OSError):
                        st = e.stat()
                        out.append((st.st_mtime, st.st_size, e.name))
        return out

    def _evict(self) -> int:
        """Oldest first, down to 90% of the limit (so that the next blocks do not each scan the folder)."""
        entries = sorted(self._entries())
        used = sum(size for _, size, _ in entries)
        for _, size, name in entries:
            if used <= self.limit * 0.9:
                break
            if name in self.pending:
                continue
            (self.folder / name).unlink(missing_ok=True)
            used -= size
        return used
