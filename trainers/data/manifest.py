"""The manifest of a prepared-data folder: the one reader that `check_inputs`, the dataset and the
tokenizer share, so that every bad manifest or shard gets the same one-line error naming the file and the fix.
No numpy or pyarrow here: `check_inputs` runs in the driver before any worker starts.

A local shard is hashed once per machine: a record of its stat when its sha256 was last found right
(`cache_root()/checked`) spares the hash at later starts while the file is unchanged. A shard in a bucket is
checked for size here, its bytes where a worker reads them (`trainers.data.shards`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from trainers._base import ConfigError
from trainers.storage import (
    cache_root,
    cached_copy,
    local_path,
    location,
    one_line_errors,
    sha256_of,
    size_of,
    write_json_atomic,
)

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST_FILE", "SPLITS", "check_shard", "fetch_shard",
           "read_manifest", "remember_checked", "shard_problem"]

FORMAT = "raytrain-tokens"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val")

# Every key a reader of the manifest uses, and its JSON type.
_KEYS = {"tokenizer.kind": str, "tokenizer.vocab_size": int} | {
    f"splits.{split}.{key}": kind for split in SPLITS for key, kind in (("tokens", int), ("shards", list))
}
_SHARD_KEYS = {"file": str, "tokens": int, "sha256": str}
# What in-place readers use (`trainers.data.shards`), where a folder has it.
_OPTIONAL_SHARD_KEYS = {"bytes": int, "values_offset": int, "pieces_offset": int, "pieces_sha256": str}
_JSON_NAMES = {str: "string", int: "integer", list: "list", dict: "object"}
_CHANGED = f"does not match its sha256 in {MANIFEST_FILE} (corrupted or changed)"


def _fix(data_dir: str | Path) -> str:
    return f"fix: run `raytrain data prepare --input TEXT_DIR --output {data_dir}` or correct data.path"


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of `data_dir`, with every key its readers use; a one-line ConfigError if it is missing,
    unreadable (empty, truncated), not ours, of another version or incomplete."""
    path = location(data_dir) / MANIFEST_FILE
    where, fix = f"data.path={data_dir}: {MANIFEST_FILE}", _fix(data_dir)
    with one_line_errors(path, f"data.path={data_dir}"):  # a store's errors (no bucket, denied) as one line
        present = path.is_file()
    if not present:
        raise ConfigError(f"data.path={data_dir}: no {MANIFEST_FILE} there; {fix}")
    manifest = _parse(path, where, fix)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{where} is not a {FORMAT} manifest (format={manifest.get('format')!r}); {fix}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{where}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION} "
                          f"(written by another version); {fix}")
    for key, kind in _KEYS.items():
        _expect(_lookup(manifest, key), kind, f"{where}: {key}", fix)
    for split in SPLITS:
        for i, shard in enumerate(manifest["splits"][split]["shards"]):
            entry = f"{where}: splits.{split}.shards[{i}]"
            _expect(shard, dict, entry, fix)
            for key, kind in (_SHARD_KEYS | _OPTIONAL_SHARD_KEYS).items():
                if key in _SHARD_KEYS or key in shard:
                    _expect(shard.get(key), kind, f"{entry}.{key}", fix)
        if "pieces_file" in manifest["splits"][split]:
            _expect(manifest["splits"][split]["pieces_file"], str, f"{where}: splits.{split}.pieces_file", fix)
    if "piece_bytes" in manifest:
        _expect(manifest["piece_bytes"], int, f"{where}: piece_bytes", fix)
    return manifest


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


def shard_problem(data_dir: str | Path, shard: dict[str, Any], what: str) -> ConfigError:
    """The one-line error for a shard that is not as the manifest says: `what` is wrong with it."""
    return ConfigError(f"data.path={data_dir}: shard {shard['file']} {what}; {_fix(data_dir)}")


def check_shard(data_dir: str | Path, shard: dict[str, Any]) -> Path:
    """The path of one shard of the manifest, present at its recorded size and sha256 (else ConfigError).
    A remote shard is checked for presence and size only (its bytes are checked where they are read); a local
    one is hashed unless this machine checked it before and it has not changed since (`remember_checked`)."""
    path = location(data_dir) / shard["file"]
    size = size_of(path)
    if size is None:
        raise shard_problem(data_dir, shard, "is missing")
    if "bytes" in shard and size != shard["bytes"]:  # older manifests have no size
        what = f"is {size} bytes, {MANIFEST_FILE} says {shard['bytes']} (truncated?)"
        raise shard_problem(data_dir, shard, what)
    if local_path(path) is None or _checked_before(path, shard["sha256"]):
        return path
    started = time.time_ns()
    if sha256_of(path) != shard["sha256"]:
        raise shard_problem(data_dir, shard, _CHANGED)
    remember_checked(path.parent, {path.name: shard["sha256"]}, started)
    return path


def fetch_shard(data_dir: str | Path, shard: dict[str, Any], cache: bool = True) -> Path | bytes:
    """One shard, checked against its sha256: a local path (a local shard, or a remote one's copy in this
    machine's cache), or, for a remote shard with `cache` off, its bytes."""
    path = check_shard(data_dir, shard)
    if local_path(path) is not None:  # checked in place
        return path
    if cache:
        found: Path | bytes | None = cached_copy(path, shard["sha256"], shard.get("bytes"))
    else:
        found = path.read_bytes()
        found = found if hashlib.sha256(found).hexdigest() == shard["sha256"] else None
    if found is None:
        raise shard_problem(data_dir, shard, _CHANGED)
    return found


# ---------------------------------------------------------------- shards this machine has checked

# A record is trusted only when the file had been unchanged this long when it was checked: a change within
# the file system's timestamp granularity of the previous one could otherwise leave size and times as they
# were (git's "racy clean" case).
_SETTLED_NS = 2_000_000_000
_records: dict[Path, dict[str, Any]] = {}  # checked/<folder>.json of each folder, as this process last wrote or read it


def _stat_key(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _record_file(folder: Path) -> Path:
    name = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    return cache_root() / "checked" / f"{name}.json"


def _folder_records(folder: Path) -> dict[str, Any]:
    folder = folder.resolve()
    if folder not in _records:
        try:
            data = json.loads(_record_file(folder).read_text())
        except (OSError, ValueError):
            data = {}
        _records[folder] = data.get("files", {}) if isinstance(data, dict) and data.get("folder") == str(folder) else {}
    return _records[folder]


def _checked_before(path: Path, sha256: str) -> bool:
    entry = _folder_records(path.parent).get(path.name)
    if not isinstance(entry, dict) or entry.get("sha256") != sha256:
        return False
    try:
        key = _stat_key(path)
    except OSError:
        return False
    return entry.get("stat") == key and entry.get("checked_ns", 0) - max(key[1], key[2]) > _SETTLED_NS


def remember_checked(folder: Path, files: dict[str, str], checked_ns: int) -> None:
    """Record that the local files `folder/name` held the sha256s `files` gives at `checked_ns` (time.time_ns()
    before they were read or written): later `check_shard`s on this machine skip the hash while a file stays
    unchanged. A record that cannot be written costs only a hash more at the next start."""
    with contextlib.suppress(OSError):
        records = _folder_records(folder)
        for name, sha256 in files.items():
            records[name] = {"sha256": sha256, "stat": _stat_key(folder / name), "checked_ns": checked_ns}
        path = _record_file(folder)
        if not path.exists():
            _forget_gone_folders(path.parent)
        write_json_atomic(path, {"folder": str(folder.resolve()), "files": records}, indent=None)


def _forget_gone_folders(records: Path, keep: int = 64) -> None:
    """Past `keep` record files, remove those of folders that are no longer there (temporary ones, mostly)."""
    files = list(records.glob("*.json"))
    if len(files) <= keep:
        return
    for f in files:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if not Path(json.loads(f.read_text()).get("folder", "")).is_dir():
                f.unlink()
