"""Profiles of chosen steps (`--profile STEP:COUNT`): each rank's `torch.profiler` Chrome trace in
RUN_DIR/profile/ (https://ui.perfetto.dev), with named ranges (`span`), and CUDA allocator snapshots
(https://pytorch.org/memory_viz). Off, `span` is a shared null context and the hooks are empty methods.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import PositiveInt

from trainers._base import StrictModel
from trainers.run_dir import PROFILE

if TYPE_CHECKING:  # torch loads with the first profiled step: a config that names a profile reads without it
    import torch

__all__ = ["ProfileConfig", "StepProfiler", "build_profiler", "span"]


class ProfileConfig(StrictModel):
    start_step: PositiveInt | None = None  # first profiled step, as numbered in metrics.jsonl; None = off
    steps: PositiveInt = 1  # profiled steps from there
    memory_snapshot: bool = False  # CUDA only: an allocator snapshot over the same steps


_NULL = contextlib.nullcontext()
_recording = False  # ranges are created only while a profiler records


def span(name: str) -> contextlib.AbstractContextManager:
    """A named range in the trace while a profile records; otherwise a shared no-op context."""
    if not _recording:
        return _NULL
    import torch

    return torch.profiler.record_function(name)


class StepProfiler:
    """The no-op default: the Trainer calls these around every step."""

    def before_step(self, step: int) -> None: ...
    def after_step(self, step: int) -> dict[str, Any] | None: ...
    def close(self) -> None: ...


class _TorchStepProfiler(StepProfiler):
    def __init__(self, cfg: ProfileConfig, out_dir: Path, rank: int, device: torch.device):
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.out_dir, self.rank, self.device = Path(out_dir), rank, device
        self.memory = cfg.memory_snapshot
        self._prof: Any = None
        self.done = False

    def before_step(self, step: int) -> None:
        global _recording
        if self._prof is not None or self.done or not self.first <= step <= self.last:
            return  # a run resumed inside the window profiles the rest of it
        import torch

        from trainers.torch_compat import record_memory_history

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory and self.device.type == "cuda":
            record_memory_history(max_entries=100_000)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self.started = self.stepped = step
        _recording = True

    def after_step(self, step: int) -> dict[str, Any] | None:
        if self._prof is None:
            return None
        self.stepped = step
        return self._stop() if step >= self.last else None

    def close(self) -> None:
        if self._prof is not None:  # the run ended inside the window
            self._stop()

    def _stop(self) -> dict[str, Any]:
        global _recording
        _recording = False
        self.done = True
        self._prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank{self.rank}-steps{self.started}-{self.stepped}.json"
        self._prof.export_chrome_trace(str(trace))
        self._prof = None
        info: dict[str, Any] = {"trace": str(trace)}
        if self.memory:
            info["memory_snapshot"] = self._dump_memory()
        return info

    def _dump_memory(self) -> str:
        if self.device.type != "cuda":
            if self.rank == 0:
                line = f"raytrain: profile: no memory snapshot on {self.device.type} (CUDA only); skipped"
                print(line, file=sys.stderr, flush=True)
            return f"skipped: needs CUDA (device {self.device.type})"
        from trainers.torch_compat import dump_memory_snapshot, stop_memory_history

        path = self.out_dir / f"rank{self.rank}-memory.pickle"
        dump_memory_snapshot(str(path))
        stop_memory_history()
        return str(path)


def build_profiler(cfg: ProfileConfig, run_dir: Path, device: torch.device) -> StepProfiler:
    """The no-op profiler unless `profile.start_step` is set."""
    if cfg.start_step is None:
        return StepProfiler()
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return _TorchStepProfiler(cfg, Path(run_dir) / PROFILE, rank, device)
