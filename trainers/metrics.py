"""Per-step metrics to `metrics.jsonl`, TensorBoard and the trackers (`trainers.tracking`), by rank 0 only.

Each line is one record: a training step (`"kind": "train"`), an evaluation (`"eval"`) or an event such as
a resume (`"event"`). On resume from step N the records of later steps are dropped first, so the file holds
each step exactly once however often a run restarts. A run dir on an object store (`trainers.storage`)
cannot be appended to: the records (and TensorBoard's files) go to a local copy, uploaded whole (one PUT:
readers see a complete file) at each event, before each checkpoint's commit (`flush`) and at the end, so a
crash never loses the record of a step whose checkpoint was committed.
"""

from __future__ import annotations

import collections
import json
import resource
import sys
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from trainers.run_dir import RunDir
from trainers.storage import (
    location,
    publish,
    read_appended,
    read_bytes,
    working_copy,
    write_text_atomic,
)
from trainers.torch_compat import TorchDispatchMode, tree_leaves

__all__ = ["LiveTensorBytes", "MetricsLog", "MetricsSink", "MetricsTail", "allocator_peak_bytes", "peak_memory_bytes", "read_metrics"]


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated by torch. CPU: the process's peak resident set size (a high-water mark
    that includes the Python runtime; compare runs through differences, as the benchmarks do)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def allocator_peak_bytes(fn: Callable[[], Any]) -> int:
    """The most bytes the CPU allocator held at once for tensors made while `fn` runs, from torch.profiler's
    allocation events: they include compiled code's buffers, unlike a dispatch mode (slow: for tests)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages while active: a CPU's torch.cuda.max_memory_allocated (slow: for
    tests and benchmarks). Each storage counts until a weakref finalizer sees it freed; kernels' scratch
    buffers are not seen. Storages made before entering must be `register`ed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if size == 0 or key in self.live:
                continue
            self.live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key).atexit = False

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.register([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [r for r in _parse(read_bytes(location(path)) or b"") if kind is None or r.get("kind") == kind]


def _parse(data: bytes) -> list[dict[str, Any]]:
    rows = []
    for line in data.decode(errors="replace").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a row cut by a kill mid-write (its step is written again)
                continue
    return rows


class MetricsTail:
    """A run's metrics.jsonl read as it grows (a driver's progress, a search's console): each `rows()`
    gives the complete rows written since the last call, all of them again after the file was rewound
    (a restart rewrites it from its checkpoint); a row cut by a kill mid-write is skipped."""

    def __init__(self, path: Any) -> None:
        self.path, self.offset, self.version = path, 0, None

    def rows(self) -> list[dict[str, Any]]:
        data, self.offset, self.version = read_appended(self.path, self.offset, self.version)
        if not data:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return _parse(complete)


class MetricsSink(Protocol):
    def start(self, step: int, kept: list[dict[str, Any]]) -> None: ...
    def rewind(self, step: int) -> None: ...
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self, status: str) -> None: ...


# Rows a replica group that is not the writer keeps (`MetricsLog.set_writer`): more than the steps a quorum can
# commit between a writer's loss and the next writer's first quorum (one).
HELD_ROWS = 8


class MetricsLog:
    def __init__(
        self, run_dir: Path, enabled: bool = True, tensorboard: bool = True, sinks: Sequence[MetricsSink] = ()
    ):
        run_dir = location(run_dir)
        self.path = RunDir(run_dir).metrics  # where readers find it
        # Where this process appends: the file itself, or its local copy for a run dir on an object store.
        self.local = working_copy(self.path)
        self._remote_tb = RunDir(run_dir).tensorboard
        self._tb_dir = None if not (enabled and tensorboard) else working_copy(self._remote_tb, fresh=True)
        self.enabled = enabled
        self.sinks = list(sinks) if enabled else []
        self._file = self._tb = None
        self._started = False  # the sinks: started once, rewound by a restore in a running trainer
        # Per-step fault tolerance: a replica group that is not the writer keeps its last rows, which it writes
        # if it becomes the writer and the file lacks them (a writer lost between a step's commit and its row).
        self._held: collections.deque[dict[str, Any]] = collections.deque(maxlen=HELD_ROWS)
        if enabled:
            self.local.parent.mkdir(parents=True, exist_ok=True)

    def _open_tensorboard(self, purge_step: int | None) -> None:
        """TensorBoard's writer (a store's: this attempt's events only). `purge_step`, the first step written
        again: TensorBoard drops earlier attempts' events from it on, so each step shows once."""
        from torch.utils.tensorboard import SummaryWriter  # heavy import; only when used

        if self._tb is not None:
            self._tb.close()
        self._tb = SummaryWriter(str(self._tb_dir), purge_step=purge_step)

    def resume_from(self, step: int) -> None:
        """Drop records of steps after `step` (they will be recomputed) before appending; then the sinks
        start from `step` with the records kept."""
        if not self.enabled:
            return
        if self._file is not None:  # a running trainer restoring a checkpoint (a PBT exploit)
            self._file.close()
            self._file = None
        keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        if self._tb_dir is not None:
            self._open_tensorboard(step + 1 if step > 0 else None)
        # The readers' file is the truth (on a store, another machine may have written it).
        if self.path.is_file() or self.local.is_file():
            write_text_atomic(self.local, "".join(json.dumps(r) + "\n" for r in keep))
            self.flush()
        for sink in self.sinks:
            if self._started:
                sink.rewind(step)
            else:
                sink.start(step, keep)
        self._started = True

    def set_writer(self, enabled: bool) -> None:
        """Per-step fault tolerance: the replica group that writes the records changes when groups are lost;
        a new writer appends to what the last one wrote (no TensorBoard or trackers on such a run)."""
        if enabled and not self.enabled:
            self.local.parent.mkdir(parents=True, exist_ok=True)
            data = read_bytes(location(self.path)) or b""
            if data and not data.endswith(b"\n"):  # the last writer was lost inside a row: end it
                self.append_text("\n")
            last = next((r["step"] for r in reversed(_parse(data)) if r.get("kind") == "train"), 0)
            self.enabled = True
            for row in [r for r in self._held if r["step"] > last]:
                self.write(row)
            self._held.clear()
        elif self.enabled and not enabled and self._file is not None:
            self._file.close()
            self._file = None
        self.enabled = enabled

    def append(self, record: dict[str, Any]) -> None:
        """One record from a process that is not the writer (a replica group that healed: how, and how long)."""
        self.append_text(json.dumps(record) + "\n")

    def append_text(self, text: str) -> None:
        self.local.parent.mkdir(parents=True, exist_ok=True)
        with open(self.local, "a") as f:
            f.write(text)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            if record.get("kind") == "train":
                self._held.append(record)
            return
        if self._file is None:
            self._file = open(self.local, "a", buffering=1)  # line-buffered: a crash loses no step
        self._file.write(json.dumps(record) + "\n")
        if record.get("kind") == "event":
            self.flush()
        if self._tb is None and self._tb_dir is not None:
            self._open_tensorboard(None)
        if self._tb is not None:
            step, kind = record.get("step", 0), record.get("kind", "train")
            for key, value in record.items():
                if key not in ("step", "kind", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        """A run dir on an object store: upload what was written so far (the whole file, one PUT), and
        TensorBoard's files (`storage.publish`). Local: the files are the record already."""
        if not self.enabled:
            return
        if self._file is not None:
            self._file.flush()
        publish(self.local, self.path)
        if self._tb is not None:
            self._tb.flush()
            publish(self._tb_dir, self._remote_tb)

    def close(self, status: str = "FINISHED") -> None:
        """`status`: how the run ended, for the sinks (FINISHED, KILLED or FAILED)."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for sink in self.sinks:
            sink.close(status)
        self.sinks = []
