"""What a training run left, read from its run dir: the result of `raytrain train` and of `raytrain_ext.train`,
on Ray or not. Imports no Ray (nor torch, until a result is read)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunResult", "goodput", "summarize"]


@dataclass
class RunResult:
    """A finished (or stopped) run: the last step's losses, the best ones, the final committed checkpoint
    and every row of its `metrics.jsonl` (kinds `train`, `eval`, `event`)."""

    run_dir: Path
    step: int  # the last step trained
    val_loss: float | None  # the last evaluation's (None: never evaluated)
    train_loss: float | None  # the last step's
    checkpoint: Path | None  # the final committed checkpoint (a step_* folder), None when none was saved
    world_sizes: list[int]  # the world size of each attempt, in order (resizes and restarts)
    best_val_loss: float | None = None
    best_train_loss: float | None = None
    # The share of the wall time that trained committed steps at full speed: committed steps x a step's wall time
    # at full size, over the time from the first step's start to the last step's end (`goodput`).
    goodput: float | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def to_dataframe(self, kind: str | None = None) -> Any:
        """The metrics rows as a pandas DataFrame: all of them, or those of one `kind` (train, eval, event)."""
        import pandas as pd

        return pd.DataFrame([r for r in self.metrics if kind is None or r.get("kind") == kind])


def summarize(run_dir: Path, checkpoint: str | Path | None = None) -> RunResult:
    """The RunResult of the run in `run_dir`; `checkpoint`: its final committed checkpoint."""
    from trainers.metrics import read_metrics  # torch: not for `import raytrain_ext`
    from trainers.run_dir import RunDir
    from trainers.storage import absolute

    run_dir = absolute(run_dir)  # the same place from any working directory (a notebook's may change)
    rows = read_metrics(RunDir(run_dir).metrics)
    train_rows = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    starts = [r for r in rows if r.get("kind") == "event" and r.get("event") in ("start", "resume")]
    return RunResult(
        run_dir=run_dir,
        step=train_rows[-1]["step"] if train_rows else 0,
        val_loss=evals[-1]["val_loss"] if evals else None,
        train_loss=train_rows[-1]["loss"] if train_rows else None,
        checkpoint=absolute(checkpoint) if checkpoint else None,
        world_sizes=[r["world_size"] for r in starts if "world_size" in r],
        best_val_loss=_least(r.get("val_loss") for r in evals),
        best_train_loss=_least(r.get("loss") for r in train_rows),
        goodput=goodput(train_rows),
        metrics=rows,
    )


def goodput(train_rows: list[dict[str, Any]]) -> float | None:
    """Committed steps x the wall time a step takes at full size (the most replica groups, or workers, any step
    had) over the wall time from the first step's start to the last step's end: 1.0 for a run that never lost
    time. A step's wall time at full size is the median interval between two consecutive committed steps both
    trained at full size, so it holds what each step costs beside its `step_time_s` (its record, callbacks, the
    next step's quorum); the median `step_time_s` at full size where no two such steps follow each other."""
    if len(train_rows) < 2:
        return None
    size = [r.get("replicas", r.get("world_size", 1)) for r in train_rows]
    top = max(size)
    per_step = sorted(b["time"] - a["time"] for a, b, m, n in zip(train_rows, train_rows[1:], size, size[1:])
                      if m == n == top and b["step"] == a["step"] + 1)
    per_step = per_step or sorted(r["step_time_s"] for r, n in zip(train_rows, size) if n == top)
    wall = train_rows[-1]["time"] - (train_rows[0]["time"] - train_rows[0]["step_time_s"])
    return round(min(len(train_rows) * per_step[len(per_step) // 2] / wall, 1.0), 4) if wall > 0 else None


def _least(values: Any) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return min(finite) if finite else None
