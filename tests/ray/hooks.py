"""TrainerCallbacks the Ray tests pass to `raytrain train --callback tests.ray.hooks:Name(...)`; they run
inside the Ray workers and talk to the test through files in the run directory (no timing guesses)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainers.trainer import Trainer, TrainerCallback

HOLD_TIMEOUT_S = 180.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _hold(what: str) -> None:
    """Wait to be stopped from outside (a kill, or Ray tearing the group down for a resize)."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)
    raise TimeoutError(f"nobody stopped this worker within {HOLD_TIMEOUT_S:.0f}s ({what})")


class RecordSamples(TrainerCallback):
    """Appends the window ids this rank actually trained on at each step to samples/rank<R>.jsonl."""

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._trainer: Trainer | None = None

    def _wrap(self, trainer: Trainer) -> None:
        get = trainer.train_data.get

        def recording_get(ids):
            self._pending.extend(int(i) for i in ids)
            return get(ids)

        trainer.train_data.get = recording_get
        self._trainer = trainer

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self._trainer is not trainer:  # first step of this attempt: ids of this step were not seen
            raise RuntimeError("RecordSamples was not attached by on_fit_start")
        line = {"step": trainer.step, "world": trainer.engine.world_size, "rank": _rank(), "loss": record["loss"],
                "time": time.time(), "ids": self._pending}
        self._pending = []
        path = trainer.run_dir / "samples" / f"rank{_rank()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def on_fit_start(self, trainer: Trainer) -> None:
        self._wrap(trainer)


class HoldAtCheckpoint(TrainerCallback):
    """After the checkpoint of `step` is committed on `world` workers: mark it and wait to be stopped."""

    def __init__(self, step: int, world: int) -> None:
        self.step, self.world = step, world

    def after_checkpoint(self, trainer: Trainer, path: Path) -> None:
        if trainer.step == self.step and trainer.engine.world_size == self.world:
            _write_atomic(trainer.run_dir / "held" / f"step{self.step}_world{self.world}_rank{_rank()}", "")
            _hold(f"held at step {self.step} on {self.world} workers")


class KillMeAtStep(TrainerCallback):
    """On `rank`, the first time `step` is reached: write this process's pid to pids/rank<R>, then wait to
    be killed. A restarted attempt finds the file and runs on."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        pid_file = trainer.run_dir / "pids" / f"rank{self.rank}"
        if trainer.step == self.step and _rank() == self.rank and not pid_file.exists():
            _write_atomic(pid_file, str(os.getpid()))
            _hold(f"waiting for SIGKILL at step {self.step}")


class RaiseAtStep(TrainerCallback):
    """A bug that fires at `step` on every attempt."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_fit_start(self, trainer: Trainer) -> None:
        with (trainer.run_dir / "attempts.log").open("a") as f:  # one line per attempt that trains
            f.write(f"{os.getpid()}\n")

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.step == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")
