"""Asynchronous checkpoints (issue 24), one process: training waits only for staging, the bytes are written,
checked and committed in the background, reports (callbacks) see committed checkpoints only and the
metrics of their own step, one save is in flight at a time, and damage is still found on resume.

A slow disk is made by a backend whose write waits for an event that the training thread sets a few steps
later: the order of what happens is forced, not guessed from timings."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch

from trainers.checkpoint import Checkpointer, CheckpointError
from trainers.checkpoint_files import COMMITTED, checkpoint_step, is_complete
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

WAIT_S = 120.0  # a bound on each forced wait; reached only when the code under test is broken


class _GatedWrites(TrainerCallback):
    """Holds the background write of step `hold` until the training thread reaches step `release` (after
    its train step, or `after_eval` when `on_eval`); records what each callback saw."""

    def __init__(self, hold: int, release: int, on_eval: bool = False) -> None:
        self.hold, self.release, self.on_eval = hold, release, on_eval
        self.gate = threading.Event()
        self.staged_when: dict[int, list[str]] = {}  # step -> committed checkpoints when it was staged
        self.reports: list[tuple[int, int, bool]] = []  # (checkpoint step, trainer step, committed then)

    def on_fit_start(self, trainer: Trainer) -> None:
        inner, hook = trainer.checkpointer.backend, self

        class Gated:
            def stage(self, state):
                hook.staged_when[trainer.step] = [p.name for p in trainer.checkpointer.candidates()]
                return inner.stage(state)

            def save(self, path, state, **kwargs):
                if path.name.startswith(f"step_{hook.hold:08d}"):
                    assert hook.gate.wait(WAIT_S), "the training thread never released the write"
                return inner.save(path, state, **kwargs)

            def load(self, path, state, **kwargs):
                inner.load(path, state, **kwargs)

        trainer.checkpointer.backend = Gated()

    def after_step(self, trainer: Trainer, record) -> None:
        if trainer.step == self.release and not self.on_eval:
            self.gate.set()

    def after_eval(self, trainer: Trainer, record) -> None:
        if trainer.step == self.release and self.on_eval:
            self.gate.set()

    def after_checkpoint(self, trainer: Trainer, path) -> None:
        self.reports.append((checkpoint_step(path), trainer.step, is_complete(path)))


def _records(run_dir, kind=None):
    return read_metrics(run_dir / "metrics.jsonl", kind)


def test_async_training_goes_on_while_writing_and_reports_at_commit_with_the_same_losses(tiny_config):
    sections = dict(train={"steps": 12, "eval_every": 4}, checkpoint={"every": 4})
    sync_cfg = tiny_config("sync", train=sections["train"], checkpoint={"every": 4, "mode": "sync"})
    sync = Trainer(sync_cfg, progress=False)
    sync.fit()

    cfg = tiny_config("async", **sections)
    assert cfg.checkpoint.mode == "async", "async is the default"
    hook = _GatedWrites(hold=4, release=7)
    live = Trainer(cfg, callbacks=[hook], progress=False)
    live.fit()

    # Training went on to step 7 while step 4 was being written; the report came at the commit, after it.
    rows = _records(cfg.out_dir)
    (event4,) = [r for r in rows if r.get("event") == "checkpoint" and r["step"] == 4]
    trained_before = [r["step"] for r in rows[: rows.index(event4)] if r["kind"] == "train"]
    assert trained_before[-1] >= 7, "the step-4 commit is reported after the steps trained during its write"
    assert hook.reports[0][0] == 4 and hook.reports[0][1] >= 7
    assert all(committed for _, _, committed in hook.reports), "callbacks see committed checkpoints only"
    assert [s for s, _, _ in hook.reports] == [4, 8, 12], "each checkpoint reported once, in order"
    for key in ("mode", "blocking_s", "wait_s", "stage_s", "write_s", "checksum_s", "commit_s", "bytes"):
        assert key in event4, key
    assert event4["mode"] == "async" and event4["bytes"] > 0
    assert event4["blocking_s"] < event4["commit_s"], "training waited for staging, not for the write"

    # Async changes when bytes hit the disk, never what is trained or saved.
    assert [r["loss"] for r in _records(cfg.out_dir, "train")] == [r["loss"] for r in _records(sync_cfg.out_dir, "train")]
    for p, q in zip(live.model.parameters(), sync.model.parameters()):
        assert torch.equal(p, q)
    a, b = (c.out_dir / "checkpoints" / "step_00000012" / "trainer_state.json" for c in (cfg, sync_cfg))
    assert json.loads(a.read_text()) == json.loads(b.read_text())
    (sync_event,) = [r for r in _records(sync_cfg.out_dir, "event") if r["event"] == "checkpoint" and r["step"] == 4]
    assert sync_event["mode"] == "sync" and sync_event["blocking_s"] == pytest.approx(sync_event["commit_s"], abs=0.01)


def test_the_next_save_waits_for_the_one_in_flight_and_the_wait_is_recorded(tiny_config):
    cfg = tiny_config(train={"steps": 6, "eval_every": 2}, checkpoint={"every": 2})
    # The write of step 2 is held until the eval of step 4, right before the save of step 4.
    hook = _GatedWrites(hold=2, release=4, on_eval=True)
    Trainer(cfg, callbacks=[hook], progress=False).fit()
    assert "step_00000002" in hook.staged_when[4], "step 4 was staged only once step 2 had committed"
    events = [r for r in _records(cfg.out_dir, "event") if r["event"] == "checkpoint"]
    assert [e["step"] for e in events] == [2, 4, 6]
    assert events[1]["wait_s"] > 0 and events[1]["blocking_s"] >= events[1]["wait_s"]


def test_fit_returns_with_its_last_save_committed_and_reported(tiny_config):
    cfg = tiny_config(train={"steps": 8}, checkpoint={"every": 0})
    hook = _GatedWrites(hold=8, release=8)  # released as the last step ends: fit must still wait for it
    result = Trainer(cfg, callbacks=[hook], progress=False).fit()
    assert result.checkpoint is not None and is_complete(result.checkpoint)
    assert hook.reports == [(8, 8, True)]
    assert [e["step"] for e in _records(cfg.out_dir, "event") if e["event"] == "checkpoint"] == [8]


class _InterruptAt(TrainerCallback):
    """After `step`: releases a held write, then Ctrl-C (or, with `stop`, asks the trainer to stop, as a Tune
    trial's hook does)."""

    def __init__(self, step: int, release: threading.Event, stop: bool = False) -> None:
        self.step, self.release, self.stop = step, release, stop

    def after_step(self, trainer: Trainer, record) -> None:
        if trainer.step == self.step:
            self.release.set()
            if not self.stop:
                raise KeyboardInterrupt
            trainer.request_stop(f"asked at step {self.step}")


def test_ctrl_c_with_a_save_in_flight_waits_for_its_commit_on_one_process(tiny_config, capsys):
    cfg = tiny_config(train={"steps": 20}, checkpoint={"every": 4})
    hook = _GatedWrites(hold=4, release=10**6)  # only the interrupt releases it
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, callbacks=[hook, _InterruptAt(6, hook.gate)], progress=False).fit()
    assert "stopping (KeyboardInterrupt): waited for the save of step 4, committed" in capsys.readouterr().out
    assert Checkpointer(cfg.out_dir / "checkpoints", 3).latest().name == "step_00000004"
    assert hook.reports == [], "no report while stopping on an error"
    resumed = Trainer(cfg, progress=False)
    assert resumed.step == 4


def test_a_stop_request_ends_fit_after_its_step_with_the_save_in_flight_committed(tiny_config, capsys):
    cfg = tiny_config(train={"steps": 20}, checkpoint={"every": 4})
    hook = _GatedWrites(hold=4, release=10**6)  # only the stop request releases it
    result = Trainer(cfg, callbacks=[hook, _InterruptAt(6, hook.gate, stop=True)], progress=False).fit()
    assert result.stopped == "asked at step 6" and result.step == 6, "returned, no exception, no step after 6"
    assert result.checkpoint is not None and result.checkpoint.name == "step_00000004"
    assert "stopping (stop requested): waited for the save of step 4, committed" in capsys.readouterr().out
    assert [r["step"] for r in _records(cfg.out_dir, "train")] == list(range(1, 7))
    assert [e["step"] for e in _records(cfg.out_dir, "event") if e["event"] == "checkpoint"] == [4]
    assert Trainer(cfg, progress=False).step == 4, "the committed save is the resume point"


def _flip_a_byte(path) -> None:
    victim = max(path.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_is_found_by_its_checksum_and_skipped(tiny_config):
    cfg = tiny_config(train={"steps": 8}, checkpoint={"every": 4})
    Trainer(cfg, progress=False).fit()
    newest = cfg.out_dir / "checkpoints" / "step_00000008"
    marker = json.loads((newest / COMMITTED).read_text())
    assert marker["hash"] == "xxh3_128" and all(f["pieces"] for f in marker["files"].values())
    _flip_a_byte(newest)

    more = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 10})})
    resumed = Trainer(more, progress=False)
    assert resumed.step == 4
    (event,) = [e for e in _records(cfg.out_dir, "event") if e["event"] == "resume"]
    assert "xxh3_128 checksum" in event["skipped"][0]["reason"]
    assert event["verify_s"] >= 0 and event["restore_s"] > 0


def test_markers_from_before_pieces_still_verify(tiny_config):
    cfg = tiny_config(train={"steps": 6}, checkpoint={"every": 6})
    Trainer(cfg, progress=False).fit()
    path = cfg.out_dir / "checkpoints" / "step_00000006"
    marker = json.loads((path / COMMITTED).read_text())
    old = {"step": 6, "files": {
        name: {"size": f["size"], "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
        for name, f in marker["files"].items()
    }}
    (path / COMMITTED).write_text(json.dumps(old))
    assert Checkpointer.verify(path) is None
    _flip_a_byte(path)
    assert Checkpointer.verify(path).endswith("does not match its sha256")


def test_a_failed_background_write_is_one_error_naming_the_step(tiny_config):
    cfg = tiny_config(train={"steps": 6}, checkpoint={"every": 2})

    class Broken(TrainerCallback):
        def on_fit_start(self, trainer):
            inner = trainer.checkpointer.backend

            class Full:
                stage = inner.stage
                load = inner.load

                def save(self, path, state, **kwargs):
                    raise OSError(28, "No space left on device")

            trainer.checkpointer.backend = Full()

    with pytest.raises(CheckpointError, match="the save of step 2 failed .*No space left on device"):
        Trainer(cfg, callbacks=[Broken()], progress=False).fit()
    assert not list((cfg.out_dir / "checkpoints").glob("step_????????")), "nothing half-written counts"


def test_a_collected_save_has_its_writer_gone_with_what_it_held(tmp_path):
    """The writer thread lets go of the staged state after it signals the commit; `collect` waits for that.
    A daemon thread still releasing tensors (which lets go of the GIL) when the interpreter exits is ended from
    inside torch's C++ and aborts the process ("terminate called without an active exception"). Here the staged
    state's release is made slow: collect must return only after it."""
    from trainers.checkpoint import DCPBackend, ModelOptimizerState

    released = threading.Event()

    class SlowRelease:
        def __del__(self):
            threading.Event().wait(0.5)  # a slow release (many tensors), in the thread that drops it
            released.set()

    inner = DCPBackend()

    class Backend:
        def stage(self, state):
            return {**inner.stage(state), "slow": SlowRelease()}

        def save(self, path, state, **kwargs):
            return inner.save(path, {k: v for k, v in state.items() if k != "slow"}, **kwargs)

        def load(self, path, state, **kwargs):
            inner.load(path, state, **kwargs)

    model = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(tmp_path, keep=2, backend=Backend(), mode="async")
    ckpt.start_save(3, {"app": ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))},
                    {"step": 3})
    committed = ckpt.collect(wait=True)
    assert committed is not None and is_complete(committed.path)
    assert released.is_set()
    assert not [t for t in threading.enumerate() if t.name == "checkpoint-3"]


def test_every_save_stages_into_the_host_buffers_of_the_first():
    """Staging copies each save's state into the host buffers of the save before (pinned on CUDA: pinning
    again costs seconds a save). torch 2.11 and 2.12's DefaultStager closed its stager after one stage: the
    second save of a run failed there (KeyError: <class 'type'>), on the GPU machine's torch."""
    from trainers.checkpoint import DCPBackend, ModelOptimizerState

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    backend, state = DCPBackend(), {"app": ModelOptimizerState(model, opt)}
    first = backend.stage(state)["app"]
    with torch.no_grad():
        model.weight.add_(1.0)
    second = backend.stage(state)["app"]
    live = state["app"].state_dict()
    torch.testing.assert_close(second["model"], live["model"], rtol=0, atol=0)
    torch.testing.assert_close(second["optim"]["state"], live["optim"]["state"], rtol=0, atol=0)
    assert second["optim"]["param_groups"] == live["optim"]["param_groups"]
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr()
    assert second["model"]["weight"].data_ptr() != model.weight.data_ptr()  # a copy, not the live weight
