"""The status lines `raytrain tune` shows (search.console.ExperimentReporter): Tune's count of what its
trial actors reserve (always 0: the Train workers reserve their own) becomes what the workers hold, and
Tune's staging folder under /tmp becomes the experiment folder."""

from __future__ import annotations

import search.console as console
from search.console import ExperimentReporter


def test_status_lines_name_what_the_workers_hold_and_the_experiment_folder(monkeypatch):
    monkeypatch.setattr(console, "held_by_workers", lambda: "Held by Train workers: 2/2 CPUs")
    reporter = ExperimentReporter(metric_columns=["val_loss"], exp_dir="/data/runs/tune/demo")
    text = reporter.text([], False, "PBT: 1 exploits", "Logical resource usage: 0/2 CPUs, 0/0 GPUs")
    lines = text.split("\n")
    assert "Held by Train workers: 2/2 CPUs" in lines and "PBT: 1 exploits" in lines
    assert not any(line.startswith("Logical resource usage") for line in lines)
    assert reporter._line("Result logdir: /tmp/ray/session_x/artifacts/demo/driver_artifacts") == (
        "Experiment folder: /data/runs/tune/demo"
    )


def test_between_reports_the_table_says_where_each_running_trial_trains_now(tmp_path):
    """The table's step and metric move once per interval; the line under the header reads each running
    trial's newest Train run as its metrics grow (only the new bytes), and says `starting` before a step."""
    import json

    from search.console import training_now

    old = tmp_path / "runs" / "ab_00000" / "live-00000000-aaaaaa"
    new = tmp_path / "runs" / "ab_00000" / "live-00000040-bbbbbb"  # after an exploit or a yield
    (tmp_path / "runs" / "ab_00001").mkdir(parents=True)
    for run in (old, new):
        run.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 39, "loss": 9.0}) + "\n")

    def write(step: int, loss: float) -> None:
        with (new / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"kind": "train", "step": step, "loss": loss}) + "\n")
            f.write(json.dumps({"kind": "eval", "step": step, "val_loss": 1.0}) + "\n")

    tails: dict = {}
    trials = ["ab_00000", "ab_00001"]
    assert training_now(tmp_path, trials, tails) == "Training now: 00000 starting | 00001 starting"
    write(41, 4.0)
    assert training_now(tmp_path, trials, tails) == "Training now: 00000 step 41 loss 4.000 | 00001 starting"
    offset = tails["ab_00000"].metrics.offset
    write(42, 3.5)
    with (new / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 43')  # a row being written: read once complete
    assert training_now(tmp_path, trials, tails) == "Training now: 00000 step 42 loss 3.500 | 00001 starting"
    assert tails["ab_00000"].metrics.offset > offset
    assert training_now(tmp_path, [], tails) == ""


def test_no_cpus_held_yet_reads_as_starting(monkeypatch):
    monkeypatch.setattr(console.ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(console.ray, "available_resources", lambda: {"CPU": 2.0})
    assert console.held_by_workers() == "Held by Train workers: none yet (their runs are starting)"
    monkeypatch.setattr(console.ray, "available_resources", lambda: {"CPU": 1.5})
    assert console.held_by_workers() == "Held by Train workers: 0.5/2 CPUs"


def test_the_scheduler_line_counts_the_populations_exploits(monkeypatch):
    """Tune runs the trials under its FIFO scheduler; the line a user reads names the population's rule and
    what it decided (the population actor's summary), not "Using FIFO scheduling algorithm."."""

    class _Actor:
        class summary:  # noqa: N801 - the shape of an actor method: .remote()
            @staticmethod
            def remote():
                return {"exploits": 3, "members": {}}

    monkeypatch.setattr(console.ray, "get_actor", lambda name: _Actor if name == "pop-1" else None)
    monkeypatch.setattr(console.ray, "get", lambda value, timeout=None: value)
    reporter = ExperimentReporter(metric_columns=["val_loss"], exp_dir="/x", population=("pbt", "pop-1"))
    assert reporter._line("Using FIFO scheduling algorithm.") == "PBT: 3 exploits decided"
    plain = ExperimentReporter(metric_columns=["val_loss"], exp_dir="/x")  # ASHA, random search: Tune's own line
    assert plain._line("Using FIFO scheduling algorithm.") == "Using FIFO scheduling algorithm."
