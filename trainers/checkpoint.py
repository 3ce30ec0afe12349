"""Checkpoints: a template whose public methods hold the guards (atomic commit, retention, discovery)
and a backend that writes and reads the tensors.

Layout under `root/`:
    step_00000040/            a complete checkpoint (only ever created by an atomic rename)
        .metadata, *.distcp    torch.distributed.checkpoint files: model + optimizer, reshardable; reading
                               them unpickles (.metadata, non-tensor entries), as reading the deepspeed
                               engine's *.pt does: load only checkpoints your runs wrote (README: Trust)
        trainer_state.json     step, samples consumed, loss-scaler state, ... (no pickle)
        rng/rank00000.pt       per-rank RNG states (tensors only; loaded with weights_only=True)
        COMMITTED              written last, before the rename: the step and every file's size and sha256
    step_00000060.partial/     a save in progress or one interrupted by a crash: never loaded

A restore verifies the files against COMMITTED (each rank hashes a slice of them); `candidates` lists the
complete checkpoints newest first, so that a caller can fall back past a corrupt one.

On an object store (`root` an s3://, gs:// URI: `trainers.storage`) there is no atomic rename: every rank
writes its shards straight into `step_XXXXXXXX/` (DCP's FsspecWriter, no staging copy), and COMMITTED,
written last by rank 0 after every rank's files and checksums are there, is what makes it a checkpoint
(an object appears whole or not at all). A save killed halfway leaves a folder without the marker: never
loaded, deleted by the next save's retention. Retention and the clean-up of a leftover delete the marker
first, so a half-deleted folder is never taken for a checkpoint either.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainers._base import ConfigError
from trainers.checkpoint_files import (
    COMMITTED,
    STEP_DIR,
    _fsync_dir,
    _write_json,
    delete_checkpoint,
    install_checkpoint,
    is_complete,
    link_tree,
    read_trainer_state,
)
from trainers.storage import is_remote, location, remove_tree, sha256_of, size_of, write_text_atomic

__all__ = [
    "link_tree",
    "CheckpointError",
    "Checkpointer",
    "CheckpointBackend",
    "DCPBackend",
    "ModelOptimizerState",
    "is_complete",
]



def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _gather(value: Any) -> list[Any]:
    """Every rank's `value` (a small picklable object), on every rank."""
    if _world() == 1:
        return [value]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, value)
    return out


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: missing or changed files, or none left to fall back to."""


_SUMS = ".sums"  # per-rank checksum lists of a save in progress, merged into COMMITTED


def _files(root: Path) -> list[str]:
    """The checkpoint's files (relative, sorted), but the marker and checksum lists."""
    if is_remote(root):
        base = root.path.rstrip("/") + "/"
        names = (p[len(base) :] for p in root.fs.find(root.path) if p.startswith(base))
        return sorted(n for n in names if n != COMMITTED and n.split("/")[0] != _SUMS)
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.name != COMMITTED and _SUMS not in p.relative_to(root).parts
    )


def _children(root: Path, pattern: str) -> list[str]:
    """Names of the entries of the folder `root` that match `pattern` (sorted; none if it is not there)."""
    if not is_remote(root):
        return sorted(p.name for p in root.glob(pattern)) if root.is_dir() else []
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in root.fs.ls(root.path, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))


def _sha256(path: Path) -> str:
    return sha256_of(path)




def _my_share(names: list[str]) -> list[str]:
    # Each rank hashes every world-th file: a big model's checkpoint is hashed in parallel.
    return names[_rank() :: _world()]


def _check_file(root: Path, name: str, expected: dict[str, Any]) -> str | None:
    path = root / name
    size = size_of(path)
    if size is None:
        return f"{name} is missing"
    if size != expected["size"]:
        return f"{name} has {size} bytes, {expected['size']} were written"
    if _sha256(path) != expected["sha256"]:
        return f"{name} does not match its sha256"
    return None


class ModelOptimizerState(Stateful):
    """Model + optimizer as FQN-keyed state dicts (DCP's recipe): loads at any world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool = True):
        # with_optimizer=False restores weights only (e.g. the run switched to another optimizer kind).
        self.model, self.optimizer, self.with_optimizer = model, optimizer, with_optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd} if self.with_optimizer else {"model": model_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "optim" not in state:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


class CheckpointBackend(Protocol):
    def save(self, path: Path, state: dict[str, Stateful]) -> None: ...
    def load(self, path: Path, state: dict[str, Stateful]) -> None: ...


class DCPBackend:
    """torch.distributed.checkpoint: every rank writes its shards; loading reshards."""

    def save(self, path: Path, state: dict[str, Stateful]) -> None:
        with _one_process_is_meant():
            if is_remote(path):  # each rank writes its shards straight to the store
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                dcp.save(state, storage_writer=FsspecWriter(str(path), **path.storage_options))
            else:
                dcp.save(state, checkpoint_id=str(path))

    def load(self, path: Path, state: dict[str, Stateful]) -> None:
        with _one_process_is_meant():
            if is_remote(path):  # each rank reads the byte ranges of its shards
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

                dcp.load(state, storage_reader=FsspecReader(str(path), **path.storage_options))
            else:
                dcp.load(state, checkpoint_id=str(path))


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process: that is what a single-process run
    means, and a user cannot act on it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class Checkpointer:
    """Atomic saves with retention, and discovery of the newest complete checkpoint."""

    def __init__(self, root: Path, keep: int, backend: CheckpointBackend | None = None):
        self.root, self.keep = location(root), keep
        self.backend = backend or DCPBackend()

    def latest(self) -> Path | None:
        done = self.candidates()
        return done[0] if done else None

    def candidates(self) -> list[Path]:
        """Complete (committed) checkpoints, newest first: the order a restore tries them in."""
        names = [n for n in _children(self.root, "step_*") if STEP_DIR.match(n)]
        done = [self.root / n for n in sorted(names) if is_complete(self.root / n)]
        return done[::-1]

    @staticmethod
    def verify(path: Path) -> str | None:
        """Collective: None when every file matches its size and sha256 in COMMITTED, else why not (the
        same answer on every rank). Checkpoints committed without checksums pass on their marker alone."""
        path = location(path)
        try:
            expected = json.loads((path / COMMITTED).read_text()).get("files")
        except (OSError, ValueError) as e:
            expected, problem = None, f"{COMMITTED} is unreadable ({e})"
        else:
            problem = None
        if problem is None and expected is not None:
            problems = (_check_file(path, name, expected[name]) for name in _my_share(sorted(expected)))
            problem = next((p for p in problems if p is not None), None)
        found = [p for p in _gather(problem) if p is not None]
        return found[0] if found else None

    def save(
        self,
        step: int,
        state: dict[str, Stateful],
        trainer_state: dict[str, Any],
        rng: dict[str, torch.Tensor] | None = None,
        before_commit: Callable[[Path], None] | None = None,
    ) -> Path:
        """Collective: every rank calls it. Visible under its final name only once complete."""
        final = self.root / f"step_{step:08d}"
        remote = is_remote(self.root)
        # On an object store the save goes straight into the step folder: the marker written last commits it.
        partial = final if remote else final.with_name(final.name + ".partial")
        rank = _rank()
        if rank == 0:
            if remote:
                delete_checkpoint(final)  # leftover of a crashed save (or this step saved before: replaced)
            else:
                shutil.rmtree(partial, ignore_errors=True)  # leftover of a crashed save
                partial.mkdir(parents=True)
        _barrier()
        self.backend.save(partial, state)
        if rng is not None:
            if remote:
                buffer = io.BytesIO()
                torch.save(rng, buffer)
                (partial / "rng" / f"rank{rank:05d}.pt").write_bytes(buffer.getvalue())
            else:
                (partial / "rng").mkdir(exist_ok=True)
                torch.save(rng, partial / "rng" / f"rank{rank:05d}.pt")
        if rank == 0:
            if remote:
                write_text_atomic(partial / "trainer_state.json", json.dumps(trainer_state, indent=1))
            else:
                _write_json(partial / "trainer_state.json", trainer_state)
        _barrier()
        self._write_sums(partial)
        _barrier()
        if rank == 0:
            if before_commit is not None:  # a test hook: simulate a crash before the commit
                before_commit(partial)
            marker = {"step": step, "files": self._merged_sums(partial)}
            if remote:
                write_text_atomic(final / COMMITTED, json.dumps(marker, indent=1))
                self._retain()
                _barrier()
                return final
            _write_json(partial / COMMITTED, marker)
            _fsync_dir(partial)
            if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            self._retain()
        _barrier()
        return final

    def install(self, src: Path) -> Path:
        """See `install_checkpoint`: `src` becomes this run's newest checkpoint."""
        return install_checkpoint(self.root, src)

    @staticmethod
    def _write_sums(partial: Path) -> None:
        sums = {
            name: {"size": size_of(partial / name), "sha256": _sha256(partial / name)}
            for name in _my_share(_files(partial))
        }
        if is_remote(partial):
            write_text_atomic(partial / _SUMS / f"rank{_rank():05d}.json", json.dumps(sums))
            return
        (partial / _SUMS).mkdir(exist_ok=True)
        _write_json(partial / _SUMS / f"rank{_rank():05d}.json", sums)

    @staticmethod
    def _merged_sums(partial: Path) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for name in _children(partial / _SUMS, "rank*.json"):
            merged.update(json.loads((partial / _SUMS / name).read_text()))
        remove_tree(partial / _SUMS)
        missing = set(_files(partial)) - set(merged)
        if missing:  # a rank listed the folder before another's files appeared: never commit unsummed
            raise CheckpointError(f"{partial}: no checksum for {sorted(missing)[:3]}")
        return merged

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
            self.backend.load(path, state)
            rng_file = path / "rng" / f"rank{_rank():05d}.pt"
            rng = None
            if is_remote(rng_file):
                if rng_file.is_file():
                    rng = torch.load(io.BytesIO(rng_file.read_bytes()), weights_only=True)
            elif rng_file.is_file():
                rng = torch.load(rng_file, weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError) as e:
            if isinstance(e, ConfigError):
                raise  # the backend's own one-line refusal (e.g. another engine wrote it)
            raise CheckpointError(f"{path} could not be read: {type(e).__name__}: {_first_line(e)}") from e
        return trainer_state, rng

    def _retain(self) -> None:
        if is_remote(self.root):
            names = [n for n in _children(self.root, "step_*") if STEP_DIR.match(n)]
            done = [n for n in names if is_complete(self.root / n)]
            old = done[: max(len(done) - self.keep, 0)]
            stale = [n for n in names if n not in done and done and n < done[-1]]  # saves a crash cut short
            for name in old + stale:
                delete_checkpoint(self.root / name)
            return
        done = sorted(p for p in self.root.glob("step_*") if is_complete(p))
        for old in done[: max(len(done) - self.keep, 0)]:
            shutil.rmtree(old, ignore_errors=True)
        for pattern in ("step_*.partial", ".install-*", ".replaced-*"):  # what a crash left half done
            for stale in self.root.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
