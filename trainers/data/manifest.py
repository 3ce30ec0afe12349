"""The manifest of a prepared-data folder: the one reader that `check_inputs`, the dataset and the
tokenizer share, so that every bad manifest or shard gets the same one-line error naming the file and the fix.

No numpy or pyarrow here: `check_inputs` runs in the driver before any worker starts.

`data.path` may be a URI (s3://, gs://: `trainers.storage`): the driver checks that each shard is there at
its recorded size; a worker fetches each shard whole (once per machine into the local cache, or into
memory) and checks its sha256 before reading it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trainers._base import ConfigError
from trainers.storage import cached_copy, local_path, location, one_line_errors, sha256_of, size_of

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "SPLITS",
    "check_shard",
    "fetch_shard",
    "file_sha256",
    "read_manifest",
]

FORMAT = "raytrain-tokens"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val")

# Every key a reader of the manifest uses, and its JSON type.
_KEYS = {"tokenizer.kind": str, "tokenizer.vocab_size": int} | {
    f"splits.{split}.{key}": kind for split in SPLITS for key, kind in (("tokens", int), ("shards", list))
}
_SHARD_KEYS = {"file": str, "tokens": int, "sha256": str}
_JSON_NAMES = {str: "string", int: "integer", list: "list", dict: "object"}


def _fix(data_dir: str | Path) -> str:
    return f"fix: run `raytrain data prepare --input TEXT_DIR --output {data_dir}` or correct data.path"


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of `data_dir`, with every key its readers use; a one-line ConfigError if it is missing,
    unreadable (empty, truncated), not ours, of another version or incomplete."""
    path = location(data_dir) / MANIFEST_FILE
    where, fix = f"data.path={data_dir}: {MANIFEST_FILE}", _fix(data_dir)
    if not _is_file(path, f"data.path={data_dir}"):
        raise ConfigError(f"data.path={data_dir}: no {MANIFEST_FILE} there; {fix}")
    manifest = _parse(path, where, fix)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{where} is not a {FORMAT} manifest (format={manifest.get('format')!r}); {fix}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{where}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION} (written by "
            f"another version); {fix}"
        )
    for key, kind in _KEYS.items():
        _expect(_lookup(manifest, key), kind, f"{where}: {key}", fix)
    for split in SPLITS:
        for i, shard in enumerate(manifest["splits"][split]["shards"]):
            entry = f"{where}: splits.{split}.shards[{i}]"
            _expect(shard, dict, entry, fix)
            for key, kind in _SHARD_KEYS.items():
                _expect(shard.get(key), kind, f"{entry}.{key}", fix)
    return manifest


def _is_file(path: Any, where: str) -> bool:
    """`path.is_file()`, with a store's errors (no bucket, no credentials, denied) as one line."""
    with one_line_errors(path, where):
        return path.is_file()


def _parse(path: Path, where: str, fix: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} is unreadable ({e}); {fix}") from None
    if not text.strip():
        raise ConfigError(f"{where} is empty; {fix}")
    try:
        manifest = json.loads(text)
    except ValueError as e:  # a truncated file ends inside an object
        raise ConfigError(f"{where} is not valid JSON ({e}: truncated?); {fix}") from None
    _expect(manifest, dict, where, fix)
    return manifest


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _expect(value: Any, kind: type, what: str, fix: str) -> None:
    # bool is an int to Python, not to JSON
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        found = "missing" if value is None else f"a JSON {_JSON_NAMES.get(type(value), type(value).__name__)}"
        raise ConfigError(f"{what} should be a JSON {_JSON_NAMES[kind]}, found {found}; {fix}")


def check_shard(data_dir: str | Path, shard: dict[str, Any]) -> Path:
    """The path of one shard of the manifest, present at its recorded size and sha256 (else ConfigError).
    A remote shard is checked for presence and size only (its bytes are hashed where they are read:
    `fetch_shard`)."""
    path = location(data_dir) / shard["file"]
    what = f"data.path={data_dir}: shard {shard['file']}"
    fix = _fix(data_dir)
    size = size_of(path)
    if size is None:
        raise ConfigError(f"{what} is missing; {fix}")
    if "bytes" in shard and size != shard["bytes"]:  # older manifests have no size
        raise ConfigError(f"{what} is {size} bytes, {MANIFEST_FILE} says {shard['bytes']} (truncated?); {fix}")
    if local_path(path) is None:  # hashed where it is read
        return path
    if file_sha256(path) != shard["sha256"]:
        raise ConfigError(f"{what} does not match its sha256 in {MANIFEST_FILE} (corrupted or changed); {fix}")
    return path


def fetch_shard(data_dir: str | Path, shard: dict[str, Any], cache: bool = True) -> Path | bytes:
    """One shard, checked against its sha256: a local path (a local shard, or a remote one's copy in this
    machine's cache), or, for a remote shard with `cache` off, its bytes."""
    path = check_shard(data_dir, shard)
    if local_path(path) is not None:  # checked in place
        return path
    what = f"data.path={data_dir}: shard {shard['file']}"
    bad = f"{what} does not match its sha256 in {MANIFEST_FILE} (corrupted or changed); {_fix(data_dir)}"
    if cache:
        local = cached_copy(path, shard["sha256"], shard.get("bytes"))
        if local is None:
            raise ConfigError(bad)
        return local
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != shard["sha256"]:
        raise ConfigError(bad)
    return data


def file_sha256(path: Path) -> str:
    return sha256_of(path)
