"""Checkpoints: a template whose public methods hold the guards (atomic commit, retention, discovery)
and a backend that writes and reads the tensors.

Layout under `root/`:
    step_00000040/            a complete checkpoint (only ever created by an atomic rename)
        .metadata, *.distcp    torch.distributed.checkpoint files: model + optimizer, reshardable; reading
                               them unpickles (.metadata, non-tensor entries), as reading the deepspeed
                               engine's *.pt does: load only checkpoints your runs wrote (README: Trust)
        trainer_state.json     step, samples consumed, loss-scaler state, ... (no pickle)
        rng/rank00000.pt       per-rank RNG states (tensors only; loaded with weights_only=True)
        COMMITTED              written last, before the rename
    step_00000060.partial/     a save in progress or one interrupted by a crash: never loaded
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["Checkpointer", "CheckpointBackend", "DCPBackend", "ModelOptimizerState", "is_complete"]

_STEP_DIR = re.compile(r"^step_(\d{8})$")
COMMITTED = "COMMITTED"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and (path / COMMITTED).is_file()


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
        dcp.save(state, checkpoint_id=str(path))

    def load(self, path: Path, state: dict[str, Stateful]) -> None:
        dcp.load(state, checkpoint_id=str(path))


class Checkpointer:
    """Atomic saves with retention, and discovery of the newest complete checkpoint."""

    def __init__(self, root: Path, keep: int, backend: CheckpointBackend | None = None):
        self.root, self.keep = Path(root), keep
        self.backend = backend or DCPBackend()

    def latest(self) -> Path | None:
        done = sorted(p for p in self.root.glob("step_*") if is_complete(p)) if self.root.is_dir() else []
        return done[-1] if done else None

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
        partial = final.with_name(final.name + ".partial")
        rank = _rank()
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # leftover of a crashed save
            partial.mkdir(parents=True)
        _barrier()
        self.backend.save(partial, state)
        if rng is not None:
            (partial / "rng").mkdir(exist_ok=True)
            torch.save(rng, partial / "rng" / f"rank{rank:05d}.pt")
        _barrier()
        if rank == 0:
            _write_json(partial / "trainer_state.json", trainer_state)
            if before_commit is not None:  # a test hook: simulate a crash before the commit
                before_commit(partial)
            _write_json(partial / COMMITTED, {"step": step})
            _fsync_dir(partial)
            if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            self._retain()
        _barrier()
        return final

    @staticmethod
    def trainer_state(path: Path) -> dict[str, Any]:
        path = Path(path)
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMMITTED} marker)")
        return json.loads((path / "trainer_state.json").read_text())

    def load(
        self, path: Path, state: dict[str, Stateful]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """Loads tensors into `state`; returns (trainer_state, this rank's RNG state or None)."""
        path = Path(path)
        trainer_state = self.trainer_state(path)
        self.backend.load(path, state)
        rng_file = path / "rng" / f"rank{_rank():05d}.pt"
        rng = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
        return trainer_state, rng

    def _retain(self) -> None:
        done = sorted(p for p in self.root.glob("step_*") if is_complete(p))
        for old in done[: max(len(done) - self.keep, 0)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob("step_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
