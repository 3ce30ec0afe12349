"""What every benchmark JSON records about how it was made: the command, the commit, the date, the
machine's cores and its load average before and after (a busy machine is said, not hidden).

The commit (`git_state`): a GPU machine lent for a session may hold a copy of `.git` older than the tree it
was sent (seen: its HEAD stayed at the session's first commit while later trees ran), so the caller can name
it: `BENCH_GIT_COMMIT=<sha>` in the remote command, the sha taken where the tree was sent from. Then
`git_dirty` is None (unknown there) and `git_commit_source` says where the commit came from."""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def provenance(started: float, load_before: tuple[float, ...]) -> dict[str, Any]:
    """`started`: time.time() when the benchmark began; `load_before`: os.getloadavg() then."""
    return {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": git_state()["git_commit"],
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.time() - started,
    }


def git_state() -> dict[str, Any]:
    """{"git_commit", "git_dirty", "git_commit_source"}: BENCH_GIT_COMMIT if set, else this checkout's
    (None where there is no git or no .git)."""
    named = os.environ.get("BENCH_GIT_COMMIT", "").strip()
    if named:
        return {"git_commit": named, "git_dirty": None, "git_commit_source": "BENCH_GIT_COMMIT"}
    commit, dirty = _git("rev-parse", "HEAD"), _git("status", "--porcelain")
    return {"git_commit": commit or None, "git_dirty": None if dirty is None else bool(dirty),
            "git_commit_source": "git" if commit else None}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
