"""metrics.jsonl under per-step fault tolerance: the replica group that writes it changes when groups are lost
(trainers/metrics.py: MetricsLog.set_writer). A writer lost after its peers committed a step and before it
wrote that step's row (seen on the cluster tier: a host cut off, back, then its Ray ended) must not leave the
step out, and a row it cut mid-write must not hide the next writer's."""

from __future__ import annotations

from trainers.metrics import MetricsLog, read_metrics


def _row(step: int) -> dict:
    return {"kind": "train", "step": step, "loss": 1.0 / step}


def test_a_new_writer_writes_the_committed_steps_its_lost_predecessor_did_not(tmp_path):
    writer = MetricsLog(tmp_path, tensorboard=False)
    other = MetricsLog(tmp_path, enabled=False, tensorboard=False)
    for step in (1, 2, 3):
        writer.write(_row(step))
        other.write(_row(step))
    other.write(_row(4))  # the writer was lost before its row of step 4
    other.set_writer(True)
    other.write(_row(5))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")] == [1, 2, 3, 4, 5]


def test_a_row_cut_mid_write_is_skipped_and_the_next_writer_starts_a_line_of_its_own(tmp_path):
    writer = MetricsLog(tmp_path, tensorboard=False)
    other = MetricsLog(tmp_path, enabled=False, tensorboard=False)
    for step in (1, 2):
        writer.write(_row(step))
        other.write(_row(step))
    writer.flush()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # killed inside its row of step 3
    other.write(_row(3))
    other.set_writer(True)
    other.write(_row(4))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")] == [1, 2, 3, 4]
