"""Ends what a driver's local Ray started when the driver dies, however it dies.

`ray.init()` without an address starts GCS, raylet, dashboard, ... as children of the driver; Ray makes
those die with it (PDEATHSIG), but not what the raylet started: on a SIGKILL of the driver its Train
workers trained on for ~10 steps (with no one to observe them) and the dashboard and runtime-env agents
lived on for good; a killed `raytrain tune` left its trials running. This process, started with the local
Ray (`launcher.ensure_ray`), watches the driver's pid and
the process trees of Ray's own children (their pids from Ray's node handle, refreshed every 0.25 s);
when the driver is gone it SIGKILLs every process of those trees, each checked by its start time so a
reused pid is never hit. A driver that ends cleanly (`launcher.stop_ray`) stops the reaper first.

Run as `python -m raytrain_ext.reaper OWNER_PID ROOT_PID...`; imports no Ray (it starts in ~50 ms).
"""

from __future__ import annotations

import os
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
        from ray._private import worker

        node = worker._global_node
        if node is None:
            return []
        return [info.process.pid for infos in node.all_processes.values() for info in infos if info.process]

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


def watch(owner: int, roots: list[int]) -> None:
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    known: dict[int, float] = {}
    while not stopping:
        if not _alive(owner):
            # Processes re-parented after their parent died are still in `known` from earlier rounds.
            _kill({**known, **_tree(list(known))})
            return
        known.update(_tree(roots + list(known)))
        known = {pid: t for pid, t in known.items() if psutil.pid_exists(pid)}
        time.sleep(_POLL_S)


if __name__ == "__main__":
    watch(int(sys.argv[1]), [int(a) for a in sys.argv[2:]])
