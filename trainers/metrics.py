"""Per-step metrics to `metrics.jsonl` (and TensorBoard), written by rank 0 only.

Each line is one record: a training step (`"kind": "train"`), an evaluation (`"kind": "eval"`) or an
event such as a resume (`"kind": "event"`). On resume from step N, records of steps after N are dropped
first, so that the file holds each step exactly once however often a run restarts.

Sinks (trackers: `trainers.tracking`) get every record too; the defaults are none.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["MetricsLog", "MetricsSink", "peak_memory_bytes", "read_metrics"]


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated by torch. CPU: the process's peak resident set size (a high-water mark
    that includes the Python runtime; compare runs through differences, as the benchmarks do)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        return []
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind") == kind]


class MetricsSink(Protocol):
    def start(self, step: int, kept: list[dict[str, Any]]) -> None: ...
    def rewind(self, step: int) -> None: ...
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self, status: str) -> None: ...


class MetricsLog:
    def __init__(
        self, run_dir: Path, enabled: bool = True, tensorboard: bool = True, sinks: Sequence[MetricsSink] = ()
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.sinks = list(sinks) if enabled else []
        self._file = None
        self._tb = None
        self._started = False  # the sinks: started once, rewound by a checkpoint loaded in place
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # heavy import; only when used

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def resume_from(self, step: int) -> None:
        """Drop records of steps after `step` (they will be recomputed) before appending; then the sinks
        start from `step` with the records kept."""
        if not self.enabled:
            return
        if self._file is not None:  # a running trainer loading a checkpoint in place (a PBT exploit)
            self._file.close()
            self._file = None
        keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        if self.path.is_file():
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.path)
        for sink in self.sinks:
            if self._started:
                sink.rewind(step)
            else:
                sink.start(step, keep)
        self._started = True

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses no step
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step, kind = record.get("step", 0), record.get("kind", "train")
            for key, value in record.items():
                if key not in ("step", "kind", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
        for sink in self.sinks:
            sink.write(record)

    def close(self, status: str = "FINISHED") -> None:
        """`status`: how the run ended, for the sinks (FINISHED, KILLED or FAILED)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for sink in self.sinks:
            sink.close(status)
        self.sinks = []
