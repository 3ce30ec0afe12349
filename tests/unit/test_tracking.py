"""Trackers: the background sink (retries, once-only warnings, resumes that never send a step twice), MLflow
on a local store read back through MLflow's own client, an unreachable server, W&B offline run files."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from trainers.metrics import read_metrics
from trainers.tracking import Tracker, TrackingSink
from trainers.trainer import Trainer, TrainerCallback


class _Flaky(Tracker):
    """Fails its first `failures` opens (a server that is down, then up)."""

    name = "fake"

    def __init__(self, failures: int = 0):
        self.failures, self.opens, self.got, self.finished, self.opened_state = failures, 0, [], None, None

    def open(self, state: dict[str, Any]) -> None:
        self.opens += 1
        if self.opens <= self.failures:
            raise ConnectionError("[Errno 111] Connection refused")
        self.opened_state = dict(state)
        state.setdefault("run_id", "run-1")

    def send(self, records: list[dict[str, Any]]) -> None:
        self.got += records

    def finish(self, status: str) -> None:
        self.finished = status


def _train(step: int) -> dict[str, Any]:
    return {"kind": "train", "step": step, "time": 1.0, "loss": 10.0 - step}


def _event(step: int, name: str) -> dict[str, Any]:
    return {"kind": "event", "step": step, "time": 1.0, "event": name}


def test_sink_keeps_records_while_down_and_warns_once(tmp_path, capfd):
    tracker = _Flaky(failures=3)
    sink = TrackingSink(tracker, tmp_path / "state.json", flush_every_s=0.01, close_timeout_s=30)
    sink.start(0, [])
    records = [_event(0, "start"), *(_train(s) for s in range(1, 41))]
    for r in records:
        sink.write(r)
    sink.close("FINISHED")
    assert tracker.got == records, "every record, in order, once the tracker is reachable"
    assert tracker.finished == "FINISHED"
    err = capfd.readouterr().err.splitlines()
    assert sum("fake failed (ConnectionError" in line for line in err) == 1, err
    assert sum("fake works again" in line for line in err) == 1, err
    assert json.loads((tmp_path / "state.json").read_text()) == {"run_id": "run-1", "sent_step": 40, "sent_eval": 0}


def test_an_eval_after_its_steps_train_row_was_sent_is_sent(tmp_path):
    """The run's final eval (step 8) arrives after the train row of step 8 went out in a flush: it is a
    different metric of that step, not a repeat (a busy machine lost it from MLflow this way)."""
    tracker = _Flaky()
    sink = TrackingSink(tracker, tmp_path / "state.json", flush_every_s=3600)
    sink.start(0, [])
    for s in range(1, 9):
        sink.write(_train(s))
    assert sink._attempt() and sink.sent_step == 8  # the train rows are out
    final_eval = {"kind": "eval", "step": 8, "time": 2.0, "val_loss": 4.5}
    sink.write(final_eval)
    sink.close("FINISHED")
    assert tracker.got[-1] == final_eval and len(tracker.got) == 9
    assert json.loads((tmp_path / "state.json").read_text())["sent_eval"] == 8


def test_a_restore_to_an_earlier_step_sends_the_steps_after_it_again_with_their_new_values(tmp_path):
    """A running trainer that restores a donor's step 10 after its own step 14 was sent (`Trainer.restore`):
    the tracker gets steps 11-14 again, from the branch the run goes on with, and each step after once."""
    tracker = _Flaky()
    sink = TrackingSink(tracker, tmp_path / "state.json", flush_every_s=3600)
    sink.start(0, [])
    for s in range(1, 15):
        sink.write(_train(s))
    assert sink._attempt() and [r["step"] for r in tracker.got] == list(range(1, 15))
    sink.rewind(10)  # the restore
    new = [{**_train(s), "loss": -float(s)} for s in range(11, 21)]
    for r in new:
        sink.write(r)
    sink.close("FINISHED")
    train = [r for r in tracker.got if r["kind"] == "train"]
    assert [r["step"] for r in train] == [*range(1, 15), *range(11, 21)]
    assert train[14:] == new, "the new branch's values, not skipped as sent already"


def test_a_rewind_while_a_batch_is_on_its_way_still_sends_the_branch_the_run_goes_on_with(tmp_path):
    class _RewindDuringSend(_Flaky):  # the exploit's rewind lands while the sink's thread is sending
        def send(self, records: list[dict[str, Any]]) -> None:
            super().send(records)
            if any(r["step"] == 14 for r in records):
                sink.rewind(10)

    tracker = _RewindDuringSend()
    sink = TrackingSink(tracker, tmp_path / "state.json", flush_every_s=3600)
    sink.start(0, [])
    for s in range(1, 15):
        sink.write(_train(s))
    assert sink._attempt()
    assert sink.sent_step == 10, "the rewind counts, not the batch that was on its way"
    new = [{**_train(s), "loss": -float(s)} for s in range(11, 15)]
    for r in new:
        sink.write(r)
    sink.close("FINISHED")
    assert tracker.got[-4:] == new, "the newest values of steps 11-14 are the branch the run went on with"


def test_resumed_sink_continues_its_run_and_never_sends_a_step_twice(tmp_path):
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"run_id": "run-1", "sent_step": 6}))
    tracker = _Flaky()
    sink = TrackingSink(tracker, state, flush_every_s=0.01)
    # metrics.jsonl after the resume from the checkpoint of step 4: steps 5 and 6 were sent already
    kept = [_train(s) for s in range(1, 5)] + [_event(4, "checkpoint")]
    sink.start(4, kept)
    for r in [_event(4, "resume"), *(_train(s) for s in range(5, 10))]:
        sink.write(r)
    sink.close("FINISHED")
    assert tracker.opened_state["run_id"] == "run-1"
    assert [(r["kind"], r["step"]) for r in tracker.got] == [("event", 4)] + [("train", s) for s in (7, 8, 9)]


def test_resumed_sink_first_sends_what_a_lost_worker_never_sent(tmp_path):
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"run_id": "run-1", "sent_step": 2}))
    tracker = _Flaky()
    sink = TrackingSink(tracker, state, flush_every_s=0.01)
    sink.start(4, [_train(s) for s in range(1, 5)])
    sink.write(_train(5))
    sink.close("KILLED")
    assert [r["step"] for r in tracker.got] == [3, 4, 5]
    assert tracker.finished == "KILLED"


def test_fresh_start_is_a_new_tracked_run(tmp_path):
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"run_id": "old", "sent_step": 30}))
    tracker = _Flaky()
    sink = TrackingSink(tracker, state, flush_every_s=0.01)
    sink.start(0, [])
    sink.write(_train(1))
    sink.close()
    assert "run_id" not in tracker.opened_state and [r["step"] for r in tracker.got] == [1]


# ------------------------------------------------------------------------------------ real trackers


class _CrashAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def after_step(self, trainer, record):
        if trainer.step == self.step:
            raise RuntimeError("worker lost")  # after steps past the last checkpoint were logged


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on leaving: nothing listens there


def _mlflow_run(run_dir: Path):
    from mlflow import MlflowClient

    state = json.loads((run_dir / "mlflow" / "state.json").read_text())
    client = MlflowClient(state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def test_mlflow_local_store_holds_params_metrics_events_and_artifacts(tiny_config):
    # close_timeout_s: the test checks what arrives; a busy machine may take a minute to create the store
    tracking = {"mlflow": {"experiment": "tests"}, "flush_every_s": 0.2, "close_timeout_s": 600}
    cfg = tiny_config(train={"steps": 8, "eval_every": 4}, checkpoint={"every": 4}, tracking=tracking)
    with pytest.raises(RuntimeError, match="worker lost"):
        Trainer(cfg, callbacks=[_CrashAt(6)], progress=False).fit()  # steps 5, 6 logged, then lost
    client, run = _mlflow_run(cfg.out_dir)
    first_id = run.info.run_id
    assert run.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(first_id, "loss")] == list(range(1, 7))

    Trainer(cfg, progress=False).fit()  # resumes from step 4, recomputes 5 and 6
    client, run = _mlflow_run(cfg.out_dir)
    assert run.info.run_id == first_id, "a resumed run continues its MLflow run"
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params["optimizer.lr"] == "0.003" and run.data.params["model.dim"] == "32"
    assert run.data.params["train.steps"] == "8" and "tracking.flush_every_s" not in run.data.params

    rows = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    history = client.get_metric_history(first_id, "loss")
    assert [m.step for m in history] == list(range(1, 9)), "each step once, though 5 and 6 ran twice"
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in rows], rel=1e-12)
    evals = read_metrics(cfg.out_dir / "metrics.jsonl", "eval")
    val = client.get_metric_history(first_id, "val_loss")
    assert [(m.step, m.value) for m in val] == [(r["step"], pytest.approx(r["val_loss"])) for r in evals]
    for key in ("lr", "tokens_per_s", "grad_norm", "data_s", "forward_backward_s", "optimizer_s"):
        assert len(client.get_metric_history(first_id, key)) == 8, key

    tags = run.data.tags
    assert json.loads(tags["event.00000000.start"])["world_size"] == 1
    assert json.loads(tags["event.00000004.resume"])["checkpoint"].endswith("step_00000004")
    final = str(cfg.out_dir / "checkpoints" / "step_00000008")
    assert tags["final_checkpoint"] == final
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert (artifacts / "final_checkpoint.txt").read_text().strip() == final
    assert "optimizer:" in (artifacts / "config.yaml").read_text()
    assert artifacts.is_relative_to(cfg.out_dir), "a local store keeps its artifacts in the run dir"


def test_unreachable_tracking_server_does_not_stop_the_run(tiny_config, capfd):
    uri = f"http://127.0.0.1:{_closed_port()}"
    tracking = {"mlflow": {"tracking_uri": uri}, "flush_every_s": 0.2, "close_timeout_s": 1.0}
    cfg = tiny_config(train={"steps": 6, "eval_every": 3}, checkpoint={"every": 3}, tracking=tracking)
    result = Trainer(cfg, progress=False).fit()
    assert result.step == 6
    rows = read_metrics(cfg.out_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 7))
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [3, 6]
    err = capfd.readouterr().err.splitlines()
    down = [line for line in err if "tracking: mlflow failed" in line]
    assert len(down) == 1 and "ConnectionError" in down[0], err


def _wandb_history(path: Path) -> list[dict[str, str]]:
    """History rows of a W&B run file (a LevelDB-style log of protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, partial = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):  # full, last
            records.append(partial)
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            )
    return rows


def test_wandb_offline_writes_its_run_files(tiny_config, monkeypatch):
    # W&B exports its service's address to this process's environment (for child processes) and keeps
    # the service until exit: let the environment be restored after the test.
    monkeypatch.setenv("WANDB_SERVICE", "")  # records that it was unset, for the restore
    monkeypatch.delenv("WANDB_SERVICE")
    tracking = {
        "wandb": {"project": "tests", "mode": "offline"},
        "flush_every_s": 0.2,
        "close_timeout_s": 600,
    }
    cfg = tiny_config(train={"steps": 6, "eval_every": 6}, checkpoint={"every": 6}, tracking=tracking)
    Trainer(cfg, progress=False).fit()
    import wandb

    wandb.teardown()  # W&B's service writes the run file on its own time; it is complete once it stops
    run_id = json.loads((cfg.out_dir / "wandb" / "state.json").read_text())["run_id"]
    (folder,) = (cfg.out_dir / "wandb").glob(f"offline-run-*-{run_id}")
    assert "optimizer:" in (folder / "files" / "config.yaml").read_text()
    history = _wandb_history(folder / f"run-{run_id}.wandb")
    losses = {int(r["_step"]): float(r["loss"]) for r in history if "loss" in r}
    rows = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    assert losses == {r["step"]: pytest.approx(r["loss"]) for r in rows}
    assert [int(r["_step"]) for r in history if "val_loss" in r] == [6]


def test_unsent_records_of_a_finished_run_are_sent_once(tiny_config, tmp_path, monkeypatch):
    """send_unsent (what search.tracking.catch_up does for each trial's Train runs when an experiment ends:
    Tune ends the last runs without waiting for their trackers): a run whose tracker sent nothing is sent
    from its metrics.jsonl, once."""
    import yaml
    from mlflow import MlflowClient

    from trainers.tracking import send_unsent

    monkeypatch.chdir(tmp_path)  # a store named by URI keeps artifacts in ./mlruns (MLflow's default)
    cfg = tiny_config(train={"steps": 6, "eval_every": 6}, checkpoint={"every": 6})
    Trainer(cfg, progress=False).fit()  # no tracking while it ran
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = yaml.safe_load((cfg.out_dir / "config.yaml").read_text())
    raw["tracking"]["mlflow"] = {"tracking_uri": uri, "experiment": "exp", "run_name": "trial_0"}
    (cfg.out_dir / "config.yaml").write_text(yaml.safe_dump(raw))

    assert send_unsent(cfg.out_dir, timeout_s=600)
    assert send_unsent(cfg.out_dir, timeout_s=600)  # all sent: nothing more
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_name == "trial_0" and run.info.status == "FINISHED"
    rows = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert run.data.tags["final_checkpoint"].endswith("step_00000006")
