"""TrainerCallbacks the Ray tests pass to `raytrain train --callback tests.ray.hooks:Name(...)`; they run
inside the Ray workers and talk to the test through files in the run directory (no timing guesses)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from trainers.checkpoint_files import checkpoint_step
from trainers.trainer import Trainer, TrainerCallback

HOLD_TIMEOUT_S = 180.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_atomic(path: Path, text: str) -> None:
    from trainers.storage import write_text_atomic  # a local folder or a bucket

    write_text_atomic(path, text)


def _wait_until(done, what: str, every_s: float = 0.1) -> None:
    """Poll `done()` (a file or a tracker another thread or process moves) until it holds, or fail after
    HOLD_TIMEOUT_S saying `what` did not happen."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {HOLD_TIMEOUT_S:.0f}s")
        time.sleep(every_s)


def _hold(what: str) -> None:
    """Wait to be stopped from outside (a kill, or Ray tearing the group down for a resize)."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)
    raise TimeoutError(f"nobody stopped this worker within {HOLD_TIMEOUT_S:.0f}s ({what})")


class RecordSamples(TrainerCallback):
    """Appends the window ids this rank actually trained on at each step to samples/rank<R>.jsonl."""

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._trainer: Trainer | None = None

    def _wrap(self, trainer: Trainer) -> None:
        get = trainer.train_data.get

        def recording_get(ids):
            self._pending.extend(int(i) for i in ids)
            return get(ids)

        trainer.train_data.get = recording_get
        self._trainer = trainer

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self._trainer is not trainer:  # first step of this attempt: ids of this step were not seen
            raise RuntimeError("RecordSamples was not attached by on_fit_start")
        line = {"step": trainer.step, "world": trainer.engine.world_size, "rank": _rank(), "loss": record["loss"],
                "time": time.time(), "ids": self._pending}
        self._pending = []
        path = trainer.run_dir / "samples" / f"rank{_rank()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def on_fit_start(self, trainer: Trainer) -> None:
        self._wrap(trainer)


class HoldAtCheckpoint(TrainerCallback):
    """After the checkpoint of `step` is committed on `world` workers: mark it and wait to be stopped."""

    def __init__(self, step: int, world: int) -> None:
        self.step, self.world = step, world

    def after_checkpoint(self, trainer: Trainer, path: Path) -> None:
        if checkpoint_step(path) == self.step and trainer.engine.world_size == self.world:
            _write_atomic(trainer.run_dir / "held" / f"step{self.step}_world{self.world}_rank{_rank()}", "")
            _hold(f"held at step {self.step} on {self.world} workers")


class HoldAtStep(TrainerCallback):
    """After `step` on `world` workers (between checkpoints): mark it and wait to be stopped. A fault made
    then costs the steps since the newest committed checkpoint."""

    def __init__(self, step: int, world: int) -> None:
        self.step, self.world = step, world

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.step == self.step and trainer.engine.world_size == self.world:
            _write_atomic(trainer.run_dir / "held" / f"step{self.step}_world{self.world}_rank{_rank()}", "")
            _hold(f"held at step {self.step} on {self.world} workers")


class KillMeAtStep(TrainerCallback):
    """On `rank`, the first time `step` is reached: write this process's pid to pids/rank<R>, then wait to
    be killed. A restarted attempt finds the file and runs on. With `after_commit`: first wait there until
    the checkpoint of step `after_commit` is committed (a background save commits a few steps after the step
    it holds; on a busy machine, more): its writer thread commits while this step waits, and no later save
    can start, so that checkpoint is the newest committed one when the kill comes, whatever the machine's
    pace (holding at the first later step that saw it committed let the next save commit too on a fast
    machine). The step it holds at is written to pids/rank<R>.step first."""

    def __init__(self, step: int, rank: int, after_commit: int | None = None) -> None:
        self.step, self.rank, self.after_commit = step, rank, after_commit

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        pid_file = trainer.run_dir / "pids" / f"rank{self.rank}"
        if trainer.step != self.step or _rank() != self.rank or pid_file.exists():
            return
        if self.after_commit is not None:
            _wait_until(lambda: _committed_step(trainer) >= self.after_commit,
                        f"step {self.after_commit}'s checkpoint was not committed", every_s=0.05)
        _write_atomic(pid_file.with_name(f"rank{self.rank}.step"), str(trainer.step))
        _write_atomic(pid_file, str(os.getpid()))
        _hold(f"waiting for SIGKILL at step {trainer.step}")


def _committed_step(trainer: Trainer) -> int:
    from trainers.checkpoint import Checkpointer
    from trainers.checkpoint_files import checkpoint_step

    latest = Checkpointer(trainer.run_dir / "checkpoints", 2).latest()
    return checkpoint_step(latest) if latest is not None else -1


class RaiseAtStep(TrainerCallback):
    """A bug that fires at `step` on every attempt (with `lr`: only in the run whose learning rate it is)."""

    def __init__(self, step: int, lr: float | None = None) -> None:
        self.step, self.lr = step, lr

    def on_fit_start(self, trainer: Trainer) -> None:
        with (trainer.run_dir / "attempts.log").open("a") as f:  # one line per attempt that trains
            f.write(f"{os.getpid()}\n")

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.step == self.step and self.lr in (None, trainer.cfg.optimizer.lr):
            raise RuntimeError(f"injected failure at step {self.step}")


class KillMeAfterExploit(TrainerCallback):
    """On `rank`, at the first step after a PBT exploit was loaded in place (the trainer's last checkpoint
    is the trial's pin of the donor's, outside the run dir): once the run's trackers have that step, write
    this process's pid to pids/rank<R>, then wait to be killed."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        pid_file = trainer.run_dir / "pids" / f"rank{self.rank}"
        exploited = _from_donor(trainer)
        if exploited and _rank() == self.rank and not pid_file.exists():
            _tracked_up_to(trainer, trainer.step)
            _write_atomic(pid_file, str(os.getpid()))
            _hold("waiting for SIGKILL after the exploit")


def _tracked_up_to(trainer: Trainer, step: int) -> None:
    """Wait until each tracker of the run (trainers.tracking.TrackingSink) has `step` and what came before it
    (the exploit's record): a kill then lands after the tracker had them, whatever the machine's pace."""
    sinks = [s for s in trainer.log.sinks if hasattr(s, "sent_step")]
    _wait_until(lambda: all(s.sent_step >= step for s in sinks), f"the tracker did not take step {step}")


class WaitForReports(TrainerCallback):
    """In the run whose learning rate is `lr`, at `at`: wait until the experiment's lineage in `exp_dir` holds
    `count` reports of `step` (the population's other members caught up), so that an asynchronous PBT decides
    this member's next report against them. `on="step"`: after training step `at`; `on="checkpoint"`: once
    the run's own checkpoint of step `at` is committed and reported. A wait that counts the member's own
    report of a step must be `on="checkpoint"`: with asynchronous saves that report comes a step or more
    after the step, at the commit, so waiting after the step would wait for itself."""

    def __init__(self, exp_dir: str, lr: float, at: int, step: int, count: int, on: str = "step") -> None:
        self.exp_dir, self.lr, self.at, self.on, self.step, self.count = Path(exp_dir), lr, at, on, step, count

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.on == "step" and trainer.step == self.at:
            self._wait(trainer)

    def after_checkpoint(self, trainer: Trainer, path: Path) -> None:
        if self.on == "checkpoint" and checkpoint_step(path) == self.at:
            self._wait(trainer)

    def _wait(self, trainer: Trainer) -> None:
        if trainer.cfg.optimizer.lr != self.lr:
            return
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while time.monotonic() < deadline:
            rows = [json.loads(line) for p in (self.exp_dir / "lineage").glob("*.jsonl") for line in p.open()]
            if sum(r["kind"] == "report" and r["step"] == self.step for r in rows) >= self.count:
                return
            time.sleep(0.1)  # polling files another process writes
        raise TimeoutError(f"fewer than {self.count} reports of step {self.step} within {HOLD_TIMEOUT_S:.0f}s")


class HoldOnceFromDonor(TrainerCallback):
    """The first time in the experiment, on rank 0 at the first step of a run that took a donor's state
    (started from another trial's checkpoint, or an exploit loaded in place): mark it and wait to be
    stopped (a test interrupts the experiment there; Tune ends the held run)."""

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        run_dir = trainer.run_dir
        marker = run_dir.parents[2] / "held-once"  # EXP_DIR/runs/<trial>/<run>
        if _from_donor(trainer) and _rank() == 0 and not marker.exists():
            _write_atomic(marker, str(os.getpid()))
            _hold("held at the first step from a donor")


def _from_donor(trainer: Trainer) -> bool:
    """Whether the trainer's state came last from a checkpoint outside its run dir (a donor's: an exploit
    loaded in place, or a run started from another trial's checkpoint)."""
    last = trainer.last_checkpoint  # a local path, or a bucket's location: compared as text
    return last is not None and not str(last).startswith(str(trainer.run_dir).rstrip("/") + "/")


class _SaveReplaced:
    """A trainer's checkpoint backend with its `save` replaced by `save(path, state, **kwargs)` (which calls the
    original, `inner.save`, when it means to write); staging and loading go to the original."""

    def __init__(self, inner: Any, save: Any) -> None:
        self.inner, self.save = inner, save

    def stage(self, state):
        return self.inner.stage(state)

    def load(self, path, state, **kwargs):
        self.inner.load(path, state, **kwargs)


def _step_of(path: Any) -> int:
    """The step of a checkpoint folder being written (`step_XXXXXXXX.partial`, or the step folder itself)."""
    return int(re.search(r"step_(\d{8})", str(path)).group(1))


class KillMeMidSave(TrainerCallback):
    """On `rank`, in the save of `step`, the first time: once DCP has written every rank's shards and before
    the commit, write the checkpoint folder's listing and this process's pid into the local folder
    `marker_dir`, then wait to be killed (a run dir in a bucket: the test reads the marker here). With
    `checkpoint.mode: async` the wait is in the writer thread: training goes on until the next save waits."""

    def __init__(self, step: int, rank: int, marker_dir: str) -> None:
        self.step, self.rank, self.marker_dir = step, rank, Path(marker_dir)

    def on_fit_start(self, trainer: Trainer) -> None:
        inner = trainer.checkpointer.backend

        def save(path, state, **kwargs):
            inner.save(path, state, **kwargs)
            pid_file = self.marker_dir / "pid"
            if _step_of(path) == self.step and _rank() == self.rank and not pid_file.exists():
                if hasattr(path, "fs"):
                    base = path.path.rstrip("/") + "/"
                    listing = sorted(p[len(base):] for p in path.fs.find(path.path))
                else:
                    listing = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())
                _write_atomic(self.marker_dir / "listing.json", json.dumps(listing))
                _write_atomic(self.marker_dir / "trainer_step", str(trainer.step))
                _write_atomic(pid_file, str(os.getpid()))
                _hold(f"waiting for SIGKILL inside the save of step {self.step}")

        trainer.checkpointer.backend = _SaveReplaced(inner, save)


class EvalAccuracy(TrainerCallback):
    """A user's own eval metric: `accuracy` = exp(-val_loss) (the probability the model gives the
    reference, in the mean), added to each eval record for a search to rank by (`metric: eval/accuracy`)."""

    def after_eval(self, trainer: Trainer, record: dict[str, Any]) -> None:
        import math

        record["accuracy"] = math.exp(-record["val_loss"])


class ReplicaLog(TrainerCallback):
    """Per-step fault tolerance: each replica group appends, at every step it commits, its pid, host, the time, the
    number of live groups, the window ids it trained on in that step's attempt (an attempt that did not
    commit is forgotten), and a digest of its weights, to replicas/group<G>.jsonl; and the step's window ids
    once its vote commits it, to replicas/group<G>.commits.jsonl (a group lost after its gradients were
    averaged, before the step's end, trained its share of a step its peers commit: each attempt's ids are also
    appended as they are read, to replicas/group<G>.attempts.jsonl, where a test finds that share). `kill_group` SIGKILLs its
    own process inside step `kill_step` (after its first micro-batch's samples are read; its first worker, in a
    group of several, whose files are group<G>.rank<R>.*): a lost group with the step in flight. It fires once
    in the run (a marker file), not in the group Ray starts in its place."""

    def __init__(self, kill_step: int = 0, kill_group: int = -1) -> None:
        self.kill_step, self.kill_group = kill_step, kill_group
        self._ids: list[int] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        import signal

        group = int(os.environ.get("RAYTRAIN_REPLICA_GROUP", "0"))
        rank = trainer.engine.group_rank  # a worker of a group of several: its own file
        self.path = trainer.run_dir / "replicas" / (f"group{group}.jsonl" if rank == 0 else f"group{group}.rank{rank}.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        marker = trainer.run_dir / "replicas" / "killed"
        begin, get = trainer.engine.begin_step, trainer.train_data.get

        attempts = self.path.with_suffix(".attempts.jsonl")
        attempt = 0

        def begin_step() -> None:
            nonlocal attempt
            self._ids, attempt = [], attempt + 1  # a new attempt at a step
            begin()

        def recording_get(ids):
            self._ids.extend(int(i) for i in ids)
            with open(attempts, "a") as f:
                f.write(json.dumps({"step": trainer.step + 1, "pid": os.getpid(), "attempt": attempt,
                                    "ids": [int(i) for i in ids]}) + "\n")
            if group == self.kill_group and rank == 0 and trainer.step + 1 == self.kill_step and not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            return get(ids)

        commit = trainer.engine.should_commit
        commits = self.path.with_suffix(".commits.jsonl")

        def should_commit() -> bool:  # the samples of a step its vote commits, written before the optimizer's step
            ok = commit()
            if ok:
                with open(commits, "a") as f:
                    f.write(json.dumps({"step": trainer.step + 1, "pid": os.getpid(), "ids": self._ids}) + "\n")
            return ok

        trainer.engine.begin_step, trainer.train_data.get = begin_step, recording_get
        trainer.engine.should_commit = should_commit

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        import hashlib

        from torch.distributed.tensor import DTensor

        digest = hashlib.sha256()
        for p in trainer.model.parameters():  # this worker's: its shards of a sharded model
            digest.update((p.to_local() if isinstance(p, DTensor) else p).detach().cpu().numpy().tobytes())
        line = {"step": trainer.step, "group": int(os.environ.get("RAYTRAIN_REPLICA_GROUP", "0")),
                "rank": trainer.engine.group_rank,
                "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "replicas": record.get("replicas"),
                "ids": self._ids, "weights": digest.hexdigest(), "loss": record["loss"]}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


class Pace(TrainerCallback):
    """Each step lasts at least `seconds` (a sleep after it) until the file `until` exists: a run that lasts
    through what a test does to it meanwhile however fast the machine steps, and that then finishes at full
    speed. Not a synchronisation: the test waits on the run's own records, never on this pace.

    `after`: from the step after it on (a run paced only once it has reached what a test waits for).
    `inside`: the sleep is in the step instead, after its quorum (a replica group's `begin_step`), where the
    groups of the quorum are bound to average their gradients; each sleep's start writes the step to
    replicas/in_step.<host>, which a test can wait on to act while the step is in flight."""

    def __init__(self, seconds: float, until: str, inside: bool = False, after: int = 0) -> None:
        self.seconds, self.until, self.inside, self.after = seconds, Path(until), inside, after

    def on_fit_start(self, trainer: Trainer) -> None:
        if not self.inside:
            return
        marker = trainer.run_dir / "replicas" / f"in_step.{socket.gethostname()}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        begin = trainer.engine.begin_step

        def begin_step() -> None:
            begin()
            if not self.until.exists():
                written = marker.with_name(marker.name + ".tmp")
                written.write_text(str(trainer.step + 1))
                written.replace(marker)
                time.sleep(self.seconds)

        trainer.engine.begin_step = begin_step

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not self.inside and trainer.step > self.after and not self.until.exists():
            time.sleep(self.seconds)


class StallOnce(TrainerCallback):
    """Replica group `group` sleeps `seconds` after the first step from `step` on that `replicas` groups
    trained, once in the run (a marker file holds that step): longer than a quorum waits for a live group
    (trainers/fault_tolerance.py: LIGHTHOUSE's join timeout), so the others train on without it (they are more
    than half of the groups) and it heals from one of them at its next quorum, in the same process."""

    def __init__(self, group: int, step: int, seconds: float, replicas: int, until_recorded: int = 0) -> None:
        self.group, self.step, self.seconds, self.replicas = group, step, seconds, replicas
        self.until_recorded = until_recorded  # and then until metrics.jsonl has this step (the others' end)

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        from trainers.metrics import read_metrics

        marker = trainer.run_dir / "replicas" / "stalled"
        if (trainer.step >= self.step and record.get("replicas") == self.replicas and not marker.exists()
                and int(os.environ.get("RAYTRAIN_REPLICA_GROUP", "0")) == self.group):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(trainer.step))
            time.sleep(self.seconds)
            if self.until_recorded:  # polling the file the other groups write
                _wait_until(lambda: any(r["step"] >= self.until_recorded
                                        for r in read_metrics(trainer.run_dir / "metrics.jsonl", "train")),
                            f"step {self.until_recorded} was not recorded")
