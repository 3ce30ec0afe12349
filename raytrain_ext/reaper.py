"""Ends what a driver's local Ray started when the driver dies, however it dies.

`ray.init()` without an address starts GCS, raylet, dashboard, ... as children of the driver; Ray makes
those die with it (PDEATHSIG), but not what the raylet started: on a SIGKILL of the driver its Train
workers trained on for ~10 steps (with no one to observe them) and the dashboard and runtime-env agents
lived on for good; a killed `raytrain tune` left its trials running. This process, started with the local
Ray (`launcher.ensure_ray`), waits for the driver's death as an event (a pidfd of the driver's pid,
Linux >= 5.3; one poll a second of that pid elsewhere) and then SIGKILLs:
- the trees of Ray's own daemons (their pids from Ray's node handle, with their children: the agents),
  snapshotted while Ray starts and every minute after: they change only when Ray restarts one;
- every process the raylet started: a Ray worker carries its raylet's pid in `RAY_RAYLET_PID`, and so do
  the processes a worker starts. They are found once, at the driver's death, wherever they were
  re-parented to.
Each is checked by its start time, so a reused pid is never hit. Nothing walks the process table while
the driver lives but the rare snapshots (the old reaper's walk every 0.25 s cost ~15% of a core). A driver
that ends cleanly (`launcher.stop_ray`) stops the reaper first.

Run as `python -m raytrain_ext.reaper OWNER_PID ROOT_PID...`; imports no Ray (it starts in ~50 ms).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import psutil

__all__ = ["Reaper"]

_POLL_S = 0.25


class Reaper:
    """The driver's handle on its reaper process."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def start(cls, roots: list[int]) -> Reaper:
        process = subprocess.Popen(
            [sys.executable, "-m", "raytrain_ext.reaper", str(os.getpid()), *map(str, roots)],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the driver's terminal must not end the reaper first
        )
        return cls(process)

    @staticmethod
    def local_ray_roots() -> list[int]:
        """Pids of the processes this driver's `ray.init()` started (Ray's node handle keeps them)."""
        from raytrain_ext import ray_compat

        return ray_compat.local_ray_pids()

    def stop(self) -> None:
        """The driver ends cleanly: the reaper leaves without killing anything."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=10)


def _tree(roots: list[int]) -> dict[int, float]:
    """pid -> start time of every live process in the trees under `roots` (the roots included)."""
    found: dict[int, float] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                found[p.pid] = p.create_time()
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _started_by(raylets: set[int]) -> dict[int, float]:
    """pid -> start time of every process whose environment names one of `raylets` as its raylet."""
    wanted = {str(pid) for pid in raylets}
    found: dict[int, float] = {}
    for p in psutil.process_iter():
        try:
            if p.environ().get("RAY_RAYLET_PID") in wanted:
                found[p.pid] = p.create_time()
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


def _kill(known: dict[int, float]) -> None:
    for pid, started in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started:
                p.kill()
        except psutil.Error:
            continue


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# Snapshots of the daemons' trees: while Ray starts its agents, then once a minute.
_SNAPSHOTS_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)


def _death_of(owner: int):
    """A function `wait(timeout_s) -> bool` that returns True once `owner` has died: a pidfd where the
    kernel has them (woken by the death itself), else a poll of the pid each call."""
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):  # no pidfd (kernel < 5.3, not Linux) or the owner is already gone
        def poll(timeout_s: float) -> bool:
            if _alive(owner):
                time.sleep(min(timeout_s, 1.0))
                return not _alive(owner)
            return True

        return poll

    def wait(timeout_s: float) -> bool:
        readable, _, _ = select.select([fd], [], [], timeout_s)  # readable: the process has exited
        return bool(readable) or not _alive(owner)

    return wait


def watch(owner: int, roots: list[int]) -> None:
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dead = _death_of(owner)
    raylets = set()
    for pid in roots:
        try:
            if psutil.Process(pid).name() == "raylet":
                raylets.add(pid)
        except psutil.Error:
            continue
    known: dict[int, float] = {}
    began = time.monotonic()
    snapshots = list(_SNAPSHOTS_S)
    while not stopping:
        elapsed = time.monotonic() - began
        if snapshots and elapsed >= snapshots[0]:
            known = {**_tree(roots + list(known)), **{p: t for p, t in known.items() if psutil.pid_exists(p)}}
            snapshots = snapshots[1:] or [elapsed + _SNAPSHOTS_S[-1]]
        if dead(min(1.0, max(0.0, snapshots[0] - elapsed))):
            # Processes re-parented after their parent died are still in `known` from the snapshots; the
            # raylet's workers are found by their environment, with whatever they started.
            doomed = {**known, **_started_by(raylets)}
            _kill({**doomed, **_tree(list(doomed))})
            return


if __name__ == "__main__":
    watch(int(sys.argv[1]), [int(a) for a in sys.argv[2:]])
