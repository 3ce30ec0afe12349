"""The table a user watches while `raytrain tune` runs: Tune's classic CLIReporter (each trial's metric,
step and current hyperparameters), with its status lines made true for this package's trials.

Tune's own lines describe its trial actors, not the Train runs they host: "Logical resource usage" counts
what the trial actors reserve (nothing: the Train workers reserve their own), so it read 0/2 CPUs while
every worker trained; "Result logdir" names Tune's staging folder in the Ray session under /tmp. Here
the first becomes what the cluster's workers hold and the second the experiment folder, where the user
looks. (The best-trial line shows a trial's current hyperparameters because the trial reports its
config as it trains with it: `search.trial.TrialRun.step`.)
"""

from __future__ import annotations

from typing import Any

import ray
from ray import tune

__all__ = ["ExperimentReporter"]


class ExperimentReporter(tune.CLIReporter):
    def __init__(self, *args: Any, exp_dir: str, slots: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exp_dir, self.slots = exp_dir, slots  # slots: the time-sharing actor's name (search.slots)

    def _progress_str(self, trials: list[Any], done: bool, *sys_info: str, **kwargs: Any) -> str:
        text = super()._progress_str(trials, done, *sys_info, **kwargs)
        return "\n".join(self._line(line) for line in text.split("\n"))

    def _line(self, line: str) -> str:
        if line.startswith("Logical resource usage:"):
            return held_by_workers() + self._turns()
        if line.startswith("Result logdir:"):
            return f"Experiment folder: {self.exp_dir}"
        return line

    def _turns(self) -> str:
        if self.slots is None:
            return ""
        try:
            stats = ray.get(ray.get_actor(self.slots).stats.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - a status line is never worth failing the experiment
            return ""
        return f"; Train runs: {stats['running']} of {stats['capacity']} slots, {stats['waiting']} members waiting their turn"


def held_by_workers() -> str:
    """What the cluster's tasks and actors hold now (the Train runs' workers, as Ray accounts them)."""
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception:  # noqa: BLE001 - a status line is never worth failing the experiment
        return "Cluster resources: ?"
    parts = [
        f"{total.get(kind, 0) - free.get(kind, 0):g}/{total.get(kind, 0):g} {kind}s"
        for kind in ("CPU", "GPU")
        if kind == "CPU" or total.get(kind)
    ]
    return "Held by Train workers: " + ", ".join(parts)
