"""What a lost Train worker looks like on the console of `raytrain train`.

Ray forwards what its actors print to the driver's terminal (`log_to_driver`). When a Train worker dies,
the survivors' collectives fail (gloo: "Connection closed by peer"), and Ray Train's workers, its
controller and the raylet print tracebacks there before the run recovers from its newest checkpoint.
`WorkerLogs` moves those blocks into the run's own log (`RUN_DIR/workers.log`) and prints one line per lost
worker instead: which worker, how it ended, and from which step the group restarts. `raytrain tune` does the
same for its trials' runs, into the experiment folder's `workers.log`. `quiet_logger`
withholds a library logger's lines that a user cannot act on, for a block.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raytrain_ext import ray_compat
from raytrain_ext.hosts import HostWatcher, LostHost
from trainers._base import env_default
from trainers.checkpoint_files import STEP_DIR, is_complete
from trainers.progress import is_terminal, plain
from trainers.run_dir import WORKER_LOG, RunDir
from trainers.storage import append_bytes

__all__ = ["WorkerLogs", "lost_worker", "split_tracebacks"]

# a Train run's actors (and the raylet, the GCS: a lost host's messages)
_SOURCES = ("RayTrainWorker", "TrainController", "PlacementGroupCleaner", "raylet", "gcs_server")
_STARTS = (
    "Traceback (most recent call last):",
    "Exception in thread ",
    "Error in training function:",
    "Graceful shutdown of backend failed",
    "A worker died or was killed while executing a task",
    # Python's report of an exception it cannot raise, e.g. Ray's SIGTERM handler firing in an actor that is
    # already shutting down (a Train run's controller as the run ends)
    "Exception ignored in:",
    # a lost host, as Ray tells it: the GCS's verdict (with its list of possible reasons), a worker's raylet
    # gone (with a state dump), the GCS failing to free a dead node's bundles
    "has been marked dead because",
    "Raylet is terminated",
    "Failed to remove",
    "GCS consider this node to be dead",  # a raylet back from a partition exits (its host's Ray restarts it)
    "*** StackTrace Information ***",
    # Ray Train's controller when the GCS answers late (a busy machine, a partition), with a traceback:
    # "it's safe to ignore this error" unless it persists; the run's resize checks try again
    "Failed to send resource request for",
    "Failed to get reserved resources for",
)
_FRAME = re.compile(r"^(/|\[0x|\s*$)|\(\+0x[0-9a-f]+\)")  # a native stack trace's line (a raylet's)
# One-line notices of a Train run's processes that a user can do nothing about, kept in the run's log:
# c10d's reverse lookup of a peer's address (a cluster whose hosts' names are not in DNS), botocore saying
# where it found a bucket's credentials and endpoint, and Ray Train's controller on a worker group that did
# not place in time after a host was lost (HostWatcher's line says what happened).
_QUIET = (
    "The hostname of the client socket cannot be retrieved",
    "Found credentials in environment variables",
    "Found endpoint for s3 via",
    "The worker group startup timed out after",
    "PYTHON worker processes have been started on node",  # the raylet's count on a node of few CPUs
    # Tune's advice for trials that restart often (reuse_actors); ours live as long as their trial
    "Trainable.setup took",
)
_PID = re.compile(r"(?:Worker PID|\bpid): (\d+)")
_IP = re.compile(r"(?:Worker IP address|\bip): ([\w.:]+)")
_EXIT = re.compile(r"exits with (?:an )?exit code (\d+)")
_NODE_DIED = "node has died"  # Ray's ActorDiedError for an actor whose node was declared dead


def split_tracebacks(lines: list[str], open_before: bool) -> tuple[list[str], list[str], bool]:
    """One batch of an actor's lines -> (for the console, for the run's log, whether a block is still open
    at its end). A block starts at a traceback's (or Ray's worker-death message's) first line and runs to
    the end of the batch (Ray batches what an actor wrote at once); a batch that continues an open block
    (its first line indented or blank) is moved whole."""
    console: list[str] = []
    moved: list[str] = []
    inside = open_before and bool(lines) and (not lines[0].strip() or lines[0][:1] in (" ", "\t")
                                              or bool(_FRAME.search(lines[0])))
    for line in lines:
        inside = inside or any(start in line for start in _STARTS)
        (moved if inside else console).append(line)
    return console, moved, inside


# A per-step fault-tolerant run (`scaling.fault_tolerance: per_step`) loses one replica group, not the run.
REPLICA_GROUP_LOST = "the other replica groups train on, and Ray replaces its group, which heals from a live one"


def lost_worker(
    lines: list[str], restart_step: int | None, experiment: bool = False, replica_groups: bool = False
) -> tuple[str, str] | None:
    """(pid, the console line) when `lines` tell of a Train worker process that died, else None. In an
    experiment (`raytrain tune`) the run is a trial's, which restarts from its own newest checkpoint."""
    text = "\n".join(lines)
    if _NODE_DIED in text:  # the worker went with its host: HostWatcher's line tells it, with the cause
        return None
    if "ActorDiedError" not in text and "A worker died or was killed" not in text:
        return None
    pid = _PID.search(text)
    if pid is None:
        return None
    where = _IP.search(text)
    code = _EXIT.search(text)
    how = (
        f"exit code {code.group(1)}"
        if code
        else "no exit code: killed by a signal (SIGKILL, or the OOM killer)"
        if "connection error" in text or "unexpectedly" in text
        else "an unexpected error"
    )
    on = f" on {where.group(1)}" if where else ""
    if experiment:
        return pid.group(1), (
            f"raytrain: lost Train worker pid {pid.group(1)}{on} ({how}); its trial's run restarts from its "
            f"newest checkpoint; tracebacks in the experiment folder's {WORKER_LOG}"
        )
    restart = f"step {restart_step}" if restart_step is not None else "its start (no checkpoint yet)"
    then = REPLICA_GROUP_LOST if replica_groups else f"the group restarts from {restart}"
    return pid.group(1), f"raytrain: lost Train worker pid {pid.group(1)}{on} ({how}); {then}; tracebacks in {WORKER_LOG}"


def newest_committed_step(run_dir: Any) -> int | None:
    root = RunDir(run_dir).checkpoints
    try:
        names = [p.name for p in root.iterdir()]
    except OSError:
        return None
    steps = [int(m.group(1)) for n in names if (m := STEP_DIR.match(n)) and is_complete(root / n)]
    return max(steps, default=None)


class WorkerLogs:
    """For the duration of a `with`: Ray's printer of actor output, with the Train run's tracebacks moved to
    `RUN_DIR/workers.log` and one line per lost worker. A process that prints no actor output (a Tune
    trial's actor hosting a run) is left as it is. `experiment`: `run_dir` is an experiment folder, whose
    trials' runs these are (`raytrain tune`'s driver)."""

    def __init__(
        self, run_dir: Path | Any, out: Any = None, experiment: bool = False, replica_groups: bool = False
    ) -> None:
        self.run_dir, self.out, self.experiment, self.replica_groups = run_dir, out, experiment, replica_groups
        self.printer: Callable[[dict[str, Any]], None] | None = None
        self.open: dict[Any, bool] = {}
        self.told: set[str] = set()
        self.hosts: HostWatcher | None = None
        self.colors = contextlib.ExitStack()  # RAY_COLOR_PREFIX while in the block

    def __enter__(self) -> WorkerLogs:
        dispatcher = ray_compat.worker_output_dispatcher()
        if not is_terminal():  # a log file: Ray's prefixes without color codes (a user's RAY_COLOR_PREFIX wins)
            self.colors.enter_context(env_default("RAY_COLOR_PREFIX", "0"))

        self.printer = dict(dispatcher.handlers).get("ray_print_logs")
        if self.printer is not None:
            dispatcher.remove_handler("ray_print_logs")
            dispatcher.add_handler("ray_print_logs", self.handle)
            # the raylet's "A worker died or was killed ..." comes through Ray's error listener, which calls
            # this module function by name (the dispatcher's handler holds the original: no double print)
            self.error_printer = ray_compat.error_printer()
            ray_compat.set_error_printer(self._handle_error)
        import ray

        if ray.is_initialized() and self.printer is not None:  # the process whose console the user watches
            back = ("its trials' runs can use it again" if self.experiment
                    else "Ray can place a lost replica group there again, which heals from a live one"
                    if self.replica_groups else "the run grows back at its next resize check")
            self.hosts = HostWatcher(self._say, self._after_loss, back).start()
        return self

    def _after_loss(self, host: LostHost) -> str:
        if self.experiment and self.replica_groups:
            return "each trial that had a replica group there trains on with its others; Ray replaces the group"
        if self.experiment:
            return "the trials that ran there go on from their newest checkpoints"
        if self.replica_groups:
            return REPLICA_GROUP_LOST
        step = newest_committed_step(self.run_dir)
        return f"the run goes on without it from {f'step {step}' if step is not None else 'its start'}"

    def __exit__(self, *exc: Any) -> None:
        if self.hosts is not None:
            self.hosts.stop()
        self.colors.close()
        if self.printer is not None:
            dispatcher = ray_compat.worker_output_dispatcher()
            dispatcher.remove_handler("ray_print_logs")
            dispatcher.add_handler("ray_print_logs", self.printer)
            ray_compat.set_error_printer(self.error_printer)

    def _handle_error(self, data: dict[str, Any], ignore_prefix: bool) -> None:
        self.handle(data, lambda rest: self.error_printer(rest, ignore_prefix=ignore_prefix))

    def handle(self, data: dict[str, Any], printer: Callable[[dict[str, Any]], None] | None = None) -> None:
        printer = printer or self.printer
        if not is_terminal() and data.get("lines"):  # Ray colors its "[repeated Nx]" notes whatever the prefix
            data = {**data, "lines": [plain(line) for line in data["lines"]]}
        source = data.get("actor_name") or data.get("pid")
        if not data.get("lines"):
            printer(data)
            return
        if source in _SOURCES:
            key = (data.get("pid"), data.get("is_err"))
            console, moved, self.open[key] = split_tracebacks(list(data["lines"]), self.open.get(key, False))
        else:  # any other process (a Tune trial's actor): only its notices a user cannot act on are moved
            console, moved = list(data["lines"]), []
        quiet = [any(q in line for q in _QUIET) for line in console]
        moved = [line for line, q in zip(console, quiet) if q] + moved
        console = [line for line, q in zip(console, quiet) if not q]
        if moved:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            text = "".join(f"{stamp} ({source} pid={data.get('pid')}) {line}\n" for line in moved)
            append_bytes(RunDir(self.run_dir).worker_log, text.encode())
            restart = None if self.experiment else newest_committed_step(self.run_dir)
            lost = lost_worker(moved, restart, self.experiment, self.replica_groups)
            if lost is not None and self.hosts is not None and self.hosts.is_lost(data.get("ip")):
                lost = None  # its host is lost: HostWatcher's line says so, with the cause
            if lost is not None and lost[0] not in self.told:
                self.told.add(lost[0])
                self._say(lost[1])
        if console:
            printer({**data, "lines": console})

    def _say(self, line: str) -> None:
        if self.out is not None:
            print(line, file=self.out, flush=True)
            return
        if not is_terminal():
            print(line, file=sys.stderr, flush=True)
            return
        from tqdm.auto import tqdm

        tqdm.write(line, file=sys.stderr)  # above the progress bar, not inside its line


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Logger `name` (and its children) shows only `level` and above for the block."""
    log = logging.getLogger(name)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)
