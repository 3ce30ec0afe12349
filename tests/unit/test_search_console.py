"""The status lines `raytrain tune` shows (search.console.ExperimentReporter): Tune's count of what its
trial actors reserve (always 0: the Train workers reserve their own) becomes what the workers hold, and
Tune's staging folder under /tmp becomes the experiment folder."""

from __future__ import annotations

import search.console as console
from search.console import ExperimentReporter


def test_status_lines_name_what_the_workers_hold_and_the_experiment_folder(monkeypatch):
    monkeypatch.setattr(console, "held_by_workers", lambda: "Held by Train workers: 2/2 CPUs")
    reporter = ExperimentReporter(metric_columns=["val_loss"], exp_dir="/data/runs/tune/demo")
    text = reporter._progress_str([], False, "PBT: 1 exploits", "Logical resource usage: 0/2 CPUs, 0/0 GPUs")
    lines = text.split("\n")
    assert "Held by Train workers: 2/2 CPUs" in lines and "PBT: 1 exploits" in lines
    assert not any(line.startswith("Logical resource usage") for line in lines)
    assert reporter._line("Result logdir: /tmp/ray/session_x/artifacts/demo/driver_artifacts") == (
        "Experiment folder: /data/runs/tune/demo"
    )
