"""A tracker fed by the Trainer's metrics records, off the training step's thread.

`TrackingSink.write` only appends a record to a buffer; a daemon thread opens the tracker, sends what
accumulated every `flush_every_s` and, while the server is down, keeps the records and retries with a growing
pause, saying so once. Training waits on a tracker only at the end of a run, for at most `close_timeout_s`;
`metrics.jsonl` has every record whatever happens to the copy. A resumed run continues its tracked run (the
id and the last step sent are kept in the run dir) and does not send again the steps it recomputes. A
trainer that goes back to an earlier checkpoint (`Trainer.restore`, a PBT exploit) rewinds its sinks: the
steps after it are trained anew and sent again. PBT decides at committed steps (`search.hooks.GateLoop`),
so no record of a branch an exploit abandons is ever written.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainers._base import first_line
from trainers.storage import write_json_atomic

__all__ = ["Tracker", "TrackingSink", "metric_values"]

_METRIC_KINDS = ("train", "eval")
_MAX_BUFFER = 200_000  # records kept for a server that is down (a long run's worth); the oldest go first


class Tracker:
    """A tracking backend. Called only from the sink's thread; any method may raise (the sink retries).
    `state` is kept in the run dir between attempts of the run (e.g. the tracked run's id)."""

    name = "tracker"

    def open(self, state: dict[str, Any]) -> None:
        """Connect; create the tracked run, or continue the one in `state`."""

    def send(self, records: list[dict[str, Any]]) -> None:
        """Metrics records (`train`/`eval`: per-step values) and events, in order."""

    def finish(self, status: str) -> None:
        """The run ended: FINISHED (all steps), KILLED (stopped, may continue) or FAILED."""


class TrackingSink:
    def __init__(
        self, tracker: Tracker, state_path: Path, flush_every_s: float = 5.0, close_timeout_s: float = 30.0
    ):
        self.tracker, self.state_path = tracker, Path(state_path)
        self.flush_every_s, self.close_timeout_s = flush_every_s, close_timeout_s
        self.state: dict[str, Any] = {}
        # Per kind, the metrics of steps up to here are sent: an eval row arrives after its step's train
        # row, which may be sent already (one counter for both dropped a run's final eval under load).
        self.sent = {"train": 0, "eval": 0}
        self._buffer: list[dict[str, Any]] = []
        self._rewinds: list[int] = []  # steps the trainer went back to: a batch then on its way counts anew
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing: str | None = None
        self._opened = self._down = False
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"tracking-{tracker.name}", daemon=True)

    # -------------------------------------------------------------------------- the training thread

    def start(self, step: int, kept: list[dict[str, Any]]) -> None:
        """The run starts at `step` (0: from scratch, a new tracked run) with `kept`, the records of
        metrics.jsonl up to there: those the tracker never got (a worker lost before it sent them) go
        first. Then the thread starts."""
        self.state = _read_state(self.state_path) if step > 0 else {}
        train = int(self.state.get("sent_step", 0))
        self.sent = {"train": train, "eval": int(self.state.get("sent_eval", train))}  # older: one counter
        with self._lock:
            # of the kept records, events too are sent up to the training steps sent
            self._buffer[:0] = [
                r for r in kept if r.get("step", 0) > self.sent.get(r.get("kind"), self.sent["train"])
            ]
        self._thread.start()

    def rewind(self, step: int) -> None:
        """A running trainer went back to `step` (`Trainer.restore`, a PBT exploit): the steps after it are
        trained anew, with new values, and are sent again (as a restarted run would send them)."""
        with self._lock:
            self._buffer = [r for r in self._buffer if r.get("step", 0) <= step]
            self.sent = {kind: min(sent, step) for kind, sent in self.sent.items()}
            self._rewinds.append(step)

    @property
    def sent_step(self) -> int:
        """The training steps the tracker has."""
        return self.sent["train"]

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind in _METRIC_KINDS and record.get("step", 0) <= self.sent[kind]:
            return  # recomputed after a resume: the tracker has this step already
        with self._lock:
            self._buffer.append(record)
            if len(self._buffer) > _MAX_BUFFER:
                del self._buffer[0]
                self._dropped += 1

    def close(self, status: str = "FINISHED") -> None:
        """Send what is left and end the tracked run, waiting at most `close_timeout_s`."""
        if not self._thread.is_alive():
            return  # never started (the Trainer failed before its restore)
        self._closing = status
        self._wake.set()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            with self._lock:
                left = len(self._buffer)
            _say(f"{self.tracker.name}: gave up after close_timeout_s={self.close_timeout_s:g} with {left} "
                 "records unsent; metrics.jsonl has every record")
        elif self._dropped:
            _say(f"{self.tracker.name}: {self._dropped} early records were dropped while it failed")

    # ----------------------------------------------------------------------------- the sink's thread

    def _run(self) -> None:
        pause = 0.0  # open at once: a new local store takes seconds to create
        while self._closing is None:
            self._wake.wait(pause)
            if self._closing is not None:
                break
            pause = self.flush_every_s if self._attempt() else min(max(pause * 2, 1.0), 60.0)
        self._drain(self._closing)

    def _drain(self, status: str) -> None:
        """Send the rest and finish, retrying (a short pause, doubling) until `close_timeout_s` is spent."""
        deadline, pause = time.monotonic() + self.close_timeout_s, 0.1
        while not self._attempt():
            if time.monotonic() + pause > deadline:
                return
            time.sleep(pause)  # a retry's back-off, not a wait on another thread
            pause *= 2
        self._guard(lambda: self.tracker.finish(status))

    def _attempt(self) -> bool:
        """Open if needed, then send the buffer; False (and the buffer kept) when the tracker failed."""
        if not self._opened:
            self._opened = self._guard(lambda: self.tracker.open(self.state))
            if not self._opened:
                return False
            self._save_state()
        with self._lock:
            batch, rewinds = list(self._buffer), len(self._rewinds)
        if not batch:
            return True
        if not self._guard(lambda: self.tracker.send(batch)):
            return False
        with self._lock:
            if rewinds == len(self._rewinds):
                del self._buffer[: len(batch)]
            else:  # the trainer went back while the batch was on its way: what it kept of it is sent now
                gone, back_to = {id(r) for r in batch}, min(self._rewinds[rewinds:])
                self._buffer = [r for r in self._buffer if id(r) not in gone]
                batch = [r for r in batch if r.get("step", 0) <= back_to]
            sent = dict(self.sent)
            for r in batch:
                if r.get("kind") in _METRIC_KINDS:
                    sent[r["kind"]] = max(sent[r["kind"]], r.get("step", 0))
            changed, self.sent = sent != self.sent, sent
        if changed:
            self._save_state()
        return True

    def _guard(self, call) -> bool:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            if not self._down:
                _say(f"{self.tracker.name} failed ({type(e).__name__}: {first_line(e)}); training goes on, "
                     "retrying in the background; metrics.jsonl has every record")
            self._down = True
            return False
        if self._down:
            _say(f"{self.tracker.name} works again; sending what was kept")
            self._down = False
        return True

    def _save_state(self) -> None:
        self.state["sent_step"], self.state["sent_eval"] = self.sent["train"], self.sent["eval"]
        write_json_atomic(self.state_path, self.state, indent=None)


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _say(line: str) -> None:
    print(f"raytrain: tracking: {line}", file=sys.stderr, flush=True)


def metric_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a train/eval record (bools as 0/1; lists such as per-expert loads left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("kind", "step", "time") and isinstance(v, (int, float))
    }
