"""The inputs of `raytrain data prepare`: which files are read, in which format, and their documents.

A file's format is named by its suffix after any compression suffix (.gz, .zst, .bz2, .xz): JSON lines (or
one JSON array), Parquet, Arrow IPC, CSV/TSV, a `datasets` save_to_disk folder (read with pyarrow alone), else
plain text, one document a file (cut at line ends past `TEXT_PART_BYTES`, so that memory stays bounded).
What is left out or cannot be read is counted with its reason (`Skipped.notes`), never silently.

A document's key (its file's path relative to the input's parent, then `#N` for the Nth record or text part)
decides its split, so adding files or appending records moves no document between splits.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import fnmatch
import gzip
import io
import itertools
import json
import lzma
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

__all__ = ["DEFAULT_INCLUDE", "TEXT_PART_BYTES", "Skipped", "Source", "list_sources", "read_documents"]

DEFAULT_INCLUDE = "*.py,*.txt,*.md,*.rst,*.jsonl,*.ndjson,*.json,*.parquet,*.arrow,*.csv,*.tsv"
TEXT_PART_BYTES = 64 << 20
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_FORMATS = {
    ".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
    ".feather": "arrow", ".csv": "csv", ".tsv": "tsv",
}  # fmt: skip
_BATCH_ROWS = 1024  # rows of a columnar file read at a time
_CSV_BLOCK = 16 << 20  # pyarrow's CSV block: must hold the longest row


@dataclass(frozen=True)
class Source:
    path: Path
    key: str  # relative path (posix): with a record's index, what decides its split
    size: int  # bytes on disk
    format: str  # "text", "json", "parquet", "arrow", "csv", "tsv" or "datasets" (a save_to_disk folder)
    compression: str | None = None


@dataclass
class Skipped:
    """What was not read, by reason, with a few names each, for the notes and the manifest."""

    left_out: dict[str, list[str]] = field(default_factory=dict)  # the include rule -> file keys
    files: dict[str, list[str]] = field(default_factory=dict)  # reason -> file keys
    records: dict[str, list[str]] = field(default_factory=dict)  # reason -> "key#N" of records
    counts: dict[str, int] = field(default_factory=dict)  # reason -> how many (files or records)

    def leave_out(self, rule: str, key: str) -> None:
        self._add(self.left_out, rule, key)

    def file(self, reason: str, key: str) -> None:
        self._add(self.files, reason, key)

    def record(self, reason: str, where: str) -> None:
        self._add(self.records, reason, where)

    def _add(self, table: dict[str, list[str]], reason: str, name: str) -> None:
        names = table.setdefault(reason, [])
        if len(names) < 3:
            names.append(name)
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def total(self, table: dict[str, list[str]]) -> int:
        """How many files or records `table` (left_out, files or records) stands for."""
        return sum(self.counts[r] for r in table)

    def notes(self) -> list[str]:
        """One line per reason: how many, which rule or why, a few names, and the fix where there is one."""
        out = []
        for table, what in ((self.left_out, "left out by"), (self.files, "skipped:"), (self.records, "skipped:")):
            unit = "record" if table is self.records else "file"
            for reason, names in table.items():
                n = self.counts[reason]
                shown = ", ".join(names) + (", ..." if n > len(names) else "")
                out.append(f"{n} {unit}{'s' if n != 1 else ''} {what} {reason} ({shown})")
        return out


def split_suffix(name: str) -> tuple[str, str | None]:
    """(the name without a compression suffix, the compression or None)."""
    stem, ext = os.path.splitext(name)
    codec = _COMPRESSION.get(ext.lower())
    return (stem, codec) if codec else (name, None)


def is_datasets_folder(folder: Path) -> bool:
    """A folder `datasets.Dataset.save_to_disk` (or `DatasetDict.save_to_disk`) wrote."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def list_sources(inputs: list[Path], patterns: list[str], skipped: Skipped) -> list[Source]:
    """Sources in a deterministic order; a file named directly is taken whatever its name; files under a
    folder the globs leave out are counted in `skipped`."""
    sources: dict[Path, Source] = {}
    rule = f"--include {','.join(patterns)}"
    for root in (p.resolve() for p in inputs):
        named = root.is_file() or is_datasets_folder(root)
        for p in [root] if named else _walk(root):
            # Relative to the input's parent: the folder name is part of the key, the machine is not.
            key = p.relative_to(root.parent).as_posix()
            if named or p.is_dir() or _matches(p.name, patterns):
                sources.setdefault(p, _source(p, key))
            else:
                skipped.leave_out(rule, key)
    return sorted(sources.values(), key=lambda s: s.key)


def _source(path: Path, key: str) -> Source:
    if path.is_dir():
        size = sum(f.stat().st_size for f in path.rglob("*.arrow"))
        return Source(path, key, size, "datasets")
    stem, codec = split_suffix(path.name)
    kind = _FORMATS.get(os.path.splitext(stem)[1].lower(), "text")
    return Source(path, key, path.stat().st_size, kind, codec)


def _matches(name: str, patterns: list[str]) -> bool:
    """By name, looking through a compression suffix (`*.jsonl` takes `a.jsonl.gz`)."""
    stem = split_suffix(name)[0]
    return any(fnmatch.fnmatch(name, g) or fnmatch.fnmatch(stem, g) for g in patterns)


def _walk(folder: Path) -> Iterator[Path]:
    """Files under `folder` (and `datasets` folders, whole), skipping hidden folders and __pycache__."""
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        if here != folder and is_datasets_folder(here):
            dirnames[:] = []
            yield here
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            yield here / name


def read_documents(source: Source, text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    """(key, text) of each document of `source`; what cannot be read is counted in `skipped`."""
    reader = {
        "text": _text_documents, "json": _json_documents, "parquet": _parquet_documents,
        "arrow": _arrow_documents, "csv": _csv_documents, "tsv": _csv_documents, "datasets": _datasets_documents,
    }[source.format]  # fmt: skip
    try:
        yield from reader(source, text_field, skipped)
    except _read_errors() as e:  # a damaged file: said, then the next one
        codec = f" {source.compression}" if source.compression else ""
        skipped.file(f"unreadable as {source.format}{codec}", f"{source.key}: {_short(e)}")


def _read_errors() -> tuple[type[BaseException], ...]:
    zstd = sys.modules.get("zstandard")  # its errors are no OSError
    return (OSError, EOFError, ValueError, pa.ArrowException, *((zstd.ZstdError,) if zstd else ()))


def _short(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:120]


def _zstd_open(path: str, mode: str) -> IO[bytes]:
    try:
        import zstandard
    except ImportError:  # pyarrow's own zstd codec
        if not pa.Codec.is_available("zstd"):
            raise OSError("no zstd codec here: pip install zstandard") from None
        return pa.CompressedInputStream(pa.OSFile(path), "zstd")
    return zstandard.ZstdDecompressor().stream_reader(open(path, mode), closefd=True)  # noqa: SIM115


_OPENERS: dict[str | None, Callable[[str, str], Any]] = {
    None: open, "gzip": gzip.open, "bz2": bz2.open, "xz": lzma.open, "zstd": _zstd_open
}


def _open(source: Source) -> IO[bytes]:
    """The file's bytes, decompressed as they are read (a context manager that closes it)."""
    return _OPENERS[source.compression](str(source.path), "rb")


@contextlib.contextmanager
def _seekable(source: Source) -> Iterator[Any]:
    """A path pyarrow can seek in: the file itself, or its decompressed copy in a temporary file."""
    if source.compression is None:
        yield str(source.path)
        return
    with tempfile.NamedTemporaryFile(prefix="raytrain-prepare-", suffix=source.path.stem) as tmp, _open(source) as f:
        shutil.copyfileobj(f, tmp, 1 << 22)
        tmp.flush()
        yield tmp.name


def _read_full(f: IO[bytes], n: int) -> bytes:
    """Up to `n` bytes, fewer only at the end (a decompressing reader may return less per call)."""
    parts, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _text_documents(source: Source, text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    """The file as one document, or cut at line ends into parts of about TEXT_PART_BYTES."""
    with _open(source) as f:
        data = _read_full(f, TEXT_PART_BYTES)
        if not data:
            skipped.file("empty", source.key)
            return
        parts = [(source.key, data)] if len(data) < TEXT_PART_BYTES else _text_parts(source.key, data, f)
        for key, raw in parts:
            text = _decode(raw)
            if text is None:
                skipped.file("binary or not UTF-8, and of no format prepare reads (by its suffix)", key)
                return
            yield key, text


def _text_parts(key: str, data: bytes, f: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    part = 0
    while data:
        more = _read_full(f, TEXT_PART_BYTES)
        cut = data.rfind(b"\n") + 1 if more else len(data)
        cut = cut or len(data)  # a part with no line end at all is cut where it is
        yield f"{key}#{part}", data[:cut]
        data, part = data[cut:] + more, part + 1


def _decode(data: bytes) -> str | None:
    try:
        return None if b"\0" in data else data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _records_of(source: Source, rows: Iterator[tuple[int, Any]], text_field: str, skipped: Skipped,
                columnar: bool = False) -> Iterator[tuple[str, str]]:
    """Documents of (index, record) pairs in file order: a record is a JSON value (a dict's `text_field` is
    the text) or, `columnar`, a text column's value. A file with no document at all is one skipped file, not
    its records one by one."""
    found, fields, mine = 0, None, Skipped()
    for n, row in rows:
        text = row if columnar else row.get(text_field) if isinstance(row, dict) else None
        if isinstance(text, str) and text:
            found += 1
            yield f"{source.key}#{n}", text
            continue
        if isinstance(row, dict) and fields is None:
            fields = sorted(row)
        mine.record(_why_no_text(row, text, text_field, columnar), f"{source.key}#{n}")
    if not found:
        shown = f"; its fields: {', '.join(fields[:8])}" if fields else ""
        reason = f"no text in {text_field!r}{shown} (fix: --text-field NAME)" if mine.counts else "empty"
        skipped.file(reason, source.key)
        return
    for reason, names in mine.records.items():
        kept = skipped.records.setdefault(reason, [])
        kept += names[: 3 - len(kept)]
        skipped.counts[reason] = skipped.counts.get(reason, 0) + mine.counts[reason]


_NOT_JSON = object()


def _why_no_text(row: Any, text: Any, text_field: str, columnar: bool) -> str:
    if row is _NOT_JSON:
        return "not JSON"
    if columnar or (isinstance(row, dict) and text_field in row and text in (None, "")):
        return f"empty or null {text_field!r}"
    if not isinstance(row, dict):
        return "not a JSON object"
    if text_field not in row:
        return f"no field {text_field!r} (fix: --text-field NAME)"
    return f"{text_field!r} is not a string (fix: --text-field NAME)"


def _no_column(source: Source, names: list[str], text_field: str, skipped: Skipped) -> None:
    skipped.file(
        f"no column {text_field!r}; its columns: {', '.join(names[:8])} (fix: --text-field NAME)", source.key
    )


def _json_documents(source: Source, text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    with _open(source) as raw:
        f = io.TextIOWrapper(raw, encoding="utf-8")
        head = f.read(1)
        while head.isspace():
            head = f.read(1)
        if head == "[":  # one JSON array: read whole
            rows: Iterator[tuple[int, Any]] = enumerate(json.loads(head + f.read()))
        else:
            rows = _json_lines(head, f)
        yield from _records_of(source, rows, text_field, skipped)


def _json_lines(head: str, f: IO[str]) -> Iterator[tuple[int, Any]]:
    """(line index, object) of each line that is not blank (`_NOT_JSON` for one that is not JSON)."""
    lines = itertools.chain([head + f.readline()], f) if head else iter(())
    for n, line in enumerate(lines):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError:
                yield n, _NOT_JSON


def _column_documents(source: Source, schema: pa.Schema, batches: Callable[[], Iterator[pa.RecordBatch]],
                      text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    """Documents of the text column of record batches; a file without such a column is said and skipped."""
    if text_field not in schema.names:
        _no_column(source, schema.names, text_field, skipped)
        return
    kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        skipped.file(f"column {text_field!r} holds {kind}, not text (fix: --text-field NAME)", source.key)
        return
    columns = (batch.column(batch.schema.get_field_index(text_field)) for batch in batches())
    values = itertools.chain.from_iterable(column.to_pylist() for column in columns)
    yield from _records_of(source, enumerate(values), text_field, skipped, columnar=True)


def _parquet_documents(source: Source, text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    with _seekable(source) as path:
        f = pq.ParquetFile(path)
        batches = lambda: f.iter_batches(_BATCH_ROWS, columns=[text_field])  # noqa: E731
        yield from _column_documents(source, f.schema_arrow, batches, text_field, skipped)


def _arrow_documents(source: Source, text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    with _seekable(source) as path:
        schema = _ipc_schema(Path(path))
        yield from _column_documents(source, schema, lambda: _ipc_batches(Path(path)), text_field, skipped)


def _ipc_reader(m: pa.MemoryMappedFile) -> Any:
    """An Arrow IPC file (it starts with ARROW1) or stream."""
    is_file = m.read(6) == b"ARROW1"
    m.seek(0)
    return ipc.open_file(m) if is_file else ipc.open_stream(m)


def _ipc_schema(path: Path) -> pa.Schema:
    with pa.memory_map(str(path)) as m:
        return _ipc_reader(m).schema


def _ipc_batches(path: Path) -> Iterator[pa.RecordBatch]:
    with pa.memory_map(str(path)) as m:
        reader = _ipc_reader(m)
        if isinstance(reader, ipc.RecordBatchFileReader):
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            yield from reader


def _csv_documents(source: Source, text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    tsv = source.format == "tsv"
    parse = pcsv.ParseOptions(delimiter="\t" if tsv else ",", quote_char=False if tsv else '"',
                              newlines_in_values=not tsv)
    with _open(source) as f:
        header = next(csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline=""), delimiter=parse.delimiter,
                                 quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL), [])
    if text_field not in header:
        _no_column(source, header, text_field, skipped)
        return
    convert = pcsv.ConvertOptions(column_types={text_field: pa.large_string()}, include_columns=[text_field])
    with _open(source) as f:
        reader = pcsv.open_csv(f, read_options=pcsv.ReadOptions(block_size=_CSV_BLOCK), parse_options=parse,
                               convert_options=convert)
        yield from _column_documents(source, reader.schema, lambda: iter(reader), text_field, skipped)


def _datasets_documents(source: Source, text_field: str, skipped: Skipped) -> Iterator[tuple[str, str]]:
    """A save_to_disk folder: its Arrow files in the order state.json lists them, rows counted across them
    (a DatasetDict: each split's folder in the order dataset_dict.json lists them)."""
    folder = source.path
    if (folder / "dataset_dict.json").is_file():
        for split in json.loads((folder / "dataset_dict.json").read_text()).get("splits", []):
            sub = Source(folder / split, f"{source.key}/{split}", 0, "datasets")
            yield from _datasets_documents(sub, text_field, skipped)
        return
    state = json.loads((folder / "state.json").read_text())
    files = [folder / f["filename"] for f in state.get("_data_files", [])]
    if not files:
        skipped.file("a datasets folder whose state.json lists no Arrow files", source.key)
        return
    batches = lambda: itertools.chain.from_iterable(map(_ipc_batches, files))  # noqa: E731
    yield from _column_documents(source, _ipc_schema(files[0]), batches, text_field, skipped)
