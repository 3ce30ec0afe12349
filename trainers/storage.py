"""Where a run's files live: a local folder (a `pathlib.Path`) or an fsspec URI (`s3://bucket/prefix`,
`gs://bucket/prefix`, any protocol fsspec knows) as a `upath.UPath`, which reads like a Path. What differs
(no atomic rename on an object store, no fsync, no flock, no append, no folders) is behind the operations
here, so that callers never branch on where a location is.

Credentials, endpoints and regions come from the environment as each library reads them (for S3 the AWS
chain and `AWS_ENDPOINT_URL`, for GCS application default credentials), never from our files;
`check_location` turns what goes wrong into one ConfigError line before any worker starts.
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

from trainers._base import ConfigError

__all__ = [
    "Location",
    "absolute",
    "append_bytes",
    "commit_folder",
    "copy_tree",
    "cache_root",
    "cached_copy",
    "check_location",
    "describe_error",
    "ensure_folder",
    "is_remote",
    "is_uri",
    "is_within",
    "list_files",
    "list_names",
    "list_sizes",
    "local_folder",
    "local_path",
    "location",
    "occupied",
    "one_line_errors",
    "poll_interval",
    "publish",
    "ray_storage",
    "read_appended",
    "read_range",
    "remove_tree",
    "sha256_of",
    "staging_folder",
    "start_folder",
    "working_copy",
    "write_bytes_atomic",
    "write_folder",
    "write_text_atomic",
]

_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # pip extras of raytrain-ext per protocol


def is_uri(value: Any) -> bool:
    """A URI with a protocol other than file:// (which is a local path)."""
    if not isinstance(value, str):
        value = str(value) if _is_upath(value) else ""
    match = _URI.match(value)
    return match is not None and match.group(1).lower() not in ("file", "local")


def _is_upath(value: Any) -> bool:
    return type(value).__module__.startswith("upath")


def is_remote(path: Any) -> bool:
    """Whether `path` (a location) is on a remote file system (an object store)."""
    return _is_upath(path) and not isinstance(path, Path)


def location(value: str | os.PathLike | Any) -> Path | Any:
    """A local `Path`, or a `UPath` for a URI (one line naming the pip extra when its file system is not
    installed)."""
    if is_remote(value) or isinstance(value, Path):
        return value
    text = str(value)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    if not is_uri(text):
        return Path(text)
    protocol = _URI.match(text).group(1).lower()
    try:
        from upath import UPath

        # No listings cache: other processes (the other ranks, the driver) write under the same prefixes.
        options = {"use_listings_cache": False} if protocol in _EXTRA else {}
        path = UPath(text.rstrip("/"), **options)
        path.fs  # noqa: B018  (imports the protocol's fsspec implementation: s3fs, gcsfs, ...)
    except ImportError as e:
        extra = _EXTRA.get(protocol)
        fix = f"pip install 'raytrain-ext[{extra}]'" if extra else f"install the fsspec package for {protocol}://"
        raise ConfigError(f"{text}: no file system for {protocol}:// here ({e}); fix: {fix}") from None
    except ValueError as e:  # an unknown protocol
        raise ConfigError(f"{text}: {e}; fix: use a local path or an s3://, gs:// URI") from None
    return path


# A run-config field that holds a local path or a URI (`run_dir`, `data.path`, `model.init_from`).
Location = Annotated[
    Any,
    BeforeValidator(lambda v: v if v is None else location(v)),
    PlainSerializer(lambda v: None if v is None else str(v), when_used="json"),
    WithJsonSchema({"type": "string", "description": "a local path or an fsspec URI (s3://, gs://)"}),
]


def fs_and_path(path: Any) -> tuple[Any, str]:
    """(fsspec file system, path on it) of a location."""
    if is_remote(path):
        return path.fs, path.path
    import fsspec

    return fsspec.filesystem("file"), str(Path(path).absolute())


def write_bytes_atomic(path: Any, data: bytes) -> None:
    """Readers see the old content or the new, never a part: a rename locally, one PUT on an object store
    (an object appears whole or not at all)."""
    if is_remote(path):
        path.fs.pipe_file(path.path, data)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Any, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: Any, obj: Any, indent: int | None = 1, default: Any = None) -> None:
    """`obj` as JSON, whole or not at all (`write_bytes_atomic`): every JSON file this package writes."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=default) + "\n")


def append_bytes(path: Any, data: bytes, current: bytes | None = None) -> bytes | None:
    """Append to a small file that only this process writes (a trial's lineage). An object store has no
    append: the object is replaced whole by one PUT, and the content after is returned, to pass as `current`
    next time and spare the GET; locally None (a reader may see the last line cut, as a crash leaves it)."""
    if not is_remote(path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            f.write(data)
        return None
    before = current if current is not None else (read_bytes(path) or b"")
    write_bytes_atomic(path, before + data)
    return before + data


def list_sizes(folder: Any, pattern: str = "*") -> dict[str, int]:
    """{name: bytes} of the files directly in `folder` whose names match `pattern` (none if it is not
    there): one listing, also on an object store."""
    if not is_remote(folder):
        folder = Path(folder)
        return {p.name: p.stat().st_size for p in folder.glob(pattern) if p.is_file()} if folder.is_dir() else {}
    try:
        entries = folder.fs.ls(folder.path, detail=True)
    except FileNotFoundError:
        return {}
    files = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries if e.get("type") == "file"}
    return {name: int(e["size"]) for name, e in files.items() if fnmatch.fnmatchcase(name, pattern)}


def copy_tree(src: Any, dst: Any, last: str | None = None, exclude: str | None = None) -> None:
    """Copy the remote folder `src` to `dst` on the same store, object by object on the server (the bytes
    do not pass through this machine); the file named `last` (e.g. a commit marker) after all others, the
    file named `exclude` not at all. A local `src` is uploaded (`last` last too)."""
    if not is_remote(src):
        upload_folder(src, dst, last=last, exclude=exclude)
        return
    base = src.path.rstrip("/") + "/"
    names = [n for n in list_files(src) if n != exclude]
    first = [n for n in names if n != last]
    if first:
        src.fs.copy([base + n for n in first], [f"{dst.path}/{n}" for n in first])
    if last in names:
        src.fs.copy(base + last, f"{dst.path}/{last}")


def remove_tree(path: Any, first: str | None = None) -> None:
    """Delete a folder and everything under it; a missing one is fine. `first`: a file deleted before the
    rest (a commit marker: a folder half deleted by a crash is never taken for a whole one)."""
    if first is not None:
        remove_file(path / first)
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        path.fs.rm(path.path, recursive=True)


def remove_file(path: Any) -> None:
    """Delete a file; a missing one is fine."""
    if not is_remote(path):
        Path(path).unlink(missing_ok=True)
        return
    with contextlib.suppress(FileNotFoundError):
        path.fs.rm_file(path.path)


def sha256_of(path: Any) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def size_of(path: Any) -> int | None:
    """Bytes of a file, None when it is not there."""
    if not is_remote(path):
        path = Path(path)
        return path.stat().st_size if path.is_file() else None
    try:
        info = path.fs.info(path.path)
    except FileNotFoundError:
        return None
    return int(info["size"]) if info.get("type") == "file" else None


# --------------------------------------------------------------------------------------- local cache


def cache_root() -> Path:
    """This machine's cache of remote files (`RAYTRAIN_CACHE`, default ~/.cache/raytrain)."""
    return Path(os.environ.get("RAYTRAIN_CACHE") or Path.home() / ".cache" / "raytrain")


def cached_copy(path: Any, sha256: str, size: int | None = None) -> Path | None:
    """A local copy of the remote file `path` whose content has the given sha256, downloaded once per machine
    (shared by its ranks: named by the hash, renamed into place whole). None when what the store holds does
    not match `sha256` (the caller says so in its own words)."""
    folder = cache_root() / "blobs"
    final = folder / sha256
    if final.is_file() and (size is None or final.stat().st_size == size):
        return final
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{sha256}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
    digest = hashlib.sha256()
    try:
        with path.open("rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != sha256:
            return None
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def describe_error(error: BaseException, where: str) -> str | None:
    """One line for a storage error (`where`: e.g. "run_dir=s3://b/x"), or None when it is none we know."""
    name = type(error).__name__
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else name
    low = f"{name} {error}".lower()
    bucket = where.split("://", 1)[-1].split("/", 1)[0]
    if "nocredentials" in low or "unable to locate credentials" in low or "could not find default credentials" in low or "defaultcredentialserror" in low:
        return (
            f"{where}: no credentials for the store ({text}); fix: give this machine and every node credentials "
            f"(an instance role / service account, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            f"GOOGLE_APPLICATION_CREDENTIALS in the environment)"
        )
    if any(k in low for k in ("permanentredirect", "authorizationheadermalformed", "wrong region", "illegallocationconstraint", "region")):
        return (
            f"{where}: the bucket {bucket} is in another region than the client asks ({text}); fix: set "
            f"AWS_REGION / AWS_DEFAULT_REGION to the bucket's region"
        )
    if isinstance(error, PermissionError) or any(
        k in low for k in ("accessdenied", "access denied", "forbidden", "403", "invalidaccesskeyid", "signaturedoesnotmatch")
    ):
        return (
            f"{where}: permission denied ({text}); fix: grant this machine's role/credentials read and write "
            f"on the bucket {bucket} (s3:ListBucket, s3:GetObject, s3:PutObject, s3:DeleteObject)"
        )
    if isinstance(error, FileNotFoundError) or "nosuchbucket" in low:
        return f"{where}: no bucket {bucket} ({text}); fix: create it, or correct the URI"
    if isinstance(error, (ConnectionError, OSError)) or "endpoint" in low or "connect" in low:
        return f"{where}: the store cannot be reached ({name}: {text}); fix: check the network and AWS_ENDPOINT_URL"
    return None


def check_location(path: Any, what: str, write: bool) -> None:
    """Before any worker starts: the bucket of a remote location exists, credentials are there and, with
    `write`, an object can be written and deleted under it; ConfigError (one line) otherwise."""
    if not is_remote(path):
        return
    type(path.fs).clear_instance_cache()  # credentials as the environment has them now, not cached ones
    path = location(str(path))
    fs = path.fs
    bucket = path.path.split("/", 1)[0]
    with one_line_errors(path, f"{what}={path}"):
        if not fs.exists(bucket):
            fs.info(bucket)  # exists() hides why: ask again to get the error (a missing bucket raises)
            raise FileNotFoundError(f"NoSuchBucket: {bucket}")
        fs.ls(path.path, detail=False) if fs.isdir(path.path) else None
        if write:
            probe = f"{path.path}/.raytrain-write-probe-{uuid.uuid4().hex[:8]}"
            fs.pipe_file(probe, b"probe")
            fs.rm_file(probe)


def check_run_storage(cfg: Any) -> None:
    """A run's remote locations, before anything else reads them: `run_dir` writable, `data.path` and
    `model.init_from` readable (one line each way it can fail). Engines that write their own local files
    (DeepSpeed) are refused with a bucket run dir."""
    check_location(cfg.out_dir, "run_dir", write=True)
    check_location(cfg.data.path, "data.path", write=False)
    check_location(cfg.model.init_from, "model.init_from", write=False)  # every rank reads its part there
    mlflow = cfg.tracking.mlflow
    if is_remote(cfg.out_dir) and mlflow is not None and mlflow.tracking_uri is None:
        raise ConfigError(
            f"run_dir={cfg.out_dir}: tracking.mlflow without tracking_uri keeps a SQLite store in the run dir, "
            f"which cannot live in a bucket; fix: set tracking.mlflow.tracking_uri (your MLflow server, or "
            f"sqlite:////a/local/mlflow.db)"
        )
    if is_remote(cfg.out_dir) and cfg.parallel.engine == "deepspeed":
        raise ConfigError(
            f"run_dir={cfg.out_dir}: parallel.engine=deepspeed saves checkpoints to local folders only; fix: "
            f"use parallel.engine=fsdp (ZeRO-3 by FSDP2), ddp or none with a bucket, or a shared-file-system run_dir"
        )


def upload_folder(
    local: Path, dest: Any, last: str | None = "manifest.json", exclude: str | None = None
) -> None:
    """Copy a local folder's files to a remote location, `last` after all others (a reader that finds it
    finds the rest: the manifest of prepared data names each shard and its sha256), `exclude` not at all."""
    for name in sorted((n for n in list_files(local) if n != exclude), key=lambda n: n == last):
        dest.fs.put_file(str(Path(local) / name), f"{dest.path}/{name}")


def download_folder(src: Any, local: Path) -> Path:
    """Copy a remote folder's files under `local` (made if needed); returns `local`."""
    local = Path(local)
    for name in list_files(src):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        src.fs.get_file(f"{src.path.rstrip('/')}/{name}", str(local / name))
    return local


def default_root(kind: str) -> Any:
    """`$RAYTRAIN_STORAGE/<kind>` when set (a cluster's bucket: s3://bucket/runs), else the local `<kind>`."""
    base = os.environ.get("RAYTRAIN_STORAGE", "").strip()
    return location(f"{base.rstrip('/')}/{kind}") if base else Path(kind)


def read_bytes(path: Any) -> bytes | None:
    """A file's content, None when it is not there. On a store: one GET of the object as it is at that
    moment (a file replaced while it is read is never an error: the old or the new content)."""
    try:
        return path.fs.cat_file(path.path) if is_remote(path) else Path(path).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None


_buffers = threading.local()  # read_range's buffer per thread (checksums hash pieces on a thread pool)


def read_range(path: Any, offset: int, length: int) -> bytes | memoryview:
    """Bytes [offset, offset + length) of a file: one ranged GET on a store; locally one `preadv` into a
    buffer reused per thread (no fresh pages per read: the view is valid until this thread's next call)."""
    if is_remote(path):
        return path.fs.cat_file(path.path, start=offset, end=offset + length) if length else b""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < length:
        buffer = _buffers.buffer = bytearray(length)
    view = memoryview(buffer)[:length]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.preadv(fd, [view], offset)
    finally:
        os.close(fd)
    return view[:got]


def read_appended(path: Any, offset: int, version: Any = None) -> tuple[bytes | None, int, Any]:
    """What a growing file (sometimes replaced by a shorter one: a log rewound) holds from `offset` on:
    (bytes, or None when it is not there; the offset they start at; the version to pass next time). From 0
    again when the file is shorter than `offset` or another one than `version`, which may have grown past
    the old offset already: its inode locally; on a store, whose objects are replaced whole, the length and
    digest of what was read (a rewound object's bytes up to the old length differ)."""
    if is_remote(path):
        data = read_bytes(path)
        if data is None:
            return None, offset, version
        if version is not None:
            size, digest = version
            if len(data) < size or hashlib.blake2b(data[:size], digest_size=16).digest() != digest:
                offset = 0
        offset = 0 if len(data) < offset else offset
        return data[offset:], offset, (len(data), hashlib.blake2b(data, digest_size=16).digest())
    try:
        stat = Path(path).stat()
    except OSError:
        return None, offset, version
    if stat.st_ino != version or stat.st_size < offset:
        version, offset = stat.st_ino, 0
    with Path(path).open("rb") as f:
        f.seek(offset)
        return f.read(), offset, version


def poll_interval(path: Any, interval_s: float) -> float:
    """How often to look at a file for changes: `interval_s` locally, at least 2 s on a store (a GET per
    look; its files change at each checkpoint anyway)."""
    return max(interval_s, 2.0) if is_remote(path) else interval_s


def absolute(path: Any) -> Path | Any:
    """A location that names the same place from any working directory (Ray workers and Tune trials run in
    other folders): a local path resolved; a URI as it is."""
    path = location(path)
    return path if is_remote(path) else path.resolve()


def is_within(path: Any, folder: Any) -> bool:
    """Whether the location `path` is `folder` or under it."""
    path, folder = absolute(path), absolute(folder)
    if is_remote(path) or is_remote(folder):
        if not (is_remote(path) and is_remote(folder)) or path.protocol != folder.protocol:
            return False
        given, ours = path.path.strip("/"), folder.path.strip("/")
        return given == ours or given.startswith(ours + "/")
    return path.is_relative_to(folder)


def local_path(path: Any) -> Path | None:
    """The location as a path of this machine, for libraries that open files by name (flock, safetensors'
    memory map, DCP's file writer); None for one only fsspec reaches (`local_folder` downloads it)."""
    if is_remote(path) or is_uri(path):
        return None
    return location(path)


def ray_storage(path: Any) -> tuple[Any, str]:
    """(`storage_filesystem`, `storage_path`) for Ray Train/Tune: on a store the fsspec file system we write
    with and the path on it; locally None (Ray's own) and the path."""
    if not is_remote(path):
        return None, str(path)
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return PyFileSystem(FSSpecHandler(path.fs)), path.path


def ensure_folder(path: Any) -> None:
    """Make a folder (and its parents) where files are about to be written: an object store has no folders
    (an object's name is its whole path), so nothing there."""
    if not is_remote(path):
        Path(path).mkdir(parents=True, exist_ok=True)


def occupied(path: Any) -> bool:
    """Whether something is at `path`: a file, or a folder with anything in it."""
    if not is_remote(path):
        path = Path(path)
        return path.exists() and (not path.is_dir() or any(path.iterdir()))
    try:
        return bool(path.fs.ls(path.path, detail=False)) or path.fs.isfile(path.path)
    except FileNotFoundError:
        return False


def list_names(folder: Any, pattern: str = "*") -> list[str]:
    """Names of the entries (files and folders) directly in `folder` that match `pattern`, sorted; none
    when it is not there. One listing, also on an object store."""
    if not is_remote(folder):
        folder = Path(folder)
        return sorted(p.name for p in folder.glob(pattern)) if folder.is_dir() else []
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in folder.fs.ls(folder.path, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))


def list_files(folder: Any) -> list[str]:
    """Every file under `folder`, as paths relative to it ("a/b"), sorted; none when it is not there."""
    if not is_remote(folder):
        folder = Path(folder)
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    base = folder.path.rstrip("/") + "/"
    try:
        found = folder.fs.find(folder.path)
    except FileNotFoundError:
        return []
    return sorted(p[len(base) :] for p in found if p.startswith(base))


# ----------------------------------------------------------------------------- folders that appear whole


def staging_folder(final: Any, name: str | None = None) -> Any:
    """Where a folder that must appear whole at `final` is written (see `commit_folder`): locally a sibling
    (`name`, default `NAME.partial`) renamed into place; on an object store, which has no rename, `final`
    itself, whose commit marker is written last."""
    if is_remote(final):
        return final
    return final.with_name(name or f"{final.name}.partial")


def start_folder(final: Any, marker: str, name: str | None = None) -> Any:
    """`staging_folder(final, name)`, emptied of what a crashed attempt left (its `marker` first) and made."""
    staging = staging_folder(final, name)
    remove_tree(staging, first=marker)
    ensure_folder(staging)
    return staging


def commit_folder(staging: Any, final: Any, marker: str, content: bytes, replaces: Iterable[str] = ()) -> None:
    """Make the folder written at `staging` (`start_folder`) visible at `final` with its commit `marker`
    (`content`), in place of `final` and of the sibling folders named in `replaces`. A crash at any point
    leaves the old folders or the new one, never a half-made one with a marker: locally the marker is synced,
    the old folders renamed aside, `staging` renamed to `final`, then the old ones deleted; on an object
    store (`staging` is `final`) the replaced folders are deleted (marker first), the marker written last."""
    replaces = [n for n in replaces if n != final.name]
    if is_remote(final):
        for name in replaces:
            remove_tree(final.parent / name, first=marker)
        write_bytes_atomic(final / marker, content)
        return
    write_bytes_atomic(staging / marker, content)
    _fsync_dir(staging)
    tag = uuid.uuid4().hex[:8]
    aside = []
    for name in [final.name, *replaces]:
        if (final.parent / name).exists():
            aside.append((final.parent / name).rename(final.parent / f".replaced-{name}-{tag}"))
    os.replace(staging, final)
    _fsync_dir(final.parent)
    for old in aside:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------- local files for tools that need them


def local_folder(path: Any, staging: Path, names: Iterable[str] | None = None) -> Path:
    """The folder `path` as a local folder: itself, or for a store a download into `staging` (made if
    needed) of its files, or of those of `names` that are there."""
    local = local_path(path)
    if local is not None:
        return local
    if names is None:
        return download_folder(path, staging)
    staging = Path(staging)
    for name in names:
        data = read_bytes(path / name)
        if data is not None:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
    return staging


@contextlib.contextmanager
def write_folder(dest: Any, last: str | None = None) -> Iterator[Path]:
    """A local folder to write the files of `dest` into: `dest` itself, or for a store an empty temporary
    folder uploaded to it when the block ends without an error (`last` after all others: a reader that
    finds it finds the rest)."""
    local = local_path(dest)
    if local is not None:
        yield local
        return
    with tempfile.TemporaryDirectory(prefix="raytrain-upload-") as tmp:
        yield Path(tmp)
        upload_folder(Path(tmp), dest, last=last)


def working_copy(path: Any, fresh: bool = False) -> Path:
    """Where this process writes the file (or folder) `path` that it alone writes, and appends to: `path`
    itself locally; for a store, which has no append, a copy in this machine's cache that `publish` uploads
    whole. `fresh`: that copy starts empty (this process's files only)."""
    local = local_path(path)
    if local is not None:
        return local
    copy = cache_root() / "runs" / hashlib.sha256(str(path.parent).encode()).hexdigest()[:16] / path.name
    if fresh:
        shutil.rmtree(copy, ignore_errors=True)
    return copy


def publish(copy: Path, path: Any) -> None:
    """Upload the `working_copy` `copy` of `path` (a file, or a folder's files) whole, one PUT each;
    nothing to do when they are the same (a local location)."""
    if local_path(path) is not None:
        return
    if copy.is_file():
        write_bytes_atomic(path, copy.read_bytes())
    elif copy.is_dir():
        for file in copy.glob("*"):
            if file.is_file():
                write_bytes_atomic(path / file.name, file.read_bytes())


@contextlib.contextmanager
def one_line_errors(path: Any, where: str, keep: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """A store's errors inside the block (no bucket, no credentials, no permission, a wrong region) become
    one ConfigError line naming `where`; a local `path`'s, those of the types `keep` and unknown ones not."""
    try:
        yield
    except keep:
        raise
    except Exception as e:  # noqa: BLE001  (a store's errors become one line; others are raised as they are)
        line = describe_error(e, where) if is_remote(path) else None
        if line is None:
            raise
        raise ConfigError(line) from None
