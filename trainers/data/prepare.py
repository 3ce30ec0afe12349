"""Text files to token shards: `raytrain data prepare`.

Layout of the output folder (written to a temp folder, then renamed into place):
    manifest.json          format, tokenizer, splits (shards with token counts, bytes and sha256), source stats
    tokenizer.json         bpe, or a model folder's (--tokenizer HF_DIR)
    train-00000.parquet    one row per document, column `tokens` list<uint16|uint32>, each row ends in eos
    val-00000.parquet
A document goes to val when a hash of (seed, its relative path) falls below val_fraction, so adding a
file never moves another one between splits.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import sysconfig
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from trainers._base import ConfigError
from trainers.data.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    SPLITS,
    file_sha256,
)
from trainers.data.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    PretrainedTokenizer,
    Tokenizer,
)
from trainers.storage import check_location, is_uri, location

__all__ = ["default_corpus", "prepare_corpus"]

# Standard-library parts that are not ordinary source: third-party code, tests, GUI, generated tables.
_STDLIB_SKIP = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "distutils",
    "tkinter", "turtledemo", "ensurepip", "encodings", "pydoc_data", "__phello__", "__pycache__",
    "lib-dynload",
}  # fmt: skip
_TEST_DIRS = {"test", "tests", "idle_test"}
_BATCH_BYTES = 1 << 20  # text encoded per encode_batch call: big enough for Rust threads, small in memory


@dataclass
class _File:
    path: Path
    key: str  # relative path (posix) that decides the split
    size: int


@dataclass
class _SourceStats:
    files_read: int = 0
    files_skipped: int = 0  # unreadable, binary (NUL bytes or not UTF-8) or empty
    bytes: int = 0


@dataclass(frozen=True)
class _Plan:
    """What to read and how to split it; both passes (bpe training, encoding) read through it."""

    files: list[_File]
    seed: int
    val_fraction: float
    max_bytes: int | None
    progress: bool

    def is_val(self, key: str) -> bool:
        digest = hashlib.sha256(f"{self.seed}\0{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.val_fraction

    def documents(self, stats: _SourceStats, desc: str) -> Iterator[tuple[str, str]]:
        """(key, text) of each readable file, stopping once `max_bytes` have been read."""
        total = sum(f.size for f in self.files)
        total = min(total, self.max_bytes) if self.max_bytes is not None else total
        with tqdm(
            total=total, desc=desc, unit="B", unit_scale=True, disable=not self.progress, leave=False
        ) as bar:
            for f in self.files:
                if self.max_bytes is not None and stats.bytes >= self.max_bytes:
                    break
                got = _read_text(f.path)
                bar.update(f.size)
                if got is None:
                    stats.files_skipped += 1
                    continue
                stats.files_read += 1
                stats.bytes += got[1]
                yield f.key, got[0]


def prepare_corpus(
    inputs: list[Path],
    output: Path,
    tokenizer: str = "byte",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    include: str = "*.py,*.txt,*.md,*.rst",
    max_bytes: int | None = None,
    shard_tokens: int = 4_000_000,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize the text files under `inputs` into train/val Parquet shards at `output`; returns the manifest."""
    output, inputs = Path(output), [Path(p) for p in inputs]
    patterns = _check_args(
        inputs, output, tokenizer, vocab_size, val_fraction, include, max_bytes, shard_tokens
    )
    files = _list_files(inputs, patterns)
    if not files:
        raise ConfigError(f"--input {_show(inputs)}: no files match --include {include}; fix: {_MORE}")
    plan = _Plan(files, seed, val_fraction, max_bytes, progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tok = _build_tokenizer(tokenizer, vocab_size, plan)
        stats = _SourceStats()
        splits, counts = _write_splits(tmp, tok, plan, shard_tokens, stats)
        _check_splits(splits, stats, inputs, val_fraction)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tokenizer": tok.save(tmp),
            "dtype": _dtype(tok.vocab_size).__name__,
            "seed": seed,
            "val_fraction": val_fraction,
            "splits": splits,
            "source": {"inputs": [str(p) for p in inputs], "include": patterns, "max_bytes": max_bytes}
            | asdict(stats),
            "unigram_entropy_nats": _entropy(counts),
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace_dir(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def default_corpus() -> list[Path]:
    """The Python standard library's own source: text on every machine, the demo corpus.

    Returns folders and top-level modules; packages that hold a test folder are returned as their
    other children, so tests, third-party code and generated tables stay out.
    """
    return _corpus_paths(Path(sysconfig.get_paths()["stdlib"]))


# ----------------------------------------------------------------------------------------- arguments

_MORE = "pass folders or files with text, or widen --include"


def _show(inputs: list[Path]) -> str:
    """Inputs for a one-line message: the first few only."""
    shown = " ".join(map(str, inputs[:3]))
    return shown + (f" (and {len(inputs) - 3} more)" if len(inputs) > 3 else "")


def _check_args(
    inputs: list[Path],
    output: Path,
    tokenizer: str,
    vocab_size: int,
    val_fraction: float,
    include: str,
    max_bytes: int | None,
    shard_tokens: int,
) -> list[str]:
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
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens={shard_tokens} must be positive; fix: e.g. 4_000_000")
    patterns = [g.strip() for g in include.split(",") if g.strip()]
    if not patterns:
        raise ConfigError(f"--include {include!r} holds no glob; fix: e.g. --include '*.py,*.txt'")
    _check_output(output)
    return patterns


def _check_output(output: Path) -> None:
    """Overwrite only an earlier prepared-data folder (or an empty one): never a user's other files."""
    if not output.exists():
        return
    fix = "fix: choose a new --output folder or remove it"
    if not output.is_dir():
        raise ConfigError(f"--output {output} is a file; {fix}")
    if any(output.iterdir()) and not _is_prepared(output):
        raise ConfigError(f"--output {output} exists and is not a prepared-data folder; {fix}")


# Every file prepare_corpus writes into an output folder (the shard names of _ShardWriter._flush).
_OUTPUT_NAME = re.compile(rf"(train|val)-\d{{5}}\.parquet|{re.escape(TOKENIZER_FILE)}|{re.escape(MANIFEST_FILE)}")


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


# ------------------------------------------------------------------------------------------ sources


def _corpus_paths(folder: Path) -> list[Path]:
    out: list[Path] = []
    for p in sorted(folder.iterdir()):
        if p.name in _STDLIB_SKIP or p.name.startswith((".", "config-", "_sysconfigdata")):
            continue
        if p.is_dir():
            out += _corpus_paths(p) if _holds_tests(p) else [p]
        elif p.suffix == ".py":
            out.append(p)
    return out


def _holds_tests(folder: Path) -> bool:
    return any(d.name in _TEST_DIRS for d in folder.rglob("*") if d.is_dir())


def _list_files(inputs: list[Path], patterns: list[str]) -> list[_File]:
    """Files in a deterministic order; a file named directly is taken whatever its name."""
    files: dict[Path, _File] = {}
    for root in (p.resolve() for p in inputs):
        if root.is_file():
            found = [root]
        else:
            found = [p for p in _walk(root) if any(fnmatch.fnmatch(p.name, g) for g in patterns)]
        for p in found:
            # Relative to the input's parent: the folder name is part of the key, the machine is not.
            key = p.relative_to(root.parent).as_posix()
            files.setdefault(p, _File(p, key, p.stat().st_size))
    return sorted(files.values(), key=lambda f: f.key)


def _walk(folder: Path) -> Iterator[Path]:
    """Files under `folder`, skipping hidden folders (.git, .venv) and __pycache__."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            yield Path(dirpath) / name


def _read_text(path: Path) -> tuple[str, int] | None:
    """(text, bytes), or None for a file that is unreadable, binary or empty."""
    try:
        raw = path.read_bytes()
        if not raw or b"\0" in raw:
            return None
        return raw.decode("utf-8"), len(raw)
    except (OSError, UnicodeDecodeError):
        return None


# ------------------------------------------------------------------------------------------- tokens


def _build_tokenizer(kind: str, vocab_size: int, plan: _Plan) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":  # a model folder: its tokenizer.json as it is
        return PretrainedTokenizer.from_folder(location(kind))
    # Merges are learnt from the train split only, so val stays unseen text.
    docs = plan.documents(_SourceStats(), "train bpe")
    return BPETokenizer.train((text for key, text in docs if not plan.is_val(key)), vocab_size)


def _dtype(vocab_size: int) -> type[np.unsignedinteger]:
    return np.uint16 if vocab_size < 1 << 16 else np.uint32


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


def _write_splits(
    folder: Path, tok: Tokenizer, plan: _Plan, shard_tokens: int, stats: _SourceStats
) -> tuple[dict[str, Any], np.ndarray]:
    """Encode every document into its split's shards; returns the splits entry and train token counts."""
    dtype = _dtype(tok.vocab_size)
    writers = {s: _ShardWriter(folder, s, dtype, shard_tokens, tok.vocab_size) for s in SPLITS}
    eos = np.array([tok.eos_id], dtype=dtype)
    for batch in _batches(plan.documents(stats, "tokenize")):
        for (key, _), ids in zip(batch, tok.encode_batch([text for _, text in batch])):
            writers["val" if plan.is_val(key) else "train"].add(np.concatenate([ids.astype(dtype), eos]))
    return {s: w.close() for s, w in writers.items()}, writers["train"].counts


class _ShardWriter:
    """Buffers documents and writes `{split}-NNNNN.parquet` every `shard_tokens` tokens."""

    def __init__(self, folder: Path, split: str, dtype: type, shard_tokens: int, vocab_size: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.rows: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict[str, Any]] = []
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, doc: np.ndarray) -> None:
        self.rows.append(doc)
        self.buffered += len(doc)
        if self.buffered >= self.shard_tokens:
            self._flush()

    def close(self) -> dict[str, Any]:
        if self.rows:
            self._flush()
        return {
            "tokens": sum(s["tokens"] for s in self.shards),
            "documents": sum(s["documents"] for s in self.shards),
            "shards": self.shards,
        }

    def _flush(self) -> None:
        values = np.concatenate(self.rows)
        offsets = np.zeros(len(self.rows) + 1, dtype=np.int32)
        np.cumsum([len(r) for r in self.rows], out=offsets[1:])
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        pq.write_table(pa.table({"tokens": column}), self.folder / name, compression="zstd")
        self.counts += np.bincount(values, minlength=len(self.counts))
        self.shards.append(
            {
                "file": name,
                "tokens": len(values),
                "documents": len(self.rows),
                "bytes": (self.folder / name).stat().st_size,  # so that a truncated shard is named as such
                "sha256": file_sha256(self.folder / name),
            }
        )
        self.rows, self.buffered = [], 0


def _entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of the unigram distribution: the loss of a model that learnt only frequencies."""
    total = counts.sum()
    if total == 0:
        return math.nan
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def _check_splits(
    splits: dict[str, Any], stats: _SourceStats, inputs: list[Path], val_fraction: float
) -> None:
    if stats.files_read == 0:
        raise ConfigError(
            f"--input {_show(inputs)}: no text found ({stats.files_skipped} files skipped as "
            f"binary, unreadable or empty); fix: {_MORE}"
        )
    for split in SPLITS:
        if splits[split]["documents"] == 0:
            raise ConfigError(
                f"the {split} split is empty ({stats.files_read} documents, --val-fraction={val_fraction}); "
                f"fix: add more text files to --input or change --val-fraction (or --seed)"
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
