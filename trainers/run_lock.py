"""One writer per run dir: an exclusive `flock` on `RUN_DIR/.lock`, whose content names the holder.

Two processes training into one run dir would interleave checkpoint renames and truncate each other's
`metrics.jsonl`. The kernel drops a `flock` when its holder dies, however it dies, so the next command takes
over a killed run's lock. The file stays (unlinking a locked file lets a third process lock a new inode
beside the old one); only its content changes.

A run dir in a bucket (a URI) has no flock: the lock is then a local file named by the URI's hash
(RAYTRAIN_CACHE/locks/), which keeps a second command on this machine out. Commands on two machines are
not kept apart: start a bucket run from one place (the cluster's head, a `ray job submit`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from trainers._base import ConfigError
from trainers.run_dir import LOCK
from trainers.storage import cache_root, local_path

__all__ = ["RunDirLock"]


class RunDirLock:
    def __init__(self, run_dir: Path | str):
        self.run_dir = str(run_dir)
        local = local_path(run_dir)  # flock needs a file of this machine
        digest = hashlib.sha256(self.run_dir.encode()).hexdigest()[:16]
        self.path = local / LOCK if local is not None else cache_root() / "locks" / f"{digest}.lock"
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Takes the lock or raises ConfigError naming its holder (never waits)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(self._held_message()) from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):  # being rewritten by its holder right now
            return None

    def _held_message(self) -> str:
        holder = self.holder() or {}
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        since = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if "since" in holder else "?"
        )
        return (
            f"run_dir {self.run_dir} is in use by another run ({who}, since {since}); fix: wait for it to "
            f"end or stop it (kill {holder.get('pid', 'PID')}), or use another run_dir"
        )
