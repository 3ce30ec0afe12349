"""Text to token shards: `raytrain data prepare`.

Layout of the output folder (written to a temp folder beside it, then renamed into place):
    manifest.json          format, tokenizer, splits (shards with token counts, bytes, sha256, where their
                           values start and their piece checksums), source stats; written last
    tokenizer.json         bpe, or a model folder's (--tokenizer HF_DIR)
    train-00000.parquet    one row per document, column `tokens` list<uint16|uint32>, each row ends in eos
    val-00000.parquet      (the layout a reader reads in place: `trainers.data.shards`)
    train.pieces           the sha256 of each 64 KiB piece of each shard, raw, shard after shard
    val.pieces
A document goes to val when a hash of (seed, its key) falls below val_fraction, so adding a file never moves
another document between splits. Batches are tokenized on a pool of processes while this one reads the next
and writes shards as they fill: memory stays bounded whatever the size of the corpus.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
import sysconfig
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from trainers._base import ConfigError
from trainers.data.encode import encode_documents, encode_in_worker, start_worker, stored_dtype, worker_spec
from trainers.data.manifest import FORMAT, FORMAT_VERSION, MANIFEST_FILE, SPLITS, remember_checked
from trainers.data.shards import PIECE_BYTES, encode_shard, piece_digests
from trainers.data.sources import DEFAULT_INCLUDE, Skipped, Source, list_sources, read_documents
from trainers.data.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    PretrainedTokenizer,
    Tokenizer,
)
from trainers.storage import check_location, is_uri, location

__all__ = ["DEFAULT_INCLUDE", "CorpusWriter", "default_corpus", "prepare_corpus"]

# Standard-library parts that are not ordinary source: third-party code, tests, GUI, generated tables.
_STDLIB_SKIP = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "distutils",
    "tkinter", "turtledemo", "ensurepip", "encodings", "pydoc_data", "__phello__", "__pycache__",
    "lib-dynload",
}  # fmt: skip
_TEST_DIRS = {"test", "tests", "idle_test"}
_BATCH_BYTES = 1 << 20  # text encoded per call: big enough for Rust threads, small in memory
_POOL_MIN_BYTES = 16 << 20  # less text than this is tokenized in this process (a pool costs ~1 s to start)
_MAX_SHARD_TOKENS = 1 << 28  # a shard's values are one Parquet page (< 2 GiB)


@dataclass
class _SourceStats:
    files_read: int = 0
    documents: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class _Plan:
    """What to read and how to split it; both passes (bpe training, encoding) read through it."""

    sources: list[Source]
    seed: int
    val_fraction: float
    max_bytes: int | None
    text_field: str

    def is_val(self, key: str) -> bool:
        digest = hashlib.sha256(f"{self.seed}\0{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.val_fraction

    @property
    def size(self) -> int:
        total = sum(s.size for s in self.sources)
        return min(total, self.max_bytes) if self.max_bytes is not None else total

    def documents(self, stats: _SourceStats, skipped: Skipped, advance: Callable[[int], None] = lambda n: None
                  ) -> Iterator[tuple[str, str]]:
        """(key, text) of each document, stopping once `max_bytes` of text have been read."""
        for source in self.sources:
            for n, (key, text) in enumerate(read_documents(source, self.text_field, skipped)):
                if self.max_bytes is not None and stats.bytes >= self.max_bytes:
                    return
                size = len(text) if text.isascii() else len(text.encode("utf-8"))
                stats.bytes += size
                stats.documents += 1
                stats.files_read += n == 0  # a file counts once it gives a document
                advance(size)
                yield key, text


def prepare_corpus(
    inputs: list[Path],
    output: Path,
    tokenizer: str = "byte",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    include: str = DEFAULT_INCLUDE,
    max_bytes: int | None = None,
    shard_tokens: int = 4_000_000,
    seed: int = 0,
    progress: bool = True,
    text_field: str = "text",
    workers: int | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tokenize the documents under `inputs` into train/val Parquet shards at `output`; returns the manifest.

    `text_field`: the field or column of record formats that holds the text. `workers`: tokenizing
    processes (default: one per core for a bpe or model tokenizer on more than 16 MB of text, else this
    process). `say`: where the one-line notes go (files left out or skipped, and why); default stderr.
    """
    say = say or (lambda line: print(f"raytrain data prepare: {line}", file=sys.stderr, flush=True))
    output, inputs = Path(output), [Path(p) for p in inputs]
    patterns = _check_args(
        inputs, output, tokenizer, vocab_size, val_fraction, include, max_bytes, shard_tokens, text_field
    )
    listing = Skipped()
    sources = list_sources(inputs, patterns, listing)
    if not sources:
        left = "".join(f" ({note})" for note in listing.notes())
        raise ConfigError(f"--input {_show(inputs)}: no files match --include {include}{left}; fix: {_MORE}")
    for note in listing.notes():
        say(note)
    plan = _Plan(sources, seed, val_fraction, max_bytes, text_field)
    tok = _build_tokenizer(tokenizer, vocab_size, plan)
    workers = _workers(workers, tok, plan)
    stats, skipped = _SourceStats(), Skipped()
    started = time.perf_counter()
    with CorpusWriter(output, tok, shard_tokens) as writer:
        _encode_into(writer, tok, plan, stats, skipped, workers, progress)
        for note in skipped.notes():
            say(note)
        _check_splits(writer, stats, skipped, inputs, val_fraction)
        seconds = time.perf_counter() - started
        tokens = sum(writer.writers[s].tokens for s in SPLITS)
        source = {
            "inputs": [str(p) for p in inputs],
            "include": patterns,
            "text_field": text_field,
            "max_bytes": max_bytes,
            "files_read": stats.files_read,
            "files_skipped": skipped.total(skipped.files),
            "files_left_out": listing.total(listing.left_out),
            "records_skipped": skipped.total(skipped.records),
            "bytes": stats.bytes,
            "notes": listing.notes() + skipped.notes(),
            "workers": workers,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds) if seconds > 0 else None,
        }
        return writer.finish(seed=seed, val_fraction=val_fraction, source=source)


def default_corpus() -> list[Path]:
    """The Python standard library's own source (without tests, third-party code and generated tables): text
    on every machine, the demo corpus."""
    return _corpus_paths(Path(sysconfig.get_paths()["stdlib"]))


_MORE = "pass folders or files with text, or widen --include"


def _show(inputs: list[Path]) -> str:
    shown = " ".join(map(str, inputs[:3]))
    return shown + (f" (and {len(inputs) - 3} more)" if len(inputs) > 3 else "")


def _check_args(inputs: list[Path], output: Path, tokenizer: str, vocab_size: int, val_fraction: float,
                include: str, max_bytes: int | None, shard_tokens: int, text_field: str) -> list[str]:
    """One-line errors before any work; returns the include globs."""
    if not inputs:
        raise ConfigError(f"--input is empty; fix: {_MORE}")
    for p in inputs:
        if not p.exists():
            raise ConfigError(f"--input {p} does not exist; fix: pass an existing file or folder")
    if tokenizer not in ("byte", "bpe") and is_uri(tokenizer):  # a model folder in a bucket
        check_location(location(tokenizer), "--tokenizer", write=False)
    if tokenizer not in ("byte", "bpe") and not location(tokenizer).is_dir():
        raise ConfigError(
            f"--tokenizer={tokenizer!r} is neither byte, bpe nor a folder; fix: use byte or bpe, or the "
            f"folder of a Hugging Face model (its tokenizer.json)"
        )
    if tokenizer == "bpe" and not 257 <= vocab_size < 1 << 32:
        raise ConfigError(
            f"--vocab-size={vocab_size} is too small for bpe; fix: use at least 257 (256 bytes + eos)"
        )
    if not 0 < val_fraction <= 0.5:
        raise ConfigError(f"--val-fraction={val_fraction} must be in (0, 0.5]; fix: e.g. --val-fraction 0.05")
    if max_bytes is not None and max_bytes < 1:
        raise ConfigError(f"--max-bytes={max_bytes} must be positive; fix: leave it out to read everything")
    if not 1 <= shard_tokens <= _MAX_SHARD_TOKENS:
        raise ConfigError(f"shard_tokens={shard_tokens} must be in [1, {_MAX_SHARD_TOKENS}]; fix: e.g. 4_000_000")
    if not text_field:
        raise ConfigError("--text-field is empty; fix: name the field or column that holds the text, e.g. text")
    patterns = [g.strip() for g in include.split(",") if g.strip()]
    if not patterns:
        raise ConfigError(f"--include {include!r} holds no glob; fix: e.g. --include '*.py,*.txt'")
    # Overwrite only an earlier prepared-data folder (or an empty one): never a user's other files.
    fix = "fix: choose a new --output folder or remove it"
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file; {fix}")
    if output.is_dir() and any(output.iterdir()) and not _is_prepared(output):
        raise ConfigError(f"--output {output} exists and is not a prepared-data folder; {fix}")
    return patterns


# Every file a CorpusWriter writes into an output folder (the shard names of _ShardWriter._flush).
_OUTPUT_NAME = re.compile(
    rf"(train|val)-\d{{5}}\.parquet|(train|val)\.pieces|{re.escape(TOKENIZER_FILE)}|{re.escape(MANIFEST_FILE)}"
)


def _is_prepared(folder: Path) -> bool:
    """Written by prepare_corpus: its manifest says so (any format version: re-preparing an old folder is
    the upgrade path), or the manifest is damaged and every file is one that prepare writes (re-preparing
    is the fix that reading such a folder suggests)."""
    try:
        if json.loads((folder / MANIFEST_FILE).read_text()).get("format") == FORMAT:
            return True
    except (OSError, ValueError, AttributeError):
        pass
    return all(p.is_file() and _OUTPUT_NAME.fullmatch(p.name) for p in folder.iterdir())


def _corpus_paths(folder: Path) -> list[Path]:
    out: list[Path] = []
    for p in sorted(folder.iterdir()):
        if p.name in _STDLIB_SKIP or p.name.startswith((".", "config-", "_sysconfigdata")):
            continue
        if p.is_dir():  # a package with a test folder is taken as its other children
            holds_tests = any(d.name in _TEST_DIRS for d in p.rglob("*") if d.is_dir())
            out += _corpus_paths(p) if holds_tests else [p]
        elif p.suffix == ".py":
            out.append(p)
    return out


def _build_tokenizer(kind: str, vocab_size: int, plan: _Plan) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":  # a model folder: its tokenizer.json as it is
        return PretrainedTokenizer.from_folder(location(kind))
    # Merges are learnt from the train split only, so val stays unseen text.
    docs = plan.documents(_SourceStats(), Skipped())
    return BPETokenizer.train((text for key, text in docs if not plan.is_val(key)), vocab_size)


def _workers(workers: int | None, tok: Tokenizer, plan: _Plan) -> int:
    if workers is not None:
        if workers < 1:
            raise ConfigError(f"--workers={workers} must be at least 1; fix: e.g. --workers {_cores()}")
        return workers
    if isinstance(tok, ByteTokenizer) or plan.size < _POOL_MIN_BYTES:
        return 1  # bytes need no pool; a small corpus is done before a pool has started
    return _cores()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _batches(docs: Iterator[tuple[str, str]]) -> Iterator[list[tuple[str, str]]]:
    batch: list[tuple[str, str]] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[1])
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(tok: Tokenizer, batches: Iterable[list[tuple[str, str]]], workers: int
             ) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """(keys, values, lengths) of each batch, in order: in this process, or on `workers` processes with at
    most two batches each in flight (so that reading never runs ahead of tokenizing by more)."""
    if workers <= 1:
        for batch in batches:
            yield [k for k, _ in batch], *encode_documents(tok, [t for _, t in batch])
        return
    spec = worker_spec(tok.to_hf(), tok.eos_id, tok.vocab_size)
    with _worker_pool(workers, spec) as pool:
        window: deque = deque()
        for batch in batches:
            window.append(([k for k, _ in batch], pool.apply_async(encode_in_worker, ([t for _, t in batch],))))
            if len(window) >= 2 * workers:
                keys, result = window.popleft()
                yield keys, *result.get()
        while window:
            keys, result = window.popleft()
            yield keys, *result.get()


@contextlib.contextmanager
def _worker_pool(workers: int, spec: tuple) -> Iterator[Any]:
    """`workers` spawned processes (not forked: this process may already run tokenizers' threads), all started
    here. A spawned process first runs the parent's main script (multiprocessing's rule for scripts): for the
    `raytrain` command that imports torch and the trainer, seconds per worker that tokenizing never uses, so
    the main module is named `__main__` while they start, which multiprocessing leaves alone."""
    main = sys.modules["__main__"]
    spec_before = getattr(main, "__spec__", None)
    main.__spec__ = spec_before or importlib.machinery.ModuleSpec("__main__", None)
    try:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=start_worker, initargs=(spec,))
    finally:
        main.__spec__ = spec_before
    try:
        yield pool
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _encode_into(writer: CorpusWriter, tok: Tokenizer, plan: _Plan, stats: _SourceStats, skipped: Skipped,
                 workers: int, progress: bool) -> None:
    """Every document, tokenized, into its split's shards; a progress bar with tokens/s."""
    started, tokens = time.perf_counter(), 0
    sized = not any(s.compression for s in plan.sources)  # text bytes track file bytes (a compressed file's do not)
    with tqdm(total=plan.size if sized else None, desc="tokenize", unit="B", unit_scale=True,
              disable=not progress, leave=False) as bar:
        for keys, values, lengths in _encoded(tok, _batches(plan.documents(stats, skipped, bar.update)), workers):
            val = np.fromiter((plan.is_val(k) for k in keys), dtype=bool, count=len(keys))
            ends = np.cumsum(lengths)
            for split, chosen in (("train", ~val), ("val", val)):
                if chosen.all():
                    writer.add(split, values, lengths)
                elif chosen.any():
                    parts = [values[e - n : e] for e, n, c in zip(ends.tolist(), lengths.tolist(), chosen) if c]
                    writer.add(split, np.concatenate(parts), lengths[chosen])
            tokens += len(values)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - started):,.0f} tokens/s", refresh=False)


class CorpusWriter:
    """A prepared-data folder written beside `output` as documents come (`add`), renamed into place by
    `finish` after the manifest; leaving the `with` block without `finish` removes it."""

    def __init__(self, output: Path, tok: Tokenizer, shard_tokens: int = 4_000_000,
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.output, self.tok, self.piece_bytes = Path(output), tok, piece_bytes
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.output.parent / f".{self.output.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.dtype = stored_dtype(tok.vocab_size)
        self.writers = {
            s: _ShardWriter(self.tmp, s, self.dtype, shard_tokens, tok.vocab_size, piece_bytes) for s in SPLITS
        }

    def __enter__(self) -> CorpusWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def add(self, split: str, values: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of `split`: `lengths` long, laid end to end in `values`, each ending in eos."""
        self.writers[split].add(values, lengths)

    def finish(self, **fields: Any) -> dict[str, Any]:
        """The manifest (with `fields`: seed, val_fraction, source), written last; returns it."""
        splits = {s: w.close() for s, w in self.writers.items()}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tokenizer": self.tok.save(self.tmp),
            "dtype": np.dtype(self.dtype).name,
            "piece_bytes": self.piece_bytes,
            **{k: fields.pop(k) for k in ("seed", "val_fraction") if k in fields},
            "splits": splits,
            **fields,
            "unigram_entropy_nats": _entropy(self.writers["train"].counts),
        }
        (self.tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        checked = time.time_ns()
        _replace_dir(self.tmp, self.output)
        # Hashed as written: the next start on this machine need not hash them again.
        remember_checked(self.output, {s["file"]: s["sha256"] for e in splits.values() for s in e["shards"]}, checked)
        return manifest


class _ShardWriter:
    """Buffers documents and writes `{split}-NNNNN.parquet` every `shard_tokens` tokens (a document is never
    cut: a shard may run over by one document)."""

    def __init__(self, folder: Path, split: str, dtype: type, shard_tokens: int, vocab_size: int,
                 piece_bytes: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.piece_bytes, self.pieces_file = piece_bytes, f"{split}.pieces"
        self.values: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.buffered = 0
        self.tokens = 0
        self.shards: list[dict[str, Any]] = []
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, values: np.ndarray, lengths: np.ndarray) -> None:
        ends = np.cumsum(lengths)
        start = 0
        while start < len(lengths):  # cut the batch where a shard fills
            room = self.shard_tokens - self.buffered
            stop = min(int(np.searchsorted(ends, (ends[start - 1] if start else 0) + room)) + 1, len(lengths))
            begin, end = (int(ends[start - 1]) if start else 0), int(ends[stop - 1])
            self.values.append(values[begin:end].astype(self.dtype, copy=False))
            self.lengths.append(np.asarray(lengths[start:stop]))
            self.buffered += end - begin
            self.tokens += end - begin
            if self.buffered >= self.shard_tokens:
                self._flush()
            start = stop

    def close(self) -> dict[str, Any]:
        if self.values:
            self._flush()
        return {
            "tokens": sum(s["tokens"] for s in self.shards),
            "documents": sum(s["documents"] for s in self.shards),
            "pieces_file": self.pieces_file,  # each piece's sha256, shard by shard (`trainers.data.shards`)
            "shards": self.shards,
        }

    def _flush(self) -> None:
        values, lengths = np.concatenate(self.values), np.concatenate(self.lengths)
        buf, values_offset = encode_shard(values, lengths)
        sha256, pieces = piece_digests(buf, self.piece_bytes)
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        with open(self.folder / name, "wb") as f:
            f.write(buf)
        self.counts += np.bincount(values, minlength=len(self.counts))
        entry = {"file": name, "tokens": len(values), "documents": len(lengths), "bytes": buf.size, "sha256": sha256}
        if values_offset is not None:  # read in place; else decoded whole (`trainers.data.shards`)
            with open(self.folder / self.pieces_file, "ab") as f:
                entry |= {"values_offset": values_offset, "pieces_offset": f.tell(),
                          "pieces_sha256": hashlib.sha256(pieces).hexdigest()}
                f.write(pieces)
        self.shards.append(entry)
        self.values, self.lengths, self.buffered = [], [], 0


def _entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of the unigram distribution: the loss of a model that learnt only frequencies."""
    total = counts.sum()
    if total == 0:
        return math.nan
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def _check_splits(writer: CorpusWriter, stats: _SourceStats, skipped: Skipped, inputs: list[Path],
                  val_fraction: float) -> None:
    if stats.documents == 0:
        why = "; ".join(skipped.notes()) or "nothing to read"
        raise ConfigError(f"--input {_show(inputs)}: no text found ({why}); fix: {_MORE}")
    for split in SPLITS:
        if writer.writers[split].tokens == 0:
            raise ConfigError(
                f"the {split} split is empty ({stats.documents} documents, --val-fraction={val_fraction}); "
                f"fix: add more text to --input or change --val-fraction (or --seed)"
            )


def _replace_dir(tmp: Path, output: Path) -> None:
    """Move the finished folder into place; an earlier one is swapped out first, then removed."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        output.rename(old)
    tmp.rename(output)
    if old is not None:
        shutil.rmtree(old)
