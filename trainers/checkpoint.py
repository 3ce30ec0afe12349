"""Checkpoints: a template whose public methods hold the guards (atomic commit, retention, discovery, at most
one save in flight) and a backend that stages, writes and reads the tensors.

Layout under `root/`:
    step_00000040/            a complete checkpoint (only ever created by an atomic rename)
        .metadata, *.distcp    torch.distributed.checkpoint files: model + optimizer, reshardable; reading
                               them unpickles (.metadata, non-tensor entries), as reading the deepspeed
                               engine's *.pt does: load only checkpoints your runs wrote (README: Trust)
        trainer_state.json     step, samples consumed, loss-scaler state, ... (no pickle)
        rng/rank00000.pt       per-rank RNG states (tensors only; loaded with weights_only=True)
        COMMITTED              written last, before the rename: the step, the commit's place in the folder
                               (`seq`), the hash's name and every file's size and piece checksums
                               (`trainers.checksums`)
    step_00000060.partial/     a save in progress or one interrupted by a crash: never loaded

Two modes (`checkpoint.mode`):
- `sync`: the training step waits for the whole save: write, checksums, COMMITTED, rename, retention.
- `async` (the default): the step waits only for staging, a copy of the state into host memory (buffers
  reused between saves, pinned on CUDA: DCP's `StateDictStager`); a writer thread then does everything
  `sync` does, with its own gloo process group for the collectives DCP and the commit need. `collect()`
  tells every rank at once (one small all-reduce per step while a save is in flight) that the save
  committed, so that reports name committed checkpoints only. A second save waits for the first.
Writing and reading use DCP's threads (`checkpoint.threads`); checksums are piece-wise xxh3-128: the
tensor files are hashed as DCP writes them (no second pass over their bytes; torch's own zip CRC-32 is
left out of them, as it would be a second checksum of the same bytes), the few other files are read back
in parallel, spread over the ranks.

A restore verifies the files against COMMITTED; `candidates` lists the complete checkpoints newest first,
so that a caller can fall back past a corrupt one. Newest is the latest commit, which retention keeps too:
a run restored to an earlier step (a PBT exploit of a donor behind it) commits lower steps after higher
ones, and those are its state.

On an object store (`root` an s3://, gs:// URI: `trainers.storage`) there is no atomic rename: every rank
writes its shards straight into `step_XXXXXXXX/` (DCP's FsspecWriter, no staging copy), and COMMITTED,
written last by rank 0 after every rank's files and checksums are there, is what makes it a checkpoint
(an object appears whole or not at all). A save killed halfway leaves a folder without the marker: never
loaded, deleted by the next save's retention. Retention and the clean-up of a leftover delete the marker
first, so a half-deleted folder is never taken for a checkpoint either.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainers._base import CheckpointError, ConfigError, first_line
from trainers.checkpoint_files import (
    COMMITTED,
    MODEL_KEY,
    OPTIM_KEY,
    STEP_DIR,
    TRAINER_STATE,
    checkpoint_step,
    commit_seq,
    committed_checkpoints,
    delete_checkpoint,
    is_complete,
    link_tree,
    read_trainer_state,
    rng_file,
)
from trainers.checksums import HASH, PIECE_BYTES, StreamDigests, check_files, digest_pieces, pieces_of
from trainers.storage import (
    commit_folder,
    ensure_folder,
    list_files,
    list_names,
    local_path,
    location,
    read_bytes,
    size_of,
    staging_folder,
    start_folder,
    write_json_atomic,
)

__all__ = [
    "link_tree",
    "CheckpointError",
    "Checkpointer",
    "CheckpointBackend",
    "Committed",
    "DCPBackend",
    "ModelOptimizerState",
    "SaveFigures",
    "checkpoint_step",
    "is_complete",
]

# Without a process group DCP warns that it assumes a single process: that is what a single-process run
# means, and a user cannot act on it. (A module-level filter: `catch_warnings` is not thread-safe, and the
# writer thread saves beside the training thread.)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

WRITER_GROUP_TIMEOUT = timedelta(minutes=30)  # a rank whose writer died: the others' barriers give up


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier(group: Any = None) -> None:
    if _world() > 1:
        dist.barrier(group=group)


def _gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value` (a small picklable object), on every rank."""
    if _world() == 1:
        return [value]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, value, group=group)
    return out


def default_threads() -> int:
    """Writer/reader/checksum threads per rank when `checkpoint.threads` is 0: what the host offers, at
    most 8 (DCP's writers are bounded by the disk beyond that)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


_LEFTOVERS = ("step_*.partial", ".install-*", ".replaced-*")  # staging, renamed-aside (and older versions') folders


def _files(root: Path) -> list[str]:
    """The checkpoint's files (relative, sorted), but the marker."""
    return [n for n in list_files(root) if n != COMMITTED]


class ModelOptimizerState(Stateful):
    """Model + optimizer as FQN-keyed state dicts (DCP's recipe): loads at any world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool = True):
        # with_optimizer=False restores weights only (e.g. the run switched to another optimizer kind).
        self.model, self.optimizer, self.with_optimizer = model, optimizer, with_optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd} if self.with_optimizer else {MODEL_KEY: model_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if OPTIM_KEY not in state:
            set_model_state_dict(self.model, state[MODEL_KEY])
            return
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIM_KEY]
        )


# {file relative to the checkpoint: (size, piece digests, seconds spent hashing it)}
Streamed = dict[str, tuple[int, list[str], float]]


class CheckpointBackend(Protocol):
    """Writes and reads a checkpoint's tensors. `stage` (optional) returns a host copy of `state` that `save`
    can write while training goes on; a backend without it saves synchronously. `save` may return the
    piece digests of the files this rank wrote, hashed as they were written; the others are read back."""

    def save(self, path: Path, state: dict[str, Any], group: Any = None, threads: int = 1) -> Streamed | None: ...
    def load(self, path: Path, state: dict[str, Stateful], threads: int = 1) -> None: ...


class _ParallelReader(FileSystemReader):
    """DCP's file reader, its files read by `threads` threads (DCP's own reads them one after another)."""

    def __init__(self, path: str, threads: int):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        read = super().read_data  # each call reads one file's items into their (distinct) tensors
        with ThreadPoolExecutor(max(1, min(self.threads, len(per_file))), thread_name_prefix="dcp-read") as pool:
            for done in [pool.submit(read, replace(plan, items=items), planner) for items in per_file.values()]:
                done.result()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


class _DigestingStream:
    """A file being written, its bytes hashed on their way (`StreamDigests`); `moved`: it was seeked or
    truncated, so the bytes fed are not the file's and its digests are not used."""

    def __init__(self, raw: Any):
        self.raw, self.digests, self.moved = raw, StreamDigests(), False

    def write(self, data: Any) -> int:
        self.digests.update(data)
        return self.raw.write(data)

    def seek(self, *args: Any) -> int:
        self.moved = True
        return self.raw.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.moved = True
        return self.raw.truncate(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


class _DigestingFileSystem:
    """DCP's file system of a writer, each file it writes hashed as it goes (DCP writes with several
    threads, and renames its `.metadata` into place)."""

    def __init__(self, fs: Any, root: Any):
        self.fs, self.root, self.streamed, self._lock = fs, str(root).rstrip("/") + "/", {}, threading.Lock()

    def _name(self, path: Any) -> str | None:
        return str(path)[len(self.root):] if str(path).startswith(self.root) else None

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self.fs.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _DigestingStream(raw)
            yield stream
        name = self._name(path)
        if name is not None and not stream.moved:
            with self._lock:
                self.streamed[name] = (stream.digests.size, stream.digests.digests(), stream.digests.seconds)

    def rename(self, path: Any, new_path: Any) -> None:
        self.fs.rename(path, new_path)
        old, new = self._name(path), self._name(new_path)
        with self._lock:
            entry = self.streamed.pop(old, None) if old is not None else None
            if entry is not None and new is not None:
                self.streamed[new] = entry

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


@contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save's per-record CRC-32 off while DCP writes (the files get our piece checksums instead; half
    of the writer's CPU time on a CPU host). The setting is process-wide: a torch.save elsewhere in the
    process meanwhile also skips it, and its file loads the same."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class DCPBackend:
    """torch.distributed.checkpoint: every rank writes its shards (`threads` files at once); loading
    reshards. Staging copies the state into host buffers kept for the next save (pinned on CUDA)."""

    def __init__(self) -> None:
        self._stager: Any = None

    def stage(self, state: dict[str, Stateful]) -> dict[str, Any]:
        # DCP's own StateDictStager, held for the process, not its DefaultStager wrapper: on torch < 2.13 that
        # closes the stager after each stage, so its next save fails (KeyError: <class 'type'>) and the
        # pinned buffers are freed and pinned again at every save.
        from trainers.torch_compat import StateDictStager

        cuda = torch.cuda.is_available()
        if self._stager is None:
            self._stager = StateDictStager(pin_memory=cuda, share_memory=False)
        staged = self._stager.stage({key: value.state_dict() for key, value in state.items()}, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def save(self, path: Path, state: dict[str, Any], group: Any = None, threads: int = 1) -> Streamed:
        # The plan is cached between saves of the same layout (only a delta goes to the coordinator).
        planner = DefaultSavePlanner(enable_plan_caching=True)
        local = local_path(path)
        if local is None:  # each rank writes its shards straight to the store
            from trainers.torch_compat import FsspecWriter

            writer = FsspecWriter(str(path), thread_count=threads, **path.storage_options)
        else:
            writer = FileSystemWriter(str(local), thread_count=threads)
        writer.fs = digesting = _DigestingFileSystem(writer.fs, writer.path)
        with _without_zip_crc32():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=_world() == 1)
        return digesting.streamed

    def load(self, path: Path, state: dict[str, Stateful], threads: int = 1) -> None:
        local = local_path(path)
        if local is None:  # each rank reads the byte ranges of its shards
            from trainers.torch_compat import FsspecReader

            dcp.load(state, storage_reader=FsspecReader(str(path), **path.storage_options))
        else:
            dcp.load(state, storage_reader=_ParallelReader(str(local), threads))


@dataclass
class SaveFigures:
    """What one save cost, for its `checkpoint` event (seconds; `bytes`: the checkpoint's files)."""

    mode: str  # sync | async
    blocking_s: float = 0.0  # what training waited for: the save before (wait_s) + staging, or the whole save
    wait_s: float = 0.0  # of that, waiting for the save in flight before this one to commit
    stage_s: float = 0.0
    write_s: float = 0.0  # the tensors, RNG and trainer state on disk, every rank (hashing as written included)
    checksum_s: float = 0.0  # the hashing during the write (this rank's, summed over threads) + the pass after
    commit_s: float = 0.0  # from the save's start to its commit
    bytes: int = 0


@dataclass
class Committed:
    step: int
    path: Path
    figures: SaveFigures


@dataclass
class _InFlight:
    step: int
    figures: SaveFigures
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    path: Path | None = None
    error: BaseException | None = None
    writer: threading.Thread | None = None


class Checkpointer:
    """Atomic saves with retention, and discovery of the newest complete checkpoint."""

    def __init__(
        self,
        root: Path,
        keep: int,
        backend: CheckpointBackend | None = None,
        mode: str = "sync",
        threads: int = 0,
    ):
        self.root, self.keep = location(root), keep
        self.backend = backend or DCPBackend()
        self.threads = threads or default_threads()
        # async needs a backend that can stage (DeepSpeed's engine writes from its own state: sync)
        self.mode = mode if hasattr(self.backend, "stage") else "sync"
        self._in_flight: _InFlight | None = None
        self._groups: tuple[Any, Any] | None = None  # (writer's, poll's): gloo groups for world > 1

    # ------------------------------------------------------------------------------------ discovery

    def latest(self) -> Path | None:
        done = self.candidates()
        return done[0] if done else None

    def candidates(self) -> list[Path]:
        """Complete (committed) checkpoints, newest first: the order a restore tries them in."""
        return committed_checkpoints(self.root)

    @staticmethod
    def verify(path: Path, threads: int = 0) -> str | None:
        """Collective: None when every file matches its size and checksums in COMMITTED, else why not (the
        same answer on every rank). Checkpoints committed without checksums pass on their marker alone."""
        path = location(path)
        try:
            marker = json.loads((path / COMMITTED).read_text())
        except (OSError, ValueError) as e:
            problem: str | None = f"{COMMITTED} is unreadable ({e})"
        else:
            problem = None
            if marker.get("files") is not None:
                sizes = {name: size_of(path / name) for name in marker["files"]}
                problem = check_files(path, marker, sizes, _rank(), _world(), threads or default_threads())
        found = [p for p in _gather(problem) if p is not None]
        return found[0] if found else None

    # ----------------------------------------------------------------------------------------- saving

    @property
    def in_flight(self) -> int | None:
        """The step of the save being written in the background, if any."""
        return self._in_flight.step if self._in_flight is not None else None

    def save(
        self,
        step: int,
        state: dict[str, Stateful],
        trainer_state: dict[str, Any],
        rng: dict[str, torch.Tensor] | None = None,
        before_commit: Callable[[Path], None] | None = None,
    ) -> Path:
        """Collective, synchronous: returns once the checkpoint is committed (the mode aside)."""
        return self.save_with_figures(step, state, trainer_state, rng, before_commit=before_commit).path

    def save_with_figures(
        self,
        step: int,
        state: dict[str, Stateful],
        trainer_state: dict[str, Any],
        rng: dict[str, torch.Tensor] | None = None,
        wait_s: float = 0.0,
        before_commit: Callable[[Path], None] | None = None,
    ) -> Committed:
        """`save`, with what it cost (`wait_s`: how long the caller waited for a save in flight before)."""
        self._refuse_second_save()
        figures = SaveFigures("sync", wait_s=wait_s)
        start = time.perf_counter()
        path = self._write_and_commit(step, state, trainer_state, rng, figures, None, before_commit)
        figures.commit_s = time.perf_counter() - start
        figures.blocking_s = figures.wait_s + figures.commit_s
        return Committed(step, path, figures)

    def start_save(
        self,
        step: int,
        state: dict[str, Stateful],
        trainer_state: dict[str, Any],
        rng: dict[str, torch.Tensor] | None = None,
        wait_s: float = 0.0,
        before_commit: Callable[[Path], None] | None = None,
    ) -> None:
        """Collective, asynchronous: returns once `state` is staged; the writer thread commits it, and
        `collect` says when. The save in flight before, if any, must have been collected (`wait_s`: how long
        the caller waited for that)."""
        self._refuse_second_save()
        start = time.perf_counter()
        staged = self.backend.stage(state)  # type: ignore[attr-defined]
        rng = {k: v.clone() for k, v in rng.items()} if rng is not None else None
        figures = SaveFigures("async", wait_s=wait_s, stage_s=time.perf_counter() - start)
        figures.blocking_s = wait_s + figures.stage_s
        job = self._in_flight = _InFlight(step, figures, start)
        group = self._writer_groups()[0]

        def write() -> None:
            try:
                job.path = self._write_and_commit(step, staged, trainer_state, rng, figures, group, before_commit)
                figures.commit_s = time.perf_counter() - job.started
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by collect()
                job.error = e
            finally:
                job.done.set()

        # A daemon: a process stopping with a save in flight is not held open by it (the partial folder
        # it leaves is never loaded, and retention removes it). A collected save's writer is joined.
        job.writer = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
        job.writer.start()

    def collect(self, wait: bool) -> Committed | None:
        """Collective while a save is in flight: the save, once it committed on every rank (all ranks get
        the same answer at the same call); None while it is still being written (`wait=False`) or when none
        is in flight. Raises CheckpointError on every rank when the write failed on any."""
        job = self._in_flight
        if job is None:
            return None
        if wait:
            job.done.wait()
        status = torch.tensor([0 if job.done.is_set() else 1, 1 if job.error is not None else 0])
        if _world() > 1:  # one small all-reduce: every rank agrees on when a commit is seen
            dist.all_reduce(status, group=self._writer_groups()[1])
        if int(status[0]) > 0:
            return None
        self._in_flight = None
        # The writer still drops its references (the staged state: tensors, whose release lets go of the GIL)
        # after it sets `done`: wait for that. A daemon thread still doing so at interpreter exit is ended by
        # pthread_exit from inside torch's C++ and the process aborts ("terminate called without an active
        # exception", 1 run in ~15 of two spawned ranks).
        job.writer.join()
        if int(status[1]) > 0:
            cause = f"{type(job.error).__name__}: {first_line(job.error)}" if job.error else "on another rank"
            raise CheckpointError(
                f"the save of step {job.step} failed ({cause}); the newest committed checkpoint is still the "
                f"resume point; fix: check the disk or bucket (space, permissions) and resume"
            ) from job.error
        assert job.path is not None
        return Committed(job.step, job.path, job.figures)

    def abandon(self) -> int | None:
        """Stop waiting for the save in flight (the process is stopping on an error; other ranks may be
        gone): its writer may still finish, else its partial folder is never loaded. Returns its step."""
        job, self._in_flight = self._in_flight, None
        return job.step if job is not None else None

    def _refuse_second_save(self) -> None:
        if self._in_flight is not None:  # one save in flight at a time: the caller collects it first
            raise RuntimeError(f"the save of step {self._in_flight.step} is still in flight: collect it first")

    def _writer_groups(self) -> tuple[Any, Any]:
        """Gloo groups of their own for the writer thread's collectives and for `collect`'s poll, so that
        neither interleaves with the training thread's (made once, collectively, at the first async save)."""
        if self._groups is None:
            if _world() == 1:
                self._groups = (None, None)
            else:
                self._groups = (
                    dist.new_group(backend="gloo", timeout=WRITER_GROUP_TIMEOUT),
                    dist.new_group(backend="gloo", timeout=WRITER_GROUP_TIMEOUT),
                )
        return self._groups

    def _write_and_commit(
        self,
        step: int,
        state: dict[str, Any],
        trainer_state: dict[str, Any],
        rng: dict[str, torch.Tensor] | None,
        figures: SaveFigures,
        group: Any,
        before_commit: Callable[[Path], None] | None,
    ) -> Path:
        """Collective over `group`: write, checksum, commit, retain. Visible under its final name only once
        complete."""
        final = self.root / f"step_{step:08d}"
        # `step_X.partial` renamed into place; on an object store the step folder itself, marker written last.
        partial = staging_folder(final)
        rank = _rank()
        start = time.perf_counter()
        if rank == 0:
            start_folder(final, COMMITTED)  # without a crashed save's leftover
        _barrier(group)
        streamed = self.backend.save(partial, state, group=group, threads=self.threads) or {}
        if rng is not None:
            buffer = io.BytesIO()
            torch.save(rng, buffer)
            ensure_folder((partial / rng_file(rank)).parent)
            (partial / rng_file(rank)).write_bytes(buffer.getvalue())
        if rank == 0:
            write_json_atomic(partial / TRAINER_STATE, trainer_state)
        _barrier(group)
        figures.write_s = time.perf_counter() - start
        start = time.perf_counter()
        files = self._checksums(partial, group, streamed)
        # what checksums cost: the pass over the files not hashed as written, and the hashing during the write
        figures.checksum_s = time.perf_counter() - start + sum(e[2] for e in streamed.values())
        figures.bytes = sum(f["size"] for f in files.values())
        if rank == 0:
            if before_commit is not None:  # a test hook: simulate a crash (or a slow disk) before the commit
                before_commit(partial)
            # `seq`: the commit's place after the folder's others (the newest commit is the run's newest state)
            before = committed_checkpoints(self.root)  # the newest commit first
            newest = commit_seq(before[0]) if before else None
            seq = 1 + (newest if newest is not None else -1)
            marker = {"step": step, "seq": seq, "hash": HASH, "piece_bytes": PIECE_BYTES, "files": files}
            # In place of the same step saved before (e.g. the final save after a periodic one).
            commit_folder(partial, final, COMMITTED, (json.dumps(marker, indent=1) + "\n").encode())
            self._retain([p.name for p in reversed(before) if p.name != final.name] + [final.name])
        _barrier(group)
        return final

    def _checksums(self, partial: Path, group: Any, streamed: Streamed) -> dict[str, dict[str, Any]]:
        """Every file's size and piece digests: those hashed as they were written (`streamed`, this rank's),
        where their size is the file's on disk; the other files' pieces spread over the ranks and threads."""
        names = _files(partial)
        sizes: dict[str, int] = {}
        for name in names:
            size = size_of(partial / name)
            if size is None:  # listed, then gone: another process is deleting the folder
                raise CheckpointError(f"{partial / name} vanished during the save")
            sizes[name] = size
        digests: dict[tuple[str, int], str] = {}
        for part in _gather({n: d for n, (size, d, _) in streamed.items() if sizes.get(n) == size}, group):
            digests.update({(name, i): d for name, pieces in part.items() for i, d in enumerate(pieces)})
        unread = {n: size for n, size in sizes.items() if (n, 0) not in digests}
        for part in _gather(digest_pieces(partial, pieces_of(unread)[_rank() :: _world()], self.threads), group):
            digests.update(part)
        files = {name: {"size": size, "pieces": []} for name, size in sizes.items()}
        for name, index, _, _ in pieces_of(sizes):
            if (name, index) not in digests:  # never commit unsummed bytes
                raise CheckpointError(f"{partial}: no checksum for piece {index} of {name}")
            files[name]["pieces"].append(digests[(name, index)])
        return files

    @staticmethod
    def trainer_state(path: Path) -> dict[str, Any]:
        return read_trainer_state(path)

    def load(
        self, path: Path, state: dict[str, Stateful]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """Loads tensors into `state`; returns (trainer_state, this rank's RNG state or None)."""
        path = location(path)
        trainer_state = self.trainer_state(path)
        try:
            self.backend.load(path, state, threads=self.threads)
            data = read_bytes(path / rng_file(_rank()))
            rng = None if data is None else torch.load(io.BytesIO(data), weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError) as e:
            if isinstance(e, ConfigError):
                raise  # the backend's own one-line refusal (e.g. another engine wrote it)
            raise CheckpointError(f"{path} could not be read: {type(e).__name__}: {first_line(e)}") from e
        return trainer_state, rng

    def _retain(self, done: list[str]) -> None:
        """Keep the newest `keep` committed checkpoints of `done` (names, the oldest commit first). Only a save's commit calls it, and one save is in
        flight at a time, so the partial folders it removes are crashes' leftovers, never a live save."""
        entries = list_names(self.root)
        names = [n for n in entries if STEP_DIR.match(n)]
        old = done[: max(len(done) - self.keep, 0)]
        stale = [n for n in names if n not in done and done and n < max(done)]  # saves a crash cut short
        # What a crash left half done where folders are renamed into place (none on an object store).
        leftovers = [n for n in entries if any(fnmatch.fnmatchcase(n, p) for p in _LEFTOVERS)]
        for name in old + stale + leftovers:
            delete_checkpoint(self.root / name)
